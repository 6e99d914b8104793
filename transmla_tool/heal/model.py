"""The trainable (natural) form of a converted model, and its export back to stock DeepSeek-V3.

A stock checkpoint stores the latent rows of kv_a_proj scaled down by ~1e-8 so that kv_a_layernorm
runs in its linear regime (ops/linear_norm.py). Training those tiny weights with Adam would wreck
them: Adam's step size does not scale with the weight. So healing swaps every attention for
`NaturalAttention` (plain linear maps, no latent norm, an ordinary query bias), trains that, and
re-linearizes the norms on export.
"""

from __future__ import annotations

import torch
from torch import nn

from ..export import natural_attention, stock_attention
from ..ops.kv_quant import cache_row_store
from ..ops.mla import MLAWeights, mla_attention
from ..runtime.cache_args import find_cache

ATTENTION_PARAMS = ("q_proj", "q_b_proj", "kv_a_proj", "kv_b_proj", "o_proj")


class NaturalAttention(nn.Module):
    """Drop-in for DeepseekV3Attention during training (packed causal windows, no KV cache).

    cache_type (a llama.cpp cache type, ops/kv_quant.py): keys and values are read through that cache's
    store-and-read-back, with the straight-through gradient, so the model learns to run over the quantized
    cache a serving engine will hold (quantization-aware healing). `cache_reads` counts the forwards that
    went through it.
    """

    def __init__(self, weights: MLAWeights, layer_idx: int, cache_type: str | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        self.cache_type = cache_type
        self.cache_store = cache_row_store(cache_type, weights.latent_dim)
        self.cache_reads = 0
        self.query_store = None  # an engine's rounding of the absorbed query (ops/kv_quant.query_dot_store)
        self.dims = dict(num_heads=weights.num_heads, latent_dim=weights.latent_dim, rope_dim=weights.rope_dim,
                         nope_dim=weights.nope_dim, v_dim=weights.v_dim)
        self.q_proj = _linear(weights.q, weights.q_bias)
        self.kv_a_proj = _linear(weights.kv_a, weights.kv_a_bias)
        self.kv_b_proj = _linear(weights.kv_b, None)
        self.o_proj = _linear(weights.o, weights.o_bias)
        # a kept query norm (ops/qk_norm.py): q_proj is read through one RMSNorm, then q_b_proj
        self.q_b_proj = None if weights.q_b is None else _linear(weights.q_b, None)

    def weights(self) -> MLAWeights:
        return MLAWeights(q=self.q_proj.weight, kv_a=self.kv_a_proj.weight, kv_b=self.kv_b_proj.weight,
                          o=self.o_proj.weight, q_bias=self.q_proj.bias, kv_a_bias=self.kv_a_proj.bias,
                          o_bias=self.o_proj.bias, q_b=None if self.q_b_proj is None else self.q_b_proj.weight,
                          **self.dims)

    def forward(self, hidden_states, position_embeddings, attention_mask=None, *args, **kwargs):
        if find_cache(args, kwargs) is not None and kwargs.get("use_cache", True):
            raise RuntimeError("NaturalAttention has no KV cache: export the model to generate with it")
        cos, sin = position_embeddings
        if self.cache_store is not None:
            self.cache_reads += 1
        return mla_attention(hidden_states, self.weights(), cos, sin, cache_store=self.cache_store,
                             query_store=self.query_store), None


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach().to(torch.float32).clone())
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().to(torch.float32).clone())
    return layer


def to_natural(model, cache_type: str | None = None) -> None:
    """Swap every stock DeepseekV3Attention of `model` for its NaturalAttention, in place (reading keys and
    values through `cache_type`'s quantizer when given)."""
    for i, layer in enumerate(model.model.layers):
        stock = {k: v.detach() for k, v in layer.self_attn.state_dict().items()}
        natural = NaturalAttention(natural_attention(stock, model.config), i, cache_type)
        natural = natural.to(layer.input_layernorm.weight.device)
        layer.self_attn = natural


def stock_state_dict(natural_state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """Stock DeepSeek-V3 state dict from the state dict of a natural-form model (norms linearized
    again). Works from a state dict so FSDP/DeepSpeed runs can export their gathered weights."""
    state = {k: v.detach().cpu() for k, v in natural_state.items() if ".self_attn." not in k}
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}.self_attn."

        def get(name, _prefix=prefix):
            value = natural_state.get(_prefix + name)
            return None if value is None else value.detach().cpu()

        weights = MLAWeights(
            q=get("q_proj.weight"), kv_a=get("kv_a_proj.weight"), kv_b=get("kv_b_proj.weight"),
            o=get("o_proj.weight"), q_bias=get("q_proj.bias"), kv_a_bias=get("kv_a_proj.bias"),
            o_bias=get("o_proj.bias"), q_b=get("q_b_proj.weight"), num_heads=config.num_attention_heads,
            latent_dim=config.kv_lora_rank,
            rope_dim=config.qk_rope_head_dim, nope_dim=config.qk_nope_head_dim, v_dim=config.v_head_dim,
        )
        tensors = stock_attention(weights, state[f"model.layers.{i}.input_layernorm.weight"],
                                  q_lora=config.q_lora_rank is not None, attention_bias=config.attention_bias)
        state.update({prefix + k: v for k, v in tensors.items()})
    return state


def is_attention_param(name: str) -> bool:
    return ".self_attn." in name
