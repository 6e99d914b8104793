"""End-to-end conversion of tiny random checkpoints of every supported family."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from helpers import logits, reference_logits, rel_err, sample_ids
from transmla_tool.errors import UserError


def test_mqa_full_rank_is_exact(make_model, convert_tiny):
    """One KV head and rope_dim = head_dim: every frequency has a single candidate, so the rotary key
    *is* the source key (nothing loses RoPE), and the latent at full rank (= head_dim) holds the values
    exactly. The only approximation left is the linearized latent norm (<1e-7 relative), so the stock
    model's logits must equal the source model's."""
    src = make_model("llama", kv_heads=1)
    out, summary, _ = convert_tiny(src, latent_dim=16, rope_dim=16)
    ids = sample_ids(AutoConfig.from_pretrained(src).vocab_size)
    assert rel_err(logits(out, ids), logits(src, ids)) < 1e-5
    assert summary["cache_values_per_token_per_layer"] == {"original": 32, "converted": 32}


def test_source_norm_eps_kept_exactly(make_model, convert_tiny):
    """A source trained with RMSNorm eps 1e-5 (Llama, Mistral, SmolLM2): the output's norms all take 1e-6
    (transformers hard-codes it for the latent norm, vLLM reads the config), and the residual stream is
    scaled so every block norm still acts as with 1e-5: the full-rank conversion stays exact."""
    src = make_model("llama", kv_heads=1, rms_norm_eps=1e-5)
    out, summary, _ = convert_tiny(src, latent_dim=16, rope_dim=16)
    ids = sample_ids(AutoConfig.from_pretrained(src).vocab_size)
    assert rel_err(logits(out, ids), logits(src, ids)) < 1e-5
    assert json.loads((out / "config.json").read_text())["rms_norm_eps"] == 1e-6
    assert summary["residual_scale"] == pytest.approx(0.1**0.5) and summary["source_rms_norm_eps"] == 1e-5


@pytest.mark.parametrize(
    "family,kwargs",
    [
        ("llama", dict(kv_heads=2)),  # GQA
        ("llama", dict(kv_heads=4)),  # MHA
        ("llama", dict(kv_heads=1)),  # MQA
        ("mistral", dict(kv_heads=2)),
        ("qwen2", dict(kv_heads=2)),  # q/k/v biases: q_lora path and attention biases
        ("llama", dict(kv_heads=2, attention_bias=True)),  # Llama with q/k/v/o biases
        ("llama", dict(kv_heads=2, rope_scaling=True)),  # Llama-3 rope scaling
    ],
)
def test_stock_model_equals_reference(make_model, convert_tiny, family, kwargs):
    """The stock transformers DeepseekV3ForCausalLM loaded from our output computes exactly the
    tool's reference MLA math (natural weights, no norm): export, norm linearization, rotary layout
    and scaling, q_lora bias path and config are all right."""
    src = make_model(family, **kwargs)
    out, summary, natural = convert_tiny(src, latent_dim=24, rope_dim=8)
    ids = sample_ids(AutoConfig.from_pretrained(src).vocab_size)
    stock = logits(out, ids)
    assert rel_err(stock, reference_logits(src, natural, out, ids)) < 1e-5
    assert max(layer["stock_vs_reference"] for layer in summary["layers"]) < 1e-5
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]
    assert config["rope_interleave"] is True and config["rms_norm_eps"] == 1e-6
    has_bias = family == "qwen2" or kwargs.get("attention_bias", False)
    assert config["attention_bias"] is has_bias
    assert (config["q_lora_rank"] is not None) is has_bias
    problems = " ".join(summary["servable"]["vllm"]["problems"])
    assert summary["servable"]["vllm"]["serves_as_is"] is False and "24 + rope 8 = 32" in problems
    assert ("no bias parameters" in problems) is has_bias
    assert ("DeepSeek YaRN" in problems) is bool(kwargs.get("rope_scaling"))


def test_error_shrinks_with_latent_dim(make_model, convert_tiny):
    """Closed form: converted-vs-source logit error never grows as the latent grows, and at full rank it
    equals the error of RoPE decoupling alone (the latent is then lossless)."""
    from transmla_tool.methods import PRESETS

    src = make_model("llama", kv_heads=2)
    ids = sample_ids(AutoConfig.from_pretrained(src).vocab_size)
    source = logits(src, ids)
    full = 2 * 2 * 16 - 8
    errors = {}
    for r in (4, 8, 16, full):
        out, _, natural = convert_tiny(src, latent_dim=r, rope_dim=8, method=PRESETS["closed-form"])
        errors[r] = rel_err(logits(out, ids), source)
        if r == full:
            full_natural = natural
    ranks = sorted(errors)
    assert all(errors[a] >= errors[b] * 0.999 for a, b in zip(ranks, ranks[1:])), errors
    assert errors[4] > 1.5 * errors[full], errors

    # At full rank the latent is lossless: kv_b @ latent rows reproduces every head's values exactly
    # (the source v_proj rows of its group) and has the full rank of [RoPE-free keys; values].
    from safetensors.torch import load_file

    source = load_file(src / "model.safetensors")
    for i, weights in full_natural.items():
        expanded = (weights.kv_b @ weights.kv_a[: weights.latent_dim]).view(4, 32, -1)  # (H, dn+dv, d)
        v_src = source[f"model.layers.{i}.self_attn.v_proj.weight"].double().view(2, 16, -1)
        for h in range(4):
            assert torch.allclose(expanded[h, 16:], v_src[h // 2], atol=1e-9)
        assert torch.linalg.matrix_rank(expanded.reshape(128, -1), rtol=1e-9) == full


@pytest.mark.parametrize("balance", ["energy", "partial"])
def test_cache_facing_bases_keep_the_model(make_model, convert_tiny, balance):
    """latent_basis and rope_key_balance are exact changes of basis applied during conversion: the stock
    checkpoint computes what the plain closed form computes, but its cached rotary key is scaled pair by pair
    (queries inversely), in the direction that evens the pairs' energies out."""
    from transmla_tool.methods import PRESETS

    src = make_model("llama", kv_heads=2)
    ids = sample_ids(AutoConfig.from_pretrained(src).vocab_size)
    plain_method = dataclasses.replace(PRESETS["closed-form"], latent_basis="pca", rope_key_balance="none")
    plain_dir, _, plain = convert_tiny(src, latent_dim=12, rope_dim=8, method=plain_method)
    method = dataclasses.replace(PRESETS["closed-form"], latent_basis="hadamard", rope_key_balance=balance)
    turned_dir, summary, turned = convert_tiny(src, latent_dim=12, rope_dim=8, method=method)
    assert summary["settings"]["method"]["rope_key_balance"] == balance
    assert rel_err(logits(turned_dir, ids), logits(plain_dir, ids)) < 1e-5
    r = 12
    for i in plain:
        before, after = plain[i].kv_a[r:], turned[i].kv_a[r:]
        scale = (after.norm(dim=1) / before.norm(dim=1)).view(-1, 2)  # one scale per rotary pair
        assert torch.allclose(scale[:, 0], scale[:, 1], rtol=1e-6) and scale.std() > 1e-3
        energy = before.pow(2).sum(1).view(-1, 2).sum(1)  # louder pairs (by weight norm) are scaled down
        assert torch.corrcoef(torch.stack([energy.log(), scale[:, 0].log()]))[0, 1] < 0


