"""Families beyond Llama's layout: exact Llama views (Granite, Phi-3, Gemma), Qwen3's approximated q/k norms,
and the facts behind each refusal (MoE routing), checked on the installed transformers."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import logits, reference_logits, rel_err, sample_ids
from transformers import AutoConfig


def _llama_view_dir(src, tmp_path):
    """The Llama view the conversion reads (arch/rewrite.py), saved as a LlamaForCausalLM checkpoint."""
    from transformers import LlamaForCausalLM

    from transmla_tool.arch import check_supported, llama_view
    from transmla_tool.io.source import open_source

    source = open_source(str(src))
    view = llama_view(source, check_supported(source.config))
    model = LlamaForCausalLM(view.config)
    model.load_state_dict({name: view.get(name) for name in model.state_dict()})
    model.save_pretrained(tmp_path / "view")
    return tmp_path / "view"


@pytest.mark.parametrize("family,kwargs", [
    ("granite", dict(kv_heads=2)),
    ("granite", dict(kv_heads=1, attention_bias=True)),
    ("phi3", dict(kv_heads=2)),
    ("phi3", dict(kv_heads=1)),
    ("gemma", dict(kv_heads=2)),
    ("gemma", dict(kv_heads=1)),  # Gemma-2B is MQA
])
def test_linear_families_full_rank_exact(make_model, convert_tiny, tmp_path, family, kwargs):
    """Granite's multipliers, Phi-3's fused tensors and Gemma's (1 + w) norms, embedding scale and GeGLU fold
    exactly into the Llama view the conversion reads (Llama's forward on it equals the source family's), and
    the output is exact where the MLA is: with one KV head and rope_dim = head_dim the full-rank output equals
    the source (fp32 logits); with two KV heads the stock model equals the reference math on the view."""
    src = make_model(family, **kwargs)
    ids = sample_ids(AutoConfig.from_pretrained(src).vocab_size)
    view = _llama_view_dir(src, tmp_path)
    assert rel_err(logits(view, ids), logits(src, ids)) < 1e-6
    if kwargs["kv_heads"] == 1:
        out, summary, _ = convert_tiny(src, latent_dim=16, rope_dim=16)
        assert rel_err(logits(out, ids), logits(src, ids)) < 1e-4
    else:
        out, summary, natural = convert_tiny(src, latent_dim=24, rope_dim=8)
        assert rel_err(logits(out, ids), reference_logits(view, natural, out, ids)) < 1e-5
    assert summary["family"] == family
    config = json.loads((out / "config.json").read_text())
    assert config["hidden_act"] == ("gelu_pytorch_tanh" if family == "gemma" else "silu")


@pytest.mark.parametrize("kwargs", [
    dict(kv_heads=2), dict(kv_heads=1), dict(kv_heads=1, attention_bias=True),
    dict(kv_heads=2, head_dim=32),  # a query wider than the hidden size (Qwen3-0.6B, -4B, -32B): q_a_proj compacted
])
def test_qwen3_q_k_norms_approximated_and_stated(make_model, convert_tiny, kwargs):
    """Qwen3's per-head q/k RMSNorms have no stock form: the key's is folded with calibrated per-head scales,
    the query keeps one genuine RMSNorm over all heads (q_lora path: q_a_proj = Qwen3's q_proj, q_a_layernorm
    weight 1, not linearized), and conversion.json and the model card say so, with each fold's error per
    layer. The refinement then fits the true Qwen3 attention: never worse than the closed form on held-out
    windows (refine falls back to it), better on some layer."""
    from safetensors.torch import load_file

    from transmla_tool.methods import PRESETS

    src = make_model("qwen3", **kwargs)
    source_config = AutoConfig.from_pretrained(src)
    latent = 40 if kwargs["kv_heads"] == 2 else 16
    out, summary, natural = convert_tiny(src, latent_dim=latent, rope_dim=16)
    assert summary["family"] == "qwen3" and summary["exact_at_full_rank"] is False
    assert "per-head" in summary["approximation"] and "Approximation" in (out / "README.md").read_text()
    assert "keeps one RMSNorm over all its heads" in summary["approximation"]
    width = source_config.num_attention_heads * source_config.head_dim
    if not kwargs.get("attention_bias"):
        width = min(width, source_config.hidden_size)
    config = json.loads((out / "config.json").read_text())
    assert config["q_lora_rank"] == width
    tensors = load_file(out / "model.safetensors")
    prefix = "model.layers.0.self_attn."
    assert torch.equal(tensors[prefix + "q_a_layernorm.weight"], torch.ones(width))  # a genuine norm
    assert (prefix + "q_a_proj.bias" in tensors) == kwargs.get("attention_bias", False)
    for layer in summary["layers"]:
        fold = layer["qk_norm_fold"]
        assert 0 < fold["fold_error"] < 1 and 0 < fold["k_fold_error"] < 1 and fold["scale_min"] > 0
        assert 0 < fold["query_norm_error"] < 1
        assert layer["refine_loss_after"] <= layer["refine_loss_before"]  # refine never hands back worse
        assert layer["stock_vs_reference"] < 1e-5
    assert all(w.q_b is not None for w in natural.values())
    assert any(layer["refine_loss_after"] < layer["refine_loss_before"] for layer in summary["layers"])
    closed, closed_summary, _ = convert_tiny(src, latent_dim=latent, rope_dim=16, method=PRESETS["closed-form"])
    assert closed_summary["layers"][0]["qk_norm_fold"] == summary["layers"][0]["qk_norm_fold"]
    assert closed_summary["layers"][0]["stock_vs_reference"] < 1e-5
    source = load_file(src / "model.safetensors")[prefix + "q_proj.weight"]
    if source.shape[0] == width:  # the closed form reads Qwen3's own q_proj through the norm
        assert torch.equal(load_file(closed / "model.safetensors")[prefix + "q_a_proj.weight"], source)

    # query_norm=fold: a plain q_proj with the query norm folded like the key's
    folded, folded_summary, folded_natural = convert_tiny(
        src, latent_dim=latent, rope_dim=16, method=PRESETS["closed-form"].with_overrides(["query_norm=fold"]))
    bias_path = source_config.hidden_size + 1 if kwargs.get("attention_bias") else None  # a query bias's q_lora
    assert json.loads((folded / "config.json").read_text())["q_lora_rank"] == bias_path
    assert "folded the same way" in folded_summary["approximation"]
    assert "query_norm_error" not in folded_summary["layers"][0]["qk_norm_fold"]
    assert all(w.q_b is None for w in folded_natural.values())


def test_qwen3_fold_is_exact_when_the_rms_is_constant():
    """The fold reproduces the normalized projection exactly when every token's per-head rms is the same
    (then 1/rms is one number per head), and the fitted scale is that number."""
    from transmla_tool.ops.qk_norm import fold_head_norm, normalized_error

    torch.manual_seed(0)
    heads, dim, hidden = 3, 8, 8
    # each head's projection is orthogonal, and the inputs are unit vectors: rms = 1/sqrt(dim) for every token
    weight = torch.cat([torch.linalg.qr(torch.randn(hidden, hidden))[0] for _ in range(heads)])  # (heads*dim, d)
    x = torch.nn.functional.normalize(torch.randn(50, hidden), dim=-1)
    norm_weight = torch.rand(dim) + 0.5
    folded, _, scales = fold_head_norm(weight, None, norm_weight, 0.0, x, heads)
    assert torch.allclose(scales, torch.full((heads,), dim**0.5), rtol=1e-5)
    assert normalized_error(weight, None, norm_weight, 0.0, x, heads, folded, None) < 1e-6
    # tokens of different norms: the fold is only a fit
    assert normalized_error(weight, None, norm_weight, 0.0, x * torch.rand(50, 1) * 3, heads, folded, None) > 0.05


def test_query_norm_is_exact_when_the_heads_share_the_rms():
    """One RMSNorm over the whole query reproduces per-head norms exactly when every head of a token has the
    same rms (then the whole query's rms is that rms), whatever the token's norm; the per-head fold cannot."""
    from transmla_tool.ops.qk_norm import fold_head_norm, fold_query_norm, normalized_error

    torch.manual_seed(0)
    heads, dim, hidden = 3, 8, 8
    # each head's projection is a signed permutation of x: every head has the rms of x
    weight = torch.cat([torch.eye(hidden)[torch.randperm(hidden)] * torch.sign(torch.randn(hidden, 1))
                        for _ in range(heads)])
    x = torch.randn(50, hidden) * torch.rand(50, 1) * 3  # tokens of different norms
    norm_weight = torch.rand(dim) + 0.5
    rows, scales, error = fold_query_norm(weight, None, norm_weight, 1e-9, x, heads, 1e-9)
    assert error < 1e-6 and torch.allclose(scales, torch.ones(heads), rtol=1e-5)
    assert torch.allclose(rows, (scales[:, None] * norm_weight).reshape(-1))
    folded, folded_bias, _ = fold_head_norm(weight, None, norm_weight, 1e-9, x, heads)
    assert normalized_error(weight, None, norm_weight, 1e-9, x, heads, folded, folded_bias) > 0.05


def test_compact_query_keeps_the_whole_query_norm():
    """A query wider than the hidden size read through d values: RMSNorm(W x) = out RMSNorm(q_a x) for any x."""
    from transmla_tool.ops.qk_norm import compact_query

    torch.manual_seed(0)
    weight, x = torch.randn(48, 16, dtype=torch.float64), torch.randn(20, 16, dtype=torch.float64) * 5

    def rms_norm(y):
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True))

    q_a, out = compact_query(weight, None)
    assert q_a.shape == (16, 16) and out.shape == (48, 16)
    assert torch.allclose(rms_norm(x @ weight.T), rms_norm(x @ q_a.T) @ out.T, atol=1e-10)
    same, eye = compact_query(weight[:12], None)  # no wider than d: kept as it is
    assert torch.equal(same, weight[:12]) and torch.equal(eye, torch.eye(12, dtype=torch.float64))


def _router_inputs(experts=8, hidden=16, tokens=32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(experts, hidden, generator=gen), torch.randn(tokens, hidden, generator=gen)


def test_transformers_deepseek_v2_router_ignores_norm_topk_prob():
    """Why Mixtral and Qwen3-MoE are refused: their routers renormalize the top-k softmax weights (they sum to
    1), transformers' DeepSeek-V2 router does not even with norm_topk_prob=True, and DeepSeek-V3's sigmoid
    scores renormalized are other weights. If a transformers release changes this, this test fails: then
    DeepSeek-V2 with norm_topk_prob maps those routers exactly and the refusal should become a conversion."""
    from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    weight, x = _router_inputs()
    common = dict(hidden_size=16, num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=2)
    mixtral = MixtralTopKRouter(MixtralConfig(**common, num_local_experts=8))
    v2 = DeepseekV2TopkRouter(DeepseekV2Config(**common, n_routed_experts=8, topk_method="greedy",
                                               norm_topk_prob=True, routed_scaling_factor=1.0))
    v3 = DeepseekV3TopkRouter(DeepseekV3Config(**common, n_routed_experts=8, n_group=1, topk_group=1,
                                               norm_topk_prob=True, routed_scaling_factor=1.0))
    with torch.no_grad():
        for router in (mixtral, v2, v3):
            router.weight.copy_(weight)
        mixtral_out = mixtral(x)
        v2_out, v3_logits = v2(x), v3(x)
    mixtral_weights, mixtral_index = mixtral_out[1], mixtral_out[2]
    assert torch.allclose(mixtral_weights.sum(-1), torch.ones(x.shape[0]), atol=1e-6)  # renormalized
    v2_weights, v2_index = v2_out[1], v2_out[2]
    assert torch.equal(v2_index.sort(-1).values, mixtral_index.sort(-1).values)  # same experts chosen
    probs = torch.softmax(x @ weight.T, dim=-1)
    assert torch.allclose(v2_weights, probs.gather(-1, v2_index), atol=1e-6)  # the plain softmax, not renormalized
    assert (v2_weights.sum(-1) - 1).abs().max() > 0.1  # so the expert outputs are weighted otherwise
    if isinstance(v3_logits, tuple):  # recent transformers: the router itself returns (logits, weights, indices)
        _, v3_weights, v3_index = v3_logits
    else:  # older: logits only; what DeepseekV3MoE then does with norm_topk_prob
        v3_index = v3_logits.topk(2, dim=-1).indices
        chosen = torch.sigmoid(v3_logits).gather(-1, v3_index)
        v3_weights = chosen / chosen.sum(-1, keepdim=True)
    assert torch.equal(v3_index.sort(-1).values, mixtral_index.sort(-1).values)  # sigmoid is monotone: same experts
    assert (v3_weights.sort(-1).values - mixtral_weights.sort(-1).values).abs().max() > 0.1  # other weights


@pytest.mark.parametrize("model_type,words", [
    ("mixtral", "renormalizes"), ("qwen3_moe", "norm_topk_prob"), ("qwen2_moe", "sigmoid gate"),
    ("gemma2", "post-attention"), ("gemma3_text", "post-norms"), ("olmo2", "post-norms"),
    ("deepseek_v3", "already uses"),
])
def test_refused_families_name_the_reason(model_type, words):
    from transmla_tool.arch import check_supported
    from transmla_tool.errors import UnsupportedModelError

    class Config:
        pass

    config = Config()
    config.model_type = model_type
    with pytest.raises(UnsupportedModelError, match=f"'{model_type}' is unsupported because .*{words}"):
        check_supported(config)


def test_phi3_view_reads_each_fused_tensor_once(make_model):
    """A layer's q, k and v (gate and up) come from one read of the fused tensor, not one read each."""
    from transmla_tool.arch import check_supported, llama_view
    from transmla_tool.io.source import open_source

    source = open_source(str(make_model("phi3", kv_heads=2)))
    view = llama_view(source, check_supported(source.config))
    reads = []
    load = source._load
    source._load = lambda name: reads.append(name) or load(name)
    for part in ("q_proj", "k_proj", "v_proj"):
        view.get(f"model.layers.0.self_attn.{part}.weight")
    for part in ("gate_proj", "up_proj"):
        view.get(f"model.layers.0.mlp.{part}.weight")
    assert reads == ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"]
