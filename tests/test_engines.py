"""Serving engines run our output: vLLM (its CPU build, in its own venv). Marked `engines`.

Installed by `make engines` (cached outside the work tree). Without it these tests skip, unless
TRANSMLA_REQUIRE_ENGINES=1 (CI sets it), where a missing engine is a failure.

vLLM's MLA layer takes kv_lora_rank + qk_rope_head_dim in {320, 512, 576} and its CPU backend 576 only,
so each checkpoint is run twice on this CPU: as converted (320 for SmolLM2) through vLLM's non-MLA
path (VLLM_MLA_DISABLE=1: same weights, expanded per-head K/V), and zero-padded to 512 + 64 (exact)
through its MLA path. Both must give transformers' greedy tokens and perplexity.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from transmla_tool.convert import ConvertSettings, convert
from transmla_tool.errors import UserError
from transmla_tool.methods import PRESETS

pytestmark = pytest.mark.engines

GREEDY_TOKENS = 32
PPL_TOLERANCE = 0.005  # relative, fp32


def _vllm_or_skip():
    from transmla_tool.engines.vllm_engine import vllm_python

    try:
        return vllm_python()
    except UserError as exc:
        if os.environ.get("TRANSMLA_REQUIRE_ENGINES") == "1":
            raise
        pytest.skip(str(exc))


def _transformers_reference(model_dir, prompts, windows):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    greedy = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False,
                                 min_new_tokens=GREEDY_TOKENS)
            greedy.append(out[0, len(ids):].tolist())
        logits = model(torch.tensor(windows)).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                torch.tensor(windows)[:, 1:].reshape(-1), reduction="sum")
    return greedy, float(nll), sum(len(w) - 1 for w in windows)


def _check_vllm(model_dir, prompts, windows, env, max_model_len=1024):
    from transmla_tool.engines.vllm_engine import run_vllm

    greedy, nll, count = _transformers_reference(model_dir, prompts, windows)
    result = run_vllm(model_dir, greedy=prompts, new_tokens=GREEDY_TOKENS, perplexity=windows, env=env,
                      max_model_len=max_model_len)
    assert result["nll_tokens"] == count
    ppl_hf, ppl_vllm = math.exp(nll / count), math.exp(result["nll_sum"] / count)
    assert abs(ppl_vllm / ppl_hf - 1) < PPL_TOLERANCE, (ppl_hf, ppl_vllm, result["log_tail"])
    assert result["greedy"] == greedy, result["log_tail"]
    print(f"{model_dir}: perplexity transformers {ppl_hf:.6f}, vLLM {ppl_vllm:.6f}; greedy {GREEDY_TOKENS} tokens equal; "
          f"vLLM KV cache {result['kv_cache']}")
    return result


def _prompts_and_windows(model_dir, text_file, window: int, count: int = 4):
    from transmla_tool.data import token_windows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows = token_windows(str(text_file), tokenizer, window, count).tolist()
    return [w[:24] for w in windows[:2]], windows


@pytest.fixture(scope="module")
def smollm2_320(tmp_path_factory):
    from transmla_tool.assets import lee_corpus, smollm2_gguf, split_documents

    _vllm_or_skip()
    model_dir, gguf = smollm2_gguf()
    root = tmp_path_factory.mktemp("engines")
    calib, heldout = split_documents(lee_corpus(), root / "data")
    outputs = {}
    for name, pad in (("320", 0), ("padded-576", 512)):
        outputs[name] = root / f"smollm2-{name}"
        convert(ConvertSettings(model=model_dir, gguf_file=gguf, output=str(outputs[name]), latent_dim=256,
                                rope_dim=64, calib_data=str(calib), calib_samples=16, calib_seq_len=256,
                                dtype="float32", device="cpu", progress=False, method=PRESETS["closed-form"],
                                pad_latent_to=pad))
    return outputs, heldout


@pytest.mark.slow
def test_vllm_serves_smollm2_through_mla(smollm2_320):
    outputs, heldout = smollm2_320
    prompts, windows = _prompts_and_windows(outputs["padded-576"], heldout, 256)
    result = _check_vllm(outputs["padded-576"], prompts, windows, env={})
    kv = result["kv_cache"]
    if "error" not in kv:  # vLLM's MLA cache: one latent + rotary key per token per layer
        assert kv["bytes_per_token_per_layer"] == pytest.approx(576 * 4, rel=0.01), kv


@pytest.mark.slow
def test_vllm_serves_smollm2_320_without_mla(smollm2_320):
    outputs, heldout = smollm2_320
    prompts, windows = _prompts_and_windows(outputs["320"], heldout, 256)
    _check_vllm(outputs["320"], prompts, windows, env={"VLLM_MLA_DISABLE": "1"})


@pytest.mark.parametrize("family,kwargs", [
    ("llama", dict(kv_heads=2)),
    ("llama", dict(kv_heads=1)),
    ("mistral", dict(kv_heads=2)),
    ("llama", dict(kv_heads=2, rope_scaling=True)),  # Llama-3 scaling mapped onto DeepSeek YaRN (--target vllm)
])
def test_vllm_serves_tiny_families(trained_model, text_file, tmp_path, family, kwargs):
    """Tiny trained models shaped so vLLM's MLA path takes them (head_dim 64 = rope 64, latent padded to
    512): greedy tokens and perplexity equal transformers'."""
    _vllm_or_skip()
    src = trained_model(family, heads=4, head_dim=64, hidden=128, **kwargs)
    out = tmp_path / "mla"
    convert(ConvertSettings(model=str(src), output=str(out), latent_dim=64, rope_dim=64, calib_data=str(text_file),
                            calib_samples=8, calib_seq_len=64, dtype="float32", device="cpu", progress=False,
                            method=PRESETS["closed-form"], pad_latent_to=512, target="vllm"))
    prompts, windows = _prompts_and_windows(out, text_file, 64)
    _check_vllm(out, prompts, windows, env={}, max_model_len=256)


