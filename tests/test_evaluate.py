"""Evaluation and sweep on tiny random models."""

from __future__ import annotations

import json

import pytest
import torch

from transmla_tool.cli import main
from transmla_tool.evaluate.cache import measure_context
from helpers import build_cloze_task
from transmla_tool.evaluate.models import load_model
from transmla_tool.errors import UserError
from transmla_tool.evaluate.run import EvalSettings, run_eval


@pytest.fixture(scope="module")
def converted_pair(make_model, text_file, tmp_path_factory):
    from transmla_tool.convert import ConvertSettings, convert

    src = make_model("llama", kv_heads=2, layers=2)
    out = tmp_path_factory.mktemp("eval") / "mla"
    convert(ConvertSettings(model=str(src), output=str(out), latent_dim=16, rope_dim=8, calib_data=str(text_file),
                            calib_samples=8, calib_seq_len=64, dtype="float32", device="cpu", progress=False))
    return src, out


@pytest.mark.parametrize("which", ["source", "converted"])
def test_measured_cache_equals_analytic(converted_pair, which):
    """The bytes transformers' cache really holds match the architecture's formula for both models:
    2*G*D for GQA, kv_lora_rank + qk_rope_head_dim for the DeepSeek-V3 output (the latent is cached,
    not expanded K/V)."""
    src, out = converted_pair
    model = load_model(str(src if which == "source" else out), None, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 300, (1, 100))
    result = measure_context(model, ids, new_tokens=3, chunk=32)
    assert result["measured_bytes"] == result["analytic_bytes"]
    timing = result["decode"]["default"]
    assert timing["steps"] == 3 and timing["tokens_per_s"] == pytest.approx(1e3 / timing["step_ms_median"])
    expected = 2 * 2 * 16 if which == "source" else 16 + 8
    assert result["measured_values_per_token_per_layer"] == pytest.approx(expected)
    assert result["analytic_bytes"] == expected * 2 * 100 * 4  # per token per layer x layers x context x fp32


def test_eval_report(converted_pair, text_file, tmp_path):
    src, out = converted_pair
    tasks = build_cloze_task(str(text_file), tmp_path / "tasks", name="tiny_cloze", examples=12)
    settings = EvalSettings(
        original=str(src), converted=str(out), output_dir=str(tmp_path / "report"), data=str(text_file),
        seq_len=64, max_tokens=640, contexts=[64, 200], new_tokens=4, prefill_chunk=50,
        tasks=["tiny_cloze"], include_path=str(tasks), limit=12, device="cpu", progress=False,
    )
    report = run_eval(settings)
    saved = json.loads((tmp_path / "report" / "report.json").read_text())
    assert saved["perplexity"]["original"] == pytest.approx(report["perplexity"]["original"])
    ppl = saved["perplexity"]
    assert ppl["ratio"] == pytest.approx(ppl["converted"] / ppl["original"])
    assert ppl["tokens"] == 10 * 63
    cache = saved["kv_cache"]
    assert cache["values_per_token_per_layer"] == {"original": 64, "converted": 24}
    for ctx in ("64", "200"):
        measured = cache["measured_bytes"][ctx]
        assert measured["converted"] / measured["original"] == pytest.approx(24 / 64)
        assert measured == cache["analytic_bytes"][ctx]
        speeds = saved["decode_tokens_per_s"][ctx]
        assert set(speeds) == {"original", "converted", "converted_absorbed"} and min(speeds.values()) > 0
        assert saved["decode_steps"][ctx]["converted_absorbed"]["warmup_steps"] == 2
    assert not cache["warnings"]
    acc = saved["lm_eval"]["tiny_cloze"]["acc"]
    assert 0.0 <= acc["original"] <= 1.0 and 0.0 <= acc["converted"] <= 1.0
    assert acc["delta"] == pytest.approx(acc["converted"] - acc["original"])
    for name in ("report.md", "cache_bytes.png", "decode_speed.png", "scores.png"):
        assert (tmp_path / "report" / name).stat().st_size > 0
    assert "tiny_cloze" in (tmp_path / "report" / "report.md").read_text()
    assert saved["plot_titles"]["cache_bytes.png"] == "KV cache held by transformers"
    # the same report as if measured in another engine names that engine, not transformers
    from transmla_tool.evaluate.report import plots

    other = dict(saved, environment=dict(saved["environment"], engine="llama.cpp 0.5.0-dev"))
    plots(other, tmp_path)
    assert other["plot_titles"] == {"cache_bytes.png": "KV cache held by llama.cpp 0.5.0-dev",
                                    "decode_speed.png": "Greedy decode speed in llama.cpp 0.5.0-dev (batch 1)"}


