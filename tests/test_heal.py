"""Healing on tiny trained models: it learns, resumes exactly, exports stock, runs under accelerate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from helpers import rel_err, sample_ids
from transmla_tool.heal.model import to_natural
from transmla_tool.heal.train import HealSettings, heal
from transmla_tool.methods import PRESETS


def _settings(teacher, student, text_file, out, **kw):
    values = dict(model=str(student), output=str(out), data=str(text_file), teacher=str(teacher), seq_len=64,
                  batch_size=4, lr=3e-3, max_steps=12, eval_data=str(text_file), eval_every=6, eval_windows=6,
                  progress=False, seed=1)
    values.update(kw)
    return HealSettings(**values)


def _log(out) -> list[dict]:
    return [json.loads(line) for line in (Path(f"{out}.ckpt") / "log.jsonl").read_text().splitlines()]


def test_healing_reduces_loss_and_exports_stock(teacher_and_student, text_file, tmp_path):
    teacher, student = teacher_and_student
    out = tmp_path / "healed"
    steps = []
    summary = heal(_settings(teacher, student, text_file, out, max_steps=30, eval_every=15),
                   on_step=lambda s, m: steps.append(m))
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 4 * 64
    first, last = sum(m["kd"] for m in steps[:5]) / 5, sum(m["kd"] for m in steps[-5:]) / 5
    assert last < 0.7 * first, (first, last)
    evals = [row["eval_perplexity"] for row in _log(out) if "eval_perplexity" in row]
    assert evals[-1] < evals[0], evals

    # The export is a stock checkpoint equal to the trained natural-form model.
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and (out / "healing.json").exists()
    ids = sample_ids(config["vocab_size"])
    stock = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    natural = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    to_natural(natural)
    trained = load_file(Path(f"{out}.ckpt") / "step-30" / "trainable.safetensors")
    assert trained and all(".self_attn." in name for name in trained)  # lean: only what was trained
    missing, unexpected = natural.load_state_dict(trained, strict=False)
    assert not unexpected and all(".self_attn." not in name for name in missing)
    assert summary["tokens_per_s"] > 0 and summary["output_dtype"] == "float32"
    with torch.no_grad():
        assert rel_err(stock(ids).logits, natural(ids, use_cache=False).logits) < 1e-5


def test_train_all_heals_the_mlp_and_embeddings_too(teacher_and_student, text_file, tmp_path):
    """`--train all`: every parameter is trained (MLP, embeddings and head with the attention), the checkpoint holds
    them all, and the export carries the trained MLP, not the converted one."""
    teacher, student = teacher_and_student
    out = tmp_path / "healed-all"
    heal(_settings(teacher, student, text_file, out, train="all", max_steps=4, save_every=2, eval_every=0))
    trained = load_file(Path(f"{out}.ckpt") / "step-2" / "trainable.safetensors")
    natural = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    to_natural(natural)
    before = dict(natural.named_parameters())
    assert set(trained) == set(before)
    for name in ("model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert not torch.equal(trained[name], before[name]), name
    exported = load_file(out / "model.safetensors")
    converted = load_file(Path(student) / "model.safetensors")
    assert not torch.equal(exported["model.layers.0.mlp.down_proj.weight"],
                           converted["model.layers.0.mlp.down_proj.weight"])


def test_resume_equals_uninterrupted(teacher_and_student, text_file, tmp_path):
    teacher, student = teacher_and_student
    straight = tmp_path / "straight"
    heal(_settings(teacher, student, text_file, straight, save_every=3))

    resumed = tmp_path / "resumed"

    def crash(step, metrics):
        if step == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        heal(_settings(teacher, student, text_file, resumed, save_every=3), on_step=crash)
    assert not resumed.exists()  # nothing that looks finished
    heal(_settings(teacher, student, text_file, resumed, save_every=3, resume=True))
    # steps 4 and 5 ran twice (after the step-3 checkpoint, then again on resuming): the log has each step once
    assert [row["step"] for row in _log(resumed)] == list(range(13))
    evals = [[row["eval_perplexity"] for row in _log(out) if "eval_perplexity" in row] for out in (straight, resumed)]
    assert evals[0] == evals[1] and len(evals[0]) == 3
    a = load_file(straight / "model.safetensors")
    b = load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_gradient_accumulation_is_one_larger_batch(teacher_and_student, text_file, tmp_path):
    """--batch-size 2 --grad-accum 2 reads the same windows as --batch-size 4 and makes the same optimizer steps:
    the weights agree to rounding (the way to a batch that does not fit in memory, e.g. batch 16 on a 24 GB CPU)."""
    teacher, student = teacher_and_student
    whole, split = tmp_path / "whole", tmp_path / "split"
    a = heal(_settings(teacher, student, text_file, whole, max_steps=4, eval_every=0))
    b = heal(_settings(teacher, student, text_file, split, max_steps=4, eval_every=0, batch_size=2, grad_accum=2))
    assert a["steps"] == b["steps"] == 4 and a["tokens"] == b["tokens"] == 4 * 4 * 64
    # each step logs the loss of its whole batch: the mean over the micro-batches, not the last one's
    steps = [[row for row in _log(out) if "loss" in row] for out in (whole, split)]
    assert len(steps[0]) == 4
    for row, split_row in zip(*steps, strict=True):
        assert abs(row["loss"] - split_row["loss"]) < 1e-4 * row["loss"], (row, split_row)
        assert row["kd"] == row["loss"] and split_row["kd"] == split_row["loss"]
    first, second = load_file(whole / "model.safetensors"), load_file(split / "model.safetensors")
    start = {k: v for shard in Path(student).glob("*.safetensors") for k, v in load_file(shard).items()}
    moved = [k for k in first if ".self_attn." in k and not torch.equal(first[k], start[k])]
    assert moved  # the steps did train
    for key in first:
        assert rel_err(first[key], second[key]) < 1e-4, key


def test_a_killed_run_leaves_no_rows_in_the_next_runs_log(teacher_and_student, text_file, tmp_path):
    """A process killed before its first checkpoint (SIGKILL, e.g. out of memory: no clean-up runs) leaves its log
    behind; the next run starts a new log instead of appending to it."""
    teacher, student = teacher_and_student
    out = tmp_path / "healed"
    leftover = Path(f"{out}.ckpt")
    leftover.mkdir()
    (leftover / "log.jsonl").write_text('{"step": 0, "tokens": 0, "eval_perplexity": 99.0}\n'
                                        '{"step": 1, "tokens": 256, "loss": 9.0}\n')
    heal(_settings(teacher, student, text_file, out, max_steps=2, eval_every=2))
    rows = _log(out)
    assert [row["step"] for row in rows] == [0, 1, 2] and rows[0]["eval_perplexity"] != 99.0


def test_a_resumed_log_keeps_the_rows_up_to_its_checkpoint(tmp_path):
    from transmla_tool.heal.train import _restart_log

    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0, "eval_perplexity": 9.0}\n{"step": 0, "eval_perplexity": 9.0}\n'
                   '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "loss": 1.4}\n{"step": 4, "lo')
    _restart_log(log, 2)  # resumed from the step-2 checkpoint; step 3 and a half-written row came after it
    assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == [0, 1, 2]
    _restart_log(log, None)
    assert not log.exists()


def test_bf16_student_heals_to_bf16_and_prunes_checkpoints(teacher_and_student, text_file, tmp_path):
    """The healed checkpoint keeps the converted checkpoint's dtype (bf16 here), and --save-total-limit
    keeps only the newest checkpoints."""
    from transformers import AutoModelForCausalLM as Auto

    teacher, student = teacher_and_student
    bf16 = tmp_path / "student-bf16"
    Auto.from_pretrained(student, dtype=torch.bfloat16).save_pretrained(bf16)
    for name in ("tokenizer.json", "tokenizer_config.json", "conversion.json"):
        if (student / name).exists():
            (bf16 / name).write_bytes((student / name).read_bytes())
    out = tmp_path / "healed-bf16"
    summary = heal(_settings(teacher, bf16, text_file, out, max_steps=6, save_every=2, save_total_limit=2,
                             eval_data=None))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    assert summary["output_dtype"] == "bfloat16"
    assert sorted(p.name for p in Path(f"{out}.ckpt").glob("step-*")) == ["step-4", "step-6"]


def test_heal_needs_a_loss(teacher_and_student, text_file, tmp_path, capsys):
    from transmla_tool.cli import main

    _, student = teacher_and_student
    code = main(["heal", "--model", str(student), "--output", str(tmp_path / "h"), "--data", str(text_file)])
    assert code == 2 and "pass --teacher or --lm-weight" in capsys.readouterr().err


def test_accelerate_launch_two_cpu_processes(teacher_and_student, text_file, tmp_path):
    """Two DDP processes on CPUs: the run trains, exports, and its learning rate follows the schedule of the
    run's optimizer steps (warm-up, then cosine), not one stepped once per process per step. The loss reads the
    logits in chunks (--loss-chunk below --seq-len) through the DDP wrapper."""
    from transmla_tool.heal.train import _lr_lambda

    teacher, student = teacher_and_student
    out = tmp_path / "ddp"
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2", "--num_machines",
           "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "transmla_tool", "heal",
           "--model", str(student), "--teacher", str(teacher), "--data", str(text_file), "--output", str(out),
           "--seq-len", "64", "--batch-size", "2", "--max-steps", "4", "--warmup-steps", "2", "--lr", "3e-3",
           "--eval-data", str(text_file), "--eval-every", "4", "--eval-windows", "4", "--no-progress",
           "--loss-chunk", "24"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((out / "healing.json").read_text())
    assert summary["processes"] == 2 and summary["tokens"] == 4 * 2 * 2 * 64
    assert summary["loss_chunk"] == 24 and summary["loss_chunk_checks"] == 4
    logged = [row["lr"] for row in _log(out) if "lr" in row]
    factor = _lr_lambda(4, 2)
    assert logged == pytest.approx([3e-3 * factor(step) for step in range(1, 5)], rel=1e-9)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert torch.isfinite(model(sample_ids(model.config.vocab_size)).logits).all()


@pytest.mark.parametrize("change,needle", [
    (dict(lr=1e-3), "lr 0.003 -> 0.001"),
    (dict(batch_size=2), "batch_size 4 -> 2"),
    (dict(seq_len=32), "seq_len 64 -> 32"),
    (dict(eval_seq_len=128), "eval_seq_len None -> 128"),  # logged perplexities of two lengths would mix
    (dict(repeat_share=0.5), "repeat_share None -> 0.5"),  # recorded only when used: older checkpoints resume
])
def test_resume_refuses_other_settings(teacher_and_student, text_file, tmp_path, change, needle):
    from transmla_tool.errors import UserError

    teacher, student = teacher_and_student
    out = tmp_path / "h"

    def crash(step, metrics):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        heal(_settings(teacher, student, text_file, out, max_steps=6, save_every=2, eval_data=None), on_step=crash)
    with pytest.raises(UserError, match=needle):
        heal(_settings(teacher, student, text_file, out, max_steps=6, save_every=2, eval_data=None, resume=True,
                       **change))
    # settings that do not shape the training may change
    heal(_settings(teacher, student, text_file, out, max_steps=6, save_every=3, eval_data=None, resume=True))
    assert json.loads((out / "healing.json").read_text())["steps"] == 6


def test_heal_scores_held_out_windows_of_eval_seq_len(teacher_and_student, text_file, tmp_path, monkeypatch):
    """Trained on 32-token windows, scored on 96-token ones: the logged step-0 perplexity is the converted model's
    own on 96-token windows, not on the training length's, and their logits are read a --loss-chunk at a time
    although the training windows are shorter than it."""
    from transmla_tool.data import token_windows
    from transmla_tool.evaluate.models import load_tokenizer
    from transmla_tool.evaluate.perplexity import perplexity

    import transmla_tool.heal.train as train

    teacher, student = teacher_and_student
    out = tmp_path / "h"
    read, scored = train.window_nll, []

    def recording(model, ids, chunk):  # the held-out windows' logits are read 48 positions at a time
        scored.append((ids.shape[1], chunk))
        return read(model, ids, chunk)

    monkeypatch.setattr(train, "window_nll", recording)
    heal(_settings(teacher, student, text_file, out, seq_len=32, eval_seq_len=96, eval_windows=3, max_steps=1,
                   eval_every=1, loss_chunk=48))
    assert scored and set(scored) == {(96, 48)}, scored
    logged = _log(out)[0]["eval_perplexity"]
    model = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(str(student), None)
    with torch.no_grad():
        at = {n: perplexity(model, token_windows(str(text_file), tokenizer, n, 3), progress=False)["perplexity"]
              for n in (32, 96)}
    assert logged == pytest.approx(at[96], rel=1e-4) and abs(at[96] - at[32]) > 1e-3 * at[32], (logged, at)
    assert json.loads((out / "healing.json").read_text())["settings"]["eval_seq_len"] == 96


def test_the_training_peak_leaves_out_the_held_out_evaluations(teacher_and_student, text_file, tmp_path,
                                                              monkeypatch):
    """healing.json's train_peak_rss_mb is the training steps' own peak: an evaluation between them that touches
    600 MB more (as long held-out windows do, --eval-seq-len) shows in eval_peak_rss_mb and the process's peak, not
    in the training one."""
    import numpy as np

    import transmla_tool.heal.train as train

    if train.vm_hwm_mb() is None:
        pytest.skip("no /proc/self/status here: no peak RSS to read")
    teacher, student = teacher_and_student
    evaluate, mb = train.evaluate_perplexity, 600

    def heavy(*args):
        block = np.ones(mb * 2**20, dtype=np.uint8)  # every page written: resident
        value = evaluate(*args)
        del block
        return value

    monkeypatch.setattr(train, "evaluate_perplexity", heavy)
    out = tmp_path / "h"
    heal(_settings(teacher, student, text_file, out, max_steps=2, eval_every=1, eval_windows=2))
    summary = json.loads((out / "healing.json").read_text())
    assert summary["eval_peak_rss_mb"] > summary["train_peak_rss_mb"] + 0.8 * mb, summary
    assert summary["peak_rss_mb"] >= summary["eval_peak_rss_mb"]


@pytest.mark.parametrize("flags,needle", [
    (["--eval-seq-len", "0"], "--eval-seq-len must be >= 1"),
    (["--max-steps", "0"], "--max-steps must be >= 1"),
    (["--max-steps", "-3"], "--max-steps must be >= 1"),
    (["--max-tokens", "0"], "--max-tokens must be >= 1"),
    (["--repeat-share", "1.5"], "--repeat-share must be between 0 and 1"),
])
def test_heal_step_counts_are_checked(teacher_and_student, text_file, tmp_path, capsys, flags, needle):
    from transmla_tool.cli import main

    teacher, student = teacher_and_student
    out = tmp_path / "h"
    code = main(["heal", "--model", str(student), "--teacher", str(teacher), "--output", str(out), "--data",
                 str(text_file), *flags])
    assert code == 2 and needle in capsys.readouterr().err
    assert not out.exists() and not Path(f"{out}.ckpt").exists()


def test_heal_refuses_a_deepseek_checkpoint_it_did_not_convert(teacher_and_student, text_file, tmp_path, capsys):
    """A DeepSeek-V3 checkpoint without convert's conversion.json (a genuine DeepSeek model) is refused:
    healing assumes the linearized latent norm."""
    from transmla_tool.cli import main

    teacher, student = teacher_and_student
    other = tmp_path / "other"
    AutoModelForCausalLM.from_pretrained(student).save_pretrained(other)
    code = main(["heal", "--model", str(other), "--teacher", str(teacher), "--output", str(tmp_path / "h"),
                 "--data", str(text_file)])
    assert code == 2 and "no conversion.json written by transmla-tool convert" in capsys.readouterr().err


def test_missing_data_leaves_no_checkpoint_dir(teacher_and_student, tmp_path, capsys):
    from transmla_tool.cli import main

    teacher, student = teacher_and_student
    out = tmp_path / "h"
    code = main(["heal", "--model", str(student), "--teacher", str(teacher), "--output", str(out), "--data",
                 str(tmp_path / "missing.txt"), "--max-steps", "2"])
    assert code == 2 and "does not exist" in capsys.readouterr().err
    assert not out.exists() and not Path(f"{out}.ckpt").exists()


@pytest.fixture(scope="module")
def qat_student(trained_model, text_file, tmp_path_factory):
    """A tiny teacher with 32-wide heads converted at latent 32 + rope 32: one q4_0 block each, as llama.cpp needs."""
    from transmla_tool.convert import ConvertSettings, convert

    teacher = trained_model("llama", kv_heads=2, head_dim=32)
    student = tmp_path_factory.mktemp("heal-qat") / "student"
    convert(ConvertSettings(model=str(teacher), output=str(student), latent_dim=32, rope_dim=32,
                            calib_data=str(text_file), calib_samples=8, calib_seq_len=64, dtype="float32",
                            device="cpu", progress=False, method=PRESETS["closed-form"]))
    return teacher, student


def test_natural_attention_reads_through_the_cache_type():
    """NaturalAttention with a cache type is the layer run over that quantized cache (the llama.cpp row store),
    with straight-through gradients reaching every projection."""
    from transmla_tool.heal.model import NaturalAttention
    from transmla_tool.ops.kv_quant import cache_row_store
    from transmla_tool.ops.mla import MLAWeights, mla_attention
    from transmla_tool.ops.rope import rotation_cos_sin

    gen = torch.Generator().manual_seed(0)
    heads, r, dr, dn, dv, d = 2, 24, 8, 8, 8, 32
    w = MLAWeights(q=torch.randn(heads * (dn + dr), d, generator=gen), kv_a=torch.randn(r + dr, d, generator=gen),
                   kv_b=torch.randn(heads * (dn + dv), r, generator=gen), o=torch.randn(d, heads * dv, generator=gen),
                   num_heads=heads, latent_dim=r, rope_dim=dr, nope_dim=dn, v_dim=dv)
    x = torch.randn(2, 16, d, generator=gen)
    cos, sin = (t.float() for t in rotation_cos_sin(10000.0 ** -(torch.arange(0, dr, 2) / dr), torch.arange(16)))
    exact = NaturalAttention(w, 0)
    quantized = NaturalAttention(w, 0, "q4_0")
    out = quantized(x, (cos, sin))[0]
    assert torch.allclose(out, mla_attention(x, w, cos, sin, cache_store=cache_row_store("q4_0", r)))
    assert rel_err(out, exact(x, (cos, sin))[0]) > 1e-3  # the quantizer is really in the path
    assert quantized.cache_reads == 1 and exact.cache_reads == 0
    out.pow(2).sum().backward()
    for proj in (quantized.q_proj, quantized.kv_a_proj, quantized.kv_b_proj, quantized.o_proj):
        assert proj.weight.grad is not None and proj.weight.grad.abs().sum() > 0


def test_quantization_aware_healing(qat_student, text_file, tmp_path):
    """heal --cache-type q4_0 trains and evaluates through the simulated cache, records it, and says so on the
    model card; the same run without it evaluates the same starting model exactly (a different number)."""
    teacher, student = qat_student
    runs = {}
    for name, cache in (("exact", None), ("q4_0", "q4_0")):
        out = tmp_path / name
        summary = heal(_settings(teacher, student, text_file, out, max_steps=4, eval_every=4, cache_type=cache))
        runs[name] = (out, summary, [r["eval_perplexity"] for r in _log(out) if "eval_perplexity" in r])
    (out, summary, evals), (_, _, exact_evals) = runs["q4_0"], runs["exact"]
    assert summary["settings"]["cache_type"] == "q4_0"
    assert abs(evals[0] / exact_evals[0] - 1) > 1e-4, (evals, exact_evals)  # step 0 read the q4_0 cache
    assert "Trained through a q4_0 KV cache" in (out / "README.md").read_text()
    assert json.loads((out / "healing.json").read_text())["settings"]["cache_type"] == "q4_0"


@pytest.mark.parametrize("cache,student_fixture,needle", [
    ("q3_k", "qat_student", "healing can train through"),
    ("q4_0", "teacher_and_student", "whose latent (8) or rotary key (8) is not a multiple of 32"),
])
def test_heal_cache_type_is_checked(request, text_file, tmp_path, capsys, cache, student_fixture, needle):
    from transmla_tool.cli import main

    teacher, student = request.getfixturevalue(student_fixture)
    out = tmp_path / "h"
    code = main(["heal", "--model", str(student), "--teacher", str(teacher), "--output", str(out), "--data",
                 str(text_file), "--max-steps", "2", "--cache-type", cache])
    assert code == 2 and needle in capsys.readouterr().err
    assert not out.exists() and not Path(f"{out}.ckpt").exists()


def test_healing_a_kept_query_norm(make_model, text_file, tmp_path):
    """A Qwen3 conversion keeps one RMSNorm over its query (q_lora path): healing trains q_proj and q_b_proj
    through that norm in natural form and exports a stock checkpoint equal to what it trained, its
    q_a_layernorm still genuine (weight 1, not linearized)."""
    from transmla_tool.convert import ConvertSettings, convert

    teacher = make_model("qwen3", kv_heads=2)
    student = tmp_path / "student"
    convert(ConvertSettings(model=str(teacher), output=str(student), latent_dim=24, rope_dim=8,
                            calib_data=str(text_file), calib_samples=8, calib_seq_len=64, dtype="float32",
                            device="cpu", progress=False, method=PRESETS["closed-form"]))
    out = tmp_path / "healed"
    heal(_settings(teacher, student, text_file, out, max_steps=3, eval_every=3))
    trained = load_file(Path(f"{out}.ckpt") / "step-3" / "trainable.safetensors")
    start = load_file(student / "model.safetensors")
    name = "model.layers.0.self_attn.q_b_proj.weight"
    assert name in trained and not torch.equal(trained[name], start[name])  # trained through the norm
    healed = load_file(out / "model.safetensors")
    assert torch.equal(healed["model.layers.0.self_attn.q_a_layernorm.weight"], torch.ones(start[name].shape[1]))
    stock = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    natural = AutoModelForCausalLM.from_pretrained(student, dtype=torch.float32).eval()
    to_natural(natural)
    missing, unexpected = natural.load_state_dict(trained, strict=False)
    assert not unexpected and all(".self_attn." not in n for n in missing)
    ids = sample_ids(stock.config.vocab_size)
    with torch.no_grad():
        assert rel_err(stock(ids).logits, natural(ids, use_cache=False).logits) < 1e-5


def test_the_loss_at_length_holds_one_chunk_of_logits_and_trains_the_same(teacher_and_student, text_file, tmp_path):
    """--seq-len longer than --loss-chunk: the loss reads logits a chunk at a time (the fast path ran: every step's
    check counted), and the run equals the whole-window one to rounding (losses, held-out perplexity, weights)."""
    teacher, student = teacher_and_student
    whole, chunked = tmp_path / "whole", tmp_path / "chunked"
    a = heal(_settings(teacher, student, text_file, whole, max_steps=3, eval_every=3, loss_chunk=0, lm_weight=0.5))
    b = heal(_settings(teacher, student, text_file, chunked, max_steps=3, eval_every=3, loss_chunk=24, lm_weight=0.5))
    assert a["loss_chunk"] is None and a["loss_chunk_checks"] == 0
    assert b["loss_chunk"] == 24 and b["loss_chunk_checks"] == 3
    for row, other in zip(_log(whole), _log(chunked), strict=True):
        for key in ("loss", "kd", "lm", "eval_perplexity"):
            if key in row:
                assert abs(row[key] - other[key]) < 1e-4 * abs(row[key]), (key, row, other)
    first, second = load_file(whole / "model.safetensors"), load_file(chunked / "model.safetensors")
    for key in first:
        assert rel_err(first[key], second[key]) < 1e-4, key


def test_gradient_checkpointing_recomputes_every_layer_and_trains_the_same(teacher_and_student, text_file, tmp_path):
    """--gradient-checkpointing: every decoder layer recomputes in the backward pass (the modules' own flags, read
    back into the summary), turned on through transformers' current name (the deprecated one's FutureWarning is an
    error here), and the run equals one without it to rounding."""
    teacher, student = teacher_and_student
    plain, checkpointed = tmp_path / "plain", tmp_path / "checkpointed"
    a = heal(_settings(teacher, student, text_file, plain, max_steps=3, eval_every=3))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*gradient_checkpointing", category=FutureWarning)
        b = heal(_settings(teacher, student, text_file, checkpointed, max_steps=3, eval_every=3,
                           gradient_checkpointing=True))
    layers = json.loads((Path(student) / "config.json").read_text())["num_hidden_layers"]
    assert a["checkpointed_layers"] == 0 and b["checkpointed_layers"] == layers
    for row, other in zip(_log(plain), _log(checkpointed), strict=True):
        for key in ("loss", "kd", "lm", "eval_perplexity"):
            if key in row:
                assert abs(row[key] - other[key]) <= 1e-4 * abs(row[key]), (key, row, other)


def test_chunked_distill_loss_equals_the_whole_one_with_its_gradient():
    from types import SimpleNamespace

    from transmla_tool.heal.loss import chunked_distill_loss, distill_loss

    torch.manual_seed(0)
    settings = SimpleNamespace(kd_weight=1.0, lm_weight=0.3, temperature=2.0)
    head, teacher_head = torch.nn.Linear(16, 50, bias=False), torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(2, 37, 16, requires_grad=True)
    target = torch.randn(2, 37, 16)
    labels = torch.randint(0, 50, (2, 37))
    whole = distill_loss(head(hidden), teacher_head(target), labels, settings)
    (grad_whole,) = torch.autograd.grad(whole[0], hidden)
    parts = chunked_distill_loss(hidden, head, target, teacher_head, labels, settings, chunk=10)
    (grad_parts,) = torch.autograd.grad(parts[0], hidden)
    for x, y in zip(whole, parts, strict=True):
        assert torch.allclose(x, y, rtol=1e-5), (x, y)
    assert rel_err(grad_parts, grad_whole) < 1e-5


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "phi3", "granite", "gemma"])
def test_the_last_hidden_state_gives_every_familys_logits(make_model, family):
    """A teacher of any family is read through its last hidden state and output layer: the check inside FinalHidden
    passes (Granite's logit scaling included) and the chunked held-out NLL equals the whole-window one."""
    from transmla_tool.heal.loss import FinalHidden, output_layer, window_nll

    model = AutoModelForCausalLM.from_pretrained(make_model(family), dtype=torch.float32).eval()
    ids = sample_ids(model.config.vocab_size, length=40)
    reader = FinalHidden(model)
    with torch.no_grad():
        hidden = reader(ids)
        assert reader.checks == 1
        assert rel_err(output_layer(model)(hidden), model(ids).logits) < 1e-5
        assert torch.allclose(window_nll(model, ids, chunk=16), window_nll(model, ids, chunk=0), rtol=1e-6)


def test_an_output_the_chunked_loss_does_not_know_is_an_error(make_model):
    """A family whose logits are not its output layer on the last hidden state (here a scale the forward does not
    apply) stops the chunked loss rather than training on other logits."""
    from transmla_tool.heal.loss import FinalHidden

    model = AutoModelForCausalLM.from_pretrained(make_model("llama"), dtype=torch.float32).eval()
    model.config.logits_scaling = 4.0
    with torch.no_grad(), pytest.raises(RuntimeError, match="--loss-chunk 0"):
        FinalHidden(model)(sample_ids(model.config.vocab_size, length=20))


def test_training_attention_runs_on_the_flash_kernel_whose_memory_is_linear():
    """MLA attention whose values are narrower than its keys (every conversion: dn + dr > dv) pads the values so that
    PyTorch's flash kernel takes it: with only that kernel allowed it runs (the math path, an (L, L) map per head, is
    what made healing at 8192 tokens need ~10 GB), and it equals the math path, gradients included."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from transmla_tool.ops.mla import MLAWeights, mla_attention
    from transmla_tool.ops.rope import rotation_cos_sin

    gen = torch.Generator().manual_seed(0)
    heads, r, dr, dn, dv, d, length = 3, 24, 8, 16, 12, 32, 40
    w = MLAWeights(q=torch.randn(heads * (dn + dr), d, generator=gen) / 4,
                   kv_a=torch.randn(r + dr, d, generator=gen) / 4,
                   kv_b=torch.randn(heads * (dn + dv), r, generator=gen) / 4,
                   o=torch.randn(d, heads * dv, generator=gen) / 4,
                   num_heads=heads, latent_dim=r, rope_dim=dr, nope_dim=dn, v_dim=dv)
    cos, sin = (t.float() for t in rotation_cos_sin(10000.0 ** -(torch.arange(0, dr, 2) / dr), torch.arange(length)))
    x = torch.randn(2, length, d, generator=gen)
    results = []
    for positions in (None, torch.arange(length)):  # the causal (padded, flash) path; the masked one, as reference
        xi = x.clone().requires_grad_(True)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION] if positions is None else [SDPBackend.MATH]):
            out = mla_attention(xi, w, cos, sin, query_positions=positions)
            out.pow(2).sum().backward()
        results.append((out.detach(), xi.grad))
    (flash, flash_grad), (reference, reference_grad) = results
    assert rel_err(flash, reference) < 1e-5 and rel_err(flash_grad, reference_grad) < 1e-4
    # why the padding: this PyTorch's flash kernel refuses values narrower than the keys
    q = torch.randn(1, 1, 4, dn + dr)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, q, torch.randn(1, 1, 4, dv), is_causal=True)


def test_heal_line_says_which_speed_and_which_peak():
    """heal's last line: a one-step run has no steady state and must not call its wall speed one; the peaks of loading
    and of training are both printed (the kernel's counter is reset between them)."""
    from transmla_tool.cli import heal_line

    base = {"steps": 1, "tokens": 8192, "wall_tokens_per_s": 39.6, "output_dtype": "float32",
            "setup_peak_rss_mb": 2100.4, "train_peak_rss_mb": 5699.0, "eval_peak_rss_mb": None, "peak_rss_mb": 5699.0,
            "train_peak_gpu_mb": None}
    line = heal_line({**base, "tokens_per_s": None}, "out")
    assert "40 tokens/s wall (no steady state" in line and "steady state (wall" not in line
    assert "peak RSS 2100 MB loading / 5699 MB training" in line and "GPU" not in line
    assert "evaluation" not in line  # none ran
    line = heal_line({**base, "tokens_per_s": None, "eval_peak_rss_mb": 7912.3}, "out")
    assert "peak RSS 2100 MB loading / 5699 MB training / 7912 MB held-out evaluation" in line
    line = heal_line({**base, "steps": 4, "tokens_per_s": 41.2, "train_peak_gpu_mb": 900.0}, "out")
    assert "41 tokens/s steady state (wall 40)" in line and line.endswith("peak GPU 900 MB training -> out (float32)")
