"""Token-level perplexity with one protocol for every model: same windows, dtype and device."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 4, progress: bool = True,
               desc: str = "perplexity") -> dict:
    """Mean next-token negative log-likelihood over every position of every window but the first.

    windows: (N, L) token ids. Each window is scored independently (no carried context), so the
    number is comparable across models that share the tokenizer.
    """
    device = next(model.parameters()).device
    nll, count = 0.0, 0
    starts = range(0, windows.shape[0], batch_size)
    for start in tqdm(starts, desc=desc, disable=not progress):
        ids = windows[start : start + batch_size].to(device)
        logits = model(ids).logits[:, :-1].float()  # (B, L-1, V)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        nll += float(loss)
        count += ids[:, 1:].numel()
    mean = nll / max(count, 1)
    return {"perplexity": math.exp(mean), "nll_per_token": mean, "tokens": count}
