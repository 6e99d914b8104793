"""What a conversion loses with context length, and why: configurations that differ in one thing (the rotary key's
size, the RoPE-free keys' rotation, the calibration length), each converted once and scored in transformers at
several lengths on text its calibration never saw, with the loss split by how far back a token can look.

A configuration is `NAME=BUDGET/ROPE/CALIB_LEN/PRESET[:k=v,...]`: cache values per token per layer, the rotary key's
size, the calibration window length, and a method. Every configuration reads the same number of calibration tokens
(`--calib-tokens`, 65,536 by default: 128 windows of 512 or 8 of 8192), so only the window length differs.

    python eval/length.py --output-dir runs/length --lengths 512,2048,8192 --configs \\
        "rope32=192/32/512/closed-form;rope64=192/64/512/closed-form;\\
         nope-expected=192/32/512/closed-form:nope_rotation=expected;calib8192=192/32/8192/closed-form"

`--model qwen2.5-coder-1.5b` runs the same on the second real model (transmla_tool/registry.py). A checkpoint made
elsewhere (eval/frontier.py --keep-checkpoints, convert) is scored as it is with `--checkpoint NAME=DIR`: its
conversion record gives its budget, rotary size, calibration length and method, and its source must be --model.

    python eval/length.py --model qwen2.5-coder-1.5b --output-dir runs/qlength --lengths 8192 --eval-tokens 8192 \
        --checkpoint rope64=runs/qsplit/ckpt/mix-docs-r100w32-rope64-224 \
        --checkpoint rope32=runs/qsplit/ckpt/mix-docs-r100w32-rope32-224

Each conversion is kept under <output-dir>/ckpt (a rerun at more lengths scores it again without converting) with
its time and peak memory. Rows go to <output-dir>/length.jsonl keyed by (config, length, domain) and record the
held-out tokens they were scored on; a rerun measures only what is missing and refuses rows scored on other windows.
length.md is rebuilt from the file: each configuration's ratio to the original per length, and at the longest length
per distance range (positions [0, 512), [512, 2048), ...: the ratio of the mean loss there, exponentiated).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from crossdomain import calib_spec, reuse_splits  # noqa: E402
from quality import _append, _read, check_resumable, check_same_scoring, parse_config  # noqa: E402

from transmla_tool.assets import DOMAINS, domain_splits  # noqa: E402
from transmla_tool.data import token_windows  # noqa: E402
from transmla_tool.engines.process import run_child  # noqa: E402
from transmla_tool.errors import UserError  # noqa: E402
from transmla_tool.evaluate.models import load_model, load_tokenizer  # noqa: E402
from transmla_tool.evaluate.perplexity import perplexity  # noqa: E402
from transmla_tool.methods import recorded_method, resolve_method  # noqa: E402
from transmla_tool.provenance import labelled_checkpoint  # noqa: E402
from transmla_tool.registry import MODELS, model_gguf  # noqa: E402

BOUNDS = (512, 2048)  # distance ranges the loss is split into (with the window's end)


def parse_length_config(spec: str) -> dict:
    """'NAME=BUDGET/ROPE/CALIB_LEN/PRESET[:k=v,...]' -> its parts; a malformed one stops before any work."""
    name, _, rest = spec.partition("=")
    parts = rest.split("/", 3)
    if not name or len(parts) != 4 or not all(p.isdigit() for p in parts[:3]):
        raise SystemExit(f"--configs: {spec!r} is not NAME=BUDGET/ROPE/CALIB_LEN/PRESET[:k=v,...] "
                         "(e.g. rope32=192/32/512/closed-form)")
    budget, rope, calib_len = (int(p) for p in parts[:3])
    _, preset, overrides = parse_config(f"{name}={parts[3]}")
    if rope >= budget:
        raise SystemExit(f"--configs {name}: the rotary key ({rope}) must leave a latent in the budget ({budget})")
    return {"name": name, "budget": budget, "rope_dim": rope, "calib_seq_len": calib_len, "preset": preset,
            "overrides": overrides}


def convert_in_child(model_dir: str, gguf: str, ckpt: Path, config: dict, spec: str, samples: int,
                     device: str) -> dict:
    """`transmla-tool convert` in its own process, so that its peak memory is its own (this process has held
    long-window logits): wall time, peak RSS and time per stage from the conversion's record."""
    argv = [sys.executable, "-m", "transmla_tool", "convert", "--model", model_dir, "--gguf-file", gguf,
            "--output", str(ckpt), "--overwrite", "--target", "llamacpp", "--no-progress", "--dtype", "float32",
            "--device", device, "--latent-dim", str(config["budget"] - config["rope_dim"]),
            "--rope-dim", str(config["rope_dim"]), "--calib-data", spec, "--calib-samples", str(samples),
            "--calib-seq-len", str(config["calib_seq_len"]), "--method", config["preset"]]
    for override in config["overrides"]:
        argv += ["--set", override]
    start = time.time()
    run = run_child(argv, check=False)
    if run.returncode != 0:
        raise SystemExit(f"length.py: converting {config['name']} failed (exit {run.returncode}): {' '.join(argv)}")
    summary = json.loads((ckpt / "conversion.json").read_text())
    return {"convert_seconds": round(time.time() - start, 1), "peak_rss_mb": summary["peak_rss_mb"],
            "stages": summary["stages"]}


