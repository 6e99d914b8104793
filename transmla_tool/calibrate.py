"""Run the source model on calibration text one decoder layer at a time.

Only one decoder layer's weights are resident at a time; the calibration activations (N windows x
L tokens x hidden) flow from layer to layer. Each layer is transformers' own module for the family,
built on the meta device and filled from the checkpoint with `assign=True`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch

from .arch import AttentionGeometry, decoder_classes
from .arch.families import ATTN, LAYER_PREFIX
from .io.source import CheckpointSource
from .ops.mla import STOCK_NORM_EPS, GQAWeights
from .ops.qk_norm import compact_query, fold_head_norm, fold_query_norm, normalized_error


QK_NORM_WINDOWS = 16  # calibration windows the per-head q/k norm scales are fitted on


class SourceLayers:
    """Factory for the source model's decoder layers and rotary tables on one device."""

    def __init__(self, source: CheckpointSource, geometry: AttentionGeometry, device: torch.device):
        self.source = source
        self.geometry = geometry
        self.device = device
        self.config = copy.deepcopy(source.config)
        self.config._attn_implementation = "sdpa"
        self.layer_cls, rotary_cls = decoder_classes(geometry)
        self.rotary = rotary_cls(self.config).to(device)
        self.qk_norm_errors: dict = {}  # the last attention_weights() fold's diagnostics (q/k-norm families)

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.rotary.inv_freq.detach().to("cpu", torch.float64)

    def position_embeddings(self, length: int, dtype=torch.float32):
        positions = torch.arange(length, device=self.device)[None]
        probe = torch.zeros(1, device=self.device, dtype=dtype)
        return self.rotary(probe, positions)  # each (1, L, D)

    def layer(self, i: int) -> torch.nn.Module:
        with torch.device("meta"):
            module = self.layer_cls(self.config, i)
        prefix = LAYER_PREFIX.format(i=i)
        state = {name: self.source.get(prefix + name).to(self.device) for name in module.state_dict()}
        module.load_state_dict(state, assign=True)
        return module.eval().requires_grad_(False)

    def attention_weights(self, layer: torch.nn.Module, inputs: torch.Tensor | None = None,
                          query_norm: str = "fold") -> GQAWeights:
        """The layer's attention as linear q/k/v/o projections. A family with per-head q/k norms (Qwen3) has
        them folded in with scales fitted on `inputs` (N, L, d), the layer's residual-stream inputs
        (ops/qk_norm.py); `self.qk_norm_errors` then holds how far the fold is from the true norms there.
        query_norm="keep" (the method setting) also gives the query read through one RMSNorm over all its heads
        (GQAWeights.q_a, q_a_bias, q_a_out) and its error in `qk_norm_errors["query_norm_error"]`."""
        attn = layer.self_attn
        g = self.geometry

        def bias(name):
            proj = getattr(attn, ATTN[name].split(".")[-1])
            return None if proj.bias is None else proj.bias.detach()

        q, k = attn.q_proj.weight.detach(), attn.k_proj.weight.detach()
        q_bias, k_bias = bias("q"), bias("k")
        kept = {}
        if g.family.qk_norm:
            if inputs is None:
                raise ValueError(f"{g.family.name} has q/k norms: attention_weights needs the layer's inputs")
            with torch.no_grad():
                x = layer.input_layernorm(inputs[:QK_NORM_WINDOWS])
            if query_norm == "keep":  # the source's own query, read through one RMSNorm over all heads
                rows, _, error = fold_query_norm(q, q_bias, attn.q_norm.weight.detach(),
                                                 attn.q_norm.variance_epsilon, x, g.num_heads, STOCK_NORM_EPS)
                q_a, out = compact_query(q, q_bias)
                kept = dict(q_a=q_a, q_a_bias=q_bias, q_a_out=rows[:, None] * out)
            q, q_bias, self.qk_norm_errors = self._fold(attn.q_proj, attn.q_norm, x, g.num_heads)
            k, k_bias, k_errors = self._fold(attn.k_proj, attn.k_norm, x, g.num_kv_heads)
            self.qk_norm_errors.update({"k_" + key: value for key, value in k_errors.items()})
            if kept:  # after the folds, which start the diagnostics afresh
                self.qk_norm_errors.update(query_norm_error=round(error, 6))
        return GQAWeights(
            q=q,
            k=k,
            v=attn.v_proj.weight.detach(),
            o=attn.o_proj.weight.detach(),
            num_heads=g.num_heads,
            num_kv_heads=g.num_kv_heads,
            head_dim=g.head_dim,
            q_bias=q_bias,
            k_bias=k_bias,
            v_bias=bias("v"),
            o_bias=bias("o"),
            **kept,
        )


    @staticmethod
    def _fold(proj, norm, x, heads):
        weight, bias = proj.weight.detach(), None if proj.bias is None else proj.bias.detach()
        eps = norm.variance_epsilon
        folded, folded_bias, scales = fold_head_norm(weight, bias, norm.weight.detach(), eps, x, heads)
        error = normalized_error(weight, bias, norm.weight.detach(), eps, x, heads, folded, folded_bias)
        return folded, folded_bias, {"fold_error": round(error, 6), "scale_min": round(float(scales.min()), 6),
                                     "scale_max": round(float(scales.max()), 6)}


def chunks(n: int, size: int) -> Iterator[slice]:
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


@torch.no_grad()
def run_source_layer(layer, hidden: torch.Tensor, position_embeddings, batch: int,
                     attention_out: torch.Tensor | None = None) -> torch.Tensor:
    """Apply a source decoder layer in place over (N, L, d) hidden states, `batch` windows at a time.

    When `attention_out` is given, the attention block's output for each window is stored in it
    (the target a converted attention layer is refined towards).
    """
    for rows in chunks(hidden.shape[0], batch):
        h = hidden[rows]
        a = layer.self_attn(layer.input_layernorm(h), position_embeddings=position_embeddings,
                            attention_mask=None)[0]
        if attention_out is not None:
            attention_out[rows] = a
        h = h + a
        hidden[rows] = h + layer.mlp(layer.post_attention_layernorm(h))
    return hidden


@torch.no_grad()
def run_layer_with_attention(layer, attention_fn, hidden: torch.Tensor, batch: int) -> torch.Tensor:
    """Like run_source_layer but with a replacement attention: attention_fn(x) -> (B, L, d)."""
    for rows in chunks(hidden.shape[0], batch):
        h = hidden[rows]
        h = h + attention_fn(layer.input_layernorm(h))
        hidden[rows] = h + layer.mlp(layer.post_attention_layernorm(h))
    return hidden
