"""Token-level perplexity with one protocol for every model: same windows, dtype and device."""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from ..heal.loss import FinalHidden, position_nll

LOGIT_CHUNK = 2048  # positions of logits alive at a time when a window is longer


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = True,
               desc: str = "perplexity", bounds: tuple[int, ...] = (), logit_chunk: int = LOGIT_CHUNK) -> dict:
    """Mean next-token negative log-likelihood over every position of every window but the first.

    windows: (N, L) token ids. Each window is scored independently (no carried context), so the
    number is comparable across models that share the tokenizer. `bounds` (e.g. (512, 2048)): also the mean
    over the predicted positions in each range [0, 512), [512, 2048), [2048, L) under "by_position", {start: nll}:
    how the loss grows with the distance a token can look back (a long window's mean hides it).

    Windows longer than `logit_chunk` are scored from the last hidden state, `logit_chunk` positions of logits at a
    time (heal.loss.FinalHidden, which checks the output layer against the model's own last position): a whole
    8192-token window of a 152k-word vocabulary is 5 GB of fp32 logits. The result then names the chunk.
    """
    device = next(model.parameters()).device
    edges = [0, *[b for b in bounds if 0 < b < windows.shape[1]], windows.shape[1]]
    sums, counts = [0.0] * (len(edges) - 1), [0] * (len(edges) - 1)
    starts = range(0, windows.shape[0], batch_size)
    reader = FinalHidden(model) if logit_chunk and windows.shape[1] > logit_chunk else None
    for start in tqdm(starts, desc=desc, disable=not progress):
        ids = windows[start : start + batch_size].to(device)
        loss = position_nll(model, ids, logit_chunk, reader)
        for k, (lo, hi) in enumerate(zip(edges, edges[1:])):
            part = loss[:, max(lo - 1, 0) : hi - 1]
            sums[k] += float(part.sum())
            counts[k] += part.numel()
    mean = sum(sums) / max(sum(counts), 1)
    result = {"perplexity": math.exp(mean), "nll_per_token": mean, "tokens": sum(counts)}
    if reader is not None:
        result["logit_chunk"] = logit_chunk
    if bounds:
        result["by_position"] = {str(lo): s / max(c, 1) for lo, s, c in zip(edges, sums, counts)}
    return result
