"""The whole benchmark table of docs/benchmarks.md in one resumable command: SmolLM2-135M in llama.cpp, the original
under f16, q8_0, iq4_nl and q4_0 caches beside the README's conversions at 2x, 3.56x, 5.3x and 7.1x fewer bytes,
training-free and healed, on HellaSwag, ARC-Easy/Challenge, PIQA, WinoGrande, LAMBADA (0-shot) and MMLU (5-shot).

    python eval/benchmark_table.py --output-dir runs/table                      # the full sets (tens of hours on 2 cores)
    python eval/benchmark_table.py --output-dir runs/table-250 --limit 250      # the first 250 rows of each task
    python eval/benchmark_table.py --output-dir runs/table --dry-run            # print the steps, run nothing

It runs the existing benchmarks one after another, each resumable on its own, so running this again after a kill
(or a stop) continues where it stopped and measures only what is missing:
1. eval/frontier.py: the original's perplexity and the conversions (default method, 200 refinement steps, calibrated
   on news, Usenet posts and Python source; Python docs held out), their GGUFs kept for step 3;
2. eval/heal.py, one run per point (`--heal-tokens`, 0 to skip): the same conversion healed by distillation, through
   llama.cpp's q4_0 cache for the points served over a 4-bit cache, its rotary key balanced afterwards;
3. eval/benchmarks.py: every point under the cache it is served with, the table in <output-dir>/benchmarks.md.
A healed point is healed from a conversion made the same way as its training-free point (the 7.1x one: without
refining through the cache, as the README's healed rows), not from the same file.
`--limit` is per task, and per MMLU subject (57 of them).
"""

import argparse
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

EVAL = Path(__file__).parent
sys.path.insert(0, str(EVAL))

from transmla_tool.engines.process import run_child  # noqa: E402

CALIB = "mix-docs"  # calibrated on the other three kinds of text, scored on docs
ZERO_SHOT = "hellaswag,arc_easy,arc_challenge,piqa,winogrande,lambada_openai"
ORIGINAL_CACHES = "f16,q8_0,iq4_nl,q4_0"
BALANCE = "partial"  # the healed models' rotary key balanced afterwards (`transmla-tool rebalance`)


@dataclass(frozen=True)
class Point:
    """One conversion of the table: its frontier configuration, sizes, the cache it is served with, and how it heals."""

    name: str  # the table's label of its size
    config: str  # eval/frontier.py configuration name
    overrides: str  # its method settings
    latent: int
    rope: int
    cache: str  # the llama.cpp cache type it is served with
    heal_cache: str | None  # heal --cache-type (None: an exact cache, for a point served over f16)
    heal_overrides: str | None = None  # the healed point's conversion, when not this one's

    @property
    def heal_settings(self) -> str:
        return self.heal_overrides or self.overrides

    @property
    def budget(self) -> int:
        return self.latent + self.rope


POINTS = (
    Point("2x", "r200-rope32", "refine_steps=200", 160, 32, "f16", None),
    Point("3.56x", "r200", "refine_steps=200", 320, 64, "iq4_nl", "q4_0"),
    Point("5.3x", "r200", "refine_steps=200", 192, 64, "iq4_nl", "q4_0"),
    # healed from the plain conversion: refining through the cache and then healing through it was never measured, and
    # the README's healed 7.1x rows (1.156) start from the plain one
    Point("7.1x", "r200-qat-iq4_nl-rope32", "refine_steps=200,refine_cache=iq4_nl", 160, 32, "iq4_nl", "q4_0",
          heal_overrides="refine_steps=200"),
)


def _script(name: str, *args: str) -> list[str]:
    return [sys.executable, str(EVAL / f"{name}.py"), *args]


def heal_dir(out: Path, point: Point) -> Path:
    return out / f"heal-{point.name}"


def healed_checkpoint(out: Path, point: Point) -> Path:
    """What eval/heal.py writes with --rebalance partial: the healed model with its rotary key balanced."""
    from heal import balanced_dir, healed_dir

    return balanced_dir(healed_dir(heal_dir(out, point), point.budget), BALANCE)


def plan(out: Path, limit: int | None, heal_tokens: int, chunks: int, mmlu: bool) -> list[list[str]]:
    """The commands, in order."""
    steps = []
    for rope in sorted({p.rope for p in POINTS}, reverse=True):
        group = [p for p in POINTS if p.rope == rope]
        configs = ";".join(dict.fromkeys(f"{p.config}=default:{p.overrides}" for p in group))
        budgets = ",".join(str(b) for b in sorted({p.budget for p in group}))
        caches = ",".join(dict.fromkeys(["f16", *(p.cache for p in group)]))
        steps.append(_script("frontier", "--output-dir", str(out), "--calib", CALIB, "--chunks", str(chunks),
                             "--rope-dim", str(rope), "--budgets", budgets, "--configs", configs,
                             "--cache-types", caches, "--original-cache-types", ORIGINAL_CACHES, "--keep-gguf"))
    if heal_tokens:
        for p in POINTS:
            overrides = [x for o in p.heal_settings.split(",") for x in ("--set", o)]
            cache = ["--cache-type", p.heal_cache] if p.heal_cache else []
            steps.append(_script("heal", "--output-dir", str(heal_dir(out, p)), "--data", CALIB,
                                 "--latent-dim", str(p.latent), "--rope-dim", str(p.rope), *overrides, *cache,
                                 "--max-tokens", str(heal_tokens), "--rebalance", BALANCE,
                                 "--cache-types", ",".join(dict.fromkeys(["f16", p.cache])),
                                 "--frontier-chunks", str(chunks)))
    points = ";".join(f"{CALIB}/{p.config}/{p.budget}:{p.cache}" for p in POINTS)
    healed = [x for p in POINTS if heal_tokens
              for x in ("--checkpoint", f"healed-{p.name}={healed_checkpoint(out, p)}:{p.cache}")]
    tasks = ZERO_SHOT + (",mmlu" if mmlu else "")
    steps.append(_script("benchmarks", "--frontier-dir", str(out), "--tasks", tasks,
                         "--original-cache-types", ORIGINAL_CACHES, "--points", points, *healed,
                         *(["--limit", str(limit)] if limit else [])))
    return steps


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/table")
    parser.add_argument("--limit", type=int, default=None, help="rows per task (per MMLU subject); default: all")
    parser.add_argument("--heal-tokens", type=int, default=409_600,
                        help="distillation tokens per healed point (0: the training-free points only; the README's "
                        "best 7.1x point healed 2M)")
    parser.add_argument("--chunks", type=int, default=16, help="llama-perplexity windows of 512 tokens per kind of text")
    parser.add_argument("--no-mmlu", action="store_true", help="the six 0-shot tasks only")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.limit is not None and args.limit < 1:
        raise SystemExit(f"--limit {args.limit}: give a positive number of rows, or leave it out for the full sets")
    if args.heal_tokens < 0:
        raise SystemExit(f"--heal-tokens {args.heal_tokens}: give 0 (no healing) or more")
    steps = plan(Path(args.output_dir), args.limit, args.heal_tokens, args.chunks, not args.no_mmlu)
    for i, step in enumerate(steps, 1):
        print(f"[{i}/{len(steps)}] {shlex.join(step)}", flush=True)
        if not args.dry_run:
            run_child(step, check=True)
    if not args.dry_run:
        print(f"the table: {Path(args.output_dir) / 'benchmarks.md'}")


if __name__ == "__main__":
    try:
        main()
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"benchmark_table.py: a step failed (exit {exc.returncode}); fix what it printed and run the "
                         "same command again: the finished steps are not redone") from None
