"""Quality on text unlike the calibration text: calibrate on one domain (or a mix), score on all.

Four domains install offline (transmla_tool.assets.DOMAINS): news articles and Usenet forum posts
from gensim's test data, Python standard-library source and Python's reference documentation. Each
is split into calibration documents (first 75%) and held-out documents (last 25%). SmolLM2-135M is
converted at each cache budget with each configuration, calibrated on each source, and every
checkpoint is scored on the held-out part of every domain. A cell is perplexity(converted) /
perplexity(original) on that domain's held-out text.

Calibration sources: a domain name; `mix` (all domains, equal weights); `mix-DOMAIN` (all but one,
to score a domain the mix never saw).

    python eval/crossdomain.py --output-dir runs/crossdomain                        # full matrix
    python eval/crossdomain.py --calib mix,mix-code --budgets 192 --configs default  # one slice

Rows are appended to <output-dir>/crossdomain.jsonl (resumable: a row is keyed by source, config name,
budget and domain; rows record the resolved method and calibration size, and a rerun under a name whose
rows were made otherwise, or a rerun with another --eval-windows, stops with an error instead of
skipping them);
the tables (markdown) and the plot are rebuilt from it. Configurations are written as in
eval/quality.py (`name=preset[:k=v,...]`).
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quality import (  # noqa: E402
    _append, _read, check_resumable, check_same_scoring, made_with, parse_config, save_ratio_plot,
)

from transmla_tool.assets import DOMAINS, domain_splits, smollm2_gguf  # noqa: E402
from transmla_tool.convert import ConvertSettings, convert_many  # noqa: E402
from transmla_tool.data import token_windows  # noqa: E402
from transmla_tool.devices import resolve_device  # noqa: E402
from transmla_tool.evaluate.models import load_model, load_tokenizer  # noqa: E402
from transmla_tool.evaluate.perplexity import perplexity  # noqa: E402
from transmla_tool.methods import resolve_method  # noqa: E402


def calib_spec(source: str, splits: dict) -> str:
    """The --calib-data spec of a calibration source name."""
    if source in splits:
        return str(splits[source][0])
    if source == "mix":
        return ",".join(str(splits[d][0]) for d in DOMAINS)
    if source.startswith("mix-") and source[4:] in splits:
        return ",".join(str(splits[d][0]) for d in DOMAINS if d != source[4:])
    raise SystemExit(f"unknown calibration source '{source}': use a domain ({', '.join(DOMAINS)}), mix or mix-DOMAIN")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/crossdomain")
    parser.add_argument("--calib", default=",".join(DOMAINS), help="comma-separated calibration sources")
    parser.add_argument("--budgets", default="96,120,192,256,320", help="cache values per token per layer")
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--configs", default="transmla;closed-form;default", help="';'-separated configurations")
    parser.add_argument("--calib-samples", type=int, default=ConvertSettings.calib_samples)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=8, help="held-out windows of --ctx tokens per domain")
    parser.add_argument("--ctx", type=int, default=512, help="held-out window length (score at the serving length)")
    parser.add_argument("--device", default="auto", help="conversion and scoring device (auto, cpu, cuda)")
    parser.add_argument("--data-dir", help="domain splits written by an earlier run (default <output-dir>/data, "
                        "rebuilt): reuse them so that another machine's Python does not change the code/docs text")
    parser.add_argument("--table-only", action="store_true", help="rebuild the tables and plot, convert nothing")
    parser.add_argument("--plot-configs", help="';'-separated configurations to plot, each NAME or NAME=LABEL "
                        "(default: every configuration run at more than one budget, under its own name)")
    args = parser.parse_args()

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "crossdomain.jsonl"
    plot = parse_plot_configs(args.plot_configs)
    if args.table_only:
        write_tables(out, plot)
        return
    configs = [parse_config(c) for c in args.configs.split(";") if c]  # bad input fails here, before any work
    model_dir, gguf = smollm2_gguf()
    splits = reuse_splits(Path(args.data_dir)) if args.data_dir else domain_splits(out / "data")
    specs = {source: calib_spec(source, splits) for source in args.calib.split(",")}
    device = resolve_device(args.device)
    tokenizer = load_tokenizer(model_dir, gguf)
    windows = {d: token_windows(str(splits[d][1]), tokenizer, args.ctx, args.eval_windows,
                                min_windows=args.eval_windows) for d in DOMAINS}
    rows = _read(results)
    done = {(r["calib"], r["config"], r["budget"], r["domain"]) for r in rows}
    scoring = {"eval_windows": args.eval_windows, "ctx": args.ctx}
    check_same_scoring(rows, results, scoring, unrecorded={"ctx": 512})  # rows before --ctx were all at 512

    # the original is scored on every device that scores converted models: fp32 perplexities differ
    # between devices by more than the effects measured here, so a ratio never mixes two devices
    original = originals(results)
    missing = [d for d in DOMAINS if (device.type, d) not in original]
    if missing:
        model = load_model(model_dir, gguf, torch.float32, device)
        for domain in missing:
            ppl = perplexity(model, windows[domain], desc=f"original on {domain}")["perplexity"]
            original[(device.type, domain)] = ppl
            _append(results, {"calib": "-", "config": "original", "budget": 384, "domain": domain, "perplexity": ppl,
                              "device": device.type, **scoring})
        del model

    budgets = [int(b) for b in args.budgets.split(",")]
    for source in args.calib.split(","):
        spec = specs[source]
        for name, preset, overrides in configs:
            method = resolve_method(preset, overrides)
            made = made_with(method, args)
            check_resumable(rows, results, {"calib": source, "config": name}, made)
            todo = [b for b in budgets if any((source, name, b, d) not in done for d in DOMAINS)]
            if not todo:
                continue
            outputs = {b - args.rope_dim: str(out / "ckpt" / f"{source}-{name.replace(':', '_')}-{b}") for b in todo}
            start = time.time()
            convert_many(ConvertSettings(
                model=model_dir, gguf_file=gguf, output="", latent_dim=max(outputs), rope_dim=args.rope_dim,
                calib_data=spec, calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len,
                dtype="float32", device=args.device, overwrite=True, target="transformers",
                method=method, method_name=preset,
            ), outputs)
            seconds = round(time.time() - start, 1)
            for latent, path in outputs.items():
                model = load_model(path, None, torch.float32, device)
                for domain in DOMAINS:
                    ppl = perplexity(model, windows[domain],
                                     desc=f"{name} @ {latent + args.rope_dim} ({source} -> {domain})")["perplexity"]
                    _append(results, {"calib": source, "config": name, "preset": preset, "overrides": overrides,
                                      "budget": latent + args.rope_dim, "domain": domain, "perplexity": ppl,
                                      "ratio": ppl / original[(device.type, domain)], "device": device.type,
                                      **made, **scoring, "convert_seconds_all_budgets": seconds})
                del model
                gc.collect()
                torch.cuda.empty_cache()
                shutil.rmtree(path, ignore_errors=True)
    write_tables(out, plot)


def reuse_splits(directory: Path) -> dict:
    """{domain: (calib, heldout)} from a directory an earlier run wrote; every file must be there."""
    splits = {d: (directory / f"{d}-calib.jsonl", directory / f"{d}-heldout.jsonl") for d in DOMAINS}
    missing = [str(p) for pair in splits.values() for p in pair if not p.exists()]
    if missing:
        raise SystemExit(f"--data-dir {directory} lacks {missing[0]}: point it at an earlier run's <output-dir>/data")
    return splits


def _device(row: dict) -> str:
    return row.get("device", "cpu")  # rows written before devices were recorded were scored on the CPU


def originals(results: Path) -> dict:
    """{(device type, domain): perplexity of the original}."""
    return {(_device(r), r["domain"]): r["perplexity"] for r in _read(results) if r["config"] == "original"}


OFF_DIAGONAL = len(DOMAINS) * (len(DOMAINS) - 1)  # cells calibrated on one domain and scored on another


def _off_diagonal(cell: dict, config: str, budget: int) -> list:
    """(ratio, calibrated on, scored on) of each off-diagonal cell of one configuration at one budget."""
    return [(v, s, d) for (s, c, b, d), v in cell.items() if c == config and b == budget and s in DOMAINS and s != d]


def parse_plot_configs(spec: str | None) -> dict | None:
    """'a;b=Label' -> {"a": "a", "b": "Label"}; None plots every configuration."""
    if not spec:
        return None
    labels = {}
    for item in filter(None, (i.strip() for i in spec.split(";"))):
        name, _, label = item.partition("=")
        labels[name.strip()] = label.strip() or name.strip()
    return labels


def write_tables(out: Path, plot: dict | None = None) -> dict:
    """Write crossdomain.md and crossdomain.png from crossdomain.jsonl; returns the plotted curves."""
    rows = [r for r in _read(out / "crossdomain.jsonl") if r["config"] != "original"]
    by_device = originals(out / "crossdomain.jsonl")
    # a cell is the converted model's perplexity over the original's on the same device
    cell = {(r["calib"], r["config"], r["budget"], r["domain"]): r["perplexity"] / by_device[(_device(r), r["domain"])]
            for r in rows}
    devices = sorted({dev for dev, _ in by_device})
    configs = list(dict.fromkeys(r["config"] for r in rows))
    budgets = sorted({r["budget"] for r in rows})
    sources = list(dict.fromkeys(r["calib"] for r in rows))
    if plot is not None:
        unknown = [c for c in plot if c not in configs]
        if unknown:
            raise SystemExit(f"--plot-configs names {unknown[0]!r}, which has no rows; configurations: "
                             + "; ".join(configs))
    ctx = {r.get("ctx", 512) for r in rows} or {512}
    lines = [f"Perplexity ratio converted / original on each domain's held-out text (windows of {max(ctx)} tokens), "
             "both scored on the same device (original: " + "; ".join(
                 f"{dev} " + ", ".join(f"{d} {by_device[(dev, d)]:.2f}" for d in DOMAINS if (dev, d) in by_device)
                 for dev in devices) + ").", ""]

    # headline: worst off-diagonal cell (calibrated on one domain, scored on another) per budget
    lines += ["Worst off-diagonal cell (calibrated on one domain, scored on another):", "",
              "| config | " + " | ".join(f"{b}/384" for b in budgets) + " |", "|---" * (len(budgets) + 1) + "|"]
    for config in configs:
        row = []
        for b in budgets:
            off = _off_diagonal(cell, config, b)
            complete = len(off) == OFF_DIAGONAL
            if off:  # a partial row says over how many cells its worst was taken
                v, src, dst = max(off)
                partial = "" if complete else f", {len(off)} of {OFF_DIAGONAL} cells run"
                row.append(f"{v:.3f} ({src}→{dst}){partial}")
            else:
                row.append("")
        lines.append(f"| {config} | " + " | ".join(row) + " |")
    lines.append("")

    left_out = [(s, c, b, s[4:]) for (s, c, b, d) in cell if s.startswith("mix-") and d == s[4:]]
    if left_out:
        lines += ["Calibrated on a mix of the other three domains, scored on the one left out:", "",
                  "| config | budget | " + " | ".join(DOMAINS) + " | worst |", "|---" * (len(DOMAINS) + 3) + "|"]
        for config in configs:
            for b in budgets:
                vals = [cell.get((f"mix-{d}", config, b, d)) for d in DOMAINS]
                if any(v is not None for v in vals):
                    present = [v for v in vals if v is not None]
                    lines.append(f"| {config} | {b} | " + " | ".join(f"{v:.3f}" if v else "" for v in vals)
                                 + f" | {max(present):.3f} |")
        lines.append("")

    for b in budgets:
        lines += [f"Budget {b}/384 ({1 - b / 384:.0%} of the cache saved); rows: calibration source, columns: "
                  "scored domain (diagonal = in-domain, disjoint documents):", "",
                  "| config | calibrated on | " + " | ".join(DOMAINS) + " |", "|---" * (len(DOMAINS) + 2) + "|"]
        for config in configs:
            for s in sources:
                vals = [cell.get((s, config, b, d)) for d in DOMAINS]
                if any(v is not None for v in vals):
                    lines.append(f"| {config} | {s} | " + " | ".join(
                        ("" if v is None else f"**{v:.3f}**" if s == d else f"{v:.3f}") for v, d in zip(vals, DOMAINS))
                        + " |")
        lines.append("")
    (out / "crossdomain.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return _plot(out, plot or {c: c for c in configs}, budgets, cell)


def _plot(out: Path, labels: dict, budgets, cell) -> dict:
    """Worst off-domain (and in-domain) ratio per budget of each configuration in labels; returns {label: points}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    curves = {}
    for config, name in labels.items():
        pts, partial = [], False
        for b in budgets:
            off = _off_diagonal(cell, config, b)
            if off:
                pts.append((b / 384, max(off)[0]))
                partial |= len(off) < OFF_DIAGONAL
        if len(pts) > 1:  # one-budget ablation rows are in the tables, not the plot
            label = f"{name}: worst off-domain" + (" (rows not all run)" if partial else "")
            ax.plot(*zip(*pts), marker="o", linestyle="--" if partial else "-", label=label)
            curves[label] = pts
        diag = [(b / 384, max(cell[(d, config, b, d)] for d in DOMAINS)) for b in budgets
                if all((d, config, b, d) in cell for d in DOMAINS)]
        if diag:
            ax.plot(*zip(*diag), marker=".", linestyle=":", label=f"{name}: worst in-domain")
            curves[f"{name}: worst in-domain"] = diag
    save_ratio_plot(fig, ax, out / "crossdomain.png")
    return curves


if __name__ == "__main__":
    main()
