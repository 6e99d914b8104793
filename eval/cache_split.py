"""Where a quantized KV cache's cost comes from in a converted model: the latent or the rotary key.

Torch simulation (ops/kv_quant.py reproduces llama.cpp's cache quantizers bit for bit): the checkpoint's
perplexity on --data with every layer's cached row [latent | rotary key] read back through a cache type,
then with only the latent or only the rotary key quantized, then with the rotary key balanced at each
`--powers` p (pairs scaled by energy^-p on --calib-data, queries inversely: ops/basis.py) and the whole row
quantized. Ratios are over the same checkpoint with an exact cache. p scales the rotary key as the checkpoint
holds it: one converted with today's default already carries p = 0.3 (`rope_key_balance=partial`), so its p = 0
rows are that balance and its p > 0 rows balance further.

    python eval/cache_split.py --model runs/heal-qat-docs-rope32/converted-192 \\
        --data runs/heal-qat-docs-rope32/data/docs-heldout.jsonl \\
        --calib-data runs/heal-qat-docs-rope32/data/calib.txt --cache-types q4_0,iq4_nl --powers 0.25,0.3,0.5

Not an engine measurement: llama.cpp's perplexity (eval/frontier.py, eval/heal.py) is what the README leads
with; this says why, in a minute on a CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from transmla_tool.data import token_windows
from transmla_tool.evaluate.perplexity import perplexity
from transmla_tool.heal.model import to_natural
from transmla_tool.ops.basis import (
    balance_latent,
    balance_rope_key,
    latent_rotation,
    rotate_latent,
)
from transmla_tool.ops.kv_quant import SIMULATED_CACHE_TYPES, query_dot_store, quantize_dequantize
from transmla_tool.rebalance import assign_weights, attention_input_moments


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint written by convert or heal")
    parser.add_argument("--data", required=True, help="text scored (keep it unlike the calibration text)")
    parser.add_argument("--calib-data", required=True, help="text the rotary-key energies are measured on")
    parser.add_argument("--cache-types", default="q4_0,iq4_nl")
    parser.add_argument("--powers", default="0.3,0.5", help="rotary-key balance powers p to try (0 = as converted)")
    parser.add_argument("--sensitivity", action="store_true",
                        help="also score the latent, and the whole row, with the latent balanced to its output "
                             "sensitivity, then Hadamard-rotated (ops/basis.balance_latent: exact)")
    parser.add_argument("--windows", type=int, default=8, help="scored windows of --seq-len tokens")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--output", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    types = [t.strip() for t in args.cache_types.split(",") if t.strip()]
    if not types or any(t not in SIMULATED_CACHE_TYPES for t in types):
        raise SystemExit(f"--cache-types: choose from {', '.join(SIMULATED_CACHE_TYPES)}, got {args.cache_types!r}")
    rows = split(args.model, args.data, args.calib_data, types, [float(p) for p in args.powers.split(",")],
                 args.windows, args.seq_len, args.sensitivity)
    for row in rows:
        print(f"{row['cache']:8s} {row['quantized']:24s} perplexity {row['perplexity']:.3f}  ratio {row['ratio']:.4f}")
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))


def split(model_dir: str, data: str, calib: str, types: list[str], powers: list[float], windows: int,
          seq_len: int = 512, sensitivity: bool = False) -> list[dict]:
    """Rows {cache, quantized, perplexity, ratio}: the exact cache first, then per type the whole row, the latent
    alone, the rotary key alone, the whole row with the query also rounded to the type llama.cpp's CPU attention
    converts it to (q8_0 for every block type; ops/kv_quant.query_dot_store), the whole row after balancing the rotary key at each power, and (sensitivity) the
    latent and the whole row with the latent balanced to its output sensitivity."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    scored = token_windows(data, tokenizer, seq_len, windows)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.config.use_cache = False  # NaturalAttention holds no cache
    to_natural(model)
    attns = [layer.self_attn for layer in model.model.layers]
    latent = attns[0].dims["latent_dim"]
    moments = attention_input_moments(model, token_windows(calib, tokenizer, seq_len, 16), 4)
    with torch.no_grad():
        start = [a.weights().to(torch.float64) for a in attns]

    def read_through(name: str, part: str):
        def store(row):
            back = quantize_dequantize(row, name)
            if part == "latent":
                return torch.cat([back[..., :latent], row[..., latent:]], -1)
            if part == "rotary key":
                return torch.cat([row[..., :latent], back[..., latent:]], -1)
            return back
        return store

    def score(name: str | None, part: str = "all", engine_query: bool = False) -> float:
        for a in attns:
            a.cache_store = None if name is None else read_through(name, part)
            a.query_store = query_dot_store(name) if engine_query else None
        return perplexity(model, scored, progress=False)["perplexity"]

    exact = score(None)
    rows = [{"cache": "exact", "quantized": "nothing", "perplexity": exact, "ratio": 1.0}]
    for name in types:
        for part in ("all", "latent", "rotary key"):
            rows.append({"cache": name, "quantized": part, "perplexity": score(name, part)})
        if query_dot_store(name) is not None:
            rows.append({"cache": name, "quantized": "all, query rounded as llama.cpp's CPU reads it",
                         "perplexity": score(name, engine_query=True)})
        for power in powers:
            if power == 0:
                continue
            for a, w, moment in zip(attns, start, moments):
                assign_weights(a, balance_rope_key(w, moment, power))
            rows.append({"cache": name, "quantized": f"all, rotary key p={power:g}", "perplexity": score(name)})
            for a, w in zip(attns, start):
                assign_weights(a, w)
        if sensitivity:
            for i, (a, w, moment) in enumerate(zip(attns, start, moments)):
                assign_weights(a, rotate_latent(balance_latent(w, moment), latent_rotation(latent, "hadamard", i)))
            rows.append({"cache": name, "quantized": "latent, balanced to its sensitivity",
                         "perplexity": score(name, "latent")})
            rows.append({"cache": name, "quantized": "all, latent balanced to its sensitivity",
                         "perplexity": score(name)})
            for a, w in zip(attns, start):
                assign_weights(a, w)
    for row in rows:
        row["ratio"] = row["perplexity"] / exact
    return rows


if __name__ == "__main__":
    main()
