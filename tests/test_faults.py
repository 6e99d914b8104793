"""Faults and hostile input: every case ends in one line and exit status 2, or in the correct result; none deletes
what it did not create, and none returns a model other than the one asked for.

Kills are real: a subprocess runs the CLI with one function wrapped to SIGKILL the process at the chosen moment (no
clean-up code runs, as after the OOM killer or a power cut), then the same command is run again with --resume.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from transmla_tool.cli import main


def _cli(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err.strip()


def _one_line_error(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert needle in err, err


def _tree(path: Path) -> dict[str, str]:
    """Every file under path with its sha256: what a refused command must leave exactly as it was."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _weights(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture
def source(make_model, tmp_path):
    """A private copy of a tiny Llama (tests below damage or swap it)."""
    path = tmp_path / "source"
    shutil.copytree(make_model("llama", kv_heads=2), path)
    return path


@pytest.fixture
def convert_args(source, text_file, tmp_path):
    def args(output=None, **overrides):
        values = {"--model": source, "--latent-dim": 12, "--rope-dim": 8, "--output": output or tmp_path / "out",
                  "--calib-data": text_file, "--calib-samples": 4, "--calib-seq-len": 32, "--device": "cpu",
                  "--target": "auto", "--set": "refine_steps=2"}
        values.update(overrides)
        return ["convert", *[str(x) for k, v in values.items() if v is not None for x in (k, v)], "--no-progress"]

    return args


