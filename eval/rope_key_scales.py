"""Other rotary-key scales than `rope_key_balance=partial`, scored under simulated 4-bit caches.

The rotary key's pairs may be scaled by any s_j with the queries' pairs scaled by 1 / s_j (exact: ops/basis.py).
The default takes s_j = energy_j^-0.3. This tries the alternatives on a converted checkpoint and scores each in
the torch simulation of llama.cpp's cache quantizers (ops/kv_quant.py, bit for bit), on held-out text of the
unseen domains:

- `--family a,b;...`: s_j = energy_j^-a x query_j^b on the scales the checkpoint carries (query_j: the pair's
  mean square in every head's query). a = b = 1/4 is what a uniform quantizer's noise budget argues for (noise
  set by the block's loudest value, each pair's score error weighted by its query), a = b = 0 the checkpoint as is.
- `--fit power`: per layer, the extra power p in -0.3..0.3 of energy^-p with the least layer-local error (the
  attention block's output with the cache quantized against it with an exact cache, on --fit-windows calibration
  windows); `--fit pairs`: per layer, coordinate descent over the 16-32 log2 scales on the same error.

    python eval/rope_key_scales.py --model runs/exp/r200-rope32-192 --data-dir runs/exp/data \\
        --family "0,0;0.25,0.25;0.2,0.2;0.5,0" --fit power,pairs

Ratios are over the same checkpoint with an exact cache (not over the original): how much the cache costs.
Rows are appended to <model>/rope-key-scales.jsonl.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from transmla_tool.data import token_windows
from transmla_tool.evaluate.perplexity import perplexity
from transmla_tool.heal.model import to_natural
from transmla_tool.ops.basis import rope_pair_energy, scale_rope_pairs
from transmla_tool.ops.linalg import affine_moment
from transmla_tool.ops.kv_quant import SIMULATED_CACHE_TYPES, quantize_dequantize
from transmla_tool.ops.mla import MLAWeights, mla_attention
from transmla_tool.rebalance import assign_weights, attention_input_moments

DOMAINS = ("forum", "code", "docs")  # unseen by a news calibration


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a checkpoint written by convert (calibrated on news)")
    parser.add_argument("--data-dir", required=True, help="domain splits (eval/frontier.py's <output-dir>/data)")
    parser.add_argument("--family", default="0,0;0.25,0.25;0.5,0", help="';'-separated a,b of energy^-a query^b")
    parser.add_argument("--fit", default="", help="comma-separated per-layer fits: power, pairs")
    parser.add_argument("--fit-cache", default="q4_0", help="the cache type the per-layer fits minimize")
    parser.add_argument("--fit-windows", type=int, default=6)
    parser.add_argument("--cache-types", default="q4_0,iq4_nl")
    parser.add_argument("--windows", type=int, default=16, help="scored windows of 512 tokens per domain")
    args = parser.parse_args()
    types = [t for t in args.cache_types.split(",") if t]
    if any(t not in SIMULATED_CACHE_TYPES for t in types + [args.fit_cache]):
        raise SystemExit(f"cache types: choose from {', '.join(SIMULATED_CACHE_TYPES)}")
    fits = [f for f in args.fit.split(",") if f]
    if any(f not in ("power", "pairs") for f in fits):
        raise SystemExit(f"--fit: choose from power, pairs; got {args.fit!r}")
    data = Path(args.data_dir)
    bench = Bench(args.model, data / "news-calib.jsonl", {d: data / f"{d}-heldout.jsonl" for d in DOMAINS},
                  args.windows, 512, args.fit_windows)
    out = Path(args.model) / "rope-key-scales.jsonl"
    families = [tuple(float(v) for v in c.split(",")) for c in args.family.split(";") if c]
    for row in measure(bench, families, fits, args.fit_cache, types):
        print(json.dumps(row), flush=True)
        with out.open("a") as f:
            f.write(json.dumps({"model": args.model, **row}) + "\n")


def measure(bench: "Bench", families: list[tuple[float, float]], fits: list[str], fit_cache: str,
            types: list[str]):
    """Yield a row per candidate and cache type: {scales, cache, ratios (per domain), worst, seconds}; the exact
    cache's row first (its ratios 1). The checkpoint's own weights are back in place after each candidate."""
    exact = bench.perplexities(None)
    yield {"scales": "exact cache", "cache": "exact", "perplexities": exact, "ratios": dict.fromkeys(exact, 1.0),
           "worst": 1.0, "seconds": 0.0}
    candidates = [(f"energy^-{a:g} query^{b:g}", lambda w, m, i, a=a, b=b: family(w, m, a, b)) for a, b in families]
    candidates += [(f"fit {f} on {fit_cache}", lambda w, m, i, f=f: bench.fit(i, w, m, f, fit_cache)) for f in fits]
    for label, scales in candidates:
        start = time.time()
        bench.set_weights([scale_rope_pairs(w, scales(w, m, i))
                           for i, (w, m) in enumerate(zip(bench.start, bench.moments))])
        try:
            for cache in types:
                ppl = bench.perplexities(cache)
                ratios = {d: round(ppl[d] / exact[d], 4) for d in ppl}
                yield {"scales": label, "cache": cache, "perplexities": ppl, "ratios": ratios,
                       "worst": max(ratios.values()), "seconds": round(time.time() - start, 1)}
        finally:
            bench.set_weights(bench.start)


def query_pair_weight(w: MLAWeights, x_moment: torch.Tensor) -> torch.Tensor:
    """(dr/2,) mean square of each rotary query pair, summed over heads (the query read straight from x)."""
    if w.q_b is not None:
        raise SystemExit("a kept query norm (q_b) reads the query through an RMSNorm: not supported here")
    heads, dn, dr = w.num_heads, w.nope_dim, w.rope_dim
    rows = torch.cat([torch.arange(h * (dn + dr) + dn, (h + 1) * (dn + dr)) for h in range(heads)])
    bias = None if w.q_bias is None else w.q_bias[rows].double()
    diag = affine_moment(w.q[rows].double(), bias, x_moment.double()).diagonal().view(heads, dr)
    return (diag[:, 0::2] + diag[:, 1::2]).sum(0)


def family(w: MLAWeights, x_moment: torch.Tensor, a: float, b: float) -> torch.Tensor:
    energy = rope_pair_energy(w, x_moment).clamp_min(1e-30)
    return energy.pow(-a) * query_pair_weight(w, x_moment).clamp_min(1e-30).pow(b)


class Bench:
    @torch.no_grad()
    def __init__(self, model_dir: str, calib: Path, scored: dict[str, Path], windows: int, seq_len: int,
                 fit_windows: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.config.use_cache = False  # NaturalAttention holds no cache
        to_natural(self.model)
        self.attns = [layer.self_attn for layer in self.model.model.layers]
        calib_windows = token_windows(str(calib), tokenizer, seq_len, 16)
        self.moments = attention_input_moments(self.model, calib_windows, 4)
        self.start = [a.weights().to(torch.float64) for a in self.attns]
        self.scored = {d: token_windows(str(path), tokenizer, seq_len, windows) for d, path in scored.items()}
        self.inputs = {}
        self.exact_outputs = {}

        def grab(index):
            def hook(module, hook_args, kwargs):
                self.inputs[index] = (kwargs["hidden_states"].detach().clone(), kwargs["position_embeddings"])
            return hook

        handles = [a.register_forward_pre_hook(grab(i), with_kwargs=True) for i, a in enumerate(self.attns)]
        try:
            self.model(calib_windows[:fit_windows], use_cache=False)
        finally:
            for handle in handles:
                handle.remove()

    @torch.no_grad()
    def set_weights(self, weights: list[MLAWeights]) -> None:
        for attn, w in zip(self.attns, weights):
            assign_weights(attn, w)

    @torch.no_grad()
    def perplexities(self, cache: str | None) -> dict[str, float]:
        for attn in self.attns:
            attn.cache_store = None if cache is None else (lambda row, c=cache: quantize_dequantize(row, c))
        result = {d: perplexity(self.model, windows, progress=False)["perplexity"] for d, windows in self.scored.items()}
        for attn in self.attns:
            attn.cache_store = None
        return result

    @torch.no_grad()
    def local_error(self, index: int, w: MLAWeights, cache: str) -> float:
        """Relative squared error of layer `index`'s output with its cache quantized, against an exact cache."""
        x, (cos, sin) = self.inputs[index]
        if index not in self.exact_outputs:  # the same for every candidate a fit tries
            self.exact_outputs[index] = mla_attention(x, self.start[index].to(torch.float32), cos, sin)
        exact = self.exact_outputs[index]
        quantized = mla_attention(x, w.to(torch.float32), cos, sin, cache_store=lambda row: quantize_dequantize(row, cache))
        return float((quantized - exact).pow(2).sum() / exact.pow(2).sum())

    def fit(self, index: int, w: MLAWeights, x_moment: torch.Tensor, kind: str, cache: str) -> torch.Tensor:
        energy = rope_pair_energy(w, x_moment).clamp_min(1e-30)

        def error(scale):
            return self.local_error(index, scale_rope_pairs(w, scale), cache)

        if kind == "power":
            return min((energy.pow(-p) for p in (0.0, -0.3, -0.2, -0.1, 0.1, 0.2, 0.3)), key=error)
        logs, best = torch.zeros_like(energy), error(torch.ones_like(energy))
        for step in (1.0, 0.5, 0.25):
            for j in range(logs.numel()):
                for delta in (step, -step):
                    trial = logs.clone()
                    trial[j] += delta
                    trial_error = error(trial.exp2())
                    if trial_error < best:
                        best, logs = trial_error, trial
                        break
        return logs.exp2()


if __name__ == "__main__":
    main()
