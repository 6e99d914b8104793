"""Copying: how well a model continues a span of random tokens it has just seen, the original beside converted (or
healed) checkpoints, at several distances. A cheap probe of exact copying, and a proxy for neither LAMBADA nor
RULER's needles 1-4K tokens back: a heal that restores copying leaves both where they were (docs/benchmarks.md,
docs/long-context.md).

Each sequence is a span of random tokens followed by the same span again. From the second token of the repeat on,
the next token is written earlier in the window, `span` positions back: a model that copies attends sharply to one
far key (the token after the earlier occurrence of the current one). A low-rank key blurs that match, and natural
text rarely repeats, so perplexity on text says little about it. The score is next-token accuracy (greedy) and the
mean loss over those positions; the original's and a checkpoint's accuracy are compared per sequence (paired).

    python eval/copying.py --output-dir runs/copying --spans 64,512,4096 \\
        --checkpoint "160+32=runs/heal52b/converted-192" --checkpoint "repeat25=runs/repeat/r25-192"

Resumable: rows go to <output-dir>/copying.jsonl keyed by (model, span) and record the sequences' seed and count; a
rerun scores only what is missing and refuses rows made with other sequences. copying.md is rebuilt from the file.
Transformers, fp32, exact cache (no quantization in the way), unless a checkpoint names a llama.cpp cache type
(`LABEL=DIR:iq4_nl`): then its attention reads keys and values through that cache's quantizer, bit-exact in torch
(heal.model.to_natural), as the benchmarks under llama.cpp's cache do.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from quality import _append, _read, check_same_scoring, parse_checkpoint  # noqa: E402

from transmla_tool.errors import UserError  # noqa: E402
from transmla_tool.evaluate.lmeval import verdict  # noqa: E402
from transmla_tool.evaluate.perplexity import LOGIT_CHUNK  # noqa: E402
from transmla_tool.heal.loss import position_logits  # noqa: E402
from transmla_tool.heal.settings import check_cache_type  # noqa: E402
from transmla_tool.registry import MODELS, model_gguf  # noqa: E402

SKIP = 1000  # the random tokens avoid the vocabulary's first and last SKIP ids (special and byte tokens)


def repeated_spans(vocab: int, span: int, count: int, seed: int) -> torch.Tensor:
    """(count, 2 * span) token ids: a random span, then the same span again."""
    low, high = min(SKIP, vocab // 4), max(vocab - SKIP, vocab // 4 + 2)
    first = torch.randint(low, high, (count, span), generator=torch.Generator().manual_seed(seed + span))
    return torch.cat([first, first], dim=1)


@torch.no_grad()
def copy_scores(model, ids: torch.Tensor, span: int, batch_size: int, chunk: int = LOGIT_CHUNK) -> dict:
    """Greedy next-token hits and losses over the repeat's predictable positions (tokens span + 1 .. 2 span - 1)."""
    device = next(model.parameters()).device
    hits, losses = [], []
    for b in range(0, ids.shape[0], batch_size):
        x = ids[b:b + batch_size].to(device)
        hit = torch.zeros(x.shape[0], device=device)
        loss = torch.zeros(x.shape[0], dtype=torch.float64, device=device)
        for start, logits in position_logits(model, x, chunk):
            lo = max(start, span)  # logits column j predicts token j + 1; the repeat's copyable targets are span + 1..
            if lo >= start + logits.shape[1]:
                continue
            part, targets = logits[:, lo - start:], x[:, lo + 1:start + 1 + logits.shape[1]]
            hit += (part.argmax(-1) == targets).sum(1)
            loss += torch.nn.functional.cross_entropy(part.transpose(1, 2), targets, reduction="none").double().sum(1)
        hits += (hit / (span - 1)).tolist()
        losses += (loss / (span - 1)).tolist()
    n = len(hits)
    accuracy = sum(hits) / n
    spread = math.sqrt(sum((h - accuracy) ** 2 for h in hits) / max(n - 1, 1) / n)
    return {"accuracy": accuracy, "accuracy_stderr": spread, "nll": sum(losses) / n, "per_sequence": hits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/copying")
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(MODELS))
    parser.add_argument("--checkpoint", action="append", default=[], metavar="LABEL=DIR",
                        help="a converted or healed checkpoint to score beside the original (repeatable); "
                        "LABEL=DIR:CACHE reads it through that llama.cpp cache type's quantizer (e.g. iq4_nl)")
    parser.add_argument("--spans", default="64,512,4096", help="span lengths; the repeat is that far back")
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--table-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "copying.jsonl"
    if args.table_only:
        write_table(out)
        return
    spans = [int(s) for s in args.spans.split(",") if s]
    if bad := [s for s in spans if s < 2]:
        raise SystemExit(f"--spans {','.join(map(str, bad))}: a span needs at least 2 tokens")
    directory, gguf = model_gguf(args.model)
    models = [("original", None, None)]
    for spec in args.checkpoint:  # simulated in torch; converted from --model
        label, path, caches = parse_checkpoint(spec, check_type=check_cache_type, source=(directory, gguf))
        models.append((label, path, caches[0] if caches else None))
    rows = _read(results)
    check_same_scoring(rows, results, {"sequences": args.sequences, "seed": args.seed, "source_model": args.model})
    done = {(r["model"], r["span"]) for r in rows}
    device = torch.device(args.device)
    for label, path, cache in models:
        todo = [s for s in spans if (label, s) not in done]
        if not todo:
            continue
        model = load_scored(path or directory, None if path else gguf, cache, device)
        vocab = model.get_output_embeddings().weight.shape[0]
        for span in todo:
            start = time.time()
            got = copy_scores(model, repeated_spans(vocab, span, args.sequences, args.seed), span, args.batch_size)
            row = {"model": label, "checkpoint": path, "cache": cache, "span": span, "sequences": args.sequences,
                   "seed": args.seed, "source_model": args.model, **got, "seconds": round(time.time() - start, 1)}
            _append(results, row)
            done.add((label, span))
        del model
    write_table(out)


