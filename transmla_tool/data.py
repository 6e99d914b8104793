"""Text for calibration, evaluation and healing: local files or a `datasets` hub spec, packed into
fixed-length token windows.

A data spec is either a local path (.txt, .jsonl/.json, .parquet) or a hub dataset written
`NAME[:CONFIG][@SPLIT]`, e.g. `wikitext:wikitext-2-raw-v1@test` (streamed, never fully loaded).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import UserError

TEXT_SUFFIXES = (".txt", ".cor", ".md", ".rst")
DATASETS_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def iter_documents(spec: str, text_field: str = "text") -> Iterator[str]:
    """Yield documents from a local file or a hub dataset spec."""
    path = Path(spec)
    if path.exists():
        if path.is_dir():
            raise UserError(f"data path {spec} is a directory; pass a .txt, .jsonl or .parquet file")
        suffix = path.suffix.lower()
        if suffix in DATASETS_SUFFIXES:
            yield from _iter_dataset(DATASETS_SUFFIXES[suffix], None, "train", text_field, data_files=str(path))
            return
        if suffix in TEXT_SUFFIXES or suffix == "":
            yield from _iter_text_file(path)
            return
        raise UserError(f"unsupported data file {spec}: use .txt, .jsonl, .json or .parquet")
    if os.sep in spec or spec.startswith("."):
        raise UserError(f"data file {spec} does not exist")
    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    yield from _iter_dataset(name, config or None, split or "train", text_field)


def _iter_text_file(path: Path) -> Iterator[str]:
    """Paragraphs separated by blank lines; a file without blank lines is one document per line."""
    text = path.read_text(encoding="utf-8", errors="replace")
    blocks = [b.strip() for b in text.replace("\r\n", "\n").split("\n\n")]
    if len(blocks) == 1:
        blocks = [line.strip() for line in text.splitlines()]
    for block in blocks:
        if block:
            yield block


def _iter_dataset(name, config, split, text_field, data_files=None) -> Iterator[str]:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True, data_files=data_files)
    except Exception as exc:  # missing dataset, no network, bad split: all reported the same way
        raise UserError(f"cannot load dataset '{name}' ({type(exc).__name__}: {exc})") from exc
    for row in ds:
        if text_field not in row:
            raise UserError(f"dataset '{name}' has no '{text_field}' column (columns: {', '.join(row)})")
        text = row[text_field]
        if text and text.strip():
            yield text


def tokenizer_adds_bos(tokenizer) -> bool:
    bos = tokenizer.bos_token_id
    return bos is not None and tokenizer("a").input_ids[:1] == [bos]


def iter_token_windows(docs, tokenizer, seq_len: int) -> Iterator[torch.Tensor]:
    """Pack documents (EOS between them) into windows of seq_len tokens.

    Windows start with BOS when the tokenizer itself adds one, so the model sees the start-of-text
    token it was trained with.
    """
    if seq_len < 2:
        raise UserError(f"sequence length must be at least 2, got {seq_len}")
    bos = [tokenizer.bos_token_id] if tokenizer_adds_bos(tokenizer) else []
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    body = seq_len - len(bos)
    buffer: list[int] = []
    for doc in docs:
        buffer.extend(tokenizer(doc, add_special_tokens=False).input_ids + sep)
        while len(buffer) >= body:
            yield torch.tensor(bos + buffer[:body], dtype=torch.long)
            buffer = buffer[body:]


def token_windows(spec: str, tokenizer, seq_len: int, max_windows: int | None = None,
                  text_field: str = "text", min_windows: int = 1) -> torch.Tensor:
    """(N, seq_len) token ids from a data spec; at most max_windows windows."""
    windows = []
    for window in iter_token_windows(iter_documents(spec, text_field), tokenizer, seq_len):
        windows.append(window)
        if max_windows is not None and len(windows) >= max_windows:
            break
    if len(windows) < min_windows:
        raise UserError(
            f"{spec} yields {len(windows)} windows of {seq_len} tokens, fewer than the {min_windows} "
            "needed; use more text or a shorter sequence length"
        )
    return torch.stack(windows)
