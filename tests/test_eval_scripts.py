"""The benchmark scripts under eval/ run end to end on a tiny converted model (their numbers are
benchmarks, not tested here; that they run and check what they claim to check is)."""

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mla_decode_runs_and_checks_paths(make_model, convert_tiny, dtype):
    out, _, _ = convert_tiny(make_model("llama", heads=4, kv_heads=2, head_dim=16), latent_dim=24, rope_dim=8,
                             target="transformers")
    run = subprocess.run([sys.executable, str(ROOT / "eval" / "mla_decode.py"), "--converted", str(out),
                          "--contexts", "64,256", "--repeats", "2", "--device", "cpu", "--dtype", dtype],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("| 64 |") or line.startswith("| 256 |")]
    assert len(rows) == 2, run.stdout
    # cache bytes: GQA holds 2 KV heads x (16 + 16) per token, MLA latent 24 + rope (bf16 bytes)
    cells = rows[1].strip("|").split("|")
    assert int(cells[4]) == 2 * 2 * 16 * 256 * 2


def _eval_module(name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "eval" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _crossdomain():
    return _eval_module("crossdomain")


def test_crossdomain_tables_divide_by_the_original_on_the_same_device(tmp_path):
    crossdomain = _crossdomain()
    domains = crossdomain.DOMAINS
    rows = []
    for device, scale in (("cpu", 1.0), ("cuda", 1.02)):  # the GPU's original scores 2% higher
        rows += [{"calib": "-", "config": "original", "budget": 384, "domain": d, "perplexity": 10.0 * scale,
                  "device": device} for d in domains]
    # news row scored on the GPU, forum row on the CPU: both are truly 1.5x their own device's original
    rows += [{"calib": "news", "config": "default", "budget": 192, "domain": d, "perplexity": 15.3, "device": "cuda"}
             for d in domains]
    rows += [{"calib": "forum", "config": "default", "budget": 192, "domain": d, "perplexity": 15.0} for d in domains]
    (tmp_path / "crossdomain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    crossdomain.write_tables(tmp_path)
    table = (tmp_path / "crossdomain.md").read_text()
    assert "| default | news | **1.500** | 1.500 | 1.500 | 1.500 |" in table
    assert "| default | forum | 1.500 | **1.500** | 1.500 | 1.500 |" in table
    assert (tmp_path / "crossdomain.png").exists()


def test_crossdomain_plots_the_chosen_configurations_under_their_labels(tmp_path):
    crossdomain = _crossdomain()
    domains = crossdomain.DOMAINS
    rows = [{"calib": "-", "config": "original", "budget": 384, "domain": d, "perplexity": 10.0} for d in domains]
    for config, scale in (("kept", 1.0), ("left out", 2.0)):
        for budget, worst in ((192, 15.0), (320, 11.0)):
            for s in domains[: 4 if budget == 192 else 1]:  # 320: one row run, so its worst is partial
                rows += [{"calib": s, "config": config, "budget": budget, "domain": d,
                          "perplexity": scale * (worst if (s, d) == ("news", "docs") else 10.5)} for d in domains]
    (tmp_path / "crossdomain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    curves = crossdomain.write_tables(tmp_path, crossdomain.parse_plot_configs("kept=the default"))
    assert curves == {"the default: worst off-domain (rows not all run)": [(0.5, 1.5), (320 / 384, 1.1)],
                      "the default: worst in-domain": [(0.5, 1.05)]}
    assert "left out" in (tmp_path / "crossdomain.md").read_text()  # the tables keep every configuration
    assert len(crossdomain.write_tables(tmp_path)) == 4  # by default every configuration is plotted
    with pytest.raises(SystemExit, match="'kep', which has no rows"):
        crossdomain.write_tables(tmp_path, crossdomain.parse_plot_configs("kep"))


def test_crossdomain_refuses_to_resume_rows_made_otherwise(tmp_path):
    """Rows are skipped by config name on a rerun: rows under that name made with another method or
    calibration size (or by a version that did not record them) stop the run instead of being reused."""
    from transmla_tool.methods import PRESETS

    check = _crossdomain().check_resumable
    results = tmp_path / "crossdomain.jsonl"
    made = {"method": PRESETS["default"].as_dict(), "calib_samples": 128, "calib_seq_len": 512}
    rows = [{"calib": "news", "config": "default", "budget": 192, "domain": d, **made} for d in ("news", "code")]
    news, forum = {"calib": "news", "config": "default"}, {"calib": "forum", "config": "default"}
    check(rows, results, news, dict(made))  # the same run: resumes
    check(rows, results, forum, {**made, "calib_samples": 64})  # another source: its own rows
    with pytest.raises(SystemExit, match="calib_samples"):
        check(rows, results, news, {**made, "calib_samples": 64})
    with pytest.raises(SystemExit, match="method"):
        check(rows, results, news, {**made, "method": PRESETS["closed-form"].as_dict()})
    legacy = [{"calib": "news", "config": "default", "budget": 192, "domain": "news", "perplexity": 40.0}]
    with pytest.raises(SystemExit, match="before rows recorded it"):
        check(legacy, results, news, made)
    # rows recorded before a method setting existed were made with its value of then (BEFORE_SETTING)
    from transmla_tool.methods import BEFORE_SETTING, resolve_method

    then = resolve_method("closed-form", [f"{k}={v}" for k, v in BEFORE_SETTING.items()])
    older = {k: v for k, v in then.as_dict().items() if k not in BEFORE_SETTING}
    rows = [{"calib": "news", "config": "cf", "budget": 192, "domain": "docs", **made, "method": older}]
    cf = {"calib": "news", "config": "cf"}
    check(rows, results, cf, {**made, "method": then.as_dict()})
    with pytest.raises(SystemExit, match="method"):  # today's closed form has moved on (latent_basis, rope_key_balance)
        check(rows, results, cf, {**made, "method": resolve_method("closed-form").as_dict()})


def test_crossdomain_rows_of_another_length_are_never_mixed(tmp_path):
    """crossdomain.py --ctx: a row records the window length it was scored at; rows written before the flag were at
    512 and resume at 512, and a run at another length refuses the file (its ratios would mix two lengths)."""
    check = _crossdomain().check_same_scoring
    results = tmp_path / "crossdomain.jsonl"
    before_flag = [{"calib": "news", "config": "default", "domain": "docs", "eval_windows": 8}]
    check(before_flag, results, {"eval_windows": 8, "ctx": 512}, unrecorded={"ctx": 512})
    with pytest.raises(SystemExit, match="ctx 512; this run asks for eval_windows 8, ctx 2048"):
        check(before_flag, results, {"eval_windows": 8, "ctx": 2048}, unrecorded={"ctx": 512})
    at_2048 = [{**before_flag[0], "ctx": 2048}]
    with pytest.raises(SystemExit, match="ctx 2048"):
        check(at_2048, results, {"eval_windows": 8, "ctx": 512}, unrecorded={"ctx": 512})


def test_rerun_commands_remake_the_recorded_method():
    """A command printed from old rows names every setting whose default has moved since, so that it remakes
    (and resumes) those rows instead of measuring today's default under their name."""
    from transmla_tool.methods import BEFORE_SETTING, resolve_method

    remaking = _eval_module("quality").remaking_overrides
    older = {k: v for k, v in resolve_method("closed-form", ["latent_basis=pca", "rope_key_balance=none"]).as_dict()
             .items() if k not in BEFORE_SETTING}  # recorded before latent_basis and rope_key_balance existed
    sets = remaking("closed-form", [], older)
    assert sorted(sets) == ["bias_fold=none", "constant_channel=none", "latent_basis=pca", "rope_bias_fold=all",
                            "rope_key_balance=none"]
    assert resolve_method("closed-form", sets).as_dict() == {**BEFORE_SETTING, **older}
    recorded = resolve_method("default", ["refine_steps=200", "latent_basis=hadamard"]).as_dict()
    recorded["rope_key_balance"] = "none"  # made when that was the default
    assert remaking("default", ["refine_steps=200", "latent_basis=hadamard"], recorded) == [
        "refine_steps=200", "latent_basis=hadamard", "rope_key_balance=none"]
    today = resolve_method("default", ["refine_steps=200"]).as_dict()
    assert remaking("default", ["refine_steps=200"], today) == ["refine_steps=200"]
    assert remaking("default", ["refine_steps=200"], None) == ["refine_steps=200"]


def _heal_script(*args):
    return subprocess.run([sys.executable, str(ROOT / "eval" / "heal.py"), *args], capture_output=True, text=True,
                          timeout=300)


def test_heal_benchmark_refuses_a_bad_method_setting_before_any_work(tmp_path):
    run = _heal_script("--output-dir", str(tmp_path / "heal"), "--set", "refine_stepz=5")
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1].startswith("--set refine_stepz=5: expected name=value")
    assert not (tmp_path / "heal").exists()


def test_heal_benchmark_refuses_a_bad_device_before_any_work(tmp_path):
    run = _heal_script("--output-dir", str(tmp_path / "heal"), "--device", "tpu")
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == "--device must be cpu, cuda, cuda:N or auto, got tpu"
    assert not (tmp_path / "heal").exists()


@pytest.mark.parametrize("flag", ["--batch-size", "--grad-accum", "--save-total-limit"])
def test_heal_benchmark_refuses_a_count_below_one_before_any_work(tmp_path, flag):
    run = _heal_script("--output-dir", str(tmp_path / "heal"), flag, "0")
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == f"{flag} must be >= 1, got 0"
    assert not (tmp_path / "heal").exists()


def test_heal_benchmark_refuses_a_repeat_share_outside_zero_to_one_before_any_work(tmp_path):
    run = _heal_script("--output-dir", str(tmp_path / "heal"), "--repeat-share", "1.5")
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1] == "--repeat-share must be between 0 and 1, got 1.5"
    assert not (tmp_path / "heal").exists()


def test_heal_run_keeps_the_text_it_started_with(tmp_path):
    """A run's data/ is written once and then read, not rewritten: a run resumed or rescored under another Python
    (whose standard library is the code and docs text) keeps its text."""
    run_splits = _eval_module("heal").run_splits
    calib, heldout = run_splits(tmp_path / "data", "docs")
    files = calib.split(",")
    assert [Path(f).name for f in files] == ["news-calib.jsonl", "forum-calib.jsonl", "code-calib.jsonl"]
    assert heldout.name == "docs-heldout.jsonl" and all(Path(f).stat().st_size > 50_000 for f in files)
    Path(files[2]).write_text('{"text": "the code this run started with"}\n')
    assert run_splits(tmp_path / "data", "docs") == (calib, heldout)
    assert Path(files[2]).read_text() == '{"text": "the code this run started with"}\n'
    news_calib, news_heldout = run_splits(tmp_path / "news", None)
    news_heldout.write_text("kept\n")
    assert run_splits(tmp_path / "news", None) == (news_calib, news_heldout)
    assert news_heldout.read_text() == "kept\n"


def test_heal_benchmark_refuses_a_directory_converted_with_other_settings(tmp_path):
    out = tmp_path / "heal"
    out.mkdir()
    (out / "conversion.json").write_text(json.dumps({"latent_dim": 128, "calib_samples": 64, "overrides": []}))
    run = _heal_script("--output-dir", str(out), "--data", "mix-code", "--set", "refine_steps=100")
    assert run.returncode != 0
    assert "use another --output-dir" in run.stderr
    assert '"overrides": ["refine_steps=100"]' in run.stderr
    assert not (out / "converted-192").exists()
    # a record of the same overrides but no resolved method predates the recorded method: `default` may have changed
    (out / "conversion.json").write_text(json.dumps({"latent_dim": 128, "calib_samples": 128, "overrides": []}))
    run = _heal_script("--output-dir", str(out), "--data", "mix-code")
    assert run.returncode != 0 and "use another --output-dir" in run.stderr
    run = _heal_script("--output-dir", str(out), "--data", "mix-code", "--rope-dim", "32")  # another rotary key size
    assert run.returncode != 0 and '"rope_dim": 32' in run.stderr
    run = _heal_script("--output-dir", str(out), "--data", "mix-code", "--calib-seq-len", "8192")  # longer windows
    assert run.returncode != 0 and '"calib_seq_len": 8192' in run.stderr
    # the calibration mix is part of the record: one that matches in all else but does not name it is refused
    from transmla_tool.methods import resolve_method

    (out / "conversion.json").write_text(json.dumps({"latent_dim": 128, "calib_samples": 128, "overrides": [],
                                                     "method": resolve_method("default", []).as_dict()}))
    run = _heal_script("--output-dir", str(out), "--data", "mix-code")
    assert run.returncode != 0 and '"calib": "mix-code"' in run.stderr


def test_heal_benchmark_adopts_only_the_conversion_it_would_make(make_model, text_file, tmp_path, capsys):
    """eval/heal.py --converted DIR: a finished conversion is copied in as the run's own only when its record says it is
    what the run would convert (same weights, every setting that changes the result, the same calibration documents);
    otherwise a one-line refusal naming what differs, and nothing in the run."""
    from transmla_tool.convert import ConvertSettings, convert
    from transmla_tool.methods import PRESETS

    heal_script = _eval_module("heal")
    model = str(make_model("llama", kv_heads=2))
    text = text_file.read_text().split("\n\n")

    def splits(where: Path, change: str = "") -> str:
        where.mkdir()
        for i, name in enumerate(["news", "forum"]):
            lines = [json.dumps({"text": t + change}) for t in text[i::2]]
            (where / f"{name}-calib.jsonl").write_text("\n".join(lines) + "\n")
        return ",".join(str(where / f"{n}-calib.jsonl") for n in ["news", "forum"])

    made = dict(model=model, latent_dim=8, rope_dim=8, calib_samples=4, calib_seq_len=64, dtype="float32",
                target="transformers", method=PRESETS["closed-form"])
    elsewhere = tmp_path / "elsewhere"
    convert(ConvertSettings(**made, output=str(elsewhere), calib_data=splits(tmp_path / "its-data"), device="cpu",
                            progress=False))
    run = tmp_path / "run"
    run.mkdir()
    converted = run / "converted-16"

    def adopt(calib_data: str, **changed):
        settings = ConvertSettings(**{**made, **changed}, output=str(converted), calib_data=calib_data, device="cpu",
                                   overwrite=True)
        return heal_script.adopt_conversion(elsewhere, settings, converted)

    same = splits(tmp_path / "same-data")  # the same documents, another directory (a run's own data/)
    with pytest.raises(SystemExit, match=r"made with other latent_dim \(8, this run asks 16\)"):
        adopt(same, latent_dim=16)
    with pytest.raises(SystemExit, match="made with other method"):
        adopt(same, method=PRESETS["default"])
    with pytest.raises(SystemExit, match="other documents than this run's .*other-data/forum-calib.jsonl"):
        adopt(splits(tmp_path / "other-data", " (edited)"))
    with pytest.raises(SystemExit, match="not on this run's --data text"):
        adopt(same.split(",")[0])
    assert not converted.exists() and not list(run.iterdir())
    record = adopt(same)
    assert record["settings"]["latent_dim"] == 8
    assert sorted(p.name for p in converted.iterdir()) == sorted(p.name for p in elsewhere.iterdir())
    assert (converted / "model.safetensors").read_bytes() == (elsewhere / "model.safetensors").read_bytes()
    assert [p.name for p in run.iterdir()] == ["converted-16"]  # no staging copy left behind


def test_heal_original_perplexity_is_measured_again_for_other_windows(make_model, text_file, tmp_path):
    """original.json is reused only for the windows it was measured on: a rerun at another --seq-len (or window
    count) in the same directory measures the original again instead of dividing by the other length's number."""
    import torch

    heal_script = _eval_module("heal")
    model = str(make_model("llama", kv_heads=2))
    reference = tmp_path / "original.json"
    device = torch.device("cpu")
    at_64 = heal_script.original_perplexity(reference, model, None, text_file, 64, 4, device)
    assert json.loads(reference.read_text()) == {"perplexity": at_64, "seq_len": 64, "windows": 4,
                                                 "heldout": text_file.name}
    reference.write_text(json.dumps({**json.loads(reference.read_text()), "perplexity": 1.0}))  # marks a reuse
    assert heal_script.original_perplexity(reference, model, None, text_file, 64, 4, device) == 1.0
    at_128 = heal_script.original_perplexity(reference, model, None, text_file, 128, 4, device)
    assert at_128 not in (1.0, at_64) and json.loads(reference.read_text())["seq_len"] == 128
    reference.write_text(json.dumps({"perplexity": 1.0}))  # a record from before the windows were recorded
    assert heal_script.original_perplexity(reference, model, None, text_file, 128, 4, device) == at_128


def test_heal_frontier_only_adds_cache_types_to_a_finished_run(tmp_path, monkeypatch):
    """`--frontier-only` scores a finished run under more cache types: frontier.json keeps the types scored before
    and gains the new ones (the engine is a stand-in here; the llama.cpp scoring is tested in test_engines.py)."""
    import transmla_tool.engines.llamacpp as llamacpp
    import transmla_tool.evaluate.frontier as frontier

    heal_script = _eval_module("heal")
    out, heldout = tmp_path / "run", tmp_path / "heldout.jsonl"
    out.mkdir()
    heldout.write_text(json.dumps({"text": "held-out words"}) + "\n")
    kernels = "SSE3 AVX AVX2"
    before = {"original": {"f16": {"perplexity": 10.0, "bytes": 768.0, "chunks": 16, "cpu_kernels": kernels}},
              "healed 8 tokens": {"q4_0": {"perplexity": 12.4, "bytes": 108.0, "chunks": 16, "cpu_kernels": kernels}}}
    engine = {"version": "llama.cpp test", "cpu_kernels": [kernels]}
    (out / "frontier.json").write_text(json.dumps({"scored": before, "chunks": 16, "engine": engine}))
    new = {"perplexity": 12.1, "bytes": 108.0, "chunks": 16, "cpu_kernels": kernels}

    def score(original, gguf, checkpoints, text, ctx, chunks, original_types, converted_types, tmp, **_):
        assert list(checkpoints) == ["healed 8 tokens"] and converted_types == ["iq4_nl"]
        return {"original": {"f16": before["original"]["f16"]}, "healed 8 tokens": {"iq4_nl": new}}

    monkeypatch.setattr(frontier, "score_in_llamacpp", score)
    monkeypatch.setattr(llamacpp, "llama_cpp_version", lambda: "llama.cpp test")
    heal_script.place_on_frontier(out, "model", "model.gguf", {"healed 8 tokens": out / "healed"}, heldout,
                                  ["iq4_nl"], 16)
    scored = json.loads((out / "frontier.json").read_text())["scored"]
    assert scored["healed 8 tokens"] == {"q4_0": before["healed 8 tokens"]["q4_0"], "iq4_nl": new}
    assert "| healed 8 tokens | iq4_nl |" in (out / "heal.md").read_text()
    assert "(llama.cpp test, CPU kernels SSE3 AVX AVX2)" in (out / "heal.md").read_text()
    assert "(16 windows of 512)" in (out / "heal.md").read_text()
    # --frontier-ctx 2048: its own record; the 512-token scores stay where they were, never beside the 2048 ones
    at_512 = (out / "frontier.json").read_text()
    heal_script.place_on_frontier(out, "model", "model.gguf", {"healed 8 tokens": out / "healed"}, heldout,
                                  ["iq4_nl"], 16, 2048)
    record = json.loads((out / "frontier-2048.json").read_text())
    assert record["ctx"] == 2048 and record["scored"]["healed 8 tokens"] == {"iq4_nl": new}
    assert (out / "frontier.json").read_text() == at_512
    assert "(16 windows of 2048)" in (out / "heal.md").read_text()


def test_heal_frontier_models_picks_what_the_placement_scores(tmp_path):
    """--frontier-models: the healed model alone (a 4-bit cache at 8192 tokens costs ~18 minutes a model), the
    conversion alone, or both in the run's order; anything else stops before any work with one line."""
    heal_script = _eval_module("heal")
    converted, healed = tmp_path / "converted-192", tmp_path / "healed-192"
    assert heal_script.frontier_models(converted, healed, 8, ["healed"]) == {"healed 8 tokens": healed}
    assert heal_script.frontier_models(converted, healed, 8, ["converted"]) == {"converted": converted}
    assert list(heal_script.frontier_models(converted, healed, 8, ["healed", "converted"])) == [
        "converted", "healed 8 tokens"]
    run = _heal_script("--output-dir", str(tmp_path / "heal"), "--frontier-models", "healed,original")
    assert run.returncode != 0 and "--frontier-models 'healed,original': give converted, healed or both" in run.stderr
    assert not (tmp_path / "heal").exists()
    run = _heal_script("--output-dir", str(tmp_path / "heal"), "--rebalanced-only")
    assert run.returncode != 0 and "--rebalanced-only needs --rebalance" in run.stderr
    assert not (tmp_path / "heal").exists()


def test_heal_frontier_placement_resumes_after_an_interruption(tmp_path, monkeypatch):
    """Each llama.cpp score is kept as it comes (frontier-<ctx>.partial.json): a placement killed midway, rerun,
    measures only what was left, and exports only the models still unscored; a partial record of other windows is
    ignored. The engine is a stand-in that counts what it is asked; frontier-8192.json appears only once everything
    is scored."""
    import transmla_tool.engines.llamacpp as llamacpp
    import transmla_tool.gguf_export as gguf_export

    heal_script = _eval_module("heal")
    out, heldout = tmp_path / "run", tmp_path / "heldout.jsonl"
    out.mkdir()
    heldout.write_text(json.dumps({"text": "held-out words"}) + "\n")
    calls, made, fail_at = [], [], [None]

    def write(path):
        Path(path).write_bytes(b"gguf")
        made.append(Path(path).name)

    def score(model_file, text, ctx, chunks, entries, flags=None):
        calls.append((Path(model_file).name, *entries))
        assert Path(model_file).exists() and ctx == 8192 and chunks == 2
        if len(calls) == fail_at[0]:
            raise RuntimeError("killed")
        return {entries[0]: {"perplexity": 10.0 + len(calls), "bytes": 108.0, "chunks": 2, "cpu_kernels": "AVX2"}}

    monkeypatch.setattr(llamacpp, "llama_cpp_version", lambda: "llama.cpp test")
    monkeypatch.setattr(llamacpp, "quantize", lambda src, dst, *a, **k: write(dst))
    monkeypatch.setattr(llamacpp, "perplexity_per_cache_type", score)
    monkeypatch.setattr(gguf_export, "export_gguf", lambda s: (write(s.output), {"run_flags": ["-mla"]})[1])
    models = {"converted": out / "converted", "healed 8 tokens": out / "healed"}

    def place():
        heal_script.place_on_frontier(out, "model", "model.gguf", models, heldout, ["iq4_nl"], 2, 8192, ["f16"])

    fail_at[0] = 3  # killed while scoring the healed model
    with pytest.raises(RuntimeError, match="killed"):
        place()
    assert not (out / "frontier-8192.json").exists()
    assert json.loads((out / "frontier-8192.partial.json").read_text())["scored"] == {
        "original": {"f16": {"perplexity": 11.0, "bytes": 108.0, "chunks": 2, "cpu_kernels": "AVX2"}},
        "converted": {"iq4_nl": {"perplexity": 12.0, "bytes": 108.0, "chunks": 2, "cpu_kernels": "AVX2"}}}
    calls.clear(), made.clear()
    fail_at[0] = None
    place()
    assert calls == [("checkpoint-healed 8 tokens-f32.gguf", "iq4_nl")]
    assert made == ["checkpoint-healed 8 tokens-f32.gguf"]  # neither the original nor the conversion re-exported
    record = json.loads((out / "frontier-8192.json").read_text())
    assert {k: {t: m["perplexity"] for t, m in v.items()} for k, v in record["scored"].items()} == {
        "original": {"f16": 11.0}, "converted": {"iq4_nl": 12.0}, "healed 8 tokens": {"iq4_nl": 11.0}}
    assert not (out / "frontier-8192.partial.json").exists() and not (out / "frontier.json").exists()
    # a partial record of other windows (here 512 tokens, put where 8192's goes) is not taken: all measured again
    (out / "frontier-8192.partial.json").write_text(json.dumps({
        "version": "llama.cpp test", "chunks": 2, "ctx": 512, "text_sha256": "x", "scored": record["scored"]}))
    calls.clear()
    place()
    assert [c[1] for c in calls] == ["f16", "iq4_nl", "iq4_nl"]


def test_heal_frontier_only_never_merges_scores_of_another_llama_cpp_build(tmp_path, monkeypatch, capsys):
    """A quantized cache's perplexity moves between llama.cpp builds (their CPU kernels): scores in frontier.json
    from another build, or from before builds were recorded, are replaced by the rerun's, never put beside them."""
    import transmla_tool.engines.llamacpp as llamacpp
    import transmla_tool.evaluate.frontier as frontier

    heal_script = _eval_module("heal")
    out, heldout = tmp_path / "run", tmp_path / "heldout.jsonl"
    out.mkdir()
    heldout.write_text(json.dumps({"text": "held-out words"}) + "\n")
    old = {"perplexity": 12.4, "bytes": 108.0, "chunks": 16}
    now = {"perplexity": 12.5, "bytes": 108.0, "chunks": 16, "cpu_kernels": "SSE3 AVX AVX2"}
    monkeypatch.setattr(llamacpp, "llama_cpp_version", lambda: "llama.cpp test")
    monkeypatch.setattr(frontier, "score_in_llamacpp", lambda *a, **k: {
        "original": {"f16": {**now, "perplexity": 10.0, "bytes": 768.0}}, "healed 8 tokens": {"iq4_nl": now}})
    for earlier_engine in (None, {"version": "llama.cpp test", "cpu_kernels": ["SSE3 AVX AVX2 AVX512"]}):
        earlier = {"scored": {"original": {"f16": {**old, "perplexity": 10.0, "bytes": 768.0}},
                              "healed 8 tokens": {"q4_0": old}}, "chunks": 16}
        if earlier_engine:
            earlier["engine"] = earlier_engine
        (out / "frontier.json").write_text(json.dumps(earlier))
        heal_script.place_on_frontier(out, "model", "model.gguf", {"healed 8 tokens": out / "healed"}, heldout,
                                      ["iq4_nl"], 16)
        written = json.loads((out / "frontier.json").read_text())
        assert written["scored"]["healed 8 tokens"] == {"iq4_nl": now}
        assert written["engine"] == {"version": "llama.cpp test", "cpu_kernels": ["SSE3 AVX AVX2"]}
        assert "its scores are replaced, not merged" in capsys.readouterr().out


def test_heal_rebalanced_rows(make_model, convert_tiny, text_file, tmp_path):
    """`--rebalance partial` adds each checkpoint with its rotary key balanced as its own row, written once
    beside it and reused by a rerun."""
    from transmla_tool.methods import PRESETS

    heal_script = _eval_module("heal")
    converted, _, _ = convert_tiny(make_model("llama", kv_heads=2), latent_dim=12, rope_dim=8,
                                   output=tmp_path / "converted-20", method=PRESETS["closed-form"])
    assert heal_script.with_rebalanced({"converted": converted}, None, str(text_file)) == {"converted": converted}
    rows = heal_script.with_rebalanced({"converted": converted}, "partial", str(text_file))
    balanced = tmp_path / "converted-20-partial"
    assert rows == {"converted": converted, "converted +partial": balanced}
    assert (balanced / "rebalance.json").exists()
    stamp = (balanced / "model.safetensors").stat().st_mtime_ns
    heal_script.with_rebalanced({"converted": converted}, "partial", str(text_file))
    assert (balanced / "model.safetensors").stat().st_mtime_ns == stamp
    # --rebalanced-only: the balanced copy alone (the served one), reused, not written again
    assert heal_script.with_rebalanced({"converted": converted}, "partial", str(text_file), only=True) == {
        "converted +partial": balanced}
    assert (balanced / "model.safetensors").stat().st_mtime_ns == stamp


def test_cache_split_rows(make_model, convert_tiny, text_file):
    """eval/cache_split.py: the exact cache is the reference, every quantized reading costs something, and balancing
    the rotary key leaves the exact model alone (its rows are restored between powers)."""
    from transmla_tool.methods import PRESETS

    split = _eval_module("cache_split").split
    plain = dataclasses.replace(PRESETS["closed-form"], latent_basis="pca", rope_key_balance="none")  # PCA-ordered latent
    converted, _, _ = convert_tiny(make_model("llama", kv_heads=2), latent_dim=24, rope_dim=8,
                                   method=plain)  # a row of 32: one block
    rows = split(str(converted), str(text_file), str(text_file), ["q4_0"], [0.0, 0.3], windows=4, seq_len=64,
                 sensitivity=True)
    assert [(r["cache"], r["quantized"]) for r in rows] == [
        ("exact", "nothing"), ("q4_0", "all"), ("q4_0", "latent"), ("q4_0", "rotary key"),
        ("q4_0", "all, query rounded as llama.cpp's CPU reads it"),
        ("q4_0", "all, rotary key p=0.3"), ("q4_0", "latent, balanced to its sensitivity"),
        ("q4_0", "all, latent balanced to its sensitivity")]
    assert rows[0]["ratio"] == 1.0 and all(r["ratio"] > 1.0 for r in rows[1:4])
    assert rows[4]["perplexity"] != rows[1]["perplexity"]  # the q8_0 query reads otherwise
    assert rows[5]["perplexity"] != rows[1]["perplexity"]
    assert rows[6]["perplexity"] != rows[2]["perplexity"]  # the balanced latent reads back otherwise
    # each change is undone before the next: the balanced latent was scored from the model as converted
    assert split(str(converted), str(text_file), str(text_file), ["q4_0"], [0.0], windows=4, seq_len=64)[:5] == rows[:5]


def test_heal_frontier_only_refuses_an_unfinished_run(tmp_path):
    run = _heal_script("--output-dir", str(tmp_path / "heal"), "--data", "mix-docs", "--frontier-only",
                       "--cache-types", "iq4_nl")
    assert run.returncode != 0
    assert "is not a finished healing run" in run.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(("last", "sentence"), [(10.4, "within 5% of the original: 20 tokens."),
                                                 (11.0, "within 5% of the original: not reached.")])
def test_heal_report_says_when_the_original_was_reached(tmp_path, last, sentence):
    rows = [{"tokens": 0, "eval_perplexity": 12.0}, {"tokens": 10, "eval_perplexity": 11.0, "tokens_per_s": 80.0},
            {"tokens": 20, "eval_perplexity": last, "tokens_per_s": 90.0}]
    summary = {"tokens": 20, "tokens_per_s": 85.0, "processes": 1, "mixed_precision": "no"}
    _eval_module("heal").write_report(tmp_path, rows, 10.0, summary, "news", "160 + 32")
    report = (tmp_path / "heal.md").read_text()
    assert report.startswith("# Healing SmolLM2-135M converted at 160 + 32 cache values per token per layer")
    assert sentence in report
    assert "| 20 | %.3f | %.3f |" % (last, last / 10.0) in report
    assert "20 training tokens, 85 tokens/s steady state (1 process(es)" in report


def test_heal_report_of_a_run_with_no_timed_step_says_so(tmp_path):
    rows = [{"tokens": 0, "eval_perplexity": 12.0}, {"tokens": 10, "eval_perplexity": 11.0, "tokens_per_s": None}]
    summary = {"tokens": 10, "tokens_per_s": None, "processes": 1, "mixed_precision": "no"}
    _eval_module("heal").write_report(tmp_path, rows, 10.0, summary, "news", "128 + 64")
    assert "speed not measured (no timed step" in (tmp_path / "heal.md").read_text()


@pytest.mark.parametrize("script", ["quality", "crossdomain"])
@pytest.mark.parametrize(("config", "problem"), [("fast=default:refine_stepz=5", "--set refine_stepz=5: expected"),
                                                 ("fast=defualt", "unknown method 'defualt'")])
def test_benchmarks_refuse_a_bad_configuration_before_any_work(tmp_path, script, config, problem):
    # the bad configuration comes second: it must stop the run before the first one converts for an hour
    run = subprocess.run([sys.executable, str(ROOT / "eval" / f"{script}.py"), "--output-dir", str(tmp_path),
                          "--configs", f"default;{config}"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"--configs {config!r}: ") and problem in last, run.stderr[-2000:]
    assert not list(tmp_path.glob("*.jsonl"))


def test_crossdomain_refuses_an_unknown_calibration_source_before_any_work(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "eval" / "crossdomain.py"), "--output-dir", str(tmp_path),
                          "--calib", "news,newz", "--configs", "default"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines()[-1].startswith("unknown calibration source 'newz'")
    assert not (tmp_path / "crossdomain.jsonl").exists()


def _frontier_rows():
    """Rows as eval/frontier.py writes them: the original on every domain, a conversion calibrated on news."""
    ppl = {"news": 30.0, "forum": 28.0, "code": 13.0, "docs": 11.0}
    rows = []
    common = {"chunks": 16, "ctx": 512}
    for cache, cost, size in (("f16", 1.0, 768.0), ("q8_0", 1.001, 408.0), ("q4_0", 1.06, 216.0)):
        rows += [{"model": "original", "calib": "-", "config": "original", "budget": 0, "cache": cache, "domain": d,
                  "perplexity": p * cost, "bytes": size, "analytic_bytes": size, "bytes_match_analytic": True, **common}
                 for d, p in ppl.items()]
    for cache, cost, size in (("f16", 1.2, 384.0), ("q4_0", 1.25, 108.0)):
        rows += [{"model": "converted", "calib": "news", "config": "default", "preset": "default", "overrides": [],
                  "budget": 192, "latent_dim": 128, "rope_dim": 64, "calib_samples": 32, "cache": cache, "domain": d, "perplexity": p * cost * (1.1 if d == "docs" else 1.0),
                  "bytes": size, "analytic_bytes": size, "bytes_match_analytic": True, **common}
                 for d, p in ppl.items() if d != "news"]
    return rows


def test_frontier_tables_take_the_worst_unseen_domain(tmp_path, monkeypatch):
    frontier = _eval_module("frontier")
    (tmp_path / "frontier.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _frontier_rows()))
    frontier.write_tables(tmp_path, [216.0, 110.0])
    text = (tmp_path / "frontier.md").read_text()
    assert "## Calibrated on news; ratio = worst of forum, code, docs" in text
    assert "| default 128 + 64 | q4_0 | 4.5 | 108 | 7.11 | 1.375 (docs) | yes |" in text  # 1.25 x 1.1 on docs
    assert "| original | q4_0 | 4.5 | 216 | 3.56 | 1.060 (" in text
    assert "at most 216 B/token/layer: do not convert, quantize the cache: original with a q4_0 cache" in text
    assert "at most 110 B/token/layer: convert: default 128 + 64 with a q4_0 cache" in text
    assert (tmp_path / "frontier-news.png").stat().st_size > 0
    # every group of rows with the command that remakes it (a rerun measures only what is missing)
    assert (f"python eval/frontier.py --output-dir {tmp_path} --chunks 16 --ctx 512 --calib news --calib-samples 32 "
            '--budgets 192 --configs "default=default" --cache-types f16,q4_0') in text
    assert "--ctx 512 --all-domains --configs '' --original-cache-types f16,q4_0,q8_0" in text
    # the original alone, on the text and the kinds of text its rows were scored on
    docs_only = [{**r, "data_dir": "runs/length/data"} for r in _frontier_rows() if r["domain"] == "docs"]
    assert (f"python eval/frontier.py --output-dir {tmp_path} --chunks 16 --ctx 512 --data-dir runs/length/data "
            "--calib mix-docs --configs '' --original-cache-types f16,q4_0,q8_0") in frontier.commands(docs_only,
                                                                                                      tmp_path)
    unseen_by_news = [r for r in _frontier_rows() if r["domain"] != "news" and r["model"] == "original"]
    assert "--ctx 512 --configs '' --original-cache-types" in "\n".join(frontier.commands(unseen_by_news, tmp_path))
    plotted = []
    monkeypatch.setattr(frontier, "plot", lambda points, *a: plotted.append({p.label for p in points}))
    frontier.write_tables(tmp_path, [216.0], plot_configs=["another"])  # the plot shows the original alone
    frontier.write_tables(tmp_path, [216.0], plot_configs=["default"])
    assert plotted == [{"original"}, {"original", "default 128 + 64"}]
    assert "| default 128 + 64 | q4_0 |" in (tmp_path / "frontier.md").read_text()  # the table keeps every row
    assert frontier.unseen("mix-code") == ["code"] and frontier.unseen("mix") == []
    assert frontier.unseen("news") == ["forum", "code", "docs"]


def test_frontier_leave_one_out_takes_each_mix_on_the_domain_it_left_out(tmp_path):
    frontier = _eval_module("frontier")
    rows = [r for r in _frontier_rows() if r["model"] == "original"]
    ppl = {"news": 30.0, "forum": 28.0, "code": 13.0, "docs": 11.0}
    cost = {"news": 1.3, "forum": 1.1, "code": 1.2, "docs": 1.15}
    common = {"chunks": 16, "ctx": 512, "preset": "default", "overrides": [], "budget": 192, "latent_dim": 160,
              "rope_dim": 32, "calib_samples": 128, "bytes": 108.0, "analytic_bytes": 108.0, "cache": "q4_0"}
    for left_out in ppl:
        # each mix scored on the domain it left out, and (to be ignored) on one it calibrated on, where it is better
        rows += [{"model": "converted", "calib": f"mix-{left_out}", "config": "default", "domain": d,
                  "perplexity": ppl[d] * (cost[left_out] if d == left_out else 1.01), **common}
                 for d in (left_out, "forum" if left_out != "forum" else "news")]
        if left_out != "docs":  # a configuration without its mix-docs conversion is no leave-one-out point
            rows.append({"model": "converted", "calib": f"mix-{left_out}", "config": "partial", "domain": left_out,
                         "perplexity": ppl[left_out], **common})
    (tmp_path / "frontier.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    frontier.write_tables(tmp_path, [110.0])
    text = (tmp_path / "frontier.md").read_text()
    section = text.split("## Calibrated on three kinds of text, scored on the fourth")[1].split("## ")[0]
    assert "| default 160 + 32 | q4_0 | 4.5 | 108 | 7.11 | 1.300 (news) | yes |" in section
    assert "partial" not in section and "| original | q4_0 | 4.5 | 216 | 3.56 | 1.060 (" in section
    assert "at most 110 B/token/layer: convert: default 160 + 32 with a q4_0 cache (108 B/token/layer, ratio 1.300)" \
        in section
    # each mix keeps its own section, scored on its left-out domain alone
    assert "| default 160 + 32 | q4_0 | 4.5 | 108 | 7.11 | 1.150 (docs) | yes |" in text.split("## Calibrated on mix-docs")[1]
    assert (tmp_path / "frontier-leave-one-out.png").stat().st_size > 0


def test_frontier_refuses_to_add_scores_of_another_llama_cpp_build(tmp_path):
    """A resumed frontier run takes a new score only from the build and CPU kernels its rows were scored by, and a
    run on another build stops before any work (the kernels are known only after llama.cpp loaded a model)."""
    check = _eval_module("frontier").check_same_engine
    results = tmp_path / "frontier.jsonl"
    rows = [{**row, "engine": "llama.cpp 1 (abc)", "cpu_kernels": "SSE3 AVX AVX2"} for row in _frontier_rows()]
    check(rows, results, "llama.cpp 1 (abc)", "SSE3 AVX AVX2")  # the same build: taken
    check(rows, results, "llama.cpp 1 (abc)")  # the same build, kernels not known yet: go on
    for engine, kernels in (("llama.cpp 1 (abc)", "SSE3 AVX AVX2 AVX512"), ("llama.cpp 2 (def)", "SSE3 AVX AVX2"),
                            ("llama.cpp 2 (def)", None)):
        with pytest.raises(SystemExit, match="scores of two builds are not comparable, use a new --output-dir"):
            check(rows, results, engine, kernels)
    with pytest.raises(SystemExit, match=r"on CPU kernels \(not recorded\)"):  # rows from before they were recorded
        check(_frontier_rows(), results, "llama.cpp 1 (abc)", "SSE3 AVX AVX2")


def test_frontier_refuses_bad_cache_types_before_any_work(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "eval" / "frontier.py"), "--output-dir", str(tmp_path / "f"),
                          "--cache-types", "q8_0/q4_0"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "view of the cached latent" in run.stderr
    assert not (tmp_path / "f").exists()


def test_heal_benchmark_checks_cache_types_before_any_work(tmp_path):
    run = _heal_script("--output-dir", str(tmp_path / "heal"), "--cache-types", "f16,q3_k")
    assert run.returncode != 0 and "'q3_k' is not a cache type" in run.stderr
    assert not (tmp_path / "heal").exists()


def test_heal_benchmark_places_its_checkpoints_on_the_frontier(tmp_path, monkeypatch):
    """place_on_frontier: every model under every cache type, ratio to the original's f16 perplexity, in heal.md."""
    heal_script = _eval_module("heal")
    ppl = {("original", "f16"): (10.0, 768.0), ("original", "q4_0"): (10.6, 216.0), ("converted", "f16"): (12.0, 384.0),
           ("converted", "q4_0"): (12.5, 108.0), ("healed 4096 tokens", "f16"): (11.0, 384.0),
           ("healed 4096 tokens", "q4_0"): (11.4, 108.0)}
    scored = {}
    for (model, cache), (perplexity, size) in ppl.items():
        scored.setdefault(model, {})[cache] = {"perplexity": perplexity, "bytes": size, "cpu_kernels": "AVX AVX2"}
    import transmla_tool.engines.llamacpp as llamacpp
    import transmla_tool.evaluate.frontier as frontier

    monkeypatch.setattr(frontier, "score_in_llamacpp", lambda *a, **k: scored)
    monkeypatch.setattr(llamacpp, "llama_cpp_version", lambda: "llama.cpp test")
    heldout = tmp_path / "held.jsonl"
    heldout.write_text(json.dumps({"text": "a b c"}) + "\n")
    (tmp_path / "heal.md").write_text("# Healing\n")
    heal_script.place_on_frontier(tmp_path, "dir", "f.gguf", {}, heldout, ["f16", "q4_0"], 4)
    text = (tmp_path / "heal.md").read_text()
    assert "| healed 4096 tokens | q4_0 | 4.5 | 108 | 7.11 | 1.140 | yes |" in text
    assert "| ratio on held | frontier |" in text and "worst" not in text  # one kind of text was scored
    assert "| original | q4_0 | 4.5 | 216 | 3.56 | 1.060 |" in text
    assert json.loads((tmp_path / "frontier.json").read_text())["scored"] == scored


def test_families_benchmark_runs_and_divides_by_the_control(tmp_path):
    """eval/families.py end to end at toy size (3 training steps, closed form): both families trained, converted at
    both budgets and scored on every domain; the table divides Qwen3's worst unseen ratio by the Llama control's."""
    script = ROOT / "eval" / "families.py"
    run = subprocess.run([sys.executable, str(script), "--output-dir", str(tmp_path), "--steps", "3", "--methods",
                          "closed-form", "--eval-windows", "2", "--calib-samples", "4", "--vocab", "512"],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "families.jsonl").read_text().splitlines()]
    assert {(r["family"], r["cache"], r["domain"]) for r in rows} == {
        (f, c, d) for f in ("llama", "qwen3") for c in ("full", "half") for d in ("news", "forum", "code", "docs")}
    full = {r["family"]: r for r in rows if r["cache"] == "full" and r["domain"] == "forum"}
    assert full["llama"]["ratio"] == pytest.approx(1.0, abs=1e-3)  # the control converts exactly at full rank
    assert full["qwen3"]["q_fold_error_mean"] > 0 and full["llama"]["q_fold_error_mean"] is None
    worst = {f: max(r["ratio"] for r in rows if r["family"] == f and r["cache"] == "half" and r["domain"] != "news")
             for f in ("llama", "qwen3")}
    assert f"= {worst['qwen3']:.3f} / {worst['llama']:.3f} = {worst['qwen3'] / worst['llama']:.3f}x" in run.stdout


def test_refine_ablation_refuses_an_unknown_setting_before_any_work(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "eval" / "refine_ablation.py"), "--output-dir", str(tmp_path),
                          "--configs", "default;fast=refine_stepz=5"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "'refine_stepz' is not one of refine_steps" in run.stderr.strip().splitlines()[-1], run.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_refine_ablation_scores_each_setting_on_every_domain(tmp_path, monkeypatch):
    # a captured problem whose targets come from a known layer and whose start is that layer perturbed:
    # refinement must bring every domain's error below the start's, and a rerun must not redo a row
    import torch

    from transmla_tool.ops.mla import MLAWeights, mla_attention

    torch.manual_seed(0)
    d, heads, dn, dr, dv, r, length = 16, 2, 4, 4, 4, 6, 12
    true = MLAWeights(q=torch.randn(heads * (dn + dr), d) / 4, kv_a=torch.randn(r + dr, d) / 4,
                      kv_b=torch.randn(heads * (dn + dv), r) / 2, o=torch.randn(d, heads * dv) / 2,
                      num_heads=heads, latent_dim=r, rope_dim=dr, nope_dim=dn, v_dim=dv)
    start = MLAWeights(**{**true.__dict__, "kv_b": true.kv_b + 0.3 * torch.randn_like(true.kv_b)})
    angles = torch.arange(length)[:, None] * torch.tensor([1.0, 0.1])[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    x = torch.randn(10, length, d)
    with torch.no_grad():
        y = mla_attention(x, true, cos, sin)
    kwargs = {"steps": 600, "lr": 4e-3, "batch": 4, "queries": 128, "holdout": 2, "seed": 7, "anchor": 0.0,
              "noise": 0.0, "value_solve": 0}
    torch.save({"mla": start, "x": x, "y": y, "cos": cos, "sin": sin, "kwargs": kwargs}, tmp_path / "L7.pt")
    for domain in ("forum", "code", "docs"):
        other = torch.randn(3, length, d)
        with torch.no_grad():
            torch.save({"x": other, "y": mla_attention(other, true, cos, sin)}, tmp_path / f"L7-{domain}.pt")
    module = _eval_module("refine_ablation")
    argv = ["refine_ablation.py", "--output-dir", str(tmp_path), "--layers", "7",
            "--configs", "short=refine_steps=60,refine_batch=2,refine_lr=1e-2"]
    monkeypatch.setattr(sys, "argv", argv)
    module.main()
    rows = {r["config"]: r for r in map(json.loads, (tmp_path / "ablation.jsonl").read_text().splitlines())}
    assert set(rows) == {"closed form", "short"}
    assert rows["short"]["overrides"] == {"steps": 60, "batch": 2, "lr": 1e-2}
    for domain in ("news", "forum", "code", "docs"):
        assert rows["short"][domain] < 0.5 * rows["closed form"][domain], (domain, rows)
    assert "| 7 | short |" in (tmp_path / "ablation.md").read_text()
    module.main()  # resumed: nothing redone
    assert len((tmp_path / "ablation.jsonl").read_text().splitlines()) == 2
    monkeypatch.setattr(sys, "argv", [*argv, "--latent-dim", "64"])
    with pytest.raises(SystemExit, match="captured with"):
        module.main()  # problems captured at another size are never reused


def test_rope_key_scales_rows(make_model, convert_tiny, text_file):
    """eval/rope_key_scales.py: rescaling the rotary key leaves the exact model alone (the exact cache reads the
    same after every candidate), a per-layer fit never raises the layer-local error it minimizes, and the
    scales change what the quantized cache holds. (A tiny random model's perplexity may even fall under q4_0.)"""
    module = _eval_module("rope_key_scales")
    converted, _, _ = convert_tiny(make_model("llama", kv_heads=2), latent_dim=24, rope_dim=8)
    bench = module.Bench(str(converted), text_file, {"text": text_file}, 4, 64, 2)
    rows = list(module.measure(bench, [(0.0, 0.0), (0.25, 0.25)], ["pairs"], "q4_0", ["q4_0"]))
    assert [r["scales"] for r in rows] == ["exact cache", "energy^-0 query^0", "energy^-0.25 query^0.25",
                                          "fit pairs on q4_0"]
    exact = rows[0]["perplexities"]["text"]
    quantized = [r["perplexities"]["text"] for r in rows[1:]]
    assert exact not in quantized and len(set(quantized)) == 3  # the cache was read through, each scale differs
    assert bench.perplexities(None) == rows[0]["perplexities"]
    for index, (w, moment) in enumerate(zip(bench.start, bench.moments)):
        fitted = module.scale_rope_pairs(w, bench.fit(index, w, moment, "pairs", "q4_0"))
        assert bench.local_error(index, fitted, "q4_0") <= bench.local_error(index, w, "q4_0")


def test_frontier_stops_before_any_work_on_another_llama_cpp_build(tmp_path):
    """Resuming a frontier directory with another llama.cpp build refuses at once, not after a conversion and a
    first score (a stand-in llama-perplexity answers --version and marks any other call)."""
    bin_dir = tmp_path / "llama.cpp" / "build" / "bin"
    bin_dir.mkdir(parents=True)
    fake = bin_dir / "llama-perplexity"
    fake.write_text(f'#!/bin/sh\n[ "$1" = "--version" ] && echo "version: 9 (fake)" && exit 0\ntouch {tmp_path}/ran\n')
    fake.chmod(0o755)
    out = tmp_path / "f"
    out.mkdir()
    rows = [{**row, "engine": "llama.cpp 1 (abc)", "cpu_kernels": "SSE3 AVX AVX2"} for row in _frontier_rows()]
    (out / "frontier.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = subprocess.run([sys.executable, str(ROOT / "eval" / "frontier.py"), "--output-dir", str(out), "--configs",
                          ""], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TRANSMLA_LLAMA_CPP_BIN": str(bin_dir)})
    assert run.returncode != 0
    assert "this is llama.cpp 9 (fake) on CPU kernels not known yet" in run.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "ran").exists() and sorted(p.name for p in out.iterdir()) == ["frontier.jsonl"]


def test_benchmarks_refuse_to_resume_rows_scored_on_other_windows(tmp_path):
    """A row's key names what was converted, not the text it was scored on: resuming with another --ctx/--chunks
    (frontier) or --eval-windows (crossdomain, quality) would find the rows done, or divide new scores by an
    original scored on other text, so the run refuses; the frontier table names its windows."""
    check = _eval_module("quality").check_same_scoring
    rows, results = _frontier_rows(), tmp_path / "frontier.jsonl"
    check(rows, results, {"ctx": 512, "chunks": 16})  # the same windows: resumed
    for ctx, chunks in ((2048, 16), (512, 24)):
        with pytest.raises(SystemExit, match=f"scored with ctx 512, chunks 16; this run asks for ctx {ctx}, chunks "
                                             f"{chunks}: scores over other windows are not comparable"):
            check(rows, results, {"ctx": ctx, "chunks": chunks})
    with pytest.raises(SystemExit, match="scored with eval_windows not recorded; this run asks for eval_windows 8"):
        check([{"config": "original", "perplexity": 30.0}], results, {"eval_windows": 8})  # rows from before
    frontier = _eval_module("frontier")
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    frontier.write_tables(tmp_path, [216.0])
    assert "held-out text, 16 windows of 512 tokens." in (tmp_path / "frontier.md").read_text()
    rows[0]["ctx"] = 2048
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    frontier.write_tables(tmp_path, [216.0])
    assert "rows scored on different windows: their ratios are not comparable" in (tmp_path / "frontier.md").read_text()


def test_length_ablation_configs_and_table(tmp_path):
    """eval/length.py: a configuration names its budget, rotary size and calibration length; the table divides each
    length's perplexity by the original's at that length, and splits the longest length by position."""
    length = _eval_module("length")
    config = length.parse_length_config("nope=192/32/8192/closed-form:nope_rotation=expected")
    assert (config["budget"], config["rope_dim"], config["calib_seq_len"]) == (192, 32, 8192)
    assert config["preset"] == "closed-form" and config["overrides"] == ["nope_rotation=expected"]
    for bad in ("x=192/32/closed-form", "x=192/192/512/default", "=192/32/512/default"):
        with pytest.raises(SystemExit):
            length.parse_length_config(bad)

    def row(config, n, ppl, by_position, **extra):
        return {"config": config, "length": n, "domain": "docs", "perplexity": ppl, "eval_tokens": 8192,
                "calib": "mix-docs", "by_position": by_position, "seconds": 60, **extra}

    made = {"budget": 192, "rope_dim": 32, "calib_seq_len": 512, "convert_seconds": 90.0,
            "convert_peak_rss_mb": 2000.0}
    rows = [row("original", 512, 10.0, {"0": 2.3}), row("original", 4096, 8.0, {"0": 2.2, "512": 2.0, "2048": 2.0}),
            row("a", 512, 12.0, {"0": 2.48}, **made),
            row("a", 4096, 12.0, {"0": 2.3, "512": 2.4, "2048": 2.6}, **made)]
    (tmp_path / "length.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    length.write_table(tmp_path)
    table = (tmp_path / "length.md").read_text()
    assert "| a | 192 | 32 | 512 | 90.0 | 2000.0 | 1.200 | 1.500 | 1.250x |" in table
    assert "| positions 0-511 | positions 512-2047 | positions 2048-4095 |" in table
    assert f"| a | {math.exp(0.1):.3f} | {math.exp(0.4):.3f} | {math.exp(0.6):.3f} |" in table
    assert table.startswith("# Quality by context length (SmolLM2-135M,")  # rows before --model: SmolLM2's
    single = [r for r in rows if r["length"] == 4096]  # one length: no growth column to print as 1.000x
    (tmp_path / "length.jsonl").write_text("".join(json.dumps(r) + "\n" for r in single))
    length.write_table(tmp_path)
    table = (tmp_path / "length.md").read_text()
    assert "| a | 192 | 32 | 512 | 90.0 | 2000.0 | 1.500 |\n" in table and "growth" not in table


def test_length_scores_a_given_checkpoint_from_its_record(teacher_and_student_copy, make_model, tmp_path):
    """eval/length.py --checkpoint NAME=DIR: budget, rotary size, calibration length and method come from the
    checkpoint's conversion record; a directory without one, or a conversion of other weights, stops at once."""
    from transmla_tool.errors import UserError

    length = _eval_module("length")
    teacher, student = teacher_and_student_copy  # a copy whose record names a cost no clock can give by chance
    record = json.loads((student / "conversion.json").read_text())
    record["wall_time_s"] = 123.4
    (student / "conversion.json").write_text(json.dumps(record))
    empty = tmp_path / "ckpt"
    empty.mkdir()
    with pytest.raises(UserError, match="without a conversion.json written by transmla-tool"):
        length.checkpoint_config(f"r8={empty}", str(teacher), None)
    config, path, cost = length.checkpoint_config(f"r8={student}", str(teacher), None)
    assert (config["name"], config["budget"], config["rope_dim"], config["calib_seq_len"]) == ("r8", 16, 8, 64)
    assert (config["method"]["refine_steps"], config["calib_samples"], path) == (0, 8, student)  # closed form
    assert cost["convert_seconds"] == 123.4
    with pytest.raises(UserError, match="the weights differ"):  # same architecture, other weights
        length.checkpoint_config(f"r8={student}", str(make_model("llama", kv_heads=2)), None)
    with pytest.raises(UserError, match="is not LABEL=DIR"):
        length.checkpoint_config(str(student), str(teacher), None)


def test_ruler_refuses_a_checkpoint_of_other_weights_before_any_work(teacher_and_student, tmp_path, monkeypatch):
    """eval/ruler.py --checkpoint: a conversion of another model than --model is refused in one line before the
    tokenizer loads or a haystack is built (its needles would be scored against the wrong original)."""
    from transmla_tool.errors import UserError

    _, student = teacher_and_student
    ruler = _eval_module("ruler")
    loaded = []
    monkeypatch.setattr("transmla_tool.evaluate.models.load_tokenizer", lambda *a: loaded.append(a))
    monkeypatch.setattr(sys, "argv", ["ruler.py", "--output-dir", str(tmp_path), "--tasks", "niah_single_1",
                                      "--checkpoint", f"tiny={student}"])
    with pytest.raises(UserError, match="the weights differ"):
        ruler.main()
    assert loaded == [] and not (tmp_path / "ruler.jsonl").exists()


def test_a_gguf_carries_its_source_to_the_ruler_check(teacher_and_student, tmp_path, monkeypatch, capsys):
    """export-gguf writes the source conversion.json names into the GGUF, so ruler's LABEL=FILE.gguf is checked as a
    directory is: other weights refused before any work, its own source taken silently, a file without the record
    taken with a warning that names what could not be checked."""
    from transmla_tool.errors import UserError
    from transmla_tool.gguf_export import GGUFSettings, export_gguf, source_record
    from transmla_tool.provenance import gguf_converted_from

    teacher, student = teacher_and_student
    own = tmp_path / "own.gguf"
    export_gguf(GGUFSettings(checkpoint=str(student), output=str(own), tokenizer_pre="gpt-2"))
    record = json.loads((student / "conversion.json").read_text())
    assert source_record(own) == {"source_identity": record["source_identity"], "source": record["source"]}
    ruler = _eval_module("ruler")
    loaded = []
    monkeypatch.setattr("transmla_tool.evaluate.models.load_tokenizer", lambda *a: loaded.append(a))
    monkeypatch.setattr(sys, "argv", ["ruler.py", "--output-dir", str(tmp_path / "ruler"), "--engine", "llamacpp",
                                      "--tasks", "niah_single_1", "--checkpoint", f"tiny={own}"])
    with pytest.raises(UserError, match="the weights differ"):  # --model is SmolLM2, not the tiny teacher
        ruler.main()
    assert loaded == [] and not (tmp_path / "ruler" / "ruler.jsonl").exists()
    capsys.readouterr()
    gguf_converted_from(str(own), "--checkpoint tiny:", str(teacher), None)
    assert capsys.readouterr().err == ""
    config = json.loads((student / "config.json").read_text())  # the cached row, read from the GGUF or the config
    row = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    assert ruler._cached_row(str(own), "", "") == ruler._cached_row(str(student), "", "") == {"mla_values": row}
    assert ruler.analytic_bytes("q8_0", **ruler._cached_row(str(own), "", "")) == row * 34 / 32

    older = tmp_path / "older"
    shutil.copytree(student, older)
    del record["source_identity"]
    (older / "conversion.json").write_text(json.dumps(record))
    unrecorded = tmp_path / "unrecorded.gguf"
    export_gguf(GGUFSettings(checkpoint=str(older), output=str(unrecorded), tokenizer_pre="gpt-2"))
    assert "source_identity" not in source_record(unrecorded)
    gguf_converted_from(str(unrecorded), "--checkpoint tiny:", str(teacher), None)
    assert f"cannot check that --model {teacher} is that model" in capsys.readouterr().err


def test_heal_memory_rows_per_arm_and_length(teacher_and_student, text_file, tmp_path):
    """eval/heal_memory.py: each (arm, length) healed in its own process, its peak memory and whether the chunked loss
    ran recorded; a rerun measures nothing again; a malformed arm stops before any work."""
    teacher, student = teacher_and_student
    argv = [sys.executable, str(ROOT / "eval" / "heal_memory.py"), "--model", str(student), "--teacher", str(teacher),
            "--data", str(text_file), "--output-dir", str(tmp_path / "hm"), "--lengths", "16,48",
            "--arms", "whole=0;chunked-gc=24,gc", "--steps", "2"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "hm" / "heal_memory.jsonl").read_text().splitlines()]
    got = {(r["arm"], r["length"]): r for r in rows}
    assert set(got) == {("whole", 16), ("whole", 48), ("chunked-gc", 16), ("chunked-gc", 48)}
    assert got[("chunked-gc", 48)]["loss_chunk_used"] == 24 and got[("chunked-gc", 48)]["loss_chunk_checks"] == 2
    assert got[("chunked-gc", 16)]["loss_chunk_used"] is None  # a window within one chunk is read whole
    assert got[("whole", 48)]["loss_chunk_used"] is None
    for r in rows:  # loading and training each read from the kernel; the process's peak covers both, and the saving of
        # the last checkpoint after them (on CI that added 0.3 MiB over the training's own peak)
        assert r["setup_peak_rss_mb"] > 100 and r["train_peak_rss_mb"] > 100
        assert r["peak_rss_mb"] >= max(r["setup_peak_rss_mb"], r["train_peak_rss_mb"])
    assert "| chunked-gc | 24 | yes | 48 |" in (tmp_path / "hm" / "heal_memory.md").read_text()
    again = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and "==" not in again.stdout
    bad = subprocess.run(argv[:-4] + ["--arms", "x=abc"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "NAME=LOSS_CHUNK" in bad.stderr


@pytest.mark.engines
def test_llamacpp_speed_times_each_file_and_cache(make_model, convert_tiny, tmp_path):
    """eval/llamacpp_speed.py: one row per (GGUF, cache type) with positive prefill, decode and re-decode speeds;
    a missing file stops before any timing."""
    from transmla_tool.engines.llamacpp_lm import bindings_installed
    from transmla_tool.gguf_export import GGUFSettings, export_gguf
    from transmla_tool.methods import PRESETS

    if not bindings_installed():
        pytest.skip("llama-cpp-python is not installed (make engines)")
    out, _, _ = convert_tiny(make_model("llama", kv_heads=2), latent_dim=24, rope_dim=8,
                             method=PRESETS["closed-form"], target="llamacpp")
    gguf = tmp_path / "converted.gguf"
    export_gguf(GGUFSettings(checkpoint=str(out), output=str(gguf), outtype="f32", tokenizer_pre="gpt-2"))
    script = str(ROOT / "eval" / "llamacpp_speed.py")
    run = subprocess.run([sys.executable, script, "--gguf", str(gguf), "--cache-types", "f16,f32", "--prompt", "40",
                          "--decode", "3", "--suffix", "10", "--repeats", "2"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.strip("|").split("|") for line in run.stdout.splitlines() if line.startswith("| converted.gguf")]
    assert [r[1].strip() for r in rows] == ["f16", "f32"]
    assert all(float(cell) > 0 for r in rows for cell in r[2:])
    missing = subprocess.run([sys.executable, script, "--gguf", str(tmp_path / "none.gguf")], capture_output=True,
                             text=True, timeout=60)
    assert missing.returncode != 0 and "is not a file" in missing.stderr


def test_bias_fold_benchmark_refuses_an_unknown_variant_and_reads_layer_sets(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "eval" / "bias_fold.py"), "--output-dir", str(tmp_path),
                          "--variants", "joint-rotating,joint-everything"], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "unknown variants ['joint-everything']" in run.stderr
    assert not list(tmp_path.iterdir())  # before any work
    module = _eval_module("bias_fold")
    assert module._layer_set("0-1,5") == {0, 1, 5} and module._layer_set("") is None
    # a refined run is its own row; a training-free one keeps the key of the rows made before --refine-steps
    args = argparse.Namespace(model="m", rope_dim=64, calib="news", heldout="docs", calib_samples=32, heldout_windows=8,
                              seq_len=512, layers=0, constant_channel=False, fold_layers="", refine_steps=0)
    assert "refine_steps" not in module._key(args, 160, "keep")
    args.refine_steps = 600
    assert module._key(args, 160, "keep")["refine_steps"] == 600


def _frontier_on_recorder(make_model, tmp_path, monkeypatch, extra=()):
    """eval/frontier.py on a tiny model with llama.cpp replaced by a recorder (the engine runs in
    tests/test_engines.py): (module, scored), where `scored` lists every (model file, flags) llama.cpp was asked to
    score and `conversions` on the module's namespace lists convert_many's calls."""
    import transmla_tool.engines.llamacpp as llamacpp
    import transmla_tool.gguf_export as gguf_export
    frontier = _eval_module("frontier")
    model = make_model("llama", heads=4, kv_heads=2, head_dim=16)
    scored = []

    def perplexity(model_file, text_file, ctx, chunks, flags=()):
        scored.append((Path(model_file).name, tuple(flags)))
        return {"perplexity": 10.0 + len(scored), "chunks": chunks, "kv_bytes_per_token_per_layer": 64.0,
                "kv_cells": ctx, "kv_layers": 2, "cpu_kernels": "AVX2"}

    def export(settings):
        Path(settings.output).write_bytes(b"GGUF")  # what was exported is what gets scored
        return {"run_flags": []}

    monkeypatch.setattr(llamacpp, "llama_cpp_version", lambda: "llama.cpp test")
    monkeypatch.setattr(llamacpp, "perplexity", perplexity)
    monkeypatch.setattr(llamacpp, "quantize", lambda src, dst, *a, **k: Path(dst).write_bytes(b"GGUF"))
    monkeypatch.setattr(gguf_export, "export_gguf", export)
    # the registry's models are GGUF files; the tiny one is a checkpoint directory, converted as such
    monkeypatch.setattr(frontier, "model_gguf", lambda name: (str(model), "model.gguf"))
    monkeypatch.setattr(frontier, "kv_values", lambda directory, gguf: 2 * 16)
    convert_many = frontier.convert_many
    frontier.conversions = []

    def counted(settings, outputs):
        frontier.conversions.append(sorted(outputs))
        return convert_many(dataclasses.replace(settings, gguf_file=None), outputs)

    monkeypatch.setattr(frontier, "convert_many", counted)
    finished = frontier.finished_conversion  # asked of what the tiny model was converted from, likewise
    monkeypatch.setattr(frontier, "finished_conversion",
                        lambda ckpt, settings, latent: finished(ckpt, dataclasses.replace(settings, gguf_file=None),
                                                                latent))
    argv = ["frontier.py", "--output-dir", str(tmp_path / "frontier"), "--calib", "mix-docs", "--budgets", "24,32",
            "--rope-dim", "8", "--calib-samples", "4", "--calib-seq-len", "32", "--cache-types", "f16,f32",
            "--original-cache-types", "f16", "--chunks", "2", "--ctx", "64", "--device", "cpu", *extra]
    monkeypatch.setattr(sys, "argv", argv)
    return frontier, scored


def _converted_rows(out: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (out / "frontier.jsonl").read_text().splitlines()]
    return sorted((r["budget"], r["cache"], r["domain"]) for r in rows if r["model"] == "converted")


@pytest.mark.parametrize("keep", [True, False])
def test_frontier_keeps_scored_checkpoints_only_when_asked(make_model, tmp_path, monkeypatch, keep):
    """eval/frontier.py end to end: each budget is converted once, scored under each cache type on the held-out
    domain, and its checkpoint is kept (a loadable conversion, for cache_split, rebalance or heal) only under
    --keep-checkpoints, its GGUF (with the flags llama.cpp needs, for benchmarks.py) only under --keep-gguf."""
    frontier, scored = _frontier_on_recorder(make_model, tmp_path, monkeypatch,
                                             ["--keep-checkpoints", "--keep-gguf"] if keep else [])
    frontier.main()
    out = tmp_path / "frontier"
    assert _converted_rows(out) == [(24, "f16", "docs"), (24, "f32", "docs"), (32, "f16", "docs"), (32, "f32", "docs")]
    assert len(scored) == 5  # the original once, each conversion under both caches
    assert frontier.conversions == [[16, 24]]  # both budgets in one pass of calibration
    kept = sorted(p.name for p in (out / "ckpt").iterdir() if not p.name.startswith("."))
    if keep:
        assert kept == ["mix-docs-default-24", "mix-docs-default-32"]
        config = json.loads((out / "ckpt" / "mix-docs-default-24" / "config.json").read_text())
        assert (config["kv_lora_rank"], config["qk_rope_head_dim"]) == (16, 8)
        assert sorted(p.name for p in (out / "gguf").glob("mix-docs-*")) == [
            f"mix-docs-default-{b}{end}" for b in (24, 32) for end in ("-f32.gguf", ".run-flags.json")]
        assert isinstance(json.loads((out / "gguf" / "mix-docs-default-24.run-flags.json").read_text()), list)
    else:
        assert kept == []
        assert not list((out / "gguf").glob("mix-docs-*"))  # the GGUFs go either way without --keep-gguf


def test_frontier_killed_while_scoring_does_not_convert_again(make_model, tmp_path, monkeypatch):
    """A frontier run killed while llama.cpp scores its conversions resumes from the finished checkpoints: the missing
    rows are scored, nothing is converted twice. A checkpoint made with other settings is never taken for one."""
    import transmla_tool.engines.llamacpp as llamacpp
    frontier, scored = _frontier_on_recorder(make_model, tmp_path, monkeypatch,
                                             ["--configs", "quick=default:refine_steps=2"])
    record = llamacpp.perplexity

    def killed(model_file, *args, **kwargs):
        if len(scored) == 2:  # the original, then the 24 budget under f16; killed under f32
            raise KeyboardInterrupt
        return record(model_file, *args, **kwargs)

    llamacpp.perplexity = killed
    with pytest.raises(KeyboardInterrupt):
        frontier.main()
    out = tmp_path / "frontier"
    assert _converted_rows(out) == [(24, "f16", "docs")]
    ckpt = out / "ckpt" / "mix-docs-quick-24"
    # the finished checkpoint is recognised for what it was made from, and only that
    method = frontier.resolve_method("default", ["refine_steps=2"])
    settings = frontier.ConvertSettings(
        model=str(tmp_path), output="", latent_dim=24, rope_dim=8, method=method)
    assert frontier.finished_conversion(ckpt, settings, 16) is None  # another source model
    made = json.loads((ckpt / "conversion.json").read_text())["settings"]
    fields = {f.name for f in dataclasses.fields(frontier.ConvertSettings)} - {"method", "output"}
    settings = frontier.ConvertSettings(**{k: v for k, v in made.items() if k in fields}, output="", method=method)
    assert frontier.finished_conversion(ckpt, settings, 16)["settings"]["latent_dim"] == 16
    assert frontier.finished_conversion(ckpt, settings, 8) is None
    other = frontier.resolve_method("default", [])
    assert frontier.finished_conversion(ckpt, dataclasses.replace(settings, method=other), 16) is None

    llamacpp.perplexity = record
    frontier.main()
    assert _converted_rows(out) == [(24, "f16", "docs"), (24, "f32", "docs"), (32, "f16", "docs"), (32, "f32", "docs")]
    assert frontier.conversions == [[16, 24]]  # the first run's pass only
    assert len(scored) == 5


def test_frontier_scores_a_finished_checkpoint_on_the_text_its_calibration_left_out(make_model, tmp_path,
                                                                                     monkeypatch, capsys):
    """eval/frontier.py --checkpoint NAME=DIR: a conversion made elsewhere is exported and scored as it is (nothing
    converted), on the domain its recorded calibration left out, with how it was made in its rows; a rerun scores
    nothing again, and a checkpoint calibrated on other documents than the splits scored here is refused before any
    work (its held-out text could be its calibration text)."""
    frontier, scored = _frontier_on_recorder(make_model, tmp_path, monkeypatch,
                                             ["--keep-checkpoints", "--budgets", "24"])
    frontier.main()  # a conversion kept by an earlier run: the checkpoint scored below
    first = tmp_path / "frontier"
    ckpt = first / "ckpt" / "mix-docs-default-24"
    labelled = frontier.labelled_checkpoint  # the tiny model is a directory, not the registry's GGUF
    monkeypatch.setattr(frontier, "labelled_checkpoint",
                        lambda spec, flag, model, gguf: labelled(spec, flag, model, None))
    out = tmp_path / "at-length"
    argv = [a for a in sys.argv if a not in ("--keep-checkpoints",)]
    argv[argv.index("--output-dir") + 1] = str(out)
    monkeypatch.setattr(sys, "argv", [*argv, "--configs", "", "--calib", "news", "--data-dir", str(first / "data"),
                                      "--checkpoint", f"kept={ckpt}"])
    del scored[:]
    frontier.conversions = []
    frontier.main()
    rows = [json.loads(line) for line in (out / "frontier.jsonl").read_text().splitlines()]
    converted = [r for r in rows if r["model"] == "converted"]
    assert frontier.conversions == []
    assert sorted((r["config"], r["calib"], r["budget"], r["cache"], r["domain"]) for r in converted) == [
        ("kept", "mix-docs", 24, "f16", "docs"), ("kept", "mix-docs", 24, "f32", "docs")]
    made = json.loads((ckpt / "conversion.json").read_text())["settings"]
    assert {(r["checkpoint"], r["calib_seq_len"], r["latent_dim"], r["healed_tokens"]) for r in converted} == {
        (str(ckpt), made["calib_seq_len"], 16, 0)}
    # the original on docs alone: the checkpoint's unseen text (--calib's news, unused, would add three kinds)
    assert sorted(r["domain"] for r in rows if r["model"] == "original") == ["docs"]
    assert [name for name, _ in scored] == ["original-f32.gguf", *["mix-docs-kept-24-f32.gguf"] * 2]
    assert not list((out / "gguf").glob("mix-docs-*"))  # exported to be scored, then deleted (no --keep-gguf)
    table = (out / "frontier.md").read_text()
    assert "kept 16 + 8" in table and f'--checkpoint "kept={ckpt}"' in table

    frontier.main()  # resumed: nothing left to score
    assert len(scored) == 3

    other = tmp_path / "other-data"
    shutil.copytree(first / "data", other)
    (other / "news-calib.jsonl").write_text(json.dumps({"text": "other documents"}) + "\n")
    monkeypatch.setattr(sys, "argv", [*argv[:argv.index("--output-dir") + 1], str(tmp_path / "refused"),
                                      *argv[argv.index("--output-dir") + 2:], "--configs", "", "--data-dir",
                                      str(other), "--checkpoint", f"kept={ckpt}"])
    refused = "other documents than this run's .*news-calib.jsonl.*those in .*frontier/data"
    with pytest.raises(SystemExit, match=refused):
        frontier.main()
    assert len(scored) == 3


def test_benchmarks_start_in_a_new_directory(tmp_path, monkeypatch):
    """eval/benchmarks.py pointed at a --frontier-dir that does not exist yet (only the original and --checkpoint
    points): the original's F32 GGUF is written there. llama-quantize cannot create the folder it writes into, so the
    recorder refuses as it does; lm-eval and the bindings are replaced (they run in tests/test_benchmarks.py)."""
    import transmla_tool.engines.llamacpp as llamacpp
    import transmla_tool.engines.llamacpp_lm as llamacpp_lm
    import transmla_tool.evaluate.lmeval as lmeval
    import transmla_tool.evaluate.models as models
    import transmla_tool.evaluate.tasks as tasks
    benchmarks = _eval_module("benchmarks")

    def quantize(src, dst, *args, **kwargs):
        if not Path(dst).parent.is_dir():
            raise RuntimeError("llama-quantize failed (exit 1): basic_ios::clear: iostream error")
        Path(dst).write_bytes(b"GGUF")

    class Engine:
        def __init__(self, model_file, *args, **kwargs):
            assert Path(model_file).read_bytes() == b"GGUF"

        def close(self):
            pass

    def run(engine, names, data, limit, num_fewshot):
        return {names[0]: {"metrics": {"acc": 0.5, "acc_norm": 0.5}, "stderr": {"acc": 0.1, "acc_norm": 0.1},
                           "rows": limit, "rows_available": 570, "num_fewshot": [num_fewshot],
                           "higher_is_better": {"acc": True, "acc_norm": True},
                           "samples": {"acc": "10", "acc_norm": "01"}}}

    monkeypatch.setattr(llamacpp, "quantize", quantize)
    monkeypatch.setattr(llamacpp_lm, "LlamaCppLM", Engine)
    monkeypatch.setattr(llamacpp_lm, "bindings_version", lambda: "llama-cpp-python test")
    monkeypatch.setattr(llamacpp_lm, "cpu_kernels", lambda: "AVX2")
    monkeypatch.setattr(lmeval, "run_lm_eval", run)
    monkeypatch.setattr(models, "load_tokenizer", lambda *a: None)
    monkeypatch.setattr(tasks, "resolve", lambda *a: {})
    monkeypatch.setattr(benchmarks, "model_gguf", lambda name: (str(tmp_path), "model.gguf"))
    out = tmp_path / "new" / "bench"
    monkeypatch.setattr(sys, "argv", ["benchmarks.py", "--frontier-dir", str(out), "--tasks", "arc_easy", "--limit",
                                      "2", "--original-cache-types", "f16"])
    benchmarks.main()
    rows = [json.loads(line) for line in (out / "benchmarks.jsonl").read_text().splitlines()]
    assert [(r["model"], r["cache"], r["task"], r["rows"]) for r in rows] == [("original", "f16", "arc_easy", 2)]
    assert (out / "gguf" / "original-f32.gguf").exists() and (out / "benchmarks.md").exists()


def test_benchmark_table_steps_are_what_each_script_takes(tmp_path):
    """eval/benchmark_table.py chains frontier.py, heal.py and benchmarks.py: every step parses with that script's own
    parser (a renamed flag fails here, not hours into a run), every point of the table reaches benchmarks.py (its
    frontier conversion made at its size and cache type, its healed model where heal.py writes it), and --dry-run
    runs nothing."""
    table = _eval_module("benchmark_table")
    parsers = {name: _eval_module(name).build_parser() for name in ("frontier", "heal", "benchmarks")}
    steps = table.plan(tmp_path, 250, 409_600, 16, True)
    parsed = [(Path(step[1]).stem, parsers[Path(step[1]).stem].parse_args(step[2:])) for step in steps]
    assert [name for name, _ in parsed] == ["frontier", "frontier", "heal", "heal", "heal", "heal", "benchmarks"]
    made = {(c.split("=")[0], int(b), cache, a.rope_dim) for name, a in parsed if name == "frontier"
            for c in a.configs.split(";") for b in a.budgets.split(",") for cache in a.cache_types.split(",")}
    healed = {}
    for name, a in parsed:
        if name == "heal":
            assert a.data == "mix-docs" and a.max_tokens == 409_600
            healed[str(a.output_dir)] = a
    bench = parsed[-1][1]
    assert bench.limit == 250 and bench.tasks.endswith(",mmlu")
    for spec, point in zip(bench.points.split(";"), table.POINTS):
        calib_config_budget, cache = spec.split(":")
        _, config, budget = calib_config_budget.split("/")
        assert (config, int(budget), cache, point.rope) in made
    assert len(bench.checkpoint) == len(table.POINTS)
    for spec, point in zip(bench.checkpoint, table.POINTS):
        directory, cache = spec.split("=", 1)[1].rsplit(":", 1)
        run = healed[str(tmp_path / f"heal-{point.name}")]
        assert (run.latent_dim, run.rope_dim, run.cache_type, cache) == (point.latent, point.rope, point.heal_cache,
                                                                          point.cache)
        assert Path(directory) == Path(run.output_dir) / f"healed-{point.budget}-{run.rebalance}"
    # no healing: the training-free points alone
    assert [Path(s[1]).stem for s in table.plan(tmp_path, None, 0, 16, False)] == ["frontier", "frontier", "benchmarks"]
    run = subprocess.run([sys.executable, str(ROOT / "eval" / "benchmark_table.py"), "--output-dir",
                          str(tmp_path / "table"), "--dry-run"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("\n[") + 1 == 7 and not (tmp_path / "table").exists()


def test_copying_scores_exactly_the_repeat_and_pairs_the_table(teacher_and_student, tmp_path):
    """eval/copying.py: a span of random tokens then the same span; hits counted on the repeat's copyable positions
    only (a model that copies from `span` back scores 1, one that repeats the current token 0); the chunked path
    gives the whole path's numbers; the table pairs a checkpoint with the original per sequence."""
    from types import SimpleNamespace

    import torch

    from transmla_tool.evaluate.models import load_model

    copying = _eval_module("copying")
    ids = copying.repeated_spans(vocab=5000, span=6, count=4, seed=0)
    assert ids.shape == (4, 12) and torch.equal(ids[:, :6], ids[:, 6:])
    assert torch.equal(ids, copying.repeated_spans(5000, 6, 4, 0)) and ids.min() >= copying.SKIP

    class Shifted(torch.nn.Module):
        """Logits at position j pick the token `back` positions before j + 1 (back = 1: the current token)."""

        def __init__(self, back):
            super().__init__()
            self.back, self.w = back, torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            picked = torch.roll(x, self.back - 1, dims=1)
            return SimpleNamespace(logits=torch.nn.functional.one_hot(picked, 5000).float() * 10)

    assert copying.copy_scores(Shifted(6), ids, 6, batch_size=3, chunk=0)["accuracy"] == 1.0
    assert copying.copy_scores(Shifted(1), ids, 6, batch_size=3, chunk=0)["accuracy"] == 0.0

    teacher, student = teacher_and_student
    model = load_model(str(student), None, torch.float32, torch.device("cpu"))
    tiny = copying.repeated_spans(model.get_output_embeddings().weight.shape[0], 24, 3, 0)
    starts, read = [], copying.position_logits

    def recording(*args):
        for start, logits in read(*args):
            starts.append(start)
            yield start, logits

    copying.position_logits = recording
    whole = copying.copy_scores(model, tiny, 24, batch_size=2, chunk=0)
    assert starts == [0, 0]
    starts.clear()
    chunked = copying.copy_scores(model, tiny, 24, batch_size=2, chunk=16)
    assert starts == [0, 16, 32] * 2  # the chunked path ran: 47 positions, 16 at a time, for each of 2 batches
    assert whole["per_sequence"] == chunked["per_sequence"]
    assert chunked["nll"] == pytest.approx(whole["nll"], rel=1e-5)

    def row(label, hits):
        return {"model": label, "span": 64, "sequences": 4, "seed": 0, "source_model": "smollm2-135m",
                "accuracy": sum(hits) / 4, "accuracy_stderr": 0.01, "nll": 1.0, "per_sequence": hits, "seconds": 6}

    rows = [row("original", [0.7, 0.6, 0.8, 0.7]), row("a", [0.3, 0.36, 0.4, 0.3]), row("b", [0.7, 0.62, 0.78, 0.7])]
    (tmp_path / "copying.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    copying.write_table(tmp_path)
    table = (tmp_path / "copying.md").read_text()
    assert "| a | 0.340 ± 0.010 (-36.0 ± 4.0, loss) |" in table
    assert "| b | 0.700 ± 0.010 (+0.0 ± 0.8, within noise) |" in table


def test_checkpoint_specs_parse_alike_in_every_script(make_model, convert_tiny):
    """eval/quality.parse_checkpoint serves copying.py (one simulated cache) and benchmarks.py (llama.cpp caches, a
    list): a list where one is allowed, an unknown cache type, a missing directory and a colon in a directory's own
    name each get their answer; given the scripts' original, a conversion of other weights is refused."""
    from transmla_tool.errors import UserError
    from transmla_tool.methods import PRESETS

    quality = _eval_module("quality")
    source = make_model("llama", kv_heads=2, head_dim=32)
    wide, _, _ = convert_tiny(source, 32, rope_dim=32, method=PRESETS["closed-form"])
    assert quality.parse_checkpoint(f"b={wide}:f16,iq4_nl", several_caches=True) == ("b", str(wide), ["f16", "iq4_nl"])
    assert quality.parse_checkpoint(f"b={wide}:f16", source=(str(source), None)) == ("b", str(wide), ["f16"])
    twin = make_model("llama", seed=1, kv_heads=2, head_dim=32)  # same shape, other weights
    with pytest.raises(UserError, match="the weights differ"):  # benchmarks.py and copying.py pass --model's
        quality.parse_checkpoint(f"b={wide}:f16", source=(str(twin), None))
    with pytest.raises(SystemExit, match="one cache type per checkpoint here"):
        quality.parse_checkpoint(f"b={wide}:f16,iq4_nl")
    with pytest.raises(SystemExit, match="unknown cache type 'q4_k'"):
        quality.parse_checkpoint(f"b={wide}:f16,q4_k", several_caches=True)
    with pytest.raises(SystemExit, match="give LABEL=DIR or LABEL=DIR:CACHE,CACHE..., DIR a checkpoint"):
        quality.parse_checkpoint(f"b={wide}-missing:f16", several_caches=True)
    from transmla_tool.heal.settings import check_cache_type  # copying.py's: a cache simulated in torch, f32 none
    assert quality.parse_checkpoint(f"b={wide}:f32") == ("b", str(wide), ["f32"])
    with pytest.raises(SystemExit, match="--cache-type f32: healing can train through"):
        quality.parse_checkpoint(f"b={wide}:f32", check_type=check_cache_type)
    colon = Path(wide).parent / "run:1"
    shutil.copytree(wide, colon)
    assert quality.parse_checkpoint(f"c={colon}") == ("c", str(colon), [])


def test_copying_reads_a_checkpoint_through_the_cache_type_it_names(make_model, convert_tiny, teacher_and_student):
    """eval/copying.py `LABEL=DIR:q4_0`: the checkpoint's attention reads its cache through the q4_0 quantizer (the
    layers are replaced, and the scores move), a cache type the checkpoint's row cannot hold is one line, and a plain
    LABEL=DIR stays exact."""
    import torch

    from transmla_tool.heal.model import NaturalAttention
    from transmla_tool.methods import PRESETS

    copying = _eval_module("copying")
    wide, _, _ = convert_tiny(make_model("llama", kv_heads=2, head_dim=32), 32, rope_dim=32,
                              method=PRESETS["closed-form"])
    assert copying.parse_checkpoint(f"q={wide}:q4_0") == ("q", str(wide), ["q4_0"])
    assert copying.parse_checkpoint(f"e={wide}") == ("e", str(wide), [])
    _, student = teacher_and_student  # a latent that is no multiple of 32: no q4_0 row
    with pytest.raises(SystemExit, match="--checkpoint 'q=.*:q4_0': --cache-type q4_0: "):
        copying.parse_checkpoint(f"q={student}:q4_0")

    exact = copying.load_scored(str(wide), None, None, torch.device("cpu"))
    quantized = copying.load_scored(str(wide), None, "q4_0", torch.device("cpu"))
    attention = [layer.self_attn for layer in quantized.model.layers]
    assert all(isinstance(a, NaturalAttention) and a.cache_type == "q4_0" for a in attention)
    ids = copying.repeated_spans(exact.get_output_embeddings().weight.shape[0], 16, 2, 0)
    assert copying.copy_scores(quantized, ids, 16, batch_size=2)["nll"] != copying.copy_scores(exact, ids, 16,
                                                                                               batch_size=2)["nll"]


def test_ruler_table_merges_offsets_by_sample_index_and_pairs_what_both_hold(tmp_path):
    """eval/ruler.py --offset: a model's rows at offsets 0 and 10 form one 20-sample cell; a difference from the
    original is paired over the samples both hold, and a cell with another count says so."""
    ruler = _eval_module("ruler")

    def row(model, offset, samples):
        return {"model": model, "engine": "llamacpp", "cache": "f16", "task": "niah_single_1", "length": 8192,
                "limit": 10, "offset": offset, "source_model": "smollm2-135m", "samples": samples,
                "accuracy": samples.count("1") / len(samples), "rows": len(samples), "seconds": 1.0}

    rows = [row("original", 0, "1" * 10), row("mla", 10, "0000011111"), row("original", 10, "1111111111"),
            row("short", 0, "1111100000"), row("apart", 20, "1100000000")]
    rows[0]["bytes"] = 768.0  # recorded since 2026-12-06: one row of a cell says the cell's bytes
    first = {k: v for k, v in row("mla", 0, "1111111100").items() if k != "offset"}  # a row from before --offset
    rows.append(first)
    (tmp_path / "ruler.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cells = ruler.merged(rows)
    assert "".join(cells[("mla", "llamacpp", "f16", "niah_single_1", 8192)][i] for i in range(20)) == \
        "1111111100" + "0000011111"
    ruler.write_table(tmp_path)
    table = (tmp_path / "ruler.md").read_text()
    assert "20 samples per task and length unless a cell says" in table
    assert "| original | llamacpp | f16 | 768 | niah_single_1 |" in table
    mla = next(line for line in table.splitlines() if line.startswith("| mla |"))
    assert "| mla | llamacpp | f16 |  | niah_single_1 |" in mla  # no row says: left blank, not guessed
    assert "| 0.65 (-0.35 ± 0.11, loss) |" in mla  # 13 of 20, paired over all 20
    short = next(line for line in table.splitlines() if line.startswith("| short |"))
    assert "| 0.50 of 10 (-0.50 ± 0.17, loss) |" in short  # paired over the first ten only
    apart = next(line for line in table.splitlines() if line.startswith("| apart |"))
    assert "| 0.20 of 10 |" in apart  # samples the original was not scored on: no difference to show
