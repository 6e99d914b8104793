"""Text for calibration, evaluation and healing: local files or a `datasets` hub spec, packed into
fixed-length token windows.

A data spec is either a local path (.txt, .jsonl/.json, .parquet) or a hub dataset written
`NAME[:CONFIG][@SPLIT]`, e.g. `wikitext:wikitext-2-raw-v1@test` (streamed, never fully loaded).
A mix is several specs joined by commas, each optionally weighted `SPEC=WEIGHT`
(`news.jsonl=2,code.jsonl=1`): windows are packed per source (a window never straddles two
sources), taken in proportion to the weights and interleaved, so every batch sees every source.
"""

from __future__ import annotations

import contextlib
import logging
import math
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
    if os.sep in spec or spec.startswith(".") or Path(spec).suffix.lower() in (*TEXT_SUFFIXES, *DATASETS_SUFFIXES):
        # a file name, not a hub dataset: looking it up on the hub would only retry and fail
        raise UserError(f"data file {spec} does not exist")
    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    yield from _iter_dataset(name, config or None, split or "train", text_field)


# Text files are read as UTF-8; a file with more undecodable or control bytes than this is not text (a binary
# file, or another encoding) and is refused rather than calibrated on.
MAX_NON_TEXT = 0.01


def _check_text(path: Path, text: str) -> None:
    if not text.strip():
        raise UserError(f"data file {path} is empty")
    sample = text[:1_000_000]
    bad = sum(1 for c in sample if c == "\ufffd" or (c < " " and c not in "\n\r\t\f"))
    if bad > MAX_NON_TEXT * len(sample):
        raise UserError(f"data file {path} does not look like text ({bad / len(sample):.0%} of its characters are "
                        "undecodable or control bytes); pass a UTF-8 text file")


def _iter_text_file(path: Path) -> Iterator[str]:
    """Paragraphs separated by blank lines; a file without blank lines is one document per line."""
    text = path.read_text(encoding="utf-8", errors="replace")
    _check_text(path, text)
    blocks = [b.strip() for b in text.replace("\r\n", "\n").split("\n\n")]
    if len(blocks) == 1:
        blocks = [line.strip() for line in text.splitlines()]
    for block in blocks:
        if block:
            yield block


def _iter_dataset(name, config, split, text_field, data_files=None) -> Iterator[str]:
    import datasets

    what = data_files or f"dataset '{name}'"
    if data_files is not None and not Path(data_files).stat().st_size:
        raise UserError(f"data file {data_files} is empty")
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True, data_files=data_files)
    except Exception as exc:  # missing dataset, no network, bad split: all reported the same way
        raise UserError(f"cannot load {what} ({type(exc).__name__}: {exc})") from exc
    rows = iter(ds)
    while True:
        try:
            with _quiet("datasets"):  # a malformed file is reported below, once, not also by datasets' logger
                row = next(rows)
        except StopIteration:
            return
        except Exception as exc:  # a malformed line or file: the reader's words, on one line
            detail = " ".join(str(exc).split())[:200]
            raise UserError(f"cannot read {what} ({type(exc).__name__}: {detail}); fix the file (one JSON object "
                            "per line for .jsonl)") from exc
        if not isinstance(row, dict):
            raise UserError(f"{what}: rows must be JSON objects with a '{text_field}' field")
        text = _row_text(row, text_field)
        if text is None:
            raise UserError(f"{what} has no '{text_field}' column (columns: {', '.join(row)}); "
                            "pass --text-field")
        if text.strip():
            yield text


@contextlib.contextmanager
def _quiet(logger: str):
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _row_text(row: dict, text_field: str) -> str | None:
    """The text of a row: the text field; else, when the field is the default 'text', a code
    dataset's 'content' or a chat dataset's 'messages'/'conversations' turns, one per line."""
    value = row.get(text_field)
    if value is None and text_field == "text":
        value = next((row[k] for k in ("content", "messages", "conversations") if row.get(k) is not None), None)
    if isinstance(value, list):  # chat turns: [{"role": ..., "content": ...}] or ShareGPT {"from", "value"}
        value = "\n".join(f"{turn.get('role', turn.get('from', ''))}: {turn.get('content', turn.get('value', ''))}"
                          if isinstance(turn, dict) else str(turn) for turn in value)
    return value if value is None else str(value)


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


def parse_mix(spec: str) -> list[tuple[str, float]]:
    """[(source spec, weight)] of a data spec; a single source has weight 1."""
    if Path(spec).exists():
        return [(spec, 1.0)]
    mix = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise UserError(f"data mix '{spec}' has an empty entry; write SPEC[=WEIGHT],SPEC[=WEIGHT]")
        source, sep, weight = part.rpartition("=")
        if not sep:
            mix.append((part, 1.0))
            continue
        try:
            value = float(weight)
        except ValueError:
            raise UserError(f"data mix entry '{part}': weight '{weight}' is not a number") from None
        if not value > 0:
            raise UserError(f"data mix entry '{part}': the weight must be positive")
        mix.append((source, value))
    return mix


