"""Serving engines run our output: vLLM (its CPU build, in its own venv) and llama.cpp (its own
tools, on the GGUF `transmla-tool export-gguf` writes). Marked `engines`.

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
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from transmla_tool.convert import ConvertSettings, convert
from transmla_tool.errors import UserError
from transmla_tool.evaluate.models import load_tokenizer
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
        for ids in prompts:  # argmax without stopping at EOS, as vLLM's ignore_eos (min_new_tokens would mask EOS)
            tokens = list(ids)
            for _ in range(GREEDY_TOKENS):
                tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
            greedy.append(tokens[len(ids):])
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


def _prompts_and_windows(model_dir, text_file, window: int, count: int = 4, prompts: int = 2):
    from transmla_tool.data import token_windows

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    windows = token_windows(str(text_file), tokenizer, window, count).tolist()
    return [w[:24] for w in windows[:prompts]], windows


@pytest.fixture(scope="module")
def smollm2_320(tmp_path_factory):
    from transmla_tool.assets import lee_corpus, smollm2_gguf, split_documents

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
    yield outputs, heldout
    shutil.rmtree(root)  # GBs a module holds: gone when the module ends, not when the session does (a CI disk is shared)


@pytest.mark.slow
def test_vllm_serves_smollm2_through_mla(smollm2_320):
    _vllm_or_skip()
    outputs, heldout = smollm2_320
    prompts, windows = _prompts_and_windows(outputs["padded-576"], heldout, 256)
    result = _check_vllm(outputs["padded-576"], prompts, windows, env={})
    kv = result["kv_cache"]
    if "error" not in kv:  # vLLM's MLA cache: one latent + rotary key per token per layer
        assert kv["bytes_per_token_per_layer"] == pytest.approx(576 * 4, rel=0.01), kv


@pytest.mark.slow
def test_vllm_serves_smollm2_320_without_mla(smollm2_320):
    _vllm_or_skip()
    outputs, heldout = smollm2_320
    prompts, windows = _prompts_and_windows(outputs["320"], heldout, 256)
    _check_vllm(outputs["320"], prompts, windows, env={"VLLM_MLA_DISABLE": "1"})


def _cpu_takes_vllm_fp8_cache() -> bool:
    """What vLLM 0.32's CPU attention backend asks of the CPU before it builds an fp8 cache (AVX-512 or AMX)."""
    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


@pytest.mark.slow
def test_vllm_fp8_cache_on_the_converted_model(smollm2_320):
    """kv_cache_dtype=fp8 in vLLM 0.32's CPU build. MLA path (512 + 64), neither CPU MLA backend serves it (this
    test fails, and docs/serving.md must change, when a vLLM does): the reference CPU_MLA backend allocates one byte
    per cached value and its prefill runs, but the first decode step dies in its decode kernel, which takes only the
    model dtype; the AMX_MLA backend (what vLLM picks on a CPU with AMX tiles) refuses an fp8 cache at the first
    cache write. Non-MLA path (VLLM_MLA_DISABLE=1): on a CPU with AVX-512 or AMX, expanded per-head K/V in fp8,
    perplexity within 10% of the bf16 cache's; on any other CPU (AVX2 only) vLLM refuses the fp8 cache when it
    builds it."""
    from transmla_tool.engines.vllm_engine import run_vllm

    _vllm_or_skip()
    outputs, heldout = smollm2_320
    prompts, windows = _prompts_and_windows(outputs["padded-576"], heldout, 256)
    refusals = {"CPU_MLA": "expected scalar type BFloat16 but found Float8_e4m3fn"}
    if torch.cpu._is_amx_tile_supported():
        refusals["AMX_MLA"] = "AMXMLAImpl only supports an unquantized \\(bf16\\) KV cache"
    for backend, message in refusals.items():
        with pytest.raises(RuntimeError, match=message):
            run_vllm(outputs["padded-576"], greedy=prompts, new_tokens=4, dtype="bfloat16", kv_cache_dtype="fp8",
                     max_model_len=1024, attention_backend=backend)
    expanded = dict(perplexity=windows, dtype="bfloat16", env={"VLLM_MLA_DISABLE": "1"}, max_model_len=1024)
    if not _cpu_takes_vllm_fp8_cache():
        with pytest.raises(RuntimeError, match="FP8 KV cache on CPU requires x86 with AVX-512 or AMX"):
            run_vllm(outputs["320"], kv_cache_dtype="fp8", **expanded)
        return
    runs = {kv: run_vllm(outputs["320"], kv_cache_dtype=kv, **expanded) for kv in ("auto", "fp8")}
    sizes = {kv: r["kv_cache"]["bytes_per_token_per_layer"] for kv, r in runs.items()}
    assert sizes["fp8"] == pytest.approx(sizes["auto"] / 2), sizes  # 9 heads x (64 + 64) x 2 (K, V) x 1 byte
    ppl = {kv: math.exp(r["nll_sum"] / r["nll_tokens"]) for kv, r in runs.items()}
    print(f"vLLM non-MLA path, bf16 model: perplexity bf16 cache {ppl['auto']:.3f}, fp8 cache {ppl['fp8']:.3f}; "
          f"cache {sizes}")
    assert ppl["fp8"] != ppl["auto"] and abs(ppl["fp8"] / ppl["auto"] - 1) < 0.10


