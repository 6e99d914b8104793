"""One attention layer's decode step three ways, on real weights: what the MLA format makes possible.

    python eval/mla_decode.py --converted demo_out/smollm2-135m-mla-192 [--contexts 1024,4096,16384]

- gqa: the source layout, the cache holds every KV head's keys and values (2 * G * D per token);
- mla-expanded: what transformers' DeepseekV3Attention does, re-expanding the latent cache into
  per-head K/V with kv_b_proj at every step (its cost grows with context times H*(dn+dv)*r);
- mla-absorbed: what serving kernels do, folding kv_b_proj into the query and the output so each
  step reads only the latent + rotary key (r + dr per token).
All three compute the same function of the same cache (checked); timings are a plain-PyTorch
reference on whatever device runs it, not a tuned kernel.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from transmla_tool.export import natural_attention


def load_layer(path: Path, layer: int):
    config = json.loads((path / "config.json").read_text())
    index = path / "model.safetensors.index.json"
    files = sorted({*json.loads(index.read_text())["weight_map"].values()}) if index.exists() else ["model.safetensors"]
    prefix = f"model.layers.{layer}.self_attn."
    tensors = {}
    for name in files:
        with safe_open(path / name, framework="pt") as f:
            for key in f.keys():
                if key.startswith(prefix):
                    tensors[key[len(prefix):]] = f.get_tensor(key).float()
    from transformers import AutoConfig

    return natural_attention(tensors, AutoConfig.from_pretrained(path)).to(torch.float32), config


def bench(fn, repeats: int, device: torch.device, warmup: int = 3) -> float:
    """Median seconds per call after `warmup` untimed calls (each call synchronised on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mla_paths(w, x, latent, k_rope):
    """(expanded, absorbed): one decode step of the query x over a cache of (latent, k_rope)."""
    heads, r, dr, dn, dv = w.num_heads, w.latent_dim, w.rope_dim, w.nope_dim, w.v_dim
    ctx, scale = latent.shape[0], w.softmax_scale
    kv_b = w.kv_b.view(heads, dn + dv, r)
    w_uk, w_uv = kv_b[:, :dn], kv_b[:, dn:]  # (H, dn, r), (H, dv, r)
    q = F.linear(x, w.q).view(heads, dn + dr)
    q_nope, q_rope = q[:, :dn], q[:, dn:]

    def expanded():
        kv = F.linear(latent, w.kv_b).view(ctx, heads, dn + dv).transpose(0, 1)  # (H, T, dn+dv)
        keys = torch.cat([kv[..., :dn], k_rope.expand(heads, ctx, dr)], -1)
        probs = ((torch.cat([q_nope, q_rope], -1)[:, None] @ keys.transpose(1, 2)) * scale).softmax(-1)
        return F.linear((probs @ kv[..., dn:]).reshape(1, -1), w.o)

    def absorbed():
        q_lat = torch.einsum("hn,hnr->hr", q_nope, w_uk)  # (H, r): kv_b folded into the query
        scores = (q_lat @ latent.T + q_rope @ k_rope.T) * scale  # (H, T)
        o_lat = scores.softmax(-1) @ latent  # (H, r)
        return F.linear(torch.einsum("hr,hvr->hv", o_lat, w_uv).reshape(1, -1), w.o)

    return expanded, absorbed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--converted", required=True)
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--kv-heads", type=int, default=None, help="source KV heads (default: from conversion.json)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.set_default_device(device)
    w32, config = load_layer(Path(args.converted), args.layer)
    w32 = w32.to(torch.float32, device)
    w = w32.to(dtype, device)
    heads, r, dr = w.num_heads, w.latent_dim, w.rope_dim
    summary = json.loads((Path(args.converted) / "conversion.json").read_text())
    gqa_values = summary["cache_values_per_token_per_layer"]["original"]
    kv_heads = args.kv_heads or gqa_values // (2 * w.v_dim)
    print(f"device {device}, {args.dtype}, median of {args.repeats} after 3 warm-up calls")
    print(f"layer {args.layer}: H={heads} latent={r} rope={dr} nope={w.nope_dim} v={w.v_dim}; source KV heads {kv_heads}")
    print("| context | gqa ms/step | mla-expanded ms/step | mla-absorbed ms/step | cache bytes gqa | cache bytes mla |")
    print("|---|---|---|---|---|---|")
    for ctx in [int(c) for c in args.contexts.split(",")]:
        inputs = (torch.randn(1, w.q.shape[1]), torch.randn(ctx, r) * 0.5, torch.randn(ctx, dr))
        # the two MLA paths must compute the same function: checked in fp32 (in bf16 the rounding of
        # random, sharply peaked scores differs between the two orders of operations)
        a, b = (f().float() for f in mla_paths(w32, *inputs))
        assert (a - b).norm() <= 1e-4 * a.norm(), f"expanded and absorbed paths disagree at context {ctx}"
        expanded, absorbed = mla_paths(w, *(t.to(dtype) for t in inputs))
        keys = torch.randn(kv_heads, ctx, w.v_dim, dtype=dtype)
        values = torch.randn(kv_heads, ctx, w.v_dim, dtype=dtype)
        q_gqa = torch.randn(heads, 1, w.v_dim, dtype=dtype)

        def gqa():
            rep = heads // kv_heads
            out = F.scaled_dot_product_attention(q_gqa, keys.repeat_interleave(rep, 0),
                                                 values.repeat_interleave(rep, 0))
            return F.linear(out.reshape(1, -1), w.o)

        t = [bench(f, args.repeats, device) * 1e3 for f in (gqa, expanded, absorbed)]
        print(f"| {ctx} | {t[0]:.3f} | {t[1]:.3f} | {t[2]:.3f} | {2 * kv_heads * w.v_dim * ctx * 2} | {(r + dr) * ctx * 2} |")
    print("(cache bytes per layer in bf16; wall time per call, plain PyTorch, not a tuned kernel)")


if __name__ == "__main__":
    main()
