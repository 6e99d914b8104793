"""Recognise a source model, refuse what we cannot convert, and describe its attention geometry."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from ..errors import UnsupportedModelError
from .families import FAMILIES, UNSUPPORTED_REASONS, FamilySpec, family_for
from .rewrite import llama_view

__all__ = ["AttentionGeometry", "FamilySpec", "FAMILIES", "check_supported", "decoder_classes", "llama_view"]

# RoPE variants whose frequencies transformers' DeepSeek-V3 rotary embedding computes exactly the same
# way for a sub-range of dimensions (see ops/rope.py). Others change the model in ways we do not map.
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class AttentionGeometry:
    """Shape facts about one model's attention that every later step needs."""

    family: FamilySpec
    hidden_size: int
    num_layers: int
    num_heads: int  # H: query heads
    num_kv_heads: int  # G: key/value heads
    head_dim: int  # D
    q_bias: bool
    k_bias: bool
    v_bias: bool
    o_bias: bool
    rope_type: str
    rope_theta: float
    rms_norm_eps: float
    hidden_act: str = "silu"

    @property
    def biased(self) -> bool:
        """Does the source's attention carry any bias (Qwen2's q/k/v)?"""
        return self.q_bias or self.k_bias or self.v_bias or self.o_bias

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def cache_values_per_token_per_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim

    def max_latent_dim(self, rope_dim: int) -> int:
        """The rank the latent can have: residual keys (G*D minus the dims moved to the rotary key)
        plus values (G*D), and never more than the hidden size it is computed from."""
        return min(2 * self.num_kv_heads * self.head_dim - rope_dim, self.hidden_size)


def check_supported(config, *, ignore_sliding_window: bool = False) -> AttentionGeometry:
    """Return the attention geometry of `config`, or raise UnsupportedModelError naming the reason."""
    model_type = getattr(config, "model_type", None)
    spec = family_for(model_type)
    if spec is None:
        reason = UNSUPPORTED_REASONS.get(model_type)
        supported = ", ".join(sorted(t for f in FAMILIES for t in f.model_types))
        if reason:
            raise UnsupportedModelError(f"model_type '{model_type}' is unsupported because {reason}")
        raise UnsupportedModelError(
            f"model_type '{model_type}' is not a family we convert (supported: {supported})"
        )

    hidden = config.hidden_size
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    if heads % kv_heads:
        raise UnsupportedModelError(f"{heads} query heads do not split evenly over {kv_heads} KV heads")
    if head_dim % 2:
        raise UnsupportedModelError(f"head_dim {head_dim} is odd, so RoPE pairs do not tile it")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in spec.hidden_acts:
        # DeepSeek-V3's gated MLP applies config.hidden_act; its engines (vLLM, llama.cpp) only SiLU.
        raise UnsupportedModelError(
            f"hidden_act '{act}' is unsupported for {spec.name} (supported: {', '.join(spec.hidden_acts)})")
    if getattr(config, "mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is unsupported because DeepSeek-V3 MLPs have no biases")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        raise UnsupportedModelError("pretraining_tp > 1 is unsupported; re-save the model with pretraining_tp=1")

    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type '{rope_type}' is unsupported because only {', '.join(SUPPORTED_ROPE_TYPES)} "
            "frequencies map onto DeepSeek-V3's rotary embedding"
        )
    if (rope.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None) or 1.0) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is unsupported (only fully rotary heads)")

    window = _active_sliding_window(config)
    if window is not None and not ignore_sliding_window:
        raise UnsupportedModelError(
            f"sliding_window={window} is unsupported because DeepSeek-V3 attends to the full context; "
            "pass --ignore-sliding-window to convert anyway (outputs differ beyond the window)"
        )

    attention_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias = attention_bias if spec.qkv_bias is None else spec.qkv_bias
    o_bias = attention_bias if spec.o_bias_from_config else False
    return AttentionGeometry(
        family=spec,
        hidden_size=hidden,
        num_layers=config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        q_bias=qkv_bias,
        k_bias=qkv_bias,
        v_bias=qkv_bias,
        o_bias=o_bias,
        rope_type=rope_type,
        rope_theta=float(rope["rope_theta"]),
        rms_norm_eps=float(config.rms_norm_eps),
        hidden_act=act,
    )


def _active_sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    max_pos = getattr(config, "max_position_embeddings", None)
    # A window as long as the context never bites.
    if max_pos is not None and window >= max_pos:
        return None
    return window


def decoder_classes(geometry: AttentionGeometry):
    """(DecoderLayer class, RotaryEmbedding class) of the source family in the installed transformers."""
    module = importlib.import_module(geometry.family.modeling_module)
    prefix = geometry.family.class_prefix
    return getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RotaryEmbedding")


def check_shapes(source, geometry: AttentionGeometry) -> None:
    """The weights are the ones the config describes (checked from file headers where the source can read shapes
    without loading: safetensors): a config.json edited or taken from another model is refused here, in one line,
    instead of failing deep inside the conversion."""
    from .families import ATTN, EMBED, LAYER_PREFIX

    shape = getattr(source, "shape", None)
    if shape is None:
        return
    g = geometry
    expected = {EMBED: (source.config.vocab_size, g.hidden_size)}
    if g.family.rewrite is None:  # Llama's layout: q/k/v/o by name (Phi-3 fuses them; its view checks its own)
        for i in (0, g.num_layers - 1):
            prefix = LAYER_PREFIX.format(i=i)
            expected[prefix + ATTN["q"] + ".weight"] = (g.num_heads * g.head_dim, g.hidden_size)
            expected[prefix + ATTN["k"] + ".weight"] = (g.num_kv_heads * g.head_dim, g.hidden_size)
            expected[prefix + ATTN["o"] + ".weight"] = (g.hidden_size, g.num_heads * g.head_dim)
    for name, want in expected.items():
        found = shape(name)
        if found is not None and tuple(found) != tuple(want):
            raise UnsupportedModelError(
                f"the config does not describe these weights: {name} has shape {tuple(found)}, the config implies "
                f"{tuple(want)}; restore the checkpoint's own config.json")
    extra = LAYER_PREFIX.format(i=g.num_layers) + ATTN["q"] + ".weight"
    if shape(extra) is not None:
        raise UnsupportedModelError(f"the config says {g.num_layers} layers but the weights hold more ({extra}); "
                                    "restore the checkpoint's own config.json")
