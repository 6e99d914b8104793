"""Per-family facts, as data.

Every family we convert uses the same decoder layout (pre-norm, q/k/v/o projections, gated MLP,
rotate-half RoPE), so the tensor names are shared; what differs is listed per family with the
reason. Families not listed here get a refusal that names what we do not handle yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Tensor-name templates shared by Llama, Mistral, Qwen2 and SmolLM2 checkpoints.
LAYER_PREFIX = "model.layers.{i}."
ATTN = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
}
# Copied unchanged into the DeepSeek-V3 checkpoint under the same names.
LAYER_PASSTHROUGH = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class FamilySpec:
    name: str
    model_types: tuple[str, ...]
    # transformers module that holds the family's decoder layer and rotary embedding classes
    modeling_module: str
    class_prefix: str
    # True: q/k/v always carry biases; None: the config's `attention_bias` decides; False: never.
    qkv_bias: bool | None
    o_bias_from_config: bool
    notes: tuple[str, ...] = field(default_factory=tuple)


FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        name="llama",
        model_types=("llama",),
        modeling_module="transformers.models.llama.modeling_llama",
        class_prefix="Llama",
        qkv_bias=None,
        o_bias_from_config=True,
        notes=("SmolLM2 is a Llama-architecture model and converts as llama.",),
    ),
    FamilySpec(
        name="mistral",
        model_types=("mistral",),
        modeling_module="transformers.models.mistral.modeling_mistral",
        class_prefix="Mistral",
        qkv_bias=False,
        o_bias_from_config=False,
        notes=("A sliding window changes attention beyond the window; see check_supported.",),
    ),
    FamilySpec(
        name="qwen2",
        model_types=("qwen2",),
        # Qwen2Attention hard-codes bias=True on q/k/v and bias=False on o.
        modeling_module="transformers.models.qwen2.modeling_qwen2",
        class_prefix="Qwen2",
        qkv_bias=True,
        o_bias_from_config=False,
    ),
)

# Families we recognise but do not convert yet, with the reason a user sees.
UNSUPPORTED_REASONS = {
    "qwen3": "its per-head q/k RMSNorms act before RoPE and cannot be folded into linear projections",
    "gemma": "it scales embeddings and uses (1 + w) norms and a GeGLU MLP the DeepSeek-V3 layout lacks",
    "gemma2": "its sliding-window layers and logit soft-capping have no DeepSeek-V3 equivalent",
    "gemma3": "its sliding-window layers, q/k norms and dual RoPE bases have no DeepSeek-V3 equivalent",
    "mixtral": "MoE conversion (mapping its experts onto DeepSeek-V3 routing) is not implemented",
    "qwen2_moe": "MoE conversion (mapping its experts onto DeepSeek-V3 routing) is not implemented",
    "qwen3_moe": "MoE conversion and its q/k norms are not implemented",
    "phi3": "its fused qkv/gate-up tensors and LongRoPE scaling are not implemented",
    "deepseek_v2": "it already uses multi-head latent attention",
    "deepseek_v3": "it already uses multi-head latent attention",
}


def family_for(model_type: str) -> FamilySpec | None:
    for spec in FAMILIES:
        if model_type in spec.model_types:
            return spec
    return None