def test_eval_in_vllm(trained_model, text_file, tmp_path):
    """`eval --engine vllm`: both models measured inside vLLM; the KV cache it allocates is the
    architecture's (GQA 2*G*D, MLA latent + rope), perplexities equal transformers' eval."""
    from transmla_tool.evaluate.run import EvalSettings, run_eval

    _vllm_or_skip()
    src = trained_model("llama", heads=4, head_dim=64, hidden=128, kv_heads=2)
    out = tmp_path / "mla"
    convert(ConvertSettings(model=str(src), output=str(out), latent_dim=64, rope_dim=64, calib_data=str(text_file),
                            calib_samples=8, calib_seq_len=64, dtype="float32", device="cpu", progress=False,
                            method=PRESETS["closed-form"], pad_latent_to=512, target="vllm"))
    common = dict(original=str(src), converted=str(out), data=str(text_file), seq_len=64, max_tokens=640,
                  contexts=[64, 192], new_tokens=4, device="cpu", dtype="float32", progress=False)
    engine = run_eval(EvalSettings(output_dir=str(tmp_path / "vllm"), engine="vllm", **common))
    reference = run_eval(EvalSettings(output_dir=str(tmp_path / "hf"), attention="absorbed", **common))
    for key in ("original", "converted"):
        assert engine["perplexity"][key] == pytest.approx(reference["perplexity"][key], rel=PPL_TOLERANCE)
    cache = engine["kv_cache"]
    assert cache["measured_values_per_token_per_layer"]["192"] == {"original": 256, "converted": 576}
    assert not cache["warnings"] and min(engine["decode_tokens_per_s"]["192"].values()) > 0
    assert "vllm" in engine["environment"]["engine"]
    assert "Measured in vLLM" in (tmp_path / "vllm" / "report.md").read_text()