def test_eval_cli_rejects_missing_converted(capsys, converted_pair, tmp_path, text_file):
    src, _ = converted_pair
    code = main(["eval", "--original", str(src), "--converted", str(tmp_path / "nope"), "--output-dir",
                 str(tmp_path / "r"), "--data", str(text_file), "--device", "cpu"])
    assert code == 2 and "is not a directory; pass the directory transmla-tool convert wrote" in capsys.readouterr().err


def test_sweep_is_monotone_where_it_must_be(trained_model, text_file, tmp_path):
    """A trained MQA model with rope_dim = head_dim loses nothing to RoPE decoupling, and the closed-form
    latent (values only) is a nested PCA basis: perplexity falls as the latent grows and reaches the
    original's at full rank (16)."""
    src = trained_model("llama", kv_heads=1)
    code = main(["sweep", "--model", str(src), "--latent-dims", "2,4,8,16", "--rope-dim", "16",
                 "--data", str(text_file), "--calib-samples", "8", "--calib-seq-len", "64", "--seq-len", "64",
                 "--max-tokens", "1280", "--output-dir", str(tmp_path / "sweep"), "--device", "cpu",
                 "--dtype", "float32", "--method", "closed-form", "--no-progress"])
    assert code == 0
    result = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    ppl = [p["perplexity"] for p in result["points"]]
    assert all(b <= a * 1.01 for a, b in zip(ppl, ppl[1:])), ppl
    assert ppl[0] > 1.05 * ppl[-1], ppl
    assert ppl[-1] == pytest.approx(result["original"]["perplexity"], rel=1e-4)
    assert result["eval_windows_skipped"] == 9  # calibration windows never scored
    assert [p["measured_values_per_token_per_layer"] for p in result["points"]] == [18, 20, 24, 32]
    assert (tmp_path / "sweep" / "sweep.png").exists()
    assert not (tmp_path / "sweep" / "checkpoints").exists()


def test_eval_refuses_an_absorbed_timing_the_latent_path_did_not_make(converted_pair, text_file, tmp_path,
                                                                    monkeypatch):
    """If the absorbed forward falls back to the stock path (as it did when transformers renamed the cache
    argument), eval stops instead of reporting the stock timing as `converted_absorbed`."""
    from transmla_tool.runtime import absorbed

    src, out = converted_pair
    monkeypatch.setattr(absorbed, "find_cache", lambda args, kwargs: None)
    settings = EvalSettings(original=str(src), converted=str(out), output_dir=str(tmp_path / "r"), data=str(text_file),
                            seq_len=64, max_tokens=128, contexts=[64], new_tokens=2, device="cpu", progress=False)
    with pytest.raises(RuntimeError, match="latent path in 0 of 8 layer steps"):
        run_eval(settings)