def test_cache_bases_follow_the_fit(make_model, convert_tiny):
    """The default's latent rotation and rotary-key balance are applied after the refinement, so a refined
    conversion computes what it computes in the plain basis (the fit never sees the basis; Adam is not
    rotation-invariant, so applying them first would change the refined model). A fit through a quantized cache
    (refine_cache) must read the basis its cache will hold: there they come first and the model differs."""
    from transmla_tool.methods import PRESETS

    src = make_model("llama", kv_heads=2, head_dim=32)  # a rotary key of 32: one q4_0 block, as llama.cpp needs
    ids = sample_ids(AutoConfig.from_pretrained(src).vocab_size)
    default = dataclasses.replace(PRESETS["default"], refine_steps=8)
    assert (default.latent_basis, default.rope_key_balance) == ("hadamard", "partial")
    plain = dataclasses.replace(default, latent_basis="pca", rope_key_balance="none")
    results = {}
    for name, method in {"default": default, "plain": plain,
                         "default q4_0": dataclasses.replace(default, refine_cache="q4_0"),
                         "plain q4_0": dataclasses.replace(plain, refine_cache="q4_0")}.items():
        out, summary, natural = convert_tiny(src, latent_dim=32, rope_dim=32, method=method, calib_samples=16)
        assert all(r["refine_loss_after"] < r["refine_loss_before"] for r in summary["layers"]), name
        results[name] = (logits(out, ids), natural)
    assert rel_err(results["default"][0], results["plain"][0]) < 1e-5
    for i in results["plain"][1]:  # the same function in another basis: the stored latent rows differ
        assert not torch.allclose(results["default"][1][i].kv_a, results["plain"][1][i].kv_a, atol=1e-3)
    assert rel_err(results["default q4_0"][0], results["plain q4_0"][0]) > 1e-3


