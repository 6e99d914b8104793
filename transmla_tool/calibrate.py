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
from .ops.mla import GQAWeights


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

    def attention_weights(self, layer: torch.nn.Module) -> GQAWeights:
        attn = layer.self_attn
        g = self.geometry

        def bias(name):
            proj = getattr(attn, ATTN[name].split(".")[-1])
            return None if proj.bias is None else proj.bias.detach()

        return GQAWeights(
            q=attn.q_proj.weight.detach(),
            k=attn.k_proj.weight.detach(),
            v=attn.v_proj.weight.detach(),
            o=attn.o_proj.weight.detach(),
            num_heads=g.num_heads,
            num_kv_heads=g.num_kv_heads,
            head_dim=g.head_dim,
            q_bias=bias("q"),
            k_bias=bias("k"),
            v_bias=bias("v"),
            o_bias=bias("o"),
        )


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