@pytest.mark.parametrize("flags,needle", [
    (["--eval-batch-size", "-1"], "--eval-batch-size must be >= 1"),
    (["--eval-batch-size", "0"], "--eval-batch-size must be >= 1"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1"),
    (["--seq-len", "1"], "--seq-len must be >= 2"),
    (["--max-tokens", "10"], "less than one window"),
    (["--cache-types", "q4_0"], "'q4_0' is not one of transformers' caches"),  # each engine its own cache types
    (["--cache-types", "quanto-int4", "--engine", "vllm"], "--kv-cache-dtype fp8"),
])
def test_eval_numbers_checked_before_loading(capsys, converted_pair, tmp_path, text_file, monkeypatch, flags, needle):
    from transmla_tool.evaluate.backends import transformers as backend

    monkeypatch.setattr(backend, "load_model", lambda *a, **k: pytest.fail("loaded a model before checking its flags"))
    src, out = converted_pair
    code = main(["eval", "--original", str(src), "--converted", str(out), "--output-dir", str(tmp_path / "r"),
                 "--data", str(text_file), "--device", "cpu", *flags])
    assert code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_eval_in_llamacpp_refuses_a_cache_type_llama_cpp_would_not_allocate(make_model, convert_tiny, text_file,
                                                                            tmp_path, monkeypatch, capsys):
    """A quantized cache type for a converted model whose latent or rotary key is not a multiple of 32 (llama.cpp
    refuses it when it builds the context) stops eval before either model is tokenized for, exported or measured.
    24 + 8 fills one 32-value block per token, and llama.cpp still refuses it: its values are read from the latent."""
    import transmla_tool.evaluate.run as run_module
    from transmla_tool.evaluate.backends import llamacpp as backend
    from transmla_tool.methods import PRESETS

    monkeypatch.setattr(backend, "evaluate_in_llamacpp", lambda *a, **k: pytest.fail("measured before checking"))
    monkeypatch.setattr(run_module, "token_windows", lambda *a, **k: pytest.fail("read the data before checking"))
    src = make_model("llama", kv_heads=2, layers=2)
    out, _, _ = convert_tiny(src, latent_dim=24, rope_dim=8, method=PRESETS["closed-form"], target="transformers")
    capsys.readouterr()  # the conversion's own output
    code = main(["eval", "--original", str(src), "--converted", str(out), "--output-dir", str(tmp_path / "r"),
                 "--data", str(text_file), "--engine", "llamacpp", "--cache-types", "f16,q8_0"])
    err = capsys.readouterr().err
    assert code == 2 and "--cache-types q8_0 for the converted model (latent 24 + rope 8)" in err
    assert "is not a multiple of 32" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_eval_in_vllm_refuses_what_vllm_would_serve_as_another_model(make_model, convert_tiny, text_file, tmp_path,
                                                                      monkeypatch, capsys):
    """A checkpoint with attention biases (vLLM drops them) is refused before anything runs, instead of
    reporting the perplexity of the model vLLM really loads as the conversion's."""
    import sys

    monkeypatch.setenv("TRANSMLA_VLLM_PYTHON", sys.executable)  # any existing interpreter: the check comes first
    src = make_model("qwen2", kv_heads=2)
    out, _, _ = convert_tiny(src, latent_dim=24, rope_dim=8, target="transformers", biases="keep")
    code = main(["eval", "--original", str(src), "--converted", str(out), "--output-dir", str(tmp_path / "r"),
                 "--data", str(text_file), "--engine", "vllm", "--seq-len", "64", "--max-tokens", "128"])
    err = capsys.readouterr().err
    assert code == 2 and "vLLM does not serve" in err and "attention biases" in err


def test_eval_in_vllm_checks_the_engine_before_any_work(converted_pair, text_file, tmp_path, monkeypatch, capsys):
    from transmla_tool.evaluate.backends import vllm as backend

    monkeypatch.setenv("TRANSMLA_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    monkeypatch.setattr(backend, "_as_directory", lambda *a: pytest.fail("prepared a model before finding vLLM"))
    src, out = converted_pair
    code = main(["eval", "--original", str(src), "--converted", str(out), "--output-dir", str(tmp_path / "r"),
                 "--data", str(text_file), "--engine", "vllm", "--seq-len", "64", "--max-tokens", "128"])
    assert code == 2 and "no vLLM environment" in capsys.readouterr().err


def test_eval_in_llamacpp_passes_the_export_run_flags(converted_pair, text_file, tmp_path, monkeypatch):
    """The YaRN ramp a Llama-3 conversion needs at run time (export-gguf's run_flags) reaches llama-perplexity."""
    from transformers import AutoTokenizer

    from transmla_tool import gguf_export
    from transmla_tool.engines import llamacpp
    from transmla_tool.evaluate.backends.llamacpp import evaluate_in_llamacpp

    src, out = converted_pair
    flags = ["--yarn-beta-fast", "24.5", "--yarn-beta-slow", "1.25"]
    seen = {}
    monkeypatch.setattr(gguf_export, "export_gguf", lambda s: {"run_flags": flags})
    monkeypatch.setattr(llamacpp, "perplexity", lambda *a, **k: seen.update(flags=k.get("flags")) or {
        "perplexity": 10.0, "chunks": 2, "kv_cache_mib": 1.0, "kv_cells": 64, "kv_layers": 2,
        "kv_bytes_per_token_per_layer": 48.0, "cpu_kernels": "SSE3 AVX AVX2"})
    monkeypatch.setattr(llamacpp, "decode_speed", lambda *a, **k: {"tokens_per_s": 5.0, "build": "x"})
    monkeypatch.setattr(llamacpp, "llama_cpp_version", lambda: "llama.cpp test")
    monkeypatch.setattr(engine_module(), "_gguf_file_type", lambda path: "ALL_F32")
    settings = EvalSettings(original=str(src), gguf_file="model.gguf", converted=str(out), output_dir=str(tmp_path),
                            seq_len=64, contexts=[64], progress=False)
    tokenizer = AutoTokenizer.from_pretrained(src)
    result = evaluate_in_llamacpp("converted", str(out), None, settings, torch.randint(3, 300, (2, 64)), tokenizer,
                                  str(tmp_path))
    assert seen["flags"] == flags and result["engine"]["run_flags"] == flags
    assert result["engine"]["version"] == "llama.cpp test" and result["engine"]["cpu_kernels"] == "SSE3 AVX AVX2"


def engine_module():
    from transmla_tool.evaluate.backends import llamacpp

    return llamacpp


def test_sweep_converts_as_convert_does(make_model, text_file, tmp_path):
    """sweep's default is convert's (--target vllm: Qwen2's biases dropped); each point is the checkpoint
    `convert` writes with the same flags (tensor for tensor), and --target transformers keeps the biases."""
    from safetensors.torch import load_file

    src = make_model("qwen2", kv_heads=2)
    common = ["--model", str(src), "--calib-data", str(text_file), "--calib-samples", "8", "--calib-seq-len", "64",
              "--rope-dim", "8", "--device", "cpu", "--dtype", "float32", "--set", "refine_steps=2", "--no-progress"]
    # (a few refinement steps: a bias-free output of a biased source without refinement is refused)
    sweep_args = ["--latent-dims", "24", "--data", str(text_file), "--seq-len", "64", "--max-tokens", "640",
                  "--keep-checkpoints"]
    assert main(["sweep", *common, *sweep_args, "--output-dir", str(tmp_path / "s")]) == 0
    result = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert result["conversion"] == {"target": "vllm", "biases": "auto"}
    assert result["points"][0]["attention_bias"] is False
    # 24 + 8 is no size vLLM serves: convert --target llamacpp writes the same bias-free conversion
    assert main(["convert", *common, "--latent-dim", "24", "--target", "llamacpp", "--output", str(tmp_path / "c")]) == 0
    swept = load_file(tmp_path / "s" / "checkpoints" / "latent24" / "model.safetensors")
    converted = load_file(tmp_path / "c" / "model.safetensors")
    assert swept.keys() == converted.keys() and all(torch.equal(swept[k], converted[k]) for k in swept)
    assert "--target vllm --biases auto" in (tmp_path / "s" / "sweep.md").read_text()

    assert main(["sweep", *common, *sweep_args, "--target", "transformers", "--output-dir", str(tmp_path / "t")]) == 0
    assert json.loads((tmp_path / "t" / "sweep.json").read_text())["points"][0]["attention_bias"] is True


def test_failed_sweep_leaves_nothing_behind(converted_pair, text_file, tmp_path, monkeypatch):
    from transmla_tool import sweep

    src, _ = converted_pair
    args = ["sweep", "--model", str(src), "--latent-dims", "16", "--rope-dim", "8", "--data", str(text_file),
            "--calib-samples", "8", "--calib-seq-len", "64", "--seq-len", "64", "--max-tokens", "640",
            "--output-dir", str(tmp_path / "deep" / "s"), "--device", "cpu", "--method", "closed-form",
            "--no-progress"]

    def broken_scoring(*a, **k):
        raise RuntimeError("scoring failed")

    monkeypatch.setattr(sweep, "_evaluate", broken_scoring)
    with pytest.raises(RuntimeError, match="scoring failed"):
        main(args)
    assert not (tmp_path / "deep").exists()
    monkeypatch.undo()
    assert main(args) == 0  # no --overwrite needed after a failure


def test_sweep_checks_scoring_flags_first(converted_pair, text_file, tmp_path, capsys):
    src, _ = converted_pair
    code = main(["sweep", "--model", str(src), "--latent-dims", "16", "--data", str(text_file), "--eval-batch-size",
                 "0", "--output-dir", str(tmp_path / "s")])
    assert code == 2 and "--eval-batch-size must be >= 1" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("which", ["source", "converted"])
def test_perplexity_through_transformers_caches(converted_pair, which):
    """Perplexity read through transformers' caches, chunk by chunk: the exact dynamic cache gives the plain
    forward's number and holds 4 bytes per cached value (fp32); the quantized caches change the number and hold
    what their formats say (fp8: one byte a value and one fp32 scale per tensor)."""
    from transmla_tool.evaluate.perplexity import perplexity
    from transmla_tool.evaluate.quantized_cache import cache_perplexity

    from transmla_tool.evaluate.quantized_cache import _has_fp8_backend, parse_transformers_cache_types

    src, out = converted_pair
    model = load_model(str(src if which == "source" else out), None, torch.float32, torch.device("cpu"))
    # 3 chunks a window: every transformers version we allow ends it with the whole cache flushed to its store
    windows = torch.randint(3, 300, (3, 48), generator=torch.Generator().manual_seed(0))
    values = 2 * 2 * 16 if which == "source" else 16 + 8
    plain = perplexity(model, windows, progress=False)["perplexity"]
    exact = cache_perplexity(model, windows, "dynamic", chunk=16, progress=False)
    assert exact["perplexity"] == pytest.approx(plain, rel=1e-5) and exact["tokens"] == 3 * 47
    assert exact["bytes"] == values * 4
    int4 = cache_perplexity(model, windows, "quanto-int4", chunk=16, progress=False)
    assert int4["bytes"] == pytest.approx(values * (0.5 + 8 / 64))  # packed codes + fp32 scale and shift per 64
    assert int4["perplexity"] != exact["perplexity"] and int4["perplexity"] == pytest.approx(plain, rel=0.2)
    if not _has_fp8_backend():  # transformers 5.15: refused with the reason, before any work
        with pytest.raises(UserError, match="has no fp8 QuantizedCache backend"):
            parse_transformers_cache_types(["fp8"])
        return
    fp8 = cache_perplexity(model, windows, "fp8", chunk=16, progress=False)
    assert fp8["bytes"] == pytest.approx(values + 2 * 4 / 48)  # keys and values: one fp32 scale each per window
    assert fp8["perplexity"] != exact["perplexity"] and fp8["perplexity"] == pytest.approx(plain, rel=0.05)


def test_eval_transformers_cache_types(converted_pair, text_file, tmp_path):
    src, out = converted_pair
    settings = EvalSettings(original=str(src), converted=str(out), output_dir=str(tmp_path / "report"),
                            data=str(text_file), seq_len=64, max_tokens=256, contexts=[64], new_tokens=2,
                            device="cpu", progress=False, cache_types=["quanto-int4", "hqq-int4"])
    report = run_eval(settings)
    rows = {(r["model"], r["cache"]): r for r in report["cache_types"]}
    assert set(rows) == {(m, c) for m in ("original", "converted") for c in ("dynamic", "quanto-int4", "hqq-int4")}
    assert report["cache_types_reference"] == "dynamic"
    assert rows["original", "dynamic"]["ratio"] == 1.0
    assert rows["original", "dynamic"]["perplexity"] == pytest.approx(report["perplexity"]["original"], rel=1e-5)
    assert rows["converted", "dynamic"]["bytes_per_token_per_layer"] == 24 * 4
    assert rows["converted", "hqq-int4"]["bytes_per_token_per_layer"] < 24 * 4 / 4
    text = (tmp_path / "report" / "report.md").read_text()
    assert "transformers' caches" in text and "| converted | hqq-int4 |" in text


def test_perplexity_by_position_splits_the_same_loss():
    """perplexity(bounds=...): the loss of the positions in each range, which together are the whole window's."""
    from types import SimpleNamespace

    from transmla_tool.evaluate.perplexity import perplexity

    torch.manual_seed(0)
    table = torch.nn.Embedding(50, 50)
    model = torch.nn.Module()
    model.table = table
    model.forward = lambda ids: SimpleNamespace(logits=table(ids))
    windows = torch.randint(0, 50, (3, 20))
    whole = perplexity(model, windows, batch_size=2, progress=False)
    split = perplexity(model, windows, batch_size=2, progress=False, bounds=(5, 12, 40))
    assert split["tokens"] == whole["tokens"] == 3 * 19
    assert list(split["by_position"]) == ["0", "5", "12"]  # a bound past the window is dropped
    counts = {"0": 4, "5": 7, "12": 8}  # predicted positions 1-4, 5-11, 12-19
    recombined = sum(split["by_position"][k] * n for k, n in counts.items()) / 19
    assert recombined == pytest.approx(whole["nll_per_token"], rel=1e-6)
    with torch.no_grad():
        logits = table(windows)[:, :-1]
        late = torch.nn.functional.cross_entropy(logits[:, 11:].transpose(1, 2), windows[:, 12:])
    assert split["by_position"]["12"] == pytest.approx(float(late), rel=1e-6)


@pytest.mark.parametrize("which", ["original", "converted"])
def test_perplexity_of_long_windows_reads_logits_a_chunk_at_a_time(make_model, convert_tiny, which):
    """A window longer than logit_chunk is scored from the last hidden state a chunk of logits at a time (a real
    8192-token window of Qwen2.5's vocabulary is 5 GB of logits): the same loss at every position, and the result
    says the chunked path ran."""
    from transformers import AutoModelForCausalLM

    from transmla_tool.evaluate.perplexity import perplexity

    source = make_model("qwen2")
    path = source if which == "original" else convert_tiny(source, 16, rope_dim=8, calib_samples=4)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    windows = torch.randint(0, model.config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(1))
    whole = perplexity(model, windows, batch_size=2, progress=False, bounds=(8, 24), logit_chunk=0)
    chunked = perplexity(model, windows, batch_size=2, progress=False, bounds=(8, 24), logit_chunk=16)
    assert "logit_chunk" not in whole and chunked["logit_chunk"] == 16
    assert chunked["tokens"] == whole["tokens"] == 3 * 39
    assert chunked["nll_per_token"] == pytest.approx(whole["nll_per_token"], rel=1e-5)
    for start, nll in whole["by_position"].items():
        assert chunked["by_position"][start] == pytest.approx(nll, rel=1e-5)
    assert "logit_chunk" not in perplexity(model, windows, progress=False, logit_chunk=40)  # not longer: whole