def test_bit_identical_outputs(make_model, convert_tiny, tmp_path):
    src = make_model("llama", kv_heads=2)
    digests = []
    for name in ("a", "b"):
        out, _, _ = convert_tiny(src, latent_dim=12, rope_dim=8, output=tmp_path / name, seed=3)
        digests.append(hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]


def test_sharded_output_loads(make_model, convert_tiny):
    src = make_model("llama", kv_heads=2)
    out, _, _ = convert_tiny(src, latent_dim=12, rope_dim=8, max_shard_size="40KB")
    whole, _, _ = convert_tiny(src, latent_dim=12, rope_dim=8)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (whole / "model.safetensors.index.json").exists()
    ids = sample_ids(AutoConfig.from_pretrained(src).vocab_size)
    assert torch.equal(logits(out, ids), logits(whole, ids))  # the same checkpoint, only split differently


def test_bfloat16_output(make_model, convert_tiny):
    """bf16 keeps the linearized norm exact (power-of-two norm weights, normal-range activations):
    the bf16 checkpoint tracks the fp32 one to bf16 rounding."""
    src = make_model("llama", kv_heads=2)
    out32, _, _ = convert_tiny(src, latent_dim=16, rope_dim=8)
    out16, _, _ = convert_tiny(src, latent_dim=16, rope_dim=8, dtype="bfloat16")
    ids = sample_ids(AutoConfig.from_pretrained(src).vocab_size)
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert rel_err(logits(out16, ids), logits(out32, ids)) < 0.05


def test_output_files(make_model, convert_tiny):
    src = make_model("llama", kv_heads=2)
    out, summary, _ = convert_tiny(src, latent_dim=12, rope_dim=8)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md",
                 "conversion.json"):
        assert (out / name).exists(), name
    card = (out / "README.md").read_text()
    assert summary["version"] in card
    # the source cached K and V of its 2 KV heads (not its 4 query heads): 2 x 2 x 16 = 64 values
    assert "| original (K and V of 2 heads x 16 (GQA, 4 query heads)) | 64 |" in card
    assert "| converted (latent 12 + rotary key 8) | 20 | 69% saved |" in card
    assert "| latent_dim | `12` |" in card
    assert not list(out.parent.glob(".*partial*"))
    stages = summary["stages"]
    assert {"read layer", "statistics", "factorize", "write", "assemble shards"} <= set(stages)
    assert all(v["seconds"] >= 0 and v["peak_rss_mb"] > 0 for v in stages.values())
    assert summary["peak_rss_mb"] >= max(v["peak_rss_mb"] for v in stages.values())


