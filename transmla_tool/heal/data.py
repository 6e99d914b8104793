"""Streamed, packed, shuffled training batches, dealt round-robin to data-parallel processes.

Nothing is loaded whole: documents stream from the file or dataset, are packed into windows, pass
through a seeded shuffle buffer and are grouped into batches. The order depends only on the seed, so
a resumed run replays the stream and skips the batches it already consumed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch

from ..data import iter_mixed_windows, with_repeats
from ..errors import UserError


def shuffled(items: Iterator, buffer: int, rng: random.Random) -> Iterator:
    pool = []
    for item in items:
        pool.append(item)
        if len(pool) >= buffer:
            yield pool.pop(rng.randrange(len(pool)))
    rng.shuffle(pool)
    yield from pool


def train_batches(spec: str, tokenizer, seq_len: int, batch_size: int, *, seed: int = 0, process_index: int = 0,
                  num_processes: int = 1, shuffle_buffer: int = 1024, text_field: str = "text",
                  skip: int = 0, repeat_share: float = 0.0) -> Iterator[torch.Tensor]:
    """Endless (B, L) batches for one process; each epoch reshuffles with seed + epoch. `repeat_share` of the windows,
    spread evenly over the stream, become their first half twice (data.with_repeats): text that asks for copying."""
    epoch, produced = 0, 0
    while True:
        rng = random.Random(seed + epoch)
        windows = iter_mixed_windows(spec, tokenizer, seq_len, text_field)
        batch, dealt = [], 0
        for k, window in enumerate(shuffled(windows, shuffle_buffer, rng)):
            if k % num_processes != process_index:
                continue
            batch.append(window)
            if len(batch) == batch_size:
                dealt += 1
                produced += 1
                if produced > skip:
                    yield with_repeats(torch.stack(batch), repeat_share, (produced - 1) * batch_size)
                batch = []
        if dealt == 0:
            raise UserError(f"{spec} has fewer than {batch_size * num_processes} windows of {seq_len} tokens; "
                            "use more text, a shorter --seq-len or a smaller --batch-size")
        epoch += 1