def checkpoint_config(spec: str, model_dir: str, gguf: str | None) -> tuple[dict, Path, dict]:
    """'NAME=DIR' of a finished conversion of --model -> (config, checkpoint, cost) from its conversion record; a
    directory that is not one, or a conversion of other weights, stops before any work."""
    name, ckpt, summary = labelled_checkpoint(spec, "--checkpoint", model_dir, gguf)
    settings = summary["settings"]
    config = {"name": name, "budget": settings["latent_dim"] + settings["rope_dim"], "rope_dim": settings["rope_dim"],
              "calib_seq_len": settings["calib_seq_len"], "preset": settings["method_name"], "overrides": [],
              "method": recorded_method(settings["method"]), "calib_samples": settings["calib_samples"],
              "checkpoint": str(ckpt)}
    cost = {"convert_seconds": summary.get("wall_time_s"), "peak_rss_mb": summary.get("peak_rss_mb"),
            "stages": summary.get("stages")}
    return config, ckpt, cost


def conversion_peak(cost: dict) -> float | None:
    """The conversion's peak RSS: its own process's, or for one run inside this script (the first rows), the largest
    of its stages' peaks (each stage resets the kernel's high-water mark; the process's peak also holds scoring)."""
    if "stages" in cost and cost.get("stages"):
        return max(stage["peak_rss_mb"] for stage in cost["stages"].values())
    return cost.get("peak_rss_mb")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/length")
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS),
                        help="the real model (transmla_tool/registry.py; `make models` fetches the ones not installed)")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                        help="also score this finished conversion of --model as it is (repeatable)")
    parser.add_argument("--configs", default="", help="';'-separated NAME=BUDGET/ROPE/CALIB_LEN/PRESET")
    parser.add_argument("--calib", default="mix-docs", help="calibration source (crossdomain.py's names)")
    parser.add_argument("--calib-tokens", type=int, default=65536)
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--eval-tokens", type=int, default=16384,
                        help="held-out tokens per length and domain (windows = this / length)")
    parser.add_argument("--data-dir", help="domain splits an earlier run wrote (default <output-dir>/data)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "length.jsonl"
    if args.table_only:
        write_table(out)
        return
    configs = [parse_length_config(c) for c in args.configs.split(";") if c.strip()]
    lengths = [int(n) for n in args.lengths.split(",") if n]
    if bad := [n for n in lengths if n <= 0 or args.eval_tokens < n]:
        raise SystemExit(f"--lengths {bad[0]}: each length must be positive and at most --eval-tokens")
    model_dir, gguf = model_gguf(args.model)
    given = [checkpoint_config(c, model_dir, gguf) for c in args.checkpoint]
    if clash := {c["name"] for c in configs} & {c["name"] for c, _, _ in given}:
        raise SystemExit(f"--checkpoint {sorted(clash)[0]}: a --configs entry has the same name")
    splits = reuse_splits(Path(args.data_dir)) if args.data_dir else domain_splits(out / "data")
    domains = [args.calib[4:]] if args.calib.startswith("mix-") else [d for d in DOMAINS if d != args.calib]
    spec = calib_spec(args.calib, splits)
    rows = _read(results)
    scoring = {"eval_tokens": args.eval_tokens, "calib": args.calib, "source_model": args.model}
    check_same_scoring(rows, results, scoring, unrecorded={"source_model": "smollm2-135m"})
    done = {(r["config"], r["length"], r["domain"]) for r in rows}
    tokenizer = load_tokenizer(model_dir, gguf)
    device = torch.device(args.device)
    windows = {(n, d): token_windows(str(splits[d][1]), tokenizer, n, args.eval_tokens // n,
                                     min_windows=args.eval_tokens // n) for n in lengths for d in domains}

    def finished(label: str) -> bool:
        return all((label, n, d) in done for n in lengths for d in domains)

    def score(label: str, path: str, gguf_file: str | None, extra: dict) -> None:
        """Load the model at path, score it at every length and kind of text it lacks a row for, and free it."""
        if finished(label):
            return
        model = load_model(path, gguf_file, torch.float32, device)
        for n in lengths:
            for d in domains:
                if (label, n, d) in done:
                    continue
                start = time.time()
                got = perplexity(model, windows[(n, d)], batch_size=1, desc=f"{label} @ {n} on {d}", bounds=BOUNDS)
                _append(results, {"config": label, "length": n, "domain": d, **got, "windows": len(windows[(n, d)]),
                                  "seconds": round(time.time() - start, 1), **scoring, **extra})
                done.add((label, n, d))
        del model
        gc.collect()

    score("original", model_dir, gguf, {})
    for config in configs:
        name = config["name"]
        method = resolve_method(config["preset"], config["overrides"])
        made = {"method": method.as_dict(), "budget": config["budget"], "rope_dim": config["rope_dim"],
                "calib_seq_len": config["calib_seq_len"],
                "calib_samples": args.calib_tokens // config["calib_seq_len"]}
        check_resumable(rows, results, {"config": name}, made)
        if finished(name):
            continue
        ckpt = out / "ckpt" / name
        record = ckpt / "conversion-cost.json"
        # the checkpoint appears only when complete (staged, renamed); kept only for the same configuration
        if not record.exists() or json.loads(record.read_text()).get("made") != made:
            cost = convert_in_child(model_dir, gguf, ckpt, config, spec, made["calib_samples"], args.device)
            record.write_text(json.dumps({"made": made, **cost}))
        cost = json.loads(record.read_text())
        score(name, str(ckpt), None, {**made, "preset": config["preset"], "overrides": config["overrides"],
                                      "convert_seconds": cost["convert_seconds"],
                                      "convert_peak_rss_mb": conversion_peak(cost)})
    for config, ckpt, cost in given:
        name = config["name"]
        made = {k: config[k] for k in ("method", "budget", "rope_dim", "calib_seq_len", "calib_samples", "checkpoint")}
        check_resumable(rows, results, {"config": name}, made)
        score(name, str(ckpt), None, {**made, "preset": config["preset"], "overrides": [],
                                      "convert_seconds": cost["convert_seconds"],
                                      "convert_peak_rss_mb": conversion_peak(cost)})
    write_table(out)


def write_table(out: Path) -> None:
    rows = _read(out / "length.jsonl")
    if not rows:
        raise SystemExit(f"{out / 'length.jsonl'} holds no rows yet")
    original = {(r["length"], r["domain"]): r for r in rows if r["config"] == "original"}
    lengths = sorted({r["length"] for r in rows})
    longest = lengths[-1]
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows if r["config"] != "original"))
    cell = {(r["config"], r["length"], r["domain"]): r for r in rows}
    first = rows[0]
    title = MODELS[first.get("source_model", "smollm2-135m")].title
    grows = len(lengths) > 1  # a growth column only when there is more than one length
    lines = [(f"# Quality by context length ({title}, transformers, fp32; calibrated on {first['calib']}, "
              f"scored on {', '.join(domains)}: {first['eval_tokens']} held-out tokens per length)"), "",
             "Ratio = the configuration's perplexity over the original's on the same windows (worst domain).", "",
             "| config | budget | rope | calib length | convert s | peak RSS MB | "
             + " | ".join(f"{n} tokens" for n in lengths) + (f" | growth {lengths[0]} -> {longest} |" if grows else " |"),
             "|---|---|---|---|---|---|" + "---|" * (len(lengths) + grows)]
    lines += ["| original (perplexity) | | | | | | " + " | ".join(
        "/".join(f"{original[(n, d)]['perplexity']:.2f}" for d in domains if (n, d) in original) for n in lengths)
        + (" | |" if grows else " |")]
    for c in configs:
        ratios = {}
        for n in lengths:
            got = [cell[(c, n, d)]["perplexity"] / original[(n, d)]["perplexity"] for d in domains
                   if (c, n, d) in cell and (n, d) in original]
            ratios[n] = max(got) if got else None
        any_row = next(r for r in rows if r["config"] == c)
        growth = (f"{ratios[longest] / ratios[lengths[0]]:.3f}x" if ratios[longest] and ratios[lengths[0]] else "")
        lines.append(f"| {c} | {any_row['budget']} | {any_row['rope_dim']} | {any_row['calib_seq_len']} | "
                     f"{any_row['convert_seconds']} | {any_row['convert_peak_rss_mb']} | "
                     + " | ".join(f"{ratios[n]:.3f}" if ratios[n] else "" for n in lengths)
                     + (f" | {growth} |" if grows else " |"))
    buckets = list(original.get((longest, domains[0]), {}).get("by_position", {}))
    if buckets:
        ends = [*buckets[1:], str(longest)]
        lines += ["", (f"At {longest} tokens, by how far back a token can look (ratio of exp(mean loss) in each range "
                       "of positions, worst domain):"), "",
                  "| config | " + " | ".join(f"positions {a}-{int(b) - 1}" for a, b in zip(buckets, ends)) + " |",
                  "|---|" + "---|" * len(buckets)]
        for c in configs:
            cells = []
            for b in buckets:
                got = [math.exp(cell[(c, longest, d)]["by_position"][b] - original[(longest, d)]["by_position"][b])
                       for d in domains if (c, longest, d) in cell and (longest, d) in original]
                cells.append(f"{max(got):.3f}" if got else "")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    seconds = sum(r.get("seconds", 0) for r in rows)
    lines += ["", f"{len(rows)} rows, {seconds / 60:.0f} min of scoring (this machine).", ""]
    (out / "length.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    try:
        main()
    except UserError as exc:
        raise SystemExit(f"length.py: {exc}") from None