def test_streams_one_layer_at_a_time(make_model, convert_tiny, monkeypatch):
    """Source weights are read layer by layer and released: when layer i is read, no tensor of layers
    before i-1 is still alive (the conversion holds one layer, never the model)."""
    import gc
    import re
    import weakref

    from transmla_tool.io.source import SafetensorsSource

    src = make_model("llama", kv_heads=2, layers=6)
    alive: dict[int, list] = {}
    violations = []
    original = SafetensorsSource._load

    def tracked(self, name):
        tensor = original(self, name)
        match = re.match(r"model\.layers\.(\d+)\.", name)
        if match:
            layer = int(match.group(1))
            gc.collect()
            for earlier, refs in alive.items():
                if earlier < layer - 1 and any(r() is not None for r in refs):
                    violations.append((layer, earlier))
            alive.setdefault(layer, []).append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(SafetensorsSource, "_load", tracked)
    convert_tiny(src, latent_dim=12, rope_dim=8)
    assert sorted(alive) == list(range(6))
    assert not violations, violations


def test_sharded_source_checkpoint(make_model, convert_tiny, tmp_path):
    """A source saved as several shards with an index converts to the same weights as the single file."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transmla_tool.methods import PRESETS

    src = make_model("llama", kv_heads=2)
    sharded = tmp_path / "sharded-src"
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(sharded, max_shard_size="30KB")
    AutoTokenizer.from_pretrained(src).save_pretrained(sharded)
    assert (sharded / "model.safetensors.index.json").exists()
    a, _, _ = convert_tiny(src, latent_dim=12, rope_dim=8, method=PRESETS["closed-form"])
    b, _, _ = convert_tiny(sharded, latent_dim=12, rope_dim=8, method=PRESETS["closed-form"])
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_llama3_rope_maps_onto_yarn_for_vllm(trained_model, convert_tiny, text_file):
    """--target vllm writes Llama-3 rope scaling as DeepSeek YaRN (what vLLM applies to every scaled
    DeepSeek model), with the ramp fitted so each slot sits near a Llama-3 frequency and the slots given
    their nearest source frequencies. Against the same conversion with Llama-3 scaling kept exactly
    (--target auto), the only difference is that frequency mismatch: it is reported and small, and
    transformers computes YaRN exactly as written."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    from transmla_tool.data import token_windows
    from transmla_tool.methods import PRESETS
    from transmla_tool.ops.rope import yarn_inv_freq

    src = trained_model("llama", kv_heads=1, rope_scaling=True)
    ids = token_windows(str(text_file), AutoTokenizer.from_pretrained(src), 256, 2)  # 4x the original context
    closed = PRESETS["closed-form"]
    exact, summary_exact, _ = convert_tiny(src, latent_dim=24, rope_dim=8, target="auto", method=closed)
    mapped, summary, _ = convert_tiny(src, latent_dim=24, rope_dim=8, target="vllm", method=closed,
                                      pad_latent_to=312)  # 312 + 8 = 320: a size vLLM serves (padding is exact)
    assert summary_exact["rope_slot_max_log_error"] == 0

    config = AutoConfig.from_pretrained(mapped)
    rope = config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 8.0 and rope["attention_factor"] == 1.0
    freq = yarn_inv_freq(rope["rope_theta"], 8, rope["factor"], rope["original_max_position_embeddings"],
                         rope["beta_fast"], rope["beta_slow"])
    rotary = DeepseekV3RotaryEmbedding(config)
    assert torch.allclose(rotary.inv_freq.double(), freq, rtol=1e-6) and rotary.attention_scaling == 1.0
    assert 0 < summary["rope_slot_max_log_error"] < 0.05
    assert summary["servable"]["vllm"]["serves_as_is"] is True, summary["servable"]["vllm"]["problems"]
    reference = logits(exact, ids)
    error = rel_err(logits(mapped, ids), reference)
    source_error = rel_err(reference, logits(src, ids))
    print(f"llama3 -> yarn: max slot |log f ratio| {summary['rope_slot_max_log_error']:.4f}; logits vs exact-llama3 "
          f"conversion {error:.4f} (that conversion vs source {source_error:.4f})")
    assert error < 0.1


