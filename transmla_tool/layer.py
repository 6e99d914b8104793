"""One decoder layer's conversion: statistics -> rope plan -> factorize -> refine -> cache basis -> stock tensors -> verify.

`LayerContext` is what every layer of a conversion shares (the method, the rotary tables of source and
target, which source frequencies each rotary slot carries); `calibrate_layer` reads what the closed form and
the refinement need from the layer's calibration inputs (shared by the outputs of a multi-latent conversion
that calibrate on the same inputs); `convert_layer` turns the source layer into stock DeepSeek-V3 attention
tensors for one latent size and says how it went. Nothing here knows about files, shards or resume state.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from .arch import AttentionGeometry
from .calibrate import SourceLayers, chunks
from .export import stock_attention
from .methods import Method
from .ops.basis import for_quantized_cache
from .ops.bias_fold import fold_biases, heldout_spread, rope_bias_share
from .ops.decouple import RopePlan, fold_pools, match_pools, plan_rope
from .ops.factorize import factorize
from .ops.kv_quant import cache_row_store
from .ops.linalg import affine_moment
from .ops.mla import GQAWeights, MLAWeights, mla_attention, pad_latent
from .ops.refine import refine
from .ops.rope import expected_rotation
from .ops.stats import LayerStats, attention_distance_mass

DISTANCE_WINDOWS = 8  # windows used for the attention-distance statistics (one at a time)


@dataclass
class LayerContext:
    """What the conversion of every layer shares."""

    method: Method
    geometry: AttentionGeometry
    rope_dim: int
    seed: int
    batch_size: int
    refine_windows: int
    cos: torch.Tensor  # (L, D) source rotary table (rotate_half layout)
    sin: torch.Tensor
    target_cos: torch.Tensor  # (L, dr) target rotary table (interleaved)
    target_sin: torch.Tensor
    inv_freq: torch.Tensor  # (D/2,) source frequencies, fp64 on the CPU
    pools: list  # source frequencies each rotary slot carries
    log_freqs: tuple  # (target, source) log frequencies
    rope_slot_max_log_error: float  # 0 when every slot turns exactly at its source frequencies

    @classmethod
    def build(cls, method: Method, geometry: AttentionGeometry, layers: SourceLayers, target_config, *,
              length: int, rope_dim: int, seed: int, batch_size: int, windows: int, device) -> "LayerContext":
        cos, sin = (t[0] for t in layers.position_embeddings(length))  # (L, D)
        target_inv_freq, target_cos, target_sin = _target_rotary(target_config, length, device)
        log_freqs = (target_inv_freq.log(), layers.inv_freq.log())
        if _on_stride(layers.inv_freq, target_inv_freq, geometry.head_dim // rope_dim):
            pools, error = fold_pools(geometry.head_dim, rope_dim, method.rope_pool), 0.0
        else:  # a scaled rope mapped onto YaRN: slots carry the source frequencies nearest to theirs
            pools, error = match_pools(log_freqs[1], log_freqs[0], method.rope_pool)
        return cls(method=method, geometry=geometry, rope_dim=rope_dim, seed=seed, batch_size=batch_size,
                   refine_windows=min(method.refine_windows, windows), cos=cos, sin=sin, target_cos=target_cos,
                   target_sin=target_sin, inv_freq=layers.inv_freq, pools=pools, log_freqs=log_freqs,
                   rope_slot_max_log_error=error)


@dataclass
class LayerCalibration:
    """What one layer's conversion reads from its calibration inputs."""

    stats: LayerStats
    plan: RopePlan
    rotation: tuple | None  # expected rotation of the RoPE-free part (method.nope_rotation), else None
    x_refine: torch.Tensor | None  # (N, L, d) attention inputs the refinement fits on
    y_refine: torch.Tensor | None  # (N, L, d) the source attention block's outputs on them


def calibrate_layer(layer, attn: GQAWeights, inputs: torch.Tensor, ctx: LayerContext, stage=None) -> LayerCalibration:
    """Statistics, rotary plan and refinement data of one source layer on its inputs (N, L, d)."""
    stage = stage or (lambda name: nullcontext())
    method = ctx.method
    with stage("statistics"):
        stats = _layer_stats(layer, attn, inputs, ctx.cos, ctx.sin, ctx.batch_size, method, ctx.geometry.biased)
    with stage("rope plan"):
        plan, rotation = _rope_plan(method, attn, stats, ctx.geometry, ctx.inv_freq, ctx.pools, ctx.log_freqs)
    x_refine = y_refine = None
    if method.refines:
        with stage("statistics"):
            x_refine, y_refine = _refine_data(layer, inputs[:ctx.refine_windows], ctx.cos, ctx.sin, ctx.batch_size)
    return LayerCalibration(stats, plan, rotation, x_refine, y_refine)


def folds_biases(geometry: AttentionGeometry, target_config, method: Method) -> bool:
    """Does this output fold the source's attention biases into its weights (a biased source, a bias-free output,
    bias_fold not "none"; ops/bias_fold.py)?"""
    return geometry.biased and not target_config.attention_bias and method.bias_fold != "none"