def _quotas(weights: list[float], total: int) -> list[int]:
    """Split total items by weight (largest remainder), every source at least one."""
    if total < len(weights):
        raise UserError(f"{total} windows cannot cover a mix of {len(weights)} sources; ask for more windows")
    shares = [w / sum(weights) * total for w in weights]
    counts = [max(1, int(s)) for s in shares]
    for i in sorted(range(len(weights)), key=lambda i: int(shares[i]) - shares[i]):
        if sum(counts) >= total:
            break
        counts[i] += 1
    while sum(counts) > total:
        counts[counts.index(max(counts))] -= 1
    return counts


def _weighted_order(weights: list[float]) -> Iterator[int]:
    """Source indices in smooth weighted round-robin order (weights 2:1 give 0,1,0,0,1,0...)."""
    credit = [0.0] * len(weights)
    while True:
        for i, w in enumerate(weights):
            credit[i] += w
        best = max(range(len(weights)), key=credit.__getitem__)
        credit[best] -= sum(weights)
        yield best


def token_windows(spec: str, tokenizer, seq_len: int, max_windows: int | None = None,
                  text_field: str = "text", min_windows: int = 1) -> torch.Tensor:
    """(N, seq_len) token ids from a data spec or mix; at most max_windows windows (for a mix, each
    source's share of them, interleaved; without max_windows all of every source)."""
    mix = parse_mix(spec)
    if len(mix) == 1:
        windows = _take(mix[0][0], tokenizer, seq_len, max_windows, text_field)
    else:
        counts = _quotas([w for _, w in mix], max_windows) if max_windows is not None else [None] * len(mix)
        parts = [_take(source, tokenizer, seq_len, n, text_field) for (source, _), n in zip(mix, counts)]
        for (source, _), part, n in zip(mix, parts, counts):
            if n is not None and len(part) < n:
                raise UserError(f"{source} yields {len(part)} windows of {seq_len} tokens, fewer than its share "
                                f"of the mix ({n}); give it more text or a smaller weight")
        order = _weighted_order([len(p) for p in parts])
        cursors = [0] * len(parts)
        windows = []
        while len(windows) < sum(map(len, parts)):
            i = next(order)
            if cursors[i] < len(parts[i]):
                windows.append(parts[i][cursors[i]])
                cursors[i] += 1
    if len(windows) < min_windows:
        raise UserError(
            f"{spec} yields {len(windows)} windows of {seq_len} tokens, fewer than the {min_windows} "
            "needed; use more text or a shorter sequence length"
        )
    return torch.stack(windows)


def repeats_window(index: int, share: float) -> bool:
    """Whether window `index` of a sequence of windows is one of the evenly spread `share` of them that
    with_repeats rebuilds (floor(share * N) of any first N)."""
    return math.floor((index + 1) * share) > math.floor(index * share)


def with_repeats(windows: torch.Tensor, share: float, start: int = 0) -> torch.Tensor:
    """windows (N, L) with floor(share * N) of them, spread evenly, rebuilt as their first half twice: text in which
    the model copies (the second half's next token is in the first). The rest are unchanged. `start`: the index of
    the first window in a longer stream (a training batch), so the spread runs across batches."""
    n, length = windows.shape
    picked = [i for i in range(n) if repeats_window(start + i, share)]
    if not picked or length < 4:
        return windows
    out = windows.clone()
    half = length // 2
    out[picked] = torch.cat([windows[picked, :half], windows[picked, :length - half]], dim=1)
    return out


def _take(spec: str, tokenizer, seq_len: int, max_windows: int | None, text_field: str) -> list[torch.Tensor]:
    windows = []
    for window in iter_token_windows(iter_documents(spec, text_field), tokenizer, seq_len):
        windows.append(window)
        if max_windows is not None and len(windows) >= max_windows:
            break
    return windows


def iter_mixed_windows(spec: str, tokenizer, seq_len: int, text_field: str = "text") -> Iterator[torch.Tensor]:
    """Windows of a data spec; for a mix, an endless weighted interleave in which each source starts
    over when it runs out (a single source is read once)."""
    mix = parse_mix(spec)
    if len(mix) == 1:
        yield from iter_token_windows(iter_documents(spec, text_field), tokenizer, seq_len)
        return

    def endless(source):
        while True:
            empty = True
            for window in iter_token_windows(iter_documents(source, text_field), tokenizer, seq_len):
                empty = False
                yield window
            if empty:
                raise UserError(f"{source} yields no window of {seq_len} tokens; use more text or a shorter "
                                "sequence length")

    streams = [endless(source) for source, _ in mix]
    for i in _weighted_order([w for _, w in mix]):
        yield next(streams[i])