def test_qwen2_bias_free_output(trained_model, convert_tiny, text_file):
    """--biases drop (the default for --target vllm, whose DeepSeek attention has no biases): the output has
    no bias tensors and no q_lora path; layer-local refinement absorbs the biases. The perplexity cost is
    measured against keeping them (exact in transformers)."""
    import math

    from safetensors.torch import load_file

    from transmla_tool.data import token_windows
    from transmla_tool.evaluate.perplexity import perplexity
    from transmla_tool.methods import PRESETS

    src = trained_model("qwen2", kv_heads=2)
    windows = token_windows(str(text_file), AutoTokenizer.from_pretrained(src), 64, 24)[-8:]

    def ppl(path):
        from transformers import AutoModelForCausalLM

        return perplexity(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), windows,
                          progress=False)["perplexity"]

    kept, _, _ = convert_tiny(src, latent_dim=40, rope_dim=8, biases="keep")
    unfolded, _, _ = convert_tiny(src, latent_dim=40, rope_dim=8, biases="drop",
                                  method=dataclasses.replace(PRESETS["default"], bias_fold="none"))
    dropped, summary, _ = convert_tiny(src, latent_dim=40, rope_dim=8, biases="drop")
    config = json.loads((dropped / "config.json").read_text())
    assert config["attention_bias"] is False and config["q_lora_rank"] is None
    assert not [k for k in load_file(dropped / "model.safetensors") if k.endswith(".bias")]
    assert not any("bias" in p for p in summary["servable"]["vllm"]["problems"])
    base = ppl(src)
    ratios = {name: ppl(path) / base for name, path in
              (("keep", kept), ("drop, refined", unfolded), ("fold, refined", dropped))}
    print("qwen2 perplexity ratio to the source:", {k: round(v, 4) for k, v in ratios.items()})
    assert all(math.isfinite(r) for r in ratios.values())
    assert ratios["keep"] < min(ratios["drop, refined"], ratios["fold, refined"])  # keeping them is exact


def test_dropped_biases_without_refinement_refused(make_model, convert_tiny, tmp_path):
    """Biases dropped for an engine target with nothing to make up for them (no refinement): refused before any work,
    nothing written (on a real Qwen2.5 the closed form alone destroys the model); with refinement on it converts,
    folding the biases through the input's near-constant direction first (ops/bias_fold.py) and saying how well."""
    from transmla_tool.methods import PRESETS

    src = make_model("qwen2", kv_heads=2)
    refused = r"the closed-form method has no refinement \(refine_steps 0\) to make up for them"
    with pytest.raises(UserError, match=refused):
        convert_tiny(src, latent_dim=24, rope_dim=8, target="llamacpp", method=PRESETS["closed-form"],
                     method_name="closed-form", output=tmp_path / "refused")
    assert not (tmp_path / "refused").exists() and not list(tmp_path.glob(".refused*"))
    out, refined, _ = convert_tiny(src, latent_dim=24, rope_dim=8, target="llamacpp",
                                   method=dataclasses.replace(PRESETS["default"], refine_steps=5))
    assert json.loads((out / "config.json").read_text())["attention_bias"] is False
    assert all("heldout_spread" in layer["bias_fold"] for layer in refined["layers"])
    # the first layer folds through one embedding channel replaced by a constant (ops/bias_fold.with_constant_channel):
    # exactly constant there, so its fit is exact; every other channel of the embedding is the source's
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    channel = refined["constant_channel"]["channel"]
    written = load_file(out / "model.safetensors")["model.embed_tokens.weight"]
    source = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).model.embed_tokens.weight.detach()
    others = [i for i in range(written.shape[1]) if i != channel]
    assert torch.equal(written[:, others], source[:, others]) and not torch.equal(written[:, channel],
                                                                                  source[:, channel])
    # exact up to the ridge's shrinkage of u (RIDGE, 1e-4 of the mean input energy: 2e-6 here), orders of magnitude
    # below the next layer's fit, which has no constant channel (2.7e-3 here)
    first, second = (refined["layers"][i]["bias_fold"]["constant_mse"] for i in (0, 1))
    assert first < 1e-5 and second > 100 * first
    # eight windows of 64 tokens fit the direction to the tokens it saw: the summary says so and names the fix
    assert len(refined["warnings"]) == 1 and "--calib-samples, 8 windows now" in refined["warnings"][0]


