"""What healing at length costs: a few `heal` steps per window length and setting, each in its own process, with
its peak memory (loading the models and text, and the training loop's own, both from the kernel's VmHWM as heal's
healing.json records them) and its speed. The child's rusage from wait4 is not used: heal resets the kernel's peak
counter before its first step, and that resets ru_maxrss too.

An arm is `NAME=LOSS_CHUNK[,gc]`: the positions whose logits the loss holds at once (0: whole windows, as before
--loss-chunk existed) and `gc` for --gradient-checkpointing.

    python eval/heal_memory.py --model runs/length/ckpt/rope32 --output-dir runs/heal-memory \\
        --lengths 512,2048,8192 --arms "whole=0;chunked=1024;chunked-gc=1024,gc"

Rows go to <output-dir>/heal_memory.jsonl keyed by (arm, length); a rerun measures only what is missing.
heal_memory.md is rebuilt from the file. The teacher is SmolLM2-135M (the installed GGUF) unless --teacher is given;
the training text is gensim's news articles unless --data is given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from quality import _append, _read  # noqa: E402

from transmla_tool.assets import lee_corpus, smollm2_gguf  # noqa: E402
from transmla_tool.engines.process import run_child  # noqa: E402


def parse_arm(spec: str) -> dict:
    name, _, rest = spec.partition("=")
    parts = rest.split(",")
    if not name or not parts[0].isdigit() or any(p != "gc" for p in parts[1:]):
        raise SystemExit(f"--arms: {spec!r} is not NAME=LOSS_CHUNK[,gc] (e.g. chunked-gc=1024,gc)")
    return {"name": name, "loss_chunk": int(parts[0]), "gradient_checkpointing": "gc" in parts[1:]}


def heal_in_child(args, arm: dict, length: int, out: Path) -> dict:
    """`transmla-tool heal` for --steps steps of one window in its own process: its wall time and what its
    healing.json records (the peaks of loading and of training)."""
    teacher_dir, teacher_file = args.teacher, args.teacher_gguf_file
    if teacher_dir is None:
        teacher_dir, teacher_file = smollm2_gguf()
    argv = [sys.executable, "-m", "transmla_tool", "heal", "--model", args.model, "--teacher", str(teacher_dir),
            "--data", args.data or str(lee_corpus()), "--output", str(out), "--overwrite", "--no-progress",
            "--seq-len", str(length), "--batch-size", "1", "--max-steps", str(args.steps),
            "--loss-chunk", str(arm["loss_chunk"])]
    if teacher_file:
        argv += ["--teacher-gguf-file", str(teacher_file)]
    if arm["gradient_checkpointing"]:
        argv.append("--gradient-checkpointing")
    start = time.time()
    code = run_child(argv).returncode
    if code != 0:
        raise SystemExit(f"heal_memory.py: {arm['name']} at {length} failed (exit {code}): {' '.join(argv)}")
    summary = json.loads((out / "healing.json").read_text())
    return {"wall_seconds": round(time.time() - start, 1), "setup_peak_rss_mb": summary.get("setup_peak_rss_mb"),
            "train_peak_rss_mb": summary.get("train_peak_rss_mb"), "peak_rss_mb": summary.get("peak_rss_mb"),
            "train_peak_gpu_mb": summary.get("train_peak_gpu_mb"),
            "tokens_per_s": summary.get("tokens_per_s"), "loss_chunk_used": summary.get("loss_chunk"),
            "loss_chunk_checks": summary.get("loss_chunk_checks")}


def _mb(value) -> str:
    return "not recorded" if value is None else f"{value:.0f}"  # rows of 2026-11-29 kept only the training peak


def write_table(out: Path, rows: list[dict]) -> None:
    lines = ["# Healing at length: memory and speed per step (batch 1; this machine)", "",
             "| arm | loss chunk | gradient checkpointing | window | training peak RSS (MiB) | loading peak RSS (MiB) "
             "| tokens/s |", "|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["arm"], r["length"])):
        speed = "-" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.0f}"
        lines.append(f"| {r['arm']} | {r['loss_chunk_used'] or 'whole'} | {'yes' if r['gradient_checkpointing'] else 'no'}"
                     f" | {r['length']} | {r['train_peak_rss_mb']:.0f} | {_mb(r.get('setup_peak_rss_mb'))} | {speed} |")
    lines += ["", f"Model: {rows[0]['model']}; {rows[0]['steps']} steps per row (tokens/s is the steady state: the "
              "steps after the first).", ""]
    (out / "heal_memory.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a directory written by transmla-tool convert")
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--teacher", default=None, help="default: the installed SmolLM2-135M GGUF")
    ap.add_argument("--teacher-gguf-file", default=None)
    ap.add_argument("--data", default=None, help="training text (default: gensim's lee_background news)")
    ap.add_argument("--lengths", default="512,8192")
    ap.add_argument("--arms", default="whole=0;chunked=1024;chunked-gc=1024,gc")
    ap.add_argument("--steps", type=int, default=2, help="heal steps per row (the first is not steady state)")
    args = ap.parse_args()
    arms = [parse_arm(a) for a in args.arms.split(";") if a.strip()]
    lengths = [int(x) for x in args.lengths.split(",")]
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "heal_memory.jsonl"
    rows = _read(results)
    done = {(r["arm"], r["length"]) for r in rows}
    for length in lengths:
        for arm in arms:
            if (arm["name"], length) in done:
                continue
            print(f"== {arm['name']} at {length} tokens", flush=True)
            measured = heal_in_child(args, arm, length, out / "healed" / f"{arm['name']}-{length}")
            row = {"arm": arm["name"], "length": length, "loss_chunk": arm["loss_chunk"],
                   "gradient_checkpointing": arm["gradient_checkpointing"], "model": args.model,
                   "steps": args.steps, **measured}
            _append(results, row)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if rows:
        write_table(out, rows)
        print((out / "heal_memory.md").read_text())


if __name__ == "__main__":
    main()