@pytest.mark.parametrize("family,kwargs", [
    ("llama", dict(kv_heads=2)),
    ("llama", dict(kv_heads=1)),
    ("mistral", dict(kv_heads=2)),
    # Llama-3 scaling mapped onto DeepSeek YaRN (--target vllm); the rope config is what moves most between
    # transformers releases, so this one also runs on the oldest allowed
    pytest.param("llama", dict(kv_heads=2, rope_scaling=True), marks=pytest.mark.oldest),
    ("granite", dict(kv_heads=2)),  # multipliers folded
    ("phi3", dict(kv_heads=2)),  # fused tensors split
    ("qwen3", dict(kv_heads=2)),  # q/k norms approximated (the engine must still equal transformers)
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
    _check_kept_query_norm(out, family, width=128)  # hidden 128 < 4 x 64: the compacted q_lora path
    prompts, windows = _prompts_and_windows(out, text_file, 64)
    _check_vllm(out, prompts, windows, env={}, max_model_len=256)


def _check_kept_query_norm(out, family: str, width: int) -> None:
    """A Qwen3 conversion is served through its genuine query norm (q_lora path of that width, weight 1)."""
    import json

    from safetensors.torch import load_file

    if family == "qwen3":
        assert json.loads((out / "config.json").read_text())["q_lora_rank"] == width
        norm = load_file(out / "model.safetensors")["model.layers.0.self_attn.q_a_layernorm.weight"]
        assert torch.equal(norm, torch.ones(width))


def test_gemma_geglu_is_not_served_by_vllm(trained_model, text_file, tmp_path):
    """Gemma's GeGLU MLP converts exactly for transformers (hidden_act gelu_pytorch_tanh), but `--target vllm`
    refuses it, and the claim behind the refusal is checked by running vLLM on the transformers output: it does
    not reproduce transformers (an error, or other tokens / perplexity)."""
    _vllm_or_skip()
    src = trained_model("gemma", heads=4, head_dim=64, hidden=128, kv_heads=1)
    settings = dict(model=str(src), latent_dim=64, rope_dim=64, calib_data=str(text_file), calib_samples=8,
                    calib_seq_len=64, dtype="float32", device="cpu", progress=False, method=PRESETS["closed-form"],
                    pad_latent_to=512)
    with pytest.raises(UserError, match="hidden_act 'gelu_pytorch_tanh'"):
        convert(ConvertSettings(output=str(tmp_path / "refused"), target="vllm", **settings))
    out = tmp_path / "mla"
    convert(ConvertSettings(output=str(out), target="transformers", **settings))
    prompts, windows = _prompts_and_windows(out, text_file, 64)
    with pytest.raises((AssertionError, RuntimeError)) as failure:
        _check_vllm(out, prompts, windows, env={}, max_model_len=256)
    reason = [line for line in str(failure.value).splitlines() if "Error" in line or "!=" in line or "assert" in line]
    print(f"vLLM on the GeGLU checkpoint: {reason[-1] if reason else str(failure.value)[-300:]}")


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


@pytest.fixture(scope="module")
def qwen_bias_free(tmp_path_factory):
    """The engines' output of the real Qwen2.5: bias-free (its q/k/v biases folded, ops/bias_fold.py), 256 + 64 = 320
    of its 512 values, zero-padded to 512 + 64 (exact) so that vLLM's CPU MLA backend (576 only) takes it. A few
    refinement steps on 4096 tokens (more than its 1536 hidden channels, so that the constant direction the biases
    are folded through is not fitted to the calibration tokens alone): this checks that the engines compute what
    transformers computes on the checkpoint, not how good the conversion is (docs/qwen.md has that)."""
    import dataclasses

    from transmla_tool.assets import domain_documents
    from transmla_tool.registry import model_gguf

    try:
        directory, name = model_gguf("qwen2.5-coder-1.5b")
    except UserError as exc:  # `make test` fetches it (make models); a bare pytest run may not have
        pytest.skip(str(exc))
    root = tmp_path_factory.mktemp("qwen-engines")
    calib, heldout = root / "code.txt", root / "docs.txt"
    calib.write_text("\n\n".join(domain_documents("code")[:120]))
    heldout.write_text("\n\n".join(domain_documents("docs")[-60:]))
    out = root / "qwen-mla-320-padded-576"
    convert(ConvertSettings(
        model=directory, gguf_file=name, output=str(out), latent_dim=256, rope_dim=64, calib_data=str(calib),
        calib_samples=16, calib_seq_len=256, dtype="float32", device="cpu", progress=False, target="vllm",
        pad_latent_to=512, method=dataclasses.replace(PRESETS["default"], refine_steps=4, refine_windows=4)))
    yield out, heldout
    shutil.rmtree(root)  # 7 GB: test_real_qwen's full-rank conversion needs the room after this module


@pytest.mark.slow
def test_vllm_serves_the_bias_free_qwen(qwen_bias_free):
    """vLLM's own DeepSeek MLA path (CPU build) on the bias-free Qwen2.5 output: transformers' greedy tokens and
    perplexity, and a cache of one latent + rotary key per token per layer."""
    _vllm_or_skip()
    out, heldout = qwen_bias_free
    prompts, windows = _prompts_and_windows(out, heldout, 256, count=2)
    kv = _check_vllm(out, prompts, windows, env={}, max_model_len=512)["kv_cache"]
    if "error" not in kv:
        assert kv["bytes_per_token_per_layer"] == pytest.approx(576 * 4, rel=0.01), kv


# --- llama.cpp -------------------------------------------------------------------------------------

def _llamacpp_or_skip():
    from transmla_tool.engines.llamacpp import llama_cpp_bin

    try:
        return llama_cpp_bin("llama-perplexity")
    except UserError as exc:
        if os.environ.get("TRANSMLA_REQUIRE_ENGINES") == "1":
            raise
        pytest.skip(str(exc))

def _smollm2_closed_form_for_llamacpp(tmp_path, calib_samples: int, calib_seq_len: int):
    """SmolLM2 converted at 128 + 64 for llama.cpp with the closed form: (source dir, GGUF name, output, held-out)."""
    from transmla_tool.assets import lee_corpus, smollm2_gguf, split_documents

    _llamacpp_or_skip()
    model_dir, gguf = smollm2_gguf()
    calib, heldout = split_documents(lee_corpus(), tmp_path / "data")
    out = tmp_path / "mla"
    convert(ConvertSettings(model=model_dir, gguf_file=gguf, output=str(out), latent_dim=128, rope_dim=64,
                            calib_data=str(calib), calib_samples=calib_samples, calib_seq_len=calib_seq_len,
                            dtype="float32", device="cpu", progress=False, method=PRESETS["closed-form"],
                            target="llamacpp"))
    return model_dir, gguf, out, heldout


def _check_llamacpp(model_dir, gguf_file, text_file, ctx: int, chunks: int, prompt: str, flags=()) -> dict:
    """llama.cpp on our GGUF vs transformers on the checkpoint: perplexity computed the same way
    (llama-perplexity's chunks, second half scored) within 0.5%, and the same greedy text (llama-simple
    takes no rope flags, so a GGUF that needs them is checked on perplexity only)."""
    from transmla_tool.engines.llamacpp import greedy_text, perplexity, reference_perplexity

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = open(text_file).read()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
    engine = perplexity(gguf_file, text_file, ctx, chunks, list(flags))
    assert engine["chunks"] == chunks
    reference = reference_perplexity(model, ids, ctx, chunks)
    assert abs(engine["perplexity"] / reference - 1) < PPL_TOLERANCE, (reference, engine)
    if flags:
        print(f"{gguf_file}: perplexity transformers {reference:.4f}, llama.cpp {engine['perplexity']:.4f} with {flags}")
        return engine
    prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(prompt_ids, max_new_tokens=GREEDY_TOKENS, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    tokens = out.sequences[0, prompt_ids.shape[1]:].tolist()
    got = greedy_text(gguf_file, prompt, GREEDY_TOKENS)  # llama-simple ends with a newline
    equal = _greedy_agreement(tokenizer, prompt_ids[0].tolist(), tokens, out.scores, got.removesuffix("\n"))
    print(f"{gguf_file}: perplexity transformers {reference:.4f}, llama.cpp {engine['perplexity']:.4f}; greedy "
          f"{equal} of {len(tokens)} tokens equal{'' if equal == len(tokens) else ', then a tie'}; KV cache "
          f"{engine['kv_bytes_per_token_per_layer']:.1f} bytes per token per layer")
    return engine


TIE_NATS = 0.01  # a top-2 log-probability gap llama.cpp's f16 cache (its default in llama-simple) can flip


def _greedy_agreement(tokenizer, prompt, tokens, scores, engine_text) -> int:
    """How many of transformers' greedy tokens llama.cpp's text reproduces; every one must, unless the first
    difference is a tie: transformers' top two there are within TIE_NATS and llama.cpp took the runner-up
    (after which the continuations are different texts and no longer comparable)."""
    for i, token in enumerate(tokens):
        if engine_text.startswith(tokenizer.decode(prompt + tokens[: i + 1], skip_special_tokens=True)):
            continue
        top = scores[i][0].float().log_softmax(-1).topk(2)
        gap, runner_up = float(top.values[0] - top.values[1]), int(top.indices[1])
        prefix = tokenizer.decode(prompt + tokens[:i] + [runner_up], skip_special_tokens=True)
        assert gap < TIE_NATS and engine_text.startswith(prefix), (
            f"llama.cpp differs at generated token {i} where transformers' top-2 gap is {gap:.4f} nats "
            f"(not a tie, or not the runner-up): {engine_text!r}")
        return i
    expected = tokenizer.decode(prompt + tokens, skip_special_tokens=True)
    assert engine_text == expected, (engine_text, expected)
    return len(tokens)


@pytest.mark.slow
def test_llamacpp_serves_smollm2_f32_and_q8_0(smollm2_320, tmp_path):
    """SmolLM2 at 256 + 64 = 320 of 384: the exported f32 GGUF equals transformers; Q8_0 stays within
    2% of f32 when attn_kv_a_mqa is kept (llama-quantize --tensor-type, or export-gguf --outtype q8_0),
    and a plain Q8_0 of the whole file is what breaks without it."""
    from transmla_tool.engines.llamacpp import perplexity, quantize
    from transmla_tool.gguf_export import GGUFSettings, export_gguf

    _llamacpp_or_skip()
    outputs, heldout = smollm2_320
    f32 = tmp_path / "smollm2-320-f32.gguf"
    export_gguf(GGUFSettings(checkpoint=str(outputs["320"]), output=str(f32)))
    base = _check_llamacpp(outputs["320"], f32, heldout, 512, 4, "The Prime Minister said on Tuesday that")
    assert base["kv_bytes_per_token_per_layer"] == pytest.approx(320 * 2, abs=2)  # f16 cache of latent + rope
    kept = tmp_path / "q8_0-kept.gguf"
    quantize(f32, kept, "Q8_0", keep={"attn_kv_a_mqa": "bf16"})
    own = tmp_path / "q8_0-export.gguf"
    export_gguf(GGUFSettings(checkpoint=str(outputs["320"]), output=str(own), outtype="q8_0"))
    plain = tmp_path / "q8_0-plain.gguf"
    quantize(f32, plain, "Q8_0")
    ppl = {p.name: perplexity(p, heldout, 512, 4)["perplexity"] for p in (kept, own, plain)}
    print(f"llama.cpp perplexity f32 {base['perplexity']:.4f}, " + ", ".join(f"{k} {v:.4f}" for k, v in ppl.items()))
    assert abs(ppl[kept.name] / base["perplexity"] - 1) < 0.02
    assert abs(ppl[own.name] / base["perplexity"] - 1) < 0.02
    assert ppl[plain.name] > 2 * base["perplexity"]


@pytest.mark.parametrize("family,kwargs,target", [
    ("llama", dict(kv_heads=2), "transformers"),
    ("llama", dict(kv_heads=1), "transformers"),
    ("mistral", dict(kv_heads=2), "transformers"),
    # Llama-3 scaling written as DeepSeek YaRN; also on the oldest transformers allowed (as for vLLM above)
    pytest.param("llama", dict(kv_heads=2, rope_scaling=True), "vllm", marks=pytest.mark.oldest),
    ("granite", dict(kv_heads=2), "transformers"),
    ("phi3", dict(kv_heads=2), "transformers"),
    ("qwen3", dict(kv_heads=2), "transformers"),
])
def test_llamacpp_serves_tiny_families(trained_model, text_file, tmp_path, family, kwargs, target):
    """Tiny trained models, vocabulary built from tokenizer.json (--tokenizer-pre gpt-2): llama.cpp's
    perplexity and greedy text equal transformers'."""
    from transmla_tool.gguf_export import GGUFSettings, export_gguf

    _llamacpp_or_skip()
    src = trained_model(family, heads=4, head_dim=32, hidden=128, **kwargs)
    out = tmp_path / "mla"
    convert(ConvertSettings(model=str(src), output=str(out), latent_dim=48, rope_dim=16, calib_data=str(text_file),
                            calib_samples=8, calib_seq_len=64, dtype="float32", device="cpu", progress=False,
                            method=PRESETS["closed-form"], target=target,
                            pad_latent_to=304 if target == "vllm" else 0))  # vllm: latent + rope must be 320
    _check_kept_query_norm(out, family, width=128)
    gguf_file = tmp_path / "mla.gguf"
    flags = export_gguf(GGUFSettings(checkpoint=str(out), output=str(gguf_file), tokenizer_pre="gpt-2"))["run_flags"]
    assert bool(flags) == kwargs.get("rope_scaling", False)  # the fitted YaRN ramp must be passed at run time
    _check_llamacpp(out, gguf_file, text_file, 64, 4, "The river", flags)


def test_gemma_geglu_is_not_served_by_llamacpp(trained_model, text_file, tmp_path):
    """export-gguf refuses Gemma's GeGLU checkpoint, and the reason is checked by running llama.cpp: the GGUF
    the exporter would write (deepseek2 GGUFs carry no activation) computes the SiLU model -- its perplexity
    equals transformers' on the same weights with hidden_act silu, not the GeGLU model's."""
    import json
    import shutil

    from transmla_tool.engines.llamacpp import perplexity, reference_perplexity
    from transmla_tool.gguf_export import GGUFSettings, export_gguf

    _llamacpp_or_skip()
    src = trained_model("gemma", heads=4, head_dim=32, hidden=128, kv_heads=1)
    out = tmp_path / "mla"
    convert(ConvertSettings(model=str(src), output=str(out), latent_dim=16, rope_dim=32, calib_data=str(text_file),
                            calib_samples=8, calib_seq_len=64, dtype="float32", device="cpu", progress=False,
                            method=PRESETS["closed-form"], target="transformers"))
    with pytest.raises(UserError, match="applies SiLU"):
        export_gguf(GGUFSettings(checkpoint=str(out), output=str(tmp_path / "refused.gguf"), tokenizer_pre="gpt-2"))
    silu = tmp_path / "as-silu"
    shutil.copytree(out, silu)
    config = json.loads((silu / "config.json").read_text())
    config["hidden_act"] = "silu"
    (silu / "config.json").write_text(json.dumps(config))
    gguf_file = tmp_path / "silu.gguf"
    export_gguf(GGUFSettings(checkpoint=str(silu), output=str(gguf_file), tokenizer_pre="gpt-2"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor(tokenizer(open(text_file).read(), add_special_tokens=False).input_ids)
    engine = perplexity(gguf_file, text_file, 64, 4)["perplexity"]
    ref = {path.name: reference_perplexity(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
                                           ids, 64, 4) for path in (out, silu)}
    print(f"llama.cpp {engine:.4f}; transformers GeGLU {ref['mla']:.4f}, same weights as SiLU {ref['as-silu']:.4f}")
    to_silu, to_geglu = abs(engine / ref["as-silu"] - 1), abs(engine / ref["mla"] - 1)
    # the tiny model has memorized its text (perplexity ~1.2), so the two activations differ by ~0.1% only:
    # llama.cpp must sit on the SiLU model (1e-5 measured) and many times farther from the GeGLU one
    assert to_silu < 2e-4 and to_geglu > max(5 * to_silu, 5e-4), (to_silu, to_geglu)


@pytest.mark.slow
def test_eval_in_llamacpp(tmp_path):
    """`eval --engine llamacpp` on SmolLM2 (the original GGUF as shipped, the converted checkpoint
    exported on the fly): the KV cache llama.cpp allocates is 384 vs latent + rope values."""
    from transmla_tool.assets import lee_corpus, smollm2_gguf, split_documents
    from transmla_tool.evaluate.run import EvalSettings, run_eval

    _llamacpp_or_skip()
    model_dir, gguf = smollm2_gguf()
    calib, heldout = split_documents(lee_corpus(), tmp_path / "data")
    out = tmp_path / "mla"
    convert(ConvertSettings(model=model_dir, gguf_file=gguf, output=str(out), latent_dim=64, rope_dim=64,
                            calib_data=str(calib), calib_samples=4, calib_seq_len=128, dtype="float32", device="cpu",
                            progress=False, method=PRESETS["closed-form"], target="transformers"))
    report = run_eval(EvalSettings(original=model_dir, gguf_file=gguf, converted=str(out), data=str(heldout),
                                   output_dir=str(tmp_path / "report"), engine="llamacpp", seq_len=256,
                                   max_tokens=1024, contexts=[256], new_tokens=4, device="cpu", dtype="float32",
                                   progress=False))
    assert report["kv_cache"]["measured_values_per_token_per_layer"]["256"] == {"original": 384, "converted": 128}
    assert not report["kv_cache"]["warnings"]
    # the converted model's llama.cpp perplexity is the checkpoint's own (transformers on the same text, scored as
    # llama-perplexity scores it), so the ratio to the original reports the conversion, not an engine difference
    from transmla_tool.data import token_windows
    from transmla_tool.engines.llamacpp import reference_perplexity

    tokenizer = load_tokenizer(model_dir, gguf)
    windows = token_windows(str(heldout), tokenizer, 256, 4)
    text = tokenizer.decode(windows.reshape(-1).tolist(), skip_special_tokens=True)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    chunks = report["perplexity"]["tokens"] // (256 - 1 - 256 // 2)  # llama-perplexity's chunks of the text
    reference = reference_perplexity(model, ids, 256, chunks)
    assert abs(report["perplexity"]["converted"] / reference - 1) < PPL_TOLERANCE, (reference, report["perplexity"])
    assert min(report["decode_tokens_per_s"]["256"].values()) > 0
    assert "Measured in llama.cpp" in (tmp_path / "report" / "report.md").read_text()
    # --gguf-type f32: the original re-typed (Q4_1 -> F32 holds the same weights), both files f32, so the decode
    # speeds compare like with like; its perplexity stays near the Q4_1 file's (llama.cpp's quantized matmuls
    # also round the activations, so not to the last digit)
    same = run_eval(EvalSettings(original=model_dir, gguf_file=gguf, converted=str(out), data=str(heldout),
                                 output_dir=str(tmp_path / "report-f32"), engine="llamacpp", gguf_type="f32",
                                 seq_len=256, max_tokens=1024, contexts=[256], new_tokens=4, device="cpu",
                                 dtype="float32", progress=False))
    types = {k: same["models"][k]["engine"]["file_type"] for k in ("original", "converted")}
    assert types == {"original": "ALL_F32", "converted": "ALL_F32"}, types
    native, retyped = report["perplexity"]["original"], same["perplexity"]["original"]
    print(f"original perplexity in llama.cpp: Q4_1 file {native:.4f}, re-typed F32 {retyped:.4f}")
    assert abs(retyped / native - 1) < 0.05
    assert "re-typed by llama-quantize" in (tmp_path / "report-f32" / "report.md").read_text()


@pytest.mark.slow
def test_eval_in_llamacpp_cache_types(tmp_path, monkeypatch):
    """`eval --engine llamacpp --cache-types`: both models under llama.cpp's cache types. The bytes it allocates
    are the types' (SmolLM2: 2 x 192 values; the converted row 128 + 64, values a view of it), the latent takes a
    q8_0 cache within 1% of its f16 cache, what ops/kv_quant.py predicts for a q4_0 cache is what llama.cpp
    does to the converted model (its perplexity through our simulated cache, scored as llama-perplexity scores), and
    llama.cpp rotates the original's quantized K cache but not the converted model's."""
    from transmla_tool.evaluate.run import EvalSettings, run_eval

    model_dir, gguf, out, heldout = _smollm2_closed_form_for_llamacpp(tmp_path, 8, 256)
    report = run_eval(EvalSettings(original=model_dir, gguf_file=gguf, converted=str(out), data=str(heldout),
                                   output_dir=str(tmp_path / "report"), engine="llamacpp", gguf_type="f32",
                                   seq_len=512, max_tokens=4096, contexts=[512], new_tokens=2, device="cpu",
                                   dtype="float32", progress=False, cache_types=["q8_0", "q4_0", "q8_0/q4_0"]))
    rows = {(r["model"], r["cache"]): r for r in report["cache_types"]}
    print({k: (round(v["bytes_per_token_per_layer"], 1), round(v["perplexity"], 3)) for k, v in rows.items()})
    expected = {("original", "f16"): 768, ("original", "q8_0"): 408, ("original", "q4_0"): 216,
                ("original", "q8_0/q4_0"): 312, ("converted", "q8_0"): 204, ("converted", "q4_0"): 108}
    for key, size in expected.items():
        assert rows[key]["bytes_per_token_per_layer"] == pytest.approx(size, abs=1.0), key
    assert ("converted", "q8_0/q4_0") not in rows  # MLA in llama.cpp: one type for its one cached row
    # the CPU kernels llama.cpp printed are recorded with its scores (a quantized cache's perplexity moves with them)
    kernels = report["environment"]["engine_cpu_kernels"]
    assert kernels not in ("", "unknown") and f"CPU kernels {kernels}" in (tmp_path / "report" / "report.md").read_text()
    assert rows[("original", "f16")]["ratio"] == 1.0
    q8, q4 = rows[("converted", "q8_0")]["perplexity"], rows[("converted", "q4_0")]["perplexity"]
    f16 = report["perplexity"]["converted"]  # the default (f16) cache, flash attention off
    assert abs(q8 / f16 - 1) < 0.01, (f16, q8)
    assert q4 > q8  # q4_0 does cost something: the types reach the engine
    assert "Perplexity per KV-cache byte" in (tmp_path / "report" / "report.md").read_text()
    # The simulated q4_0 cache healing and refine_cache train through (heal.model.NaturalAttention, whose cached row
    # [normed latent | rotated rope key] keeps each rotary pair side by side, as llama.cpp's deepseek2 stores it)
    # predicts llama.cpp's q4_0 number. Within a tenth of what q4_0 costs: the row with transformers' rope layout
    # (each pair's halves split into different 32-value blocks) missed by a third of it (62.53 against 66.11).
    from transmla_tool.data import token_windows
    from transmla_tool.engines.llamacpp import reference_perplexity
    from transmla_tool.heal.model import to_natural

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    model.config.use_cache = False
    to_natural(model, "q4_0")
    tokenizer = load_tokenizer(model_dir, gguf)
    windows = token_windows(str(heldout), tokenizer, 512, 8)
    text = tokenizer.decode(windows.reshape(-1).tolist(), skip_special_tokens=True)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
    chunks = report["perplexity"]["tokens"] // (512 - 1 - 512 // 2)
    simulated = reference_perplexity(model, ids, 512, chunks)
    print(f"converted with a q4_0 cache: llama.cpp {q4:.4f}, simulated in transformers {simulated:.4f}, f16 {f16:.4f}")
    assert all(layer.self_attn.cache_reads == chunks for layer in model.model.layers)  # the simulated cache was read
    assert abs(simulated / q4 - 1) < 0.1 * abs(q4 / f16 - 1), (simulated, q4, f16)
    # llama.cpp rotates a quantized K cache (Walsh-Hadamard on queries and keys) for the original's attention but not
    # for deepseek2's MLA: what docs/serving.md and docs/frontier.md say of the original's q4_0 rows
    from transmla_tool.engines.llamacpp import cache_flags, perplexity
    from transmla_tool.gguf_export import GGUFSettings, export_gguf

    converted_gguf = tmp_path / "mla.gguf"
    export_gguf(GGUFSettings(checkpoint=str(out), output=str(converted_gguf), outtype="f32",
                             tokenizer_gguf=str(Path(model_dir) / gguf)))
    text_file = tmp_path / "windows.txt"
    text_file.write_text(text)
    q4_0 = {}
    for rotation in ("0", "1"):
        monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", rotation)
        q4_0[rotation] = [perplexity(model_file, text_file, 512, 4, flags=cache_flags("q4_0"))["perplexity"]
                          for model_file in (Path(model_dir) / gguf, converted_gguf)]
    print(f"llama.cpp q4_0 (original, converted): rotation on {q4_0['0']}, LLAMA_ATTN_ROT_DISABLE=1 {q4_0['1']}")
    assert q4_0["0"][0] < q4_0["1"][0]  # the original's keys are rotated, and it pays
    assert q4_0["0"][1] == q4_0["1"][1]  # the MLA cache is not (this fails, and the docs must change, when it is)


GGML_ROUND_TRIP = r"""
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
void quantize_row_iq4_nl_ref(const float *x, void *y, int64_t k);
void dequantize_row_iq4_nl(const void *x, float *y, int64_t k);
int main(int argc, char **argv) { /* rows of k floats on stdin -> the same rows stored as iq4_nl and read back */
    int k = atoi(argv[1]);
    float *x = malloc(k * sizeof(float)), *y = malloc(k * sizeof(float));
    void *q = malloc(k);
    while (fread(x, sizeof(float), k, stdin) == (size_t)k) {
        quantize_row_iq4_nl_ref(x, q, k);
        dequantize_row_iq4_nl(q, y, k);
        fwrite(y, sizeof(float), k, stdout);
    }
    return 0;
}
"""


def test_iq4_nl_simulation_matches_ggml(tmp_path):
    """ops/kv_quant.py's iq4_nl is bit-equal to the quantizer llama.cpp writes an iq4_nl KV cache with
    (quantize_row_iq4_nl_ref, the CPU backend's from_float for the type) and its dequantizer: a C program linked
    against the ggml that `make engines` built, on values with outliers, a zero block and a near-zero block."""
    import shutil
    import subprocess

    import numpy as np

    from transmla_tool.ops.kv_quant import quantize_dequantize

    build = _llamacpp_or_skip().parents[1]
    library, headers, compiler = build / "ggml" / "src" / "libggml-base.a", build.parent / "ggml" / "include", \
        shutil.which("cc") or shutil.which("gcc")
    if not library.exists() or compiler is None:
        if os.environ.get("TRANSMLA_REQUIRE_ENGINES") == "1":
            raise AssertionError(f"no {library} or no C compiler: build llama.cpp with `make engines`")
        pytest.skip(f"no {library} or no C compiler")
    (tmp_path / "round_trip.c").write_text(GGML_ROUND_TRIP)
    program = tmp_path / "round_trip"
    subprocess.run([compiler, "-O1", f"-I{headers}", str(tmp_path / "round_trip.c"), str(library), "-lm", "-lpthread",
                    "-lstdc++", "-fopenmp", "-o", str(program)], check=True, capture_output=True)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 192, generator=gen) * torch.rand(4096, 1, generator=gen) * 5
    x[3, 5], x[4, :32], x[5, :32] = 40.0, 0.0, 1e-20
    run = subprocess.run([str(program), "192"], input=x.numpy().tobytes(), capture_output=True, check=True)
    reference = np.frombuffer(run.stdout, np.float32).reshape(x.shape)
    ours = quantize_dequantize(x, "iq4_nl").numpy()
    assert np.array_equal(ours, reference), int((ours != reference).sum())
    assert not np.array_equal(ours, x.numpy())


@pytest.mark.slow
def test_sweep_in_llamacpp_recommends_from_measured_points(tmp_path):
    """`sweep --engine llamacpp --max-cache-bytes`: the latent at each rope dim (llama.cpp runs a 32-value rotary key
    too) and the original scored in llama.cpp under each cache type, bytes as allocated, and the recommendation is
    the best measured point that fits the budget. One latent (the grid over latents is the transformers sweep's test):
    each conversion scored adds ~70 s of a 2-core CI machine."""
    import json

    from transmla_tool.assets import lee_corpus, smollm2_gguf, split_documents
    from transmla_tool.cli import main

    _llamacpp_or_skip()
    model_dir, gguf = smollm2_gguf()
    calib, heldout = split_documents(lee_corpus(), tmp_path / "data")
    out = tmp_path / "sweep"
    assert main(["sweep", "--model", model_dir, "--gguf-file", gguf, "--latent-dims", "64", "--rope-dim", "64,32",
                 "--output-dir", str(out),
                 "--calib-data", str(calib), "--calib-samples", "8", "--calib-seq-len", "256", "--data", str(heldout),
                 "--seq-len", "512", "--max-tokens", "2048", "--method", "closed-form", "--target", "llamacpp",
                 "--engine", "llamacpp", "--cache-types", "f16,q8_0,q4_0", "--max-cache-bytes", "230",
                 "--max-ratio", "1e9", "--device", "cpu", "--dtype", "float32", "--no-progress"]) == 0
    result = json.loads((out / "sweep.json").read_text())
    sizes = {key: {t: round(m["bytes"]) for t, m in types.items()} for key, types in result["cache_types"].items()}
    assert sizes == {"original": {"f16": 768, "q8_0": 408, "q4_0": 216},
                     "64+64": {"f16": 256, "q8_0": 136, "q4_0": 72},
                     "64+32": {"f16": 192, "q8_0": 102, "q4_0": 54}}, sizes
    reference = result["cache_types"]["original"]["f16"]["perplexity"]
    fits = [(m["perplexity"] / reference, key, t) for key, types in result["cache_types"].items()
            for t, m in types.items() if m["bytes"] <= 230]
    best = min(fits)
    point = result["recommendation"]["point"]
    expected = (None, None) if best[1] == "original" else tuple(int(v) for v in best[1].split("+"))
    assert (point["cache"], point["latent_dim"], point["rope_dim"]) == (best[2], *expected)
    print(result["recommendation"]["advice"])
    assert "Recommendation" in (out / "sweep.md").read_text() and (out / "sweep.png").exists()


def test_pre_tokenizer_names_are_llama_cpps():
    """export-gguf's list of pre-tokenizer names is the one the built llama.cpp's loader accepts."""
    import re

    from transmla_tool.gguf_tokenizer import LLAMA_CPP_PRE_TOKENIZERS

    source = _llamacpp_or_skip().parents[2] / "src" / "llama-vocab.cpp"
    known = set(re.findall(r'tokenizer_pre == "([^"]+)"', source.read_text()))
    assert known and set(LLAMA_CPP_PRE_TOKENIZERS) == known, sorted(known ^ set(LLAMA_CPP_PRE_TOKENIZERS))


@pytest.mark.slow
def test_eval_tasks_in_llamacpp_under_each_cache(tmp_path, monkeypatch):
    """`eval --engine llamacpp --tasks --cache-types`: lm-eval's stock task answered by llama.cpp for both models under
    each cache type (the converted model under the K type), on the rows lm-eval picks, with the data read offline."""
    from transmla_tool.evaluate.run import EvalSettings, run_eval

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model_dir, gguf, out, heldout = _smollm2_closed_form_for_llamacpp(tmp_path, 4, 128)
    report = run_eval(EvalSettings(original=model_dir, gguf_file=gguf, converted=str(out), data=str(heldout),
                                   output_dir=str(tmp_path / "report"), engine="llamacpp", gguf_type="f32",
                                   seq_len=128, max_tokens=512, contexts=[128], new_tokens=2, device="cpu",
                                   dtype="float32", progress=False, cache_types=["f16", "q4_0"], tasks=["arc_easy"],
                                   limit=8))
    assert set(report["lm_eval_by_cache"]) == {"f16", "q4_0"}
    info = report["lm_eval_tasks"]["arc_easy"]
    assert info["rows"] == 8 and info["rows_available"] == 570 and info["dataset"] == ["arrow"]
    for entry in ("f16", "q4_0"):
        cell = report["lm_eval_by_cache"][entry]["arc_easy"]["acc"]
        assert 0 <= cell["original"] <= 1 and cell["paired"]
    assert "Under the q4_0 cache (llama.cpp)" in (tmp_path / "report" / "report.md").read_text()


@pytest.mark.slow
def test_llamacpp_serves_the_bias_free_qwen(qwen_bias_free, tmp_path):
    """llama.cpp's deepseek2 on the same checkpoint exported as an f32 GGUF: transformers' perplexity and greedy
    text."""
    from transmla_tool.gguf_export import GGUFSettings, export_gguf

    _llamacpp_or_skip()
    out, heldout = qwen_bias_free
    gguf = tmp_path / "qwen-mla-f32.gguf"
    export_gguf(GGUFSettings(checkpoint=str(out), output=str(gguf)))
    engine = _check_llamacpp(out, gguf, heldout, 256, 2, "def fibonacci(n):")
    assert engine["kv_bytes_per_token_per_layer"] == pytest.approx(576 * 2, abs=2)  # f16 cache of latent + rope