def test_fold_warning_names_the_loosest_layer():
    from transmla_tool.convert import fold_warnings

    reports = [{"layer": 0, "bias_fold": {"heldout_spread": 0.09}}, {"layer": 1, "bias_fold": {"heldout_spread": 0.04}},
               {"layer": 2, "bias_fold": {"heldout_spread": 0.0004}}, {"layer": 3}]
    (text,) = fold_warnings(reports, 128)
    assert "+-0.30" in text and "at layer 0 (2 layers above 0.1)" in text and "128 windows now" in text
    assert fold_warnings(reports[2:], 128) == []


def test_target_llamacpp(make_model, convert_tiny):
    """--target llamacpp: any latent size, Llama-3 scaling written as DeepSeek YaRN (llama.cpp's
    deepseek2 has no llama3 rope type), biases dropped by default and refused when kept."""
    from transmla_tool.errors import UserError
    from transmla_tool.methods import PRESETS

    closed = PRESETS["closed-form"]
    out, _, _ = convert_tiny(make_model("llama", kv_heads=2, rope_scaling=True), latent_dim=12, rope_dim=8,
                             target="llamacpp", method=closed)
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    qwen = make_model("qwen2", kv_heads=2)
    with pytest.raises(UserError, match="the closed-form method has no refinement"):
        convert_tiny(qwen, latent_dim=12, rope_dim=8, target="llamacpp", method=closed)
    out, _, _ = convert_tiny(qwen, latent_dim=12, rope_dim=8, target="llamacpp", method=dataclasses.replace(closed, refine_steps=2))
    assert json.loads((out / "config.json").read_text())["attention_bias"] is False
    with pytest.raises(UserError, match="--target llamacpp: attention biases"):
        convert_tiny(qwen, latent_dim=12, rope_dim=8, target="llamacpp", biases="keep", method=closed)