def load_scored(path: str, gguf: str | None, cache: str | None, device: torch.device):
    """A model in fp32 for scoring; with `cache`, its attention reads keys and values through that llama.cpp cache
    type's quantizer (heal.model.to_natural, as heal --cache-type trains)."""
    from transmla_tool.evaluate.models import load_model

    model = load_model(path, gguf, torch.float32, device)
    if cache:
        from transmla_tool.heal.model import to_natural

        to_natural(model, cache)
        model.config.use_cache = False  # the natural form scores whole windows and keeps no KV cache
    return model


def write_table(out: Path) -> None:
    rows = _read(out / "copying.jsonl")
    if not rows:
        raise SystemExit(f"{out / 'copying.jsonl'} holds no rows yet")
    cell = {(r["model"], r["span"]): r for r in rows}
    spans = sorted({r["span"] for r in rows})
    labels = list(dict.fromkeys(r["model"] for r in rows))
    title = MODELS[rows[0]["source_model"]].title
    lines = [f"# Copying a repeated random span ({title}, transformers, fp32, {rows[0]['sequences']} sequences per "
             "span)", "", "Greedy next-token accuracy over the repeat (the next token is `span` positions back); "
             "a checkpoint's difference from the original is paired per sequence, a loss only beyond 1.96 stderrs.",
             "", "| model | " + " | ".join(f"span {s}" for s in spans) + " |", "|---|" + "---|" * len(spans)]
    for label in labels:
        cells = []
        for s in spans:
            row, base = cell.get((label, s)), cell.get(("original", s))
            if row is None:
                cells.append("")
                continue
            text = f"{row['accuracy']:.3f} ± {row['accuracy_stderr']:.3f}"
            if label != "original" and base is not None:
                d = _paired(base["per_sequence"], row["per_sequence"])
                text += f" ({100 * d['delta']:+.1f} ± {100 * d['delta_stderr']:.1f}, {d['verdict']})"
            cells.append(text)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", f"{len(rows)} rows, {sum(r['seconds'] for r in rows) / 60:.1f} min of scoring (this machine).", ""]
    (out / "copying.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _paired(original: list[float], converted: list[float]) -> dict:
    """The mean of the per-sequence accuracy differences, its stderr and its verdict (a win or loss beyond 1.96)."""
    n = len(original)
    diffs = [b - a for a, b in zip(original, converted)]
    mean = sum(diffs) / n
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / max(n - 1, 1) / n)
    return {"delta": mean, "delta_stderr": se, "verdict": verdict(mean, se, True)}


if __name__ == "__main__":
    try:
        main()
    except UserError as exc:  # a --checkpoint of other weights, a cache its row cannot hold
        raise SystemExit(f"copying.py: {exc}") from None
