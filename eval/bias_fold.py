"""How each way of folding attention biases into a bias-free layer does, per layer and end to end, training-free.

A bias-free output (what vLLM and llama.cpp serve) of a biased source (Qwen2.5) reads every bias through the input's
near-constant direction u (u.x ~ 1; ops/bias_fold.py). The method setting `bias_fold` says where the value bias goes:
"constant" folds it after the joint latent is chosen (least squares into the latent's value span), "joint" hands it to
the joint latent PCA as signal ([W_v | b_v] under the augmented moment), "none" drops every bias; `rope_bias_fold`
folds the rotary key's bias "all" or as far as each slot rotates ("rotating"). This runs the source model over
calibration windows one layer at a time, converts each layer in closed form (no refinement; `--refine-steps N`: the
default method's layer-local refinement, N steps, in the layers that fold) once per variant, and measures:
- per layer, the relative MSE of the attention block's output on held-out windows of another kind of text (each
  variant's layer fed the source's own inputs), and the value bias the variant's latent misses;
- end to end, the held-out perplexity of the model with every layer replaced by the variant's (each variant carries
  its own residual stream), beside the source's and beside the same conversion keeping its biases (transformers).

    python eval/bias_fold.py --model qwen2.5-coder-1.5b --output-dir runs/bias-fold --latent-dims 160,448

Rows (one per variant and latent dim, plus one per layer) go to <output-dir>/bias-fold.jsonl; a rerun skips what is
there.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from transmla_tool.arch import check_supported, llama_view
from transmla_tool.arch.families import EMBED, FINAL_NORM, LM_HEAD
from transmla_tool.calibrate import SourceLayers, chunks, run_layer_with_attention, run_source_layer
from transmla_tool.data import token_windows
from transmla_tool.export import deepseek_config
from transmla_tool.io.source import open_source
from transmla_tool.layer import LayerContext, calibrate_layer, convert_layer
from transmla_tool.methods import PRESETS
from transmla_tool.ops.bias_fold import with_constant_channel
from transmla_tool.ops.mla import mla_attention
from transmla_tool.registry import MODELS, model_gguf

# name -> method settings of a bias-free output; "keep" keeps the biases (transformers): the exact-bias reference
VARIANTS = {
    "keep": {},
    "none": {"bias_fold": "none"},
    "constant-all": {"bias_fold": "constant", "rope_bias_fold": "all"},  # the default until 2026-12-01
    "joint-all": {"bias_fold": "joint", "rope_bias_fold": "all"},
    "constant-rotating": {"bias_fold": "constant", "rope_bias_fold": "rotating"},
    "joint-rotating": {"bias_fold": "joint", "rope_bias_fold": "rotating"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", choices=sorted(MODELS))
    parser.add_argument("--output-dir", default="runs/bias-fold")
    parser.add_argument("--data-dir", default=None, help="domain splits of an earlier run (default <output-dir>/data)")
    parser.add_argument("--calib", default="news,forum,code", help="calibration kinds of text (domain names)")
    parser.add_argument("--heldout", default="docs", help="the held-out kind of text (not in --calib)")
    parser.add_argument("--calib-samples", type=int, default=32)
    parser.add_argument("--heldout-windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--latent-dims", default="160")
    parser.add_argument("--rope-dim", type=int, default=64)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--layers", type=int, default=0, help="convert only the first N layers (0 = all)")
    parser.add_argument("--fold-layers", default="", help="fold in these layers only (e.g. 0-1 or 2,5), keep the "
                        "biases (transformers) elsewhere: which layers' folds cost the model")
    parser.add_argument("--refine-steps", type=int, default=0,
                        help="refine each folding layer (--fold-layers, else every layer) with the default method's "
                             "layer-local refinement for this many steps (0: closed form, training-free); the layers "
                             "outside --fold-layers stay closed form: whether refinement absorbs what the fold loses")
    parser.add_argument("--constant-channel", action="store_true",
                        help="every variant (and the original it is compared with) on the embedding with one channel "
                             "made constant for the first layer (ops/bias_fold.with_constant_channel), as convert does "
                             "for a bias-free output")
    args = parser.parse_args()
    from transmla_tool.assets import domain_splits

    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.constant_channel and "none" in variants:
        variants.remove("none")  # nothing to fold through
    torch.manual_seed(0)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data_dir) if args.data_dir else out / "data"
    if not (data / f"{args.heldout}-heldout.jsonl").exists():
        domain_splits(data)
    rows_path = out / "bias-fold.jsonl"
    done = {json.dumps(r["key"]) for r in map(json.loads, rows_path.read_text().splitlines())} \
        if rows_path.exists() else set()
    latent_dims = [int(r) for r in args.latent_dims.split(",")]
    wanted = [(r, v) for r in latent_dims for v in variants
              if json.dumps(_key(args, r, v)) not in done]
    if not wanted:
        print("every row is there:", rows_path)
        return

    directory, gguf = model_gguf(args.model)
    source = open_source(directory, gguf)
    geometry = check_supported(source.config)
    source = llama_view(source, geometry)
    tokenizer = source.load_tokenizer()
    calib_kinds = args.calib.split(",")
    per_kind = math.ceil(args.calib_samples / len(calib_kinds))
    calib = torch.cat([token_windows(str(data / f"{k}-calib.jsonl"), tokenizer, args.seq_len, per_kind)
                       for k in calib_kinds])[: args.calib_samples]
    held = token_windows(str(data / f"{args.heldout}-heldout.jsonl"), tokenizer, args.seq_len, args.heldout_windows)
    device = torch.device("cpu")
    layers = SourceLayers(source, geometry, device)
    method = replace(PRESETS["closed-form"], moment_shrinkage=PRESETS["default"].moment_shrinkage)
    refined = replace(method, refine_steps=args.refine_steps)  # the default method when the steps are its 600
    configs = {}
    for r, v in wanted:
        keep = v == "keep"
        configs[(r, v)] = deepseek_config(source.config, geometry, latent_dim=r, rope_dim=args.rope_dim,
                                          q_bias=keep and geometry.q_bias, attention_bias=keep,
                                          dtype=torch.float32, yarn_for_scaled_rope=not keep)
    first_config = next(iter(configs.values()))
    ctx = LayerContext.build(refined, geometry, layers, first_config, length=args.seq_len, rope_dim=args.rope_dim,
                             seed=0, batch_size=4, windows=calib.shape[0], device=device)
    embed = source.get(EMBED).float()
    pristine = embed[held].clone()  # the original's own stream (the one with a constant channel is another model)
    if args.constant_channel:
        embed, chosen = with_constant_channel(embed, geometry.rms_norm_eps)
        print(f"embedding channel {chosen.channel} made constant ({chosen.value:.3f} after the first norm)")
    hidden, held_hidden = embed[calib], embed[held]
    fold_layers = _layer_set(args.fold_layers)
    keep_config = {r: deepseek_config(source.config, geometry, latent_dim=r, rope_dim=args.rope_dim,
                                      q_bias=geometry.q_bias, attention_bias=True, dtype=torch.float32)
                   for r in latent_dims}
    streams = {key: embed[held].clone() for key in wanted}  # each variant's own residual stream on held-out text
    del embed
    per_layer = {key: [] for key in wanted}
    start = time.time()
    count = args.layers or geometry.num_layers
    for i in range(count):
        layer = layers.layer(i)
        attn = layers.attention_weights(layer, hidden)
        calib_i = calibrate_layer(layer, attn, hidden, ctx)
        target = _attention(layer, held_hidden, ctx)
        kept = {}  # latent dim -> this layer with its biases kept, for the layers outside --fold-layers
        for key in wanted:
            r, v = key
            if fold_layers is not None and i not in fold_layers:
                if r not in kept:
                    kept[r] = convert_layer(layer, attn, hidden, calib_i, replace(ctx, method=method), i, r,
                                            keep_config[r])
                _, mla, report = kept[r]
            else:
                ctx_v = replace(ctx, method=replace(refined, **VARIANTS[v]))
                _, mla, report = convert_layer(layer, attn, hidden, calib_i, ctx_v, i, r, configs[key])
            mla32 = mla.to(torch.float32)
            err = _relative_mse(layer, held_hidden, target, mla32, ctx)
            row = {"layer": i, "heldout_rel_mse": round(err, 6), **report.get("bias_fold", {}),
                   **{k: report[k] for k in ("refine_loss_before", "refine_loss_after") if k in report}}
            per_layer[key].append(row)
            run_layer_with_attention(layer, lambda x, w=mla32: mla_attention(x, w, ctx.target_cos, ctx.target_sin),
                                     streams[key], 4)
            print(f"layer {i} latent {r} {v}: held-out rel. MSE {err:.4f}"
                  + (f", rotary-key bias folded {row['rope_bias_folded']:.3f}" if "rope_bias_folded" in row else "")
                  + (f", refinement loss {row['refine_loss_before']:.4f} -> {row['refine_loss_after']:.4f}"
                     if "refine_loss_after" in row else ""),
                  flush=True)
        run_source_layer(layer, hidden, (ctx.cos[None], ctx.sin[None]), 4)
        run_source_layer(layer, held_hidden, (ctx.cos[None], ctx.sin[None]), 4)
        if args.constant_channel:
            run_source_layer(layer, pristine, (ctx.cos[None], ctx.sin[None]), 4)
        del layer, attn, calib_i
    norm_w = source.get(FINAL_NORM).float()
    head = source.get(LM_HEAD if source.has(LM_HEAD) else EMBED).float()
    eps = source.config.rms_norm_eps
    original = _perplexity(held_hidden, held, norm_w, head, eps)  # with the constant channel, if asked
    untouched = _perplexity(pristine, held, norm_w, head, eps) if args.constant_channel else original
    with rows_path.open("a") as f:
        for key in wanted:
            r, v = key
            ppl = _perplexity(streams[key], held, norm_w, head, eps)
            errs = [p["heldout_rel_mse"] for p in per_layer[key]]
            row = {"key": _key(args, r, v), "model": args.model, "latent_dim": r, "rope_dim": args.rope_dim,
                   "variant": v, "settings": VARIANTS[v], "layers": count, "calib": args.calib, "heldout": args.heldout,
                   "original_perplexity": round(original, 4), "untouched_original_perplexity": round(untouched, 4),
                   "perplexity": round(ppl, 4),
                   "ratio": round(ppl / original, 4), "mean_layer_rel_mse": round(sum(errs) / len(errs), 6),
                   "per_layer": per_layer[key], "seconds": round(time.time() - start, 1)}
            f.write(json.dumps(row) + "\n")
            print(f"latent {r} + {args.rope_dim} {v}: perplexity {ppl:.3f} (original {original:.3f}, "
                  f"{ppl / original:.3f}x); mean layer rel. MSE {row['mean_layer_rel_mse']:.4f}", flush=True)


def _layer_set(text: str) -> set[int] | None:
    """'0-1,5' -> {0, 1, 5}; '' -> None (every layer)."""
    if not text:
        return None
    layers = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        layers.update(range(int(lo), int(hi or lo) + 1))
    return layers


def _key(args, r, v) -> dict:
    return {"model": args.model, "latent_dim": r, "rope_dim": args.rope_dim, "variant": v, "calib": args.calib,
            "heldout": args.heldout, "calib_samples": args.calib_samples, "heldout_windows": args.heldout_windows,
            "seq_len": args.seq_len, "layers": args.layers,
            # absent in rows made before the flags
            **({"constant_channel": True} if args.constant_channel else {}),
            **({"fold_layers": args.fold_layers} if args.fold_layers else {}),
            **({"refine_steps": args.refine_steps} if args.refine_steps else {})}


@torch.no_grad()
def _attention(layer, hidden, ctx):
    outs = []
    for rows in chunks(hidden.shape[0], 4):
        x = layer.input_layernorm(hidden[rows])
        outs.append(layer.self_attn(x, position_embeddings=(ctx.cos[None], ctx.sin[None]), attention_mask=None)[0])
    return torch.cat(outs)


@torch.no_grad()
def _relative_mse(layer, hidden, target, mla, ctx) -> float:
    num = den = 0.0
    for rows in chunks(hidden.shape[0], 4):
        x = layer.input_layernorm(hidden[rows])
        num += float((mla_attention(x, mla, ctx.target_cos, ctx.target_sin) - target[rows]).pow(2).sum())
        den += float(target[rows].pow(2).sum())
    return num / den


@torch.no_grad()
def _perplexity(hidden, ids, norm_w, head, eps) -> float:
    nll = count = 0.0
    for rows in chunks(hidden.shape[0], 2):
        h = hidden[rows]
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * norm_w
        logits = h[:, :-1] @ head.T
        nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[rows, 1:].reshape(-1),
                                     reduction="sum"))
        count += ids[rows, 1:].numel()
    return math.exp(nll / count)


if __name__ == "__main__":
    main()
