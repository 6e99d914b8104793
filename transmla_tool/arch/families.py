"""Per-family facts, as data.

Every family we convert uses the same decoder layout (pre-norm, q/k/v/o projections, gated MLP,
rotate-half RoPE), so the tensor names are shared; what differs is listed per family with the
reason. Granite, Phi-3 and Gemma differ from it linearly and are read through an exact Llama view
(`rewrite`, arch/rewrite.py); Qwen3's q/k norms are approximated (`qk_norm`). Families not listed here
get a refusal that names the reason (UNSUPPORTED_REASONS) or what we do not handle yet.
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
LLAMA_MODELING = "transformers.models.llama.modeling_llama"
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
    # Families whose differences from Llama are linear are read through an exact Llama view of the checkpoint
    # (arch/rewrite.py): the name of that rewrite, or None when the checkpoint is already in Llama's layout.
    rewrite: str | None = None
    # MLP activations the family uses that the output can carry (DeepSeek-V3's MLP applies config.hidden_act)
    hidden_acts: tuple[str, ...] = ("silu",)
    # Per-head RMSNorms of q and k before RoPE (Qwen3): not linear, so converted approximately (arch/qk_norm.py)
    qk_norm: bool = False
    # What the output does not reproduce exactly, for conversion.json and the model card; None: exact at full rank
    approximation: str | None = None


FAMILIES: tuple[FamilySpec, ...] = (
    FamilySpec(
        name="llama",
        model_types=("llama",),
        modeling_module=LLAMA_MODELING,
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
    FamilySpec(
        name="granite",
        model_types=("granite",),
        modeling_module=LLAMA_MODELING,
        class_prefix="Llama",
        qkv_bias=None,
        o_bias_from_config=True,
        rewrite="granite",
        notes=("Its embedding, attention, residual and logit multipliers are folded into the weights (exact).",),
    ),
    FamilySpec(
        name="phi3",
        model_types=("phi3",),
        modeling_module=LLAMA_MODELING,
        class_prefix="Llama",
        qkv_bias=False,
        o_bias_from_config=False,
        rewrite="phi3",
        notes=("Its fused qkv_proj and gate_up_proj are split (exact); LongRoPE and partial rotary are refused.",),
    ),
    FamilySpec(
        name="gemma",
        model_types=("gemma",),
        modeling_module=LLAMA_MODELING,
        class_prefix="Llama",
        qkv_bias=None,
        o_bias_from_config=True,
        rewrite="gemma",
        hidden_acts=("gelu_pytorch_tanh",),
        notes=("Its (1 + w) norms and embedding scale are folded into the weights, the embedding untied (exact); "
               "the GeGLU MLP keeps hidden_act gelu_pytorch_tanh, which transformers' DeepSeek-V3 applies and "
               "vLLM's and llama.cpp's DeepSeek paths do not (they hard-code SiLU).",),
    ),
    FamilySpec(
        name="qwen3",
        model_types=("qwen3",),
        modeling_module="transformers.models.qwen3.modeling_qwen3",
        class_prefix="Qwen3",
        qkv_bias=None,
        o_bias_from_config=True,
        qk_norm=True,
        approximation=(
            "Qwen3 normalizes each head's query and key (RMSNorm over head_dim) before RoPE; no stock DeepSeek layer "
            "has a per-head norm. The key norm's weight is folded into k_proj with one calibrated scale per head "
            "(the least-squares fit of 1/rms on the calibration text), and the layer-local refinement fits the rest "
            "against the true Qwen3 attention output. Not exact even at full rank: measure it (eval/families.py)."),
    ),
)

# How the query's norm was converted (method setting query_norm), appended to a q/k-norm family's approximation.
QUERY_NORM_NOTES = {
    "keep": "The query keeps one RMSNorm over all its heads (DeepSeek's q_a_layernorm on a q_lora path as wide as "
            "the source query; q_b_proj applies each head's norm weight and a calibrated scale): only each head's "
            "rms relative to the whole query's is approximated.",
    "fold": "The query norm is folded the same way (method setting query_norm=fold).",
}


def approximation(family: FamilySpec, query_norm: str) -> str | None:
    """What a conversion of `family` approximates (None: exact at full rank), for conversion.json and the card."""
    if family.approximation is None or not family.qk_norm:
        return family.approximation
    return f"{family.approximation} {QUERY_NORM_NOTES[query_norm]}"


# Families we recognise but do not convert yet, with the reason a user sees.
UNSUPPORTED_REASONS = {
    "gemma2": "it normalizes sublayer outputs (post-attention and post-MLP norms) and soft-caps attention "
              "logits, which no stock DeepSeek-V3 layer does",
    "gemma3": "it normalizes sublayer outputs (post-norms) and mixes sliding-window layers with two RoPE bases, "
              "which no stock DeepSeek-V3 layer does",
    "gemma3_text": "it normalizes sublayer outputs (post-norms) and mixes sliding-window layers with two RoPE bases, "
                   "which no stock DeepSeek-V3 layer does",
    "olmo2": "it normalizes sublayer outputs (post-norms), which no stock DeepSeek-V3 layer does",
    # MoE: the attention would convert as for dense models, but no stock class routes like these sources in
    # transformers (tests/test_families.py checks the facts below on the installed version).
    "mixtral": "its router renormalizes the top-k softmax weights, and no stock DeepSeek class does that in "
               "transformers (DeepSeek-V3 scores with sigmoids; transformers' DeepSeek-V2 router ignores "
               "norm_topk_prob), so the converted MoE would compute another model",
    "qwen3_moe": "its router renormalizes the top-k softmax weights (norm_topk_prob), and no stock DeepSeek class "
                 "does that in transformers (DeepSeek-V3 scores with sigmoids; transformers' DeepSeek-V2 router "
                 "ignores norm_topk_prob); it also has per-head q/k norms",
    "qwen2_moe": "its shared expert is scaled per token by a learned sigmoid gate, which no stock DeepSeek MoE has",
    "granitemoe": "MoE conversion is not implemented",
    "deepseek_v2": "it already uses multi-head latent attention",
    "deepseek_v3": "it already uses multi-head latent attention",
}


def family_for(model_type: str) -> FamilySpec | None:
    for spec in FAMILIES:
        if model_type in spec.model_types:
            return spec
    return None