def test_target_sglang(make_model, convert_tiny, tmp_path):
    """--target sglang (limits read in SGLang 0.5.23's source, never run): any latent <= 512 with a rope
    part <= 64 (FlashAttention-3, its Hopper default), biases dropped, Llama-3 scaling as YaRN; a latent
    over 512 is refused before anything is written. The verdict is labelled as read, not observed."""
    from transmla_tool.errors import UserError
    from transmla_tool.methods import PRESETS

    closed = PRESETS["closed-form"]
    out, summary, _ = convert_tiny(make_model("llama", kv_heads=2, rope_scaling=True), latent_dim=24,
                                   rope_dim=8, target="sglang", method=closed)
    config = json.loads((out / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn"
    verdict = summary["servable"]["sglang"]
    assert verdict["serves_as_is"] is True and verdict["run"] is False, verdict
    assert "read from its source, not run" in (out / "README.md").read_text()
    qwen = make_model("qwen2", kv_heads=2)
    with pytest.raises(UserError, match="the closed-form method has no refinement"):
        convert_tiny(qwen, latent_dim=16, rope_dim=8, target="sglang", method=closed)
    out, summary, _ = convert_tiny(qwen, latent_dim=16, rope_dim=8, target="sglang",
                                   method=dataclasses.replace(closed, refine_steps=2))
    assert json.loads((out / "config.json").read_text())["attention_bias"] is False
    with pytest.raises(UserError, match="--target sglang: attention biases"):
        convert_tiny(qwen, latent_dim=16, rope_dim=8, target="sglang", biases="keep", method=closed)
    # the same source at latent 16 with biases kept and --target auto: converted, and the verdict says why not
    out, summary, _ = convert_tiny(qwen, latent_dim=16, rope_dim=8, target="auto", biases="keep", method=closed)
    assert summary["servable"]["sglang"]["serves_as_is"] is False
    assert any("biases" in p for p in summary["servable"]["sglang"]["problems"])


def test_sglang_size_limits():
    """The size rule itself, on configs (a tiny model cannot reach a 512+ latent cheaply)."""
    from types import SimpleNamespace

    from transmla_tool.engines import check_target

    def config(latent, rope):
        return SimpleNamespace(kv_lora_rank=latent, qk_rope_head_dim=rope, attention_bias=False,
                               rope_parameters={"rope_type": "yarn", "factor": 1.0})

    assert check_target(config(512, 64), "sglang") == []
    assert check_target(config(128, 64), "sglang") == []   # not a vLLM size, but FA3 / triton take it
    assert check_target(config(128, 64), "vllm")            # vLLM refuses 192
    assert "latent 576" in check_target(config(576, 64), "sglang")[0]
    assert check_target(config(256, 128), "sglang")          # rope part over 64
    assert check_target(config(100, 64), "sglang")           # not a multiple of 8


def test_llamacpp_cache_note(make_model, text_file, tmp_path, capsys):
    """Sizes llama.cpp serves with an f16 cache only (its quantized types need a latent and a rotary key that are
    multiples of 32) are said when converting for it and kept in conversion.json, never refused."""
    from types import SimpleNamespace

    from transmla_tool.cli import main
    from transmla_tool.engines import llamacpp_cache_note

    def config(latent, rope):
        return SimpleNamespace(kv_lora_rank=latent, qk_rope_head_dim=rope)

    assert llamacpp_cache_note(config(128, 64)) is None and llamacpp_cache_note(config(160, 32)) is None
    note = llamacpp_cache_note(config(176, 16))
    assert "f16, bf16 or f32 cache only" in note and "--pad-latent-to 192 (exact) and --rope-dim 32 or 64" in note
    assert "--rope-dim" not in llamacpp_cache_note(config(100, 64))
    src = make_model("llama", kv_heads=2)
    assert main(["convert", "--model", str(src), "--latent-dim", "24", "--rope-dim", "8", "--output",
                 str(tmp_path / "out"), "--calib-data", str(text_file), "--calib-samples", "4", "--calib-seq-len", "32",
                 "--device", "cpu", "--target", "llamacpp", "--method", "closed-form"]) == 0
    assert "note (llama.cpp, latent 24): latent 24 + rope 8: llama.cpp runs it with an f16" in \
        capsys.readouterr().out
    summary = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert any("f16, bf16 or f32 cache only" in p for p in summary["servable"]["llama.cpp"]["problems"])


def test_convert_prints_time_per_stage(make_model, text_file, tmp_path, capsys):
    """The CLI ends with the stages' wall time, largest first, refinement included when the method refines."""
    from transmla_tool.cli import main

    src = make_model("llama", kv_heads=2)
    assert main(["convert", "--model", str(src), "--latent-dim", "12", "--rope-dim", "8", "--output",
                 str(tmp_path / "out"), "--calib-data", str(text_file), "--calib-samples", "4", "--calib-seq-len", "32",
                 "--device", "cpu", "--target", "transformers", "--set", "refine_steps=3", "--no-progress"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("time per stage: "))
    names = [part.rsplit(" ", 3)[0] for part in line.removeprefix("time per stage: ").split(", ")]
    summary = json.loads((tmp_path / "out" / "conversion.json").read_text())
    assert sorted(names) == sorted(summary["stages"]) and {"statistics", "refine", "factorize", "verify"} <= set(names)
    seconds = [summary["stages"][name]["seconds"] for name in names]
    assert seconds == sorted(seconds, reverse=True)


def test_stock_layer_check_runs_on_bounded_positions(make_model, convert_tiny, monkeypatch):
    """The stock-attention check reads at most VERIFY_POSITIONS positions per window (its math-path (L, L) maps held
    12 GB at 8192 for SmolLM2), with the rotary table cut to match: still exact."""
    from transmla_tool import layer as layer_module

    seen = []
    real = layer_module.verify_stock_layer

    def spy(tensors, mla, config, index, x, cos, sin):
        seen.append((x.shape[1], cos.shape[0]))
        return real(tensors, mla, config, index, x, cos, sin)

    monkeypatch.setattr(layer_module, "VERIFY_POSITIONS", 24)
    monkeypatch.setattr(layer_module, "verify_stock_layer", spy)
    src = make_model("llama", kv_heads=2)
    _, summary, _ = convert_tiny(src, latent_dim=24, rope_dim=8, calib_seq_len=64)
    assert seen and all(x_len == 24 and table == 64 for x_len, table in seen)
    assert max(layer["stock_vs_reference"] for layer in summary["layers"]) < 1e-5