def convert_layer(layer, attn: GQAWeights, inputs: torch.Tensor, calib: LayerCalibration, ctx: LayerContext,
                  index: int, latent_dim: int, config, stage=None) -> tuple[dict, MLAWeights, dict]:
    """One source layer as stock attention tensors for a latent of `latent_dim` (config: the output's
    DeepseekV3Config, its kv_lora_rank the stored, possibly padded, latent). Returns the tensors (names relative
    to `self_attn.`, fp64), the natural-form weights and the layer's report."""
    stage = stage or (lambda name: nullcontext())
    method, device = ctx.method, inputs.device
    # A bias-free output of a biased source (ops/bias_fold.py): "joint" gives the value bias to the joint latent,
    # "constant" folds it after the latent is chosen; rope_bias_fold says how much of the rotary key's bias is folded
    fold = method.bias_fold if folds_biases(ctx.geometry, config, method) else "none"
    with stage("factorize"):  # fp64 on the conversion device: a GPU does it in a fraction of the time
        mla, fact = factorize(
            attn.to(torch.float64, device), calib.stats.x_moment.to(device), _plan_to(calib.plan, device),
            ctx.rope_dim, latent_dim, nope_rotation=_rotation_to(calib.rotation, device),
            latent_weighting=method.latent_weighting, kv_balance=method.kv_balance,
            value_bias="latent" if fold == "joint" else "output",
        )
        mla = mla.to(torch.float64, "cpu")
        folded = None
        if not config.attention_bias:  # a bias-free output: folded or dropped; refinement fits
            if fold != "none":
                share = None
                if method.rope_bias_fold == "rotating":
                    slot_freq = ctx.log_freqs[0].exp()
                    share = lambda spread: rope_bias_share(slot_freq, calib.stats.distance_mass.cpu(), spread)
                halves = calib.stats.halves
                spread = None if halves is None else heldout_spread(tuple(h.cpu() for h in halves))
                mla, folded = fold_biases(mla, calib.stats.raw_moment.cpu(), rope_share=share, spread=spread)
            mla = replace(mla, q_bias=None, kv_a_bias=None, o_bias=None)
    # Exact changes of basis that only change how the cache quantizes (ops/basis.py), on the energies the cache
    # will hold (the measured moment, not the shrunk one the factorization trusts). They come after the fit, so
    # the refined function is the one an exact cache measured, unless the fit reads its keys through a quantized
    # cache (refine_cache): then it must see the basis that cache will hold.
    fit_through_cache = method.refine_cache != "none"

    def cache_basis(weights: MLAWeights) -> MLAWeights:
        return for_quantized_cache(weights, method.latent_basis, method.rope_key_balance, calib.stats.raw_moment,
                                   ctx.seed + index)

    if fit_through_cache:
        mla = cache_basis(mla)
    report = {"layer": index, "kept_energy": round(fact.kept_energy, 6), "kv_balance": round(fact.kv_balance, 6)}
    if folded is not None:
        report["bias_fold"] = {"constant_mse": round(folded.constant_mse, 6),
                               "value_residual": round(folded.value_residual, 6),
                               "rope_bias_folded": round(folded.rope_bias_folded, 6)}
        if folded.heldout_spread is not None:
            report["bias_fold"]["heldout_spread"] = round(folded.heldout_spread, 6)
    if method.refines:
        windows = calib.x_refine.shape[0]
        with stage("refine"):
            mla, ref = refine(
                mla, calib.x_refine, calib.y_refine, ctx.target_cos, ctx.target_sin, steps=method.refine_steps,
                lr=method.refine_lr, batch=method.refine_batch, queries=method.refine_queries,
                holdout=max(1, windows // 8) if windows > 1 else 0, seed=ctx.seed + index,
                anchor=method.refine_anchor, noise=method.refine_noise,
                teacher=lambda x: source_attention(layer, x, ctx.cos, ctx.sin),
                cache_store=cache_row_store(None if method.refine_cache == "none" else method.refine_cache,
                                            latent_dim, config.kv_lora_rank),
                value_solve=method.refine_value_solve)
        report.update(refine_loss_before=round(ref.loss_before, 6), refine_loss_after=round(ref.loss_after, 6),
                      refine_seconds=round(ref.seconds, 2))
    if not fit_through_cache:
        mla = cache_basis(mla)
    mla = pad_latent(mla, config.kv_lora_rank)
    tensors = stock_attention(mla, layer.input_layernorm.weight.cpu(), q_lora=config.q_lora_rank is not None,
                              attention_bias=config.attention_bias)
    with stage("verify"), torch.no_grad():
        # two windows' first VERIFY_POSITIONS positions: the stock attention's query and value widths differ, so
        # PyTorch runs it on its math path, whose (L, L) maps at 8192 held 12 GB for SmolLM2's nine heads
        sample = layer.input_layernorm(inputs[: min(2, inputs.shape[0]), :VERIFY_POSITIONS])
        report["stock_vs_reference"] = verify_stock_layer(tensors, mla, config, index, sample, ctx.target_cos,
                                                          ctx.target_sin)
    return tensors, mla, report


def source_attention(layer, x, cos, sin):
    """The source attention block (causal) on its normalized inputs x (B, L, d)."""
    return layer.self_attn(x, position_embeddings=(cos[None], sin[None]), attention_mask=None)[0]


VERIFY_POSITIONS = 2048  # positions per window the stock-layer check runs on (conversion.json's stock_vs_reference)


def verify_stock_layer(tensors, mla, target_config, layer_idx, x, cos, sin) -> float:
    """Relative difference between transformers' stock DeepSeek-V3 attention loaded with our tensors
    and the reference math of the natural weights, on calibration inputs (fp32)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    cos, sin = cos[: x.shape[1]], sin[: x.shape[1]]
    config = copy.deepcopy(target_config)
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        module = DeepseekV3Attention(config, layer_idx)
    module.load_state_dict({k: v.to(x.device, torch.float32) for k, v in tensors.items()}, assign=True)
    with torch.no_grad():
        stock = module(x, position_embeddings=(cos[None], sin[None]), attention_mask=None)[0]
        reference = mla_attention(x, mla.to(torch.float32, x.device), cos, sin)
    return float((stock - reference).norm() / reference.norm().clamp_min(1e-30))


def _plan_to(plan, device):
    return type(plan)(a=plan.a.to(device), b=plan.b.to(device))


def _rotation_to(rotation, device):
    return None if rotation is None else tuple(r.to(device) for r in rotation)


def _rope_plan(method, attn, stats, geometry, inv_freq, pools, log_freqs):
    key_moment = affine_moment(attn.k.double().cpu(), _cpu(attn.k_bias), stats.x_moment.cpu())
    candidate_weight = rotation = None
    if method.nope_rotation == "expected" or method.rope_weighting == "score":
        exp_cos, exp_sin = expected_rotation(inv_freq, stats.distance_mass.cpu())  # (H, D/2)
        if method.nope_rotation == "expected":
            rotation = (exp_cos, exp_sin)
        if method.rope_weighting == "score":
            candidate_weight = _score_weight(attn, stats, geometry, 1.0 - exp_cos**2 - exp_sin**2)
    plan = plan_rope(key_moment, pools, geometry.num_kv_heads, geometry.head_dim, candidate_weight, *log_freqs)
    return plan, rotation


@torch.no_grad()
def _refine_data(layer, inputs, cos, sin, batch):
    """Attention inputs and the source attention block's outputs on them, (N, L, d) each."""
    xs, ys = [], []
    for rows in chunks(inputs.shape[0], batch):
        x = layer.input_layernorm(inputs[rows])
        xs.append(x)
        ys.append(source_attention(layer, x, cos, sin))
    return torch.cat(xs), torch.cat(ys)


def _cpu(t):
    return None if t is None else t.double().cpu()


def _layer_stats(layer, attn, inputs, cos, sin, batch, method: Method, biased: bool) -> LayerStats:
    # a biased source, whatever the output (eval/bias_fold.py serves outputs that keep and fold from one calibration):
    # the halves' moments tell how well the direction its biases are folded through holds off the
    # windows it was fitted on (ops/bias_fold.heldout_spread)
    stats = LayerStats.empty(attn.q.shape[1], attn.num_heads, inputs.shape[1], device=inputs.device, split=biased)
    with torch.no_grad():
        for rows in chunks(inputs.shape[0], batch):
            stats.add(layer.input_layernorm(inputs[rows]))
        # attention maps are L x L per head: a few windows, one at a time, bound their memory
        for rows in chunks(min(DISTANCE_WINDOWS, inputs.shape[0]), 1):
            x = layer.input_layernorm(inputs[rows])
            stats.distance_mass += attention_distance_mass(x, attn, cos, sin).double()
    return stats.finalize(method.moment_shrinkage, method.shrink_target)


def _score_weight(attn, stats, geometry, rotation_spread):
    """(G, D/2): query energy at each frequency, summed over a group's heads, times how much RoPE
    moves scores at that frequency (1 - |E e^{i w delta}|^2)."""
    heads, dim, half = geometry.num_heads, geometry.head_dim, geometry.head_dim // 2
    q_moment = affine_moment(attn.q.double().cpu(), _cpu(attn.q_bias), stats.x_moment.cpu())
    diag = q_moment.diagonal().view(heads, dim)
    energy = diag[:, :half] + diag[:, half:]  # (H, D/2)
    weighted = energy * rotation_spread.clamp_min(0)
    return weighted.view(geometry.num_kv_heads, geometry.group_size, half).sum(1)


def _target_rotary(target_config, length, device):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    rotary = DeepseekV3RotaryEmbedding(target_config).to(device)
    positions = torch.arange(length, device=device)[None]
    cos, sin = rotary(torch.zeros(1, device=device), positions)
    return rotary.inv_freq.detach().to("cpu", torch.float64), cos[0], sin[0]


def _on_stride(source_inv_freq, target_inv_freq, stride) -> bool:
    """Does slot j of the target turn exactly at source frequency stride*j?"""
    expected = source_inv_freq[::stride][: target_inv_freq.shape[0]]
    return bool(torch.allclose(expected, target_inv_freq, rtol=1e-5))
