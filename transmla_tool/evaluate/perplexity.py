"""Token-level perplexity with one protocol for every model: same windows, dtype and device."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = True,
               desc: str = "perplexity", bounds: tuple[int, ...] = ()) -> dict:
    """Mean next-token negative log-likelihood over every position of every window but the first.

    windows: (N, L) token ids. Each window is scored independently (no carried context), so the
    number is comparable across models that share the tokenizer. `bounds` (e.g. (512, 2048)): also the mean
    over the predicted positions in each range [0, 512), [512, 2048), [2048, L) under "by_position", {start: nll}:
    how the loss grows with the distance a token can look back (a long window's mean hides it).
    """
    device = next(model.parameters()).device
    edges = [0, *[b for b in bounds if 0 < b < windows.shape[1]], windows.shape[1]]
    sums, counts = [0.0] * (len(edges) - 1), [0] * (len(edges) - 1)
    starts = range(0, windows.shape[0], batch_size)
    for start in tqdm(starts, desc=desc, disable=not progress):
        ids = windows[start : start + batch_size].to(device)
        logits = model(ids).logits[:, :-1].float()  # (B, L-1, V)
        loss = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # (B, L-1); column j predicts j+1
        for k, (lo, hi) in enumerate(zip(edges, edges[1:])):
            part = loss[:, max(lo - 1, 0) : hi - 1]
            sums[k] += float(part.sum())
            counts[k] += part.numel()
    mean = sum(sums) / max(sum(counts), 1)
    result = {"perplexity": math.exp(mean), "nll_per_token": mean, "tokens": sum(counts)}
    if bounds:
        result["by_position"] = {str(lo): s / max(c, 1) for lo, s, c in zip(edges, sums, counts)}
    return result
