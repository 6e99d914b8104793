"""Text sources: every local format gives the same documents, packed the same way."""

from __future__ import annotations

import json

import pytest

from transmla_tool.data import iter_documents, token_windows
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


def test_bad_sources(files, tmp_path):
    with pytest.raises(UserError, match="no 'text' column"):
        list(iter_documents(str(files["jsonl"])))
    with pytest.raises(UserError, match="does not exist"):
        list(iter_documents(str(tmp_path / "missing" / "x.txt")))
    odd = tmp_path / "x.csv"
    odd.write_text("a,b")
    with pytest.raises(UserError, match="unsupported data file"):
        list(iter_documents(str(odd)))