def _kill_run(args: list[str], target: str, when: str = "after", nth: int = 1) -> subprocess.CompletedProcess:
    """Run the CLI in a subprocess that SIGKILLs itself at the nth call of `target` (module:attribute), `before` or
    `after` the call runs, or `midway` through a directory removal (its first file removed)."""
    module, attribute = target.split(":")
    owner, _, name = attribute.rpartition(".")
    code = textwrap.dedent(f"""
        import os, signal, sys
        import importlib
        holder = importlib.import_module({module!r})
        {f"holder = getattr(holder, {owner!r})" if owner else ""}
        original = getattr(holder, {name!r})
        calls = [0]
        def wrapped(*args, **kwargs):
            calls[0] += 1
            if calls[0] == {nth} and {when!r} == "midway":  # rmtree cut short: one file gone (if any), then the kill
                for first in sorted(p for p in __import__("pathlib").Path(args[0]).iterdir())[:1]:
                    os.remove(first)
                os.kill(os.getpid(), signal.SIGKILL)
            if calls[0] == {nth} and {when!r} == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            result = original(*args, **kwargs)
            if calls[0] == {nth} and {when!r} == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        setattr(holder, {name!r}, wrapped)
        from transmla_tool.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=600)


# --- data loss -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["source", "parent"])
def test_overwrite_never_replaces_the_source(capsys, convert_args, source, where):
    """Issue case 1: --output the model's own directory or a parent of it, with --overwrite: refused, nothing gone."""
    target = source if where == "source" else source.parent
    (source.parent / "unrelated.txt").write_text("the user's")
    before = _tree(source.parent)
    code, err = _cli(capsys, *convert_args(output=target), "--overwrite")
    _one_line_error(code, err, "an input of this run")
    assert _tree(source.parent) == before


def test_heal_and_rebalance_refuse_to_write_over_their_input(capsys, teacher_and_student_copy, text_file):
    teacher, student = teacher_and_student_copy
    before = _tree(student)
    code, err = _cli(capsys, "heal", "--model", student, "--teacher", teacher, "--data", text_file, "--output",
                     student, "--overwrite", "--max-steps", 1, "--no-progress")
    _one_line_error(code, err, "is an input of this run")
    code, err = _cli(capsys, "rebalance", student, "--output", student, "--calib-data", text_file, "--overwrite")
    _one_line_error(code, err, "is an input of this run")
    code, err = _cli(capsys, "heal", "--model", student, "--teacher", teacher, "--data", text_file, "--output",
                     student.parent / "healed", "--checkpoint-dir", student, "--max-steps", 1, "--no-progress")
    _one_line_error(code, err, "--checkpoint-dir")
    assert _tree(student) == before


def test_overwrite_refuses_a_directory_this_tool_did_not_write(capsys, convert_args, tmp_path):
    mine = tmp_path / "out"
    (mine / "checkpoints").mkdir(parents=True)
    (mine / "checkpoints" / "weights.bin").write_bytes(b"precious")
    (mine / "notes.txt").write_text("mine")
    before = _tree(mine)
    code, err = _cli(capsys, *convert_args(), "--overwrite")
    _one_line_error(code, err, "was not written by transmla-tool")
    assert _tree(mine) == before


def test_sweep_overwrite_stages_and_never_mixes(capsys, source, text_file, tmp_path):
    """Issue case 2: sweep --overwrite into a directory it did not write is refused (its checkpoints/ kept); into its
    own earlier output it replaces the whole output, leaving nothing of the old one."""
    sweep = ["sweep", "--model", source, "--latent-dims", "12", "--rope-dim", "8", "--data", text_file,
             "--calib-samples", 4, "--calib-seq-len", 32, "--seq-len", 32, "--max-tokens", 128, "--target", "auto",
             "--set", "refine_steps=0", "--device", "cpu", "--no-progress"]
    user = tmp_path / "user"
    (user / "checkpoints").mkdir(parents=True)
    (user / "checkpoints" / "keep.pt").write_bytes(b"x")
    before = _tree(user)
    code, err = _cli(capsys, *sweep, "--output-dir", user, "--overwrite")
    _one_line_error(code, err, "was not written by transmla-tool")
    assert _tree(user) == before

    out = tmp_path / "sweep"
    assert main([str(a) for a in (*sweep, "--output-dir", out)]) == 0
    (out / "left-over.txt").write_text("from the first sweep")
    assert main([str(a) for a in (*sweep, "--output-dir", out, "--overwrite")]) == 0
    assert not (out / "left-over.txt").exists() and (out / "sweep.json").exists()
    assert not (out / "checkpoints").exists()  # not kept: removed before the rename, not after
    assert not list(tmp_path.glob(".sweep*"))


def test_overwrite_respects_a_running_conversion(capsys, convert_args, tmp_path):
    """Issue case 3: another live process holds the lock: --overwrite refuses (naming it) and leaves its work."""
    staging = tmp_path / ".out.partial"
    staging.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (staging / "LOCK").write_text(str(sleeper.pid))
        (staging / "RESUMABLE").touch()
        (staging / "layer-work").write_text("in progress")
        before = _tree(staging)
        code, err = _cli(capsys, *convert_args())
        _one_line_error(code, err, f"another process (pid {sleeper.pid})")
        assert "--overwrite" not in err  # the plain rerun is not sent to --overwrite
        code, err = _cli(capsys, *convert_args(), "--overwrite")
        _one_line_error(code, err, f"another process (pid {sleeper.pid})")
        assert _tree(staging) == before
    finally:
        sleeper.kill()
        sleeper.wait()


# --- a wrong model or a wrong number ---------------------------------------------------------------------------

def _interrupt_after_layer0(monkeypatch, args):
    from transmla_tool.io import writer

    original = writer.ShardedWriter.add_part

    def flaky(self, part, tensors):
        if part == "layer-00001":
            raise KeyboardInterrupt
        return original(self, part, tensors)

    with monkeypatch.context() as patch:
        patch.setattr(writer.ShardedWriter, "add_part", flaky)
        assert main(args) == 130


def test_resume_refuses_other_source_weights(capsys, monkeypatch, convert_args, source, make_model, tmp_path):
    """Issue case 4: the weights were swapped between the kill and the resume: refused, naming the source."""
    _interrupt_after_layer0(monkeypatch, convert_args())
    shutil.copy(make_model("llama", kv_heads=2, seed=1) / "model.safetensors", source / "model.safetensors")
    code, err = _cli(capsys, *convert_args(), "--resume")
    _one_line_error(code, err, "the source model (weight files changed: model.safetensors)")
    assert (tmp_path / ".out.partial" / "RESUMABLE").exists() and not (tmp_path / "out").exists()


def test_resume_refuses_another_batch_size(capsys, monkeypatch, convert_args, tmp_path):
    """Issue case 5: --batch-size changes the result's rounding, so a resume must keep it; the refusal names it."""
    _interrupt_after_layer0(monkeypatch, convert_args())
    code, err = _cli(capsys, *convert_args(**{"--batch-size": 3}), "--resume")
    _one_line_error(code, err, "--batch-size: 8 -> 3")


@pytest.fixture
def converted(convert_args, tmp_path):
    out = tmp_path / "converted"
    assert main(convert_args(output=out)) == 0
    return out


def _eval(original, converted_dir, text_file, out):
    return ["eval", "--original", original, "--converted", converted_dir, "--data", text_file, "--output-dir", out,
            "--seq-len", 32, "--max-tokens", 64, "--contexts", 32, "--new-tokens", 1, "--warmup-tokens", 0,
            "--attention", "stock", "--device", "cpu"]


def test_eval_refuses_other_tokenizers(capsys, converted, source, text_file, tmp_path):
    """Issue case 6: the converted model's tokenizer has the same vocabulary size in another order."""
    tokenizer = json.loads((converted / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    names = sorted(vocab, key=vocab.get)
    a, b = names[100], names[101]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (converted / "tokenizer.json").write_text(json.dumps(tokenizer))
    code, err = _cli(capsys, *_eval(source, converted, text_file, tmp_path / "report"))
    _one_line_error(code, err, "tokenizers of --original")
    assert not (tmp_path / "report").exists()


def test_eval_refuses_an_unrelated_original_and_a_plain_model(capsys, converted, make_model, source, text_file,
                                                               tmp_path):
    other = make_model("llama", kv_heads=2, seed=3)  # the same tokenizer and shapes, other weights
    code, err = _cli(capsys, *_eval(other, converted, text_file, tmp_path / "report"))
    _one_line_error(code, err, "was converted from")
    code, err = _cli(capsys, *_eval(source, source, text_file, tmp_path / "report"))
    _one_line_error(code, err, "is a llama model without a conversion.json")
    assert not (tmp_path / "report").exists()


def test_heal_refuses_a_teacher_it_was_not_converted_from(capsys, teacher_and_student_copy, trained_model, text_file,
                                                          tmp_path):
    _, student = teacher_and_student_copy
    stranger = trained_model("llama", kv_heads=2, steps=20)
    code, err = _cli(capsys, "heal", "--model", student, "--teacher", stranger, "--data", text_file, "--output",
                     tmp_path / "healed", "--max-steps", 1, "--no-progress")
    _one_line_error(code, err, "was converted from")
    assert not (tmp_path / "healed").exists() and not (tmp_path / "healed.ckpt").exists()


def test_a_record_too_old_to_name_its_source_is_said_and_accepted(capsys, converted, source, text_file,
                                                                   teacher_and_student_copy, tmp_path):
    """A conversion.json from before source_identity: eval and heal warn, naming the option they cannot check, and
    go on (refusing would strand every checkpoint an older version wrote)."""
    def forget_source(directory):
        record = json.loads((directory / "conversion.json").read_text())
        del record["source_identity"]
        (directory / "conversion.json").write_text(json.dumps(record))

    forget_source(converted)
    code, err = _cli(capsys, *_eval(source, converted, text_file, tmp_path / "report"))
    assert code == 0 and f"cannot check that --original {source} is the model it was converted from" in err, err
    teacher, student = teacher_and_student_copy
    forget_source(student)
    code, err = _cli(capsys, "heal", "--model", student, "--teacher", teacher, "--data", text_file, "--seq-len", 32,
                     "--batch-size", 2, "--max-steps", 1, "--output", tmp_path / "healed", "--no-progress")
    assert code == 0 and f"cannot check that --teacher {teacher} is the model it was converted from" in err, err


def test_calibration_shortfall_is_said_and_recorded(capsys, convert_args, tmp_path):
    """Issue case 7: asking for 100000 windows of a text that has fewer: a warning, and the card says what was used."""
    code = main(convert_args(**{"--calib-samples": 100000}))
    err = capsys.readouterr().err
    assert code == 0 and "fewer than the 100000 asked for" in err
    record = json.loads((tmp_path / "out" / "conversion.json").read_text())["settings"]
    assert record["calib_samples"] == 100000 and 0 < record["calib_windows"] < 100000
    assert f"| calib_windows (used) | `{record['calib_windows']}` |" in (tmp_path / "out" / "README.md").read_text()


def test_binary_junk_is_not_calibration_text(capsys, convert_args, tmp_path):
    junk = tmp_path / "junk.txt"
    junk.write_bytes(bytes(range(256)) * 400)
    code, err = _cli(capsys, *convert_args(**{"--calib-data": junk}))
    _one_line_error(code, err, "does not look like text")


# --- stuck states ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target,when,nth", [
    ("transmla_tool.io.writer:ShardedWriter._assemble", "after", 1),  # shards written, mark not yet set
    ("transmla_tool.io.writer:shutil.rmtree", "midway", 1),  # the original report: parts being removed
    ("transmla_tool.io.staging:write_marker", "before", 2),  # everything written, before the rename
])
def test_killed_final_assembly_resumes_bit_identical(convert_args, tmp_path, target, when, nth):
    """Issue case 8: a SIGKILL during the final steps; the same command with --resume finishes the conversion, and
    the result equals an uninterrupted one byte for byte."""
    reference = tmp_path / "reference"
    assert main(convert_args(output=reference)) == 0
    killed = _kill_run(convert_args(), target, when, nth)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not (tmp_path / "out").exists()
    done = subprocess.run([sys.executable, "-m", "transmla_tool", *convert_args(), "--resume"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _weights(tmp_path / "out") == _weights(reference)
    assert not list(tmp_path.glob(".out*"))
    leftovers = {"parts", "resume", "RESUMABLE", "COMPLETE", "ASSEMBLED", "LOCK"} & {p.name for p in
                                                                                    (tmp_path / "out").iterdir()}
    assert not leftovers


def test_killed_between_shards_resumes_with_the_parts_already_freed(convert_args, tmp_path):
    """A sharded output killed after its first shard is written: the parts only that shard read are gone already (the
    disk holds about one copy while assembling, not two), and --resume writes the rest from the parts still there,
    every shard byte for byte an uninterrupted run's."""
    def shards(out: Path) -> dict:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.glob("model-*.safetensors"))}

    small = {"--max-shard-size": "40KB"}
    reference = tmp_path / "reference"
    assert main(convert_args(output=reference, **small)) == 0
    assert len(shards(reference)) >= 3
    killed = _kill_run(convert_args(**small), "transmla_tool.io.writer:ShardedWriter._write_shard", "before", 2)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    staging = next(tmp_path.glob(".out*"))
    written = list(staging.glob("model-*.safetensors"))
    parts = {p.name for p in (staging / "parts").glob("*.safetensors")}
    assert len(written) == 1 and "embed.safetensors" not in parts and "final.safetensors" in parts
    done = subprocess.run([sys.executable, "-m", "transmla_tool", *convert_args(**small), "--resume"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert shards(tmp_path / "out") == shards(reference)
    assert not (tmp_path / "out" / "parts").exists()


def test_killed_heal_export_resumes(teacher_and_student_copy, text_file, tmp_path):
    """Issue case 9: a heal killed while writing its final checkpoint: --resume alone finishes it (no training again),
    and the result equals an uninterrupted heal's."""
    teacher, student = teacher_and_student_copy
    common = ["heal", "--model", student, "--teacher", teacher, "--data", text_file, "--seq-len", 32,
              "--batch-size", 2, "--max-steps", 3, "--lr", "1e-3", "--no-progress"]
    args = [str(a) for a in common]
    assert main([*args, "--output", str(tmp_path / "reference")]) == 0
    out = tmp_path / "healed"
    killed = _kill_run([*args, "--output", str(out)], "transmla_tool.model_card:write_model_card", "before")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert not out.exists() and (tmp_path / ".healed.partial").exists()
    done = subprocess.run([sys.executable, "-m", "transmla_tool", *args, "--output", str(out), "--resume"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert _weights(out) == _weights(tmp_path / "reference")
    assert not (tmp_path / ".healed.partial").exists()


# --- one line, exit 2, where a traceback was ------------------------------------------------------------------

def test_config_missing_fields(capsys, convert_args, source):
    config = json.loads((source / "config.json").read_text())
    del config["num_attention_heads"], config["hidden_size"]
    (source / "config.json").write_text(json.dumps(config))
    code, err = _cli(capsys, *convert_args())
    _one_line_error(code, err, "lacks hidden_size, num_attention_heads")


def test_config_of_another_model(capsys, convert_args, source):
    config = json.loads((source / "config.json").read_text())
    config["num_key_value_heads"] = 4  # the weights have 2
    (source / "config.json").write_text(json.dumps(config))
    code, err = _cli(capsys, *convert_args())
    _one_line_error(code, err, "the config does not describe these weights")


def test_truncated_safetensors(capsys, convert_args, source):
    weights = source / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, err = _cli(capsys, *convert_args())
    _one_line_error(code, err, "is truncated")


@pytest.mark.parametrize("keep", [1000, 3_000_000])
def test_truncated_gguf(capsys, tmp_path, text_file, keep):
    from transmla_tool.assets import smollm2_gguf

    directory, name = smollm2_gguf()
    broken = tmp_path / "gguf"
    broken.mkdir()
    with open(Path(directory) / name, "rb") as f:
        (broken / name).write_bytes(f.read(keep))
    code, err = _cli(capsys, "convert", "--model", broken, "--gguf-file", name, "--latent-dim", 128, "--output",
                     tmp_path / "out", "--calib-data", text_file, "--target", "auto")
    _one_line_error(code, err, "is not a readable GGUF file")


def test_broken_and_empty_jsonl(capsys, convert_args, tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a fine line"}\n{"text": "cut sho\n')
    code, err = _cli(capsys, *convert_args(**{"--calib-data": broken}))
    _one_line_error(code, err, "cannot read")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, err = _cli(capsys, *convert_args(**{"--calib-data": empty}))
    _one_line_error(code, err, "is empty")


@pytest.mark.parametrize("flag", [("--set", "refine_lr=nan"), ("--set", "moment_shrinkage=inf")])
def test_nan_method_setting(capsys, convert_args, flag):
    code, err = _cli(capsys, *convert_args(), *flag)
    _one_line_error(code, err, "must be a finite number")


def test_nan_heal_setting(capsys, teacher_and_student_copy, text_file, tmp_path):
    teacher, student = teacher_and_student_copy
    code, err = _cli(capsys, "heal", "--model", student, "--teacher", teacher, "--data", text_file, "--output",
                     tmp_path / "h", "--lr", "nan")
    _one_line_error(code, err, "--lr must be a finite number")


def test_eval_vocabulary_mismatch(capsys, converted, source, text_file, tmp_path, tokenizer_dir):
    """A converted checkpoint given another vocabulary size (its tokenizer replaced by a bigger one)."""
    tokenizer = json.loads((converted / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["zzz-extra-token"] = len(tokenizer["model"]["vocab"])
    (converted / "tokenizer.json").write_text(json.dumps(tokenizer))
    code, err = _cli(capsys, *_eval(source, converted, text_file, tmp_path / "report"))
    _one_line_error(code, err, "vocabularies of")


def test_export_gguf_refusals(capsys, converted, tmp_path):
    directory = tmp_path / "x.gguf"
    directory.mkdir()
    code, err = _cli(capsys, "export-gguf", converted, "--output", directory, "--tokenizer-pre", "gpt-2")
    _one_line_error(code, err, "is a directory")
    foreign = tmp_path / "theirs.gguf"
    foreign.write_bytes(b"GGUF not ours")
    code, err = _cli(capsys, "export-gguf", converted, "--output", foreign, "--tokenizer-pre", "gpt-2", "--overwrite")
    _one_line_error(code, err, "was not written by transmla-tool")
    assert foreign.read_bytes() == b"GGUF not ours"


def test_unwritable_or_full_disk_is_found_before_any_work(capsys, monkeypatch, convert_args, tmp_path):
    from transmla_tool import convert as convert_module

    monkeypatch.setattr(convert_module, "_convert_weights", lambda *a, **k: pytest.fail("converted anyway"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, err = _cli(capsys, *convert_args(output=blocker / "out"))
    _one_line_error(code, err, "is a file, not a directory")
    monkeypatch.setattr(os, "access", lambda *a, **k: False)
    code, err = _cli(capsys, *convert_args())
    _one_line_error(code, err, "permission denied")
    monkeypatch.undo()
    monkeypatch.setattr(convert_module, "_convert_weights", lambda *a, **k: pytest.fail("converted anyway"))

    class Usage:
        free = 1000

    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage())
    code, err = _cli(capsys, *convert_args())
    _one_line_error(code, err, "GiB free but the output needs about")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.partial").exists()


def test_a_full_disk_midway_is_one_line(capsys, monkeypatch, convert_args, tmp_path):
    import errno

    from transmla_tool.io import writer

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "part.safetensors")

    monkeypatch.setattr(writer, "save_file", full)
    code, err = _cli(capsys, *convert_args())
    _one_line_error(code, err, "No space left on device")
    assert not (tmp_path / "out").exists()


# --- clear messages --------------------------------------------------------------------------------------------

def test_interrupt_messages_do_not_contradict(capsys, monkeypatch, convert_args):
    _interrupt_after_layer0(monkeypatch, convert_args())
    err = capsys.readouterr().err
    assert "unfinished work kept" in err and "--resume" in err and "no output was left behind" not in err


def test_output_path_that_is_a_file(capsys, convert_args, tmp_path):
    path = tmp_path / "out"
    path.write_text("a file")
    for extra in ([], ["--overwrite"]):
        code, err = _cli(capsys, *convert_args(), *extra)
        _one_line_error(code, err, "is a file; give a directory path")
        assert "--overwrite" not in err
    assert path.read_text() == "a file"


def test_missing_data_file_without_a_slash_is_not_looked_up_on_the_hub(capsys, convert_args, monkeypatch, tmp_path):
    import datasets

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("asked the hub"))
    code, err = _cli(capsys, *convert_args(**{"--calib-data": "missing-calibration.txt"}))
    _one_line_error(code, err, "data file missing-calibration.txt does not exist")


def test_rebalance_of_a_missing_path(capsys, tmp_path):
    code, err = _cli(capsys, "rebalance", tmp_path / "nowhere", "--output", tmp_path / "x")
    _one_line_error(code, err, "does not exist")


@pytest.mark.parametrize("args", [["convert", "--model"], ["convert", "--latent-dim", "x"], ["frobnicate"]])
def test_argparse_errors_are_one_line(capsys, args):
    code, err = _cli(capsys, *args)
    assert code == 2 and len(err.splitlines()) == 1 and "usage:" not in err, err


def test_eval_output_dir_cannot_replace_the_converted_model(capsys, converted, source, text_file):
    before = _tree(converted)
    code, err = _cli(capsys, *_eval(source, converted, text_file, converted), "--overwrite")
    _one_line_error(code, err, "is an input of this run")
    assert _tree(converted) == before


def test_sweep_data_inside_its_output(capsys, source, tmp_path):
    out = tmp_path / "sweep"
    out.mkdir()
    data = out / "text.txt"
    data.write_text("words " * 5000)
    code, err = _cli(capsys, "sweep", "--model", source, "--latent-dims", "12", "--rope-dim", "8", "--data", data,
                     "--output-dir", out, "--overwrite", "--device", "cpu")
    _one_line_error(code, err, "contains an input of this run")
    assert data.exists()


def test_nothing_left_after_refusals(tmp_path):
    """Sanity of this suite's own checks: _tree sees files in nested folders (a check that cannot fail is none)."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "c").write_text("x")
    before = _tree(tmp_path)
    (tmp_path / "a" / "b" / "c").write_text("y")
    assert _tree(tmp_path) != before


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _kill_parent_of_a_sleeping_tool(tmp_path: Path, run_call: str) -> int:
    """Start a parent that runs a long-sleeping 'tool' through `run_call`, SIGKILL the parent, and return the
    tool's pid."""
    pid_file = tmp_path / f"tool-{len(list(tmp_path.iterdir()))}.pid"
    tool = [sys.executable, "-c", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
                                  "time.sleep(120)"]
    parent = subprocess.Popen([sys.executable, "-c", f"import subprocess\n{run_call}({tool!r})"],
                              cwd=Path(__file__).resolve().parents[1])
    for _ in range(600):
        if pid_file.exists() and pid_file.read_text():
            break
        assert parent.poll() is None, "the parent ended before its tool started"
        time.sleep(0.05)
    else:
        pytest.fail("the tool never started")
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    return int(pid_file.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_engine_tool_ends_with_the_benchmark_that_started_it(tmp_path):
    """`pkill -f eval/frontier.py` once left its llama-perplexity running for up to an hour. The engine tools run
    through engines.process.run_child (llama.cpp's _run here), whose children the kernel terminates when their
    parent dies; the same kill with plain subprocess.run leaves the tool running, which shows the check can fail."""
    plain, ours = _kill_parent_of_a_sleeping_tool(tmp_path, "subprocess.run"), None
    try:
        ours = _kill_parent_of_a_sleeping_tool(tmp_path, "from transmla_tool.engines.llamacpp import _run; _run")
        deadline = time.time() + 10
        while _alive(ours) and time.time() < deadline:
            time.sleep(0.05)
        assert not _alive(ours), "the tool outlived the killed benchmark"
        assert _alive(plain), "control: a plain subprocess.run child should outlive its killed parent"
    finally:
        for pid in (plain, ours):
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
