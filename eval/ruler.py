"""Long-range retrieval: lm-eval's RULER needle-in-a-haystack tasks at several context lengths, the original beside
converted (or healed) checkpoints, in transformers or in llama.cpp under its cache types.

The tasks whose haystacks are built offline: niah_single_1 (one needle in a repeated filler sentence),
niah_multikey_2 and niah_multikey_3 (one needle among many other needles, numbers and UUIDs). The essay haystacks of
the other NIAH tasks come from the hub and are not run. Each length is its own lm-eval call (RULER builds its rows for
the lengths it is given, in order, so --limit would otherwise cut all but the first length); the tokenizer that sizes
the haystacks is the original's.

    python eval/ruler.py --output-dir runs/ruler --lengths 2048,4096,8192 --limit 25 \\
        --checkpoint "160+32=runs/bench-heal/converted-192" --engine llamacpp --cache-types f16,iq4_nl
    python eval/ruler.py ... --checkpoint "320+64=runs/bench/gguf/mix-docs-r200-384-f32.gguf"   # a kept GGUF

Resumable: rows go to <output-dir>/ruler.jsonl keyed by (model, engine, cache, task, length, offset) and keep each
sample's 0/1 match, so a converted model's accuracy is compared with the original's on the same samples (paired).
ruler.md is rebuilt from the file. Ten samples tell 8 of 10 from 4 of 10 only at about two stderrs: `--offset 10`
scores the next ten of the same generated rows without scoring the first ten again, and the table merges a model's
rows by sample index (a difference is paired over the samples both models hold):

    python eval/ruler.py --output-dir runs/ruler --lengths 8192 --limit 10 --offset 10 --checkpoint ...
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from quality import _append, _read, check_same_scoring  # noqa: E402

from transmla_tool.errors import UserError  # noqa: E402
from transmla_tool.evaluate.frontier import analytic_bytes  # noqa: E402
from transmla_tool.evaluate.lmeval import delta_entry  # noqa: E402
from transmla_tool.provenance import gguf_converted_from, labelled_checkpoint  # noqa: E402
from transmla_tool.registry import MODELS, model_gguf  # noqa: E402

TASKS = ("niah_single_1", "niah_multikey_2", "niah_multikey_3")


def _key(row: dict) -> tuple:
    return (row["model"], row["engine"], row["cache"], row["task"], row["length"], row.get("offset", 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/ruler")
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--checkpoint", action="append", default=[], metavar="LABEL=DIR",
                        help="a checkpoint converted (or healed) from --model, scored beside the original "
                             "(repeatable); llama.cpp also takes LABEL=FILE.gguf (export-gguf records the source in it)")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--lengths", default="2048,4096,8192")
    parser.add_argument("--limit", type=int, default=25, help="samples per task and length")
    parser.add_argument("--offset", type=int, default=0,
                        help="score samples OFFSET .. OFFSET+limit-1 (more samples beside a finished run's)")
    parser.add_argument("--engine", default="transformers", choices=["transformers", "llamacpp"])
    parser.add_argument("--cache-types", default="f16", help="--engine llamacpp: llama.cpp cache types")
    parser.add_argument("--skip-original", action="store_true")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "ruler.jsonl"
    if args.table_only:
        write_table(out)
        return
    tasks = [t for t in args.tasks.split(",") if t]
    if unknown := [t for t in tasks if t not in TASKS]:
        raise SystemExit(f"--tasks: {', '.join(unknown)} need downloads or are not needle tasks; use "
                         f"{', '.join(TASKS)}")
    lengths = [int(n) for n in args.lengths.split(",") if n]
    if args.offset < 0 or args.limit < 1:
        raise SystemExit(f"--limit {args.limit} --offset {args.offset}: give a limit of 1 or more and an offset of 0 "
                         "or more")
    caches = [c for c in args.cache_types.split(",") if c] if args.engine == "llamacpp" else ["exact"]
    rows = _read(results)
    check_same_scoring(rows, results, {"limit": args.limit, "source_model": args.model})
    done = {_key(r) for r in rows}
    directory, gguf = model_gguf(args.model)
    models = [] if args.skip_original else [("original", None)]
    for spec in args.checkpoint:  # checked before any work: a checkpoint of other weights is refused here
        label, _, path = spec.partition("=")
        if path.endswith(".gguf") and Path(path).is_file():
            if args.engine != "llamacpp":
                raise SystemExit(f"--checkpoint {spec!r}: a GGUF runs in llama.cpp only (--engine llamacpp)")
            gguf_converted_from(path, f"--checkpoint {label}:", directory, gguf)
        else:
            label, checkpoint, _ = labelled_checkpoint(spec, "--checkpoint", directory, gguf)
            path = str(checkpoint)
        models.append((label, path))
    from transmla_tool.evaluate.models import load_tokenizer
    from transmla_tool.evaluate.tasks import resolve

    tokenizer = load_tokenizer(directory, gguf)
    tokenizer_dir = out / "tokenizer"
    if not (tokenizer_dir / "tokenizer_config.json").exists():
        tokenizer.save_pretrained(tokenizer_dir)  # RULER loads the tokenizer that sizes its haystacks by path
    with tempfile.TemporaryDirectory(prefix="ruler-") as tmp:
        data = resolve(tasks, Path(tmp) / "tasks", "hub")  # generated locally: nothing to resolve
        for label, path in models:
            row_values = _cached_row(path, directory, gguf) if args.engine == "llamacpp" else None
            for cache in caches:
                todo = [(t, n) for t in tasks for n in lengths
                        if (label, args.engine, cache, t, n, args.offset) not in done]
                if not todo:
                    continue
                lm, close = _model(args, label, path, cache, directory, gguf, tokenizer, max(lengths), tmp)
                size = {"bytes": analytic_bytes(cache, **row_values)} if row_values else {}
                try:
                    for task, length in todo:
                        start = time.time()
                        run = _run(lm, task, length, data, args.limit, args.offset, tokenizer_dir)
                        row = {"model": label, "engine": args.engine, "cache": cache, "task": task, "length": length,
                               **size, "limit": args.limit, "offset": args.offset, "source_model": args.model, **run,
                               "seconds": round(time.time() - start, 1)}
                        _append(results, row)
                        done.add(_key(row))
                finally:
                    close()
    write_table(out)


def _model(args, label, path, cache, directory, gguf, tokenizer, length: int, tmp: str):
    """(the lm-eval model for one checkpoint under one cache, its clean-up)."""
    if args.engine == "transformers":
        import torch

        from transmla_tool.evaluate.models import load_model

        model = load_model(path or directory, None if path else gguf, torch.float32, torch.device("cpu"))
        return model, lambda: None
    from transmla_tool.engines.llamacpp import quantize
    from transmla_tool.engines.llamacpp_lm import LlamaCppLM
    from transmla_tool.gguf_export import GGUFSettings, export_gguf

    model_file = Path(path) if path and path.endswith(".gguf") else Path(tmp) / f"{label}-f32.gguf"
    if not model_file.exists():
        if path is None:
            quantize(Path(directory) / gguf, model_file, "F32", allow_requantize=True)
        else:
            export_gguf(GGUFSettings(checkpoint=path, output=str(model_file), outtype="f32",
                                     tokenizer_gguf=str(Path(directory) / gguf)))
    lm = LlamaCppLM(str(model_file), tokenizer, cache, n_ctx=length + 256)
    return lm, lm.close


def _cached_row(path: str | None, directory: str, gguf: str) -> dict:
    """What llama.cpp caches per token per layer, as frontier.analytic_bytes takes it: the original's keys (and as
    many values) of every KV head (`path` None), or a conversion's one row of latent + rotary key."""
    if path is None:
        from transmla_tool.evaluate.cache import cached_values_per_token_per_layer
        from transmla_tool.io.source import open_source

        return {"kv_values": cached_values_per_token_per_layer(open_source(directory, gguf).config) // 2}
    if path.endswith(".gguf"):
        from gguf import GGUFReader

        from transmla_tool.io.gguf_fields import field_number

        return {"mla_values": field_number(GGUFReader(path).fields["deepseek2.attention.key_length"])}
    config = json.loads((Path(path) / "config.json").read_text())
    return {"mla_values": config["kv_lora_rank"] + config["qk_rope_head_dim"]}


def _run(lm, task: str, length: int, data, limit: int, offset: int, tokenizer_dir: Path) -> dict:
    from transmla_tool.evaluate.lmeval import run_lm_eval

    tokenizer = None
    if not hasattr(lm, "loglikelihood"):  # a transformers model: lm-eval's HF wrapper needs the tokenizer
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    metadata = {"max_seq_lengths": [length], "tokenizer": str(tokenizer_dir)}
    # the first rows through --limit, as every earlier row was scored; later ones by index
    chosen = {"indices": list(range(offset, offset + limit))} if offset else {"limit": limit}
    run = run_lm_eval(lm, [task], data, tokenizer=tokenizer, batch_size=1, metadata=metadata, **chosen)[task]
    matches = run["samples"].get(str(length))
    if not matches:
        raise UserError(f"RULER {task} at {length} tokens returned no per-sample matches; lm-eval changed its output")
    if run["doc_ids"] != list(range(offset, offset + len(matches))):
        raise UserError(f"RULER {task} at {length} tokens: lm-eval scored rows {run['doc_ids'][:3]}..., not "
                        f"{offset}..{offset + limit - 1}; the merged table would pair other samples")
    return {"accuracy": _share(matches), "rows": len(matches), "samples": matches}


def merged(rows: list[dict]) -> dict[tuple, dict[int, str]]:
    """{(model, engine, cache, task, length): {sample index: '0' or '1'}} over every offset's rows (a sample scored
    twice keeps its first match: the same greedy answer to the same generated row)."""
    out: dict[tuple, dict[int, str]] = {}
    for r in sorted(rows, key=lambda r: r.get("offset", 0)):
        matches = out.setdefault(_key(r)[:5], {})
        for i, m in enumerate(r["samples"]):
            matches.setdefault(r.get("offset", 0) + i, m)
    return out


def write_table(out: Path) -> None:
    rows = _read(out / "ruler.jsonl")
    if not rows:
        raise SystemExit(f"{out / 'ruler.jsonl'} holds no rows yet")
    lengths = sorted({r["length"] for r in rows})
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    cell = merged(rows)
    counts = [len(m) for m in cell.values()]
    usual = max(set(counts), key=lambda c: (counts.count(c), c))  # the most common count, ties to the larger
    title = MODELS[rows[0]["source_model"]].title
    lines = [f"# RULER needle retrieval ({title}, {usual} samples per task and length unless a cell says)", "",
             "Accuracy (share of samples whose needle value the model generated); beside a converted model, its "
             "difference from the original under the same engine and cache type (f16 for llama.cpp, exact in "
             "transformers), paired over the samples both hold, called a loss only beyond 1.96 stderrs.", "",
             "| model | engine | cache | B/token/layer | task | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
             "|---|---|---|---|---|" + "---|" * len(lengths)]
    size = {(r["model"], r["engine"], r["cache"]): r["bytes"] for r in rows if r.get("bytes")}
    for model, engine, cache in dict.fromkeys((r["model"], r["engine"], r["cache"]) for r in rows):
        known = size.get((model, engine, cache))
        bytes_cell = f"{known:g}" if known else ""  # rows scored before the bytes were recorded, or transformers
        for task in tasks:
            cells = []
            for n in lengths:
                got = cell.get((model, engine, cache, task, n))
                if got is None:
                    cells.append("")
                    continue
                text = f"{_share(got.values()):.2f}" + (f" of {len(got)}" if len(got) != usual else "")
                ref = cell.get(("original", engine, cache, task, n)) or cell.get(("original", engine, "f16", task, n))
                both = sorted(set(got) & set(ref or {}))
                if both and model != "original":
                    a, b = "".join(ref[i] for i in both), "".join(got[i] for i in both)
                    d = delta_entry(_share(a), None, _share(b), None, a, b, True)
                    se = d["delta_stderr"]
                    text += (f" ({d['delta']:+.2f}" + (f" ± {se:.2f}" if se is not None else "") + f", {d['verdict']}"
                             + (f", on {len(both)}" if len(both) != len(got) else "") + ")")
                cells.append(text)
            lines.append(f"| {model} | {engine} | {cache} | {bytes_cell} | {task} | " + " | ".join(cells) + " |")
    seconds = sum(r.get("seconds", 0) for r in rows)
    lines += ["", f"{len(rows)} rows, {seconds / 3600:.1f} h of scoring in all (this machine).", ""]
    (out / "ruler.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _share(matches) -> float:
    matches = list(matches)
    return matches.count("1") / len(matches) if matches else float("nan")


if __name__ == "__main__":
    try:
        main()
    except UserError as exc:
        raise SystemExit(f"ruler.py: {exc}") from None
