"""Layer-local refinement: fit one converted attention layer to the source layer's output.

No end-to-end training: each layer is fitted on its own calibration inputs to reproduce what the
source attention block produced on them (relative MSE of the block output), starting from the
closed-form weights. Parameters are trained in the natural form (no RMSNorm) with Adam, each tensor
with a learning rate proportional to its RMS so that tensors of very different scales (the latent
bases are whitened) move at the same relative speed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from .mla import MLAWeights, mla_attention
from .value_solve import solve_value_path, value_statistics


@dataclass
class RefineReport:
    loss_before: float  # relative MSE of the block output on the held-out calibration windows
    loss_after: float
    steps: int
    seconds: float


def _relative_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-30)


@torch.no_grad()
def evaluate(mla: MLAWeights, inputs, targets, cos, sin, batch: int, cache_store=None) -> float:
    num = den = 0.0
    for start in range(0, inputs.shape[0], batch):
        x, t = inputs[start : start + batch], targets[start : start + batch]
        num += float((mla_attention(x, mla, cos, sin, cache_store=cache_store) - t).pow(2).sum())
        den += float(t.pow(2).sum())
    return num / max(den, 1e-30)


def refine(mla: MLAWeights, inputs: torch.Tensor, targets: torch.Tensor, cos, sin, *, steps: int,
           lr: float = 1e-3, batch: int = 8, queries: int = 0, holdout: int = 0,
           seed: int = 0, anchor: float = 0.0, noise: float = 0.0,
           teacher: Callable[[torch.Tensor], torch.Tensor] | None = None,
           cache_store: Callable[[torch.Tensor], torch.Tensor] | None = None,
           value_solve: int = 0) -> tuple[MLAWeights, RefineReport]:
    """Fit `mla` (fp32 on the inputs' device) so that mla_attention(inputs) ~= targets.

    inputs/targets: (N, L, d). Each step uses `batch` random windows and, when `queries` > 0, only
    that many random query positions of them (every key is still used): most of the cost of a step
    is in the queries, so this buys many more steps per second. The last `holdout` windows are not
    trained on and give the reported losses; with holdout=0 they are measured on the training windows.
    `anchor` > 0 adds anchor x the mean over tensors of |p - p0|^2 / |p0|^2 (p0: the starting weights) to
    the loss, so the fit moves away from the closed form only where the calibration text pays for it.
    `noise` > 0 (needs `teacher`, the source attention block) fits on perturbed inputs too: each training
    window gets Gaussian noise of u x noise x that channel's RMS (u uniform in [0, 1) per window) and
    its target is teacher(noisy window). Inputs then cover directions the calibration text rarely
    visits, the refinement-side counterpart of diagonal moment shrinkage (covariance + noise^2 u^2 diag).
    `cache_store` (see mla_attention) fits the layer as it runs over a quantized cache: the loss, the
    reported losses and the never-worse check all read keys and values through it (its gradient is the
    straight-through one of ops/kv_quant.straight_through).
    `value_solve` > 0: after the Adam steps (or alone with steps=0), o_proj and the value rows of kv_b are
    refitted in closed form for the attention weights the fit ended with (ops/value_solve.py, that many ALS
    rounds) on the training windows. (Solving them before the Adam steps too was measured worse: the steps
    then settle the scores around a value path fitted to the closed form's scores.)
    """
    if noise > 0 and teacher is None:
        raise ValueError("refine(noise > 0) needs the source attention block as teacher")
    start = time.time()
    train_x, train_t = inputs[: inputs.shape[0] - holdout], targets[: targets.shape[0] - holdout]
    eval_x, eval_t = (inputs[-holdout:], targets[-holdout:]) if holdout else (train_x, train_t)
    mla = mla.to(torch.float32, inputs.device)
    before = evaluate(mla, eval_x, eval_t, cos, sin, batch, cache_store)

    def solve(weights):
        if not value_solve:
            return weights
        stats = value_statistics(weights, train_x, train_t, cos, sin, batch, cache_store)
        return solve_value_path(weights, *stats[:3], iterations=value_solve)[0]

    if steps <= 0 and not value_solve:
        return mla, RefineReport(before, before, 0, time.time() - start)
    start_mla = mla
    if steps <= 0:
        mla = solve(mla)
        after = evaluate(mla, eval_x, eval_t, cos, sin, batch, cache_store)
        return (mla, RefineReport(before, after, 0, time.time() - start)) if after < before else \
            (start_mla, RefineReport(before, before, 0, time.time() - start))

    names = [f.name for f in fields(mla) if isinstance(getattr(mla, f.name), torch.Tensor)]
    params = {n: getattr(mla, n).detach().clone().requires_grad_(True) for n in names}
    start_weights = {n: getattr(mla, n).detach() for n in names}
    start_norms = {n: w.pow(2).sum().clamp_min(1e-30) for n, w in start_weights.items()}
    groups = [{"params": [p], "lr": lr * float(p.detach().pow(2).mean().sqrt().clamp_min(1e-8))}
              for p in params.values()]
    optimizer = torch.optim.Adam(groups, betas=(0.9, 0.99))
    base = [g["lr"] for g in optimizer.param_groups]
    gen = torch.Generator().manual_seed(seed)
    n, length = train_x.shape[0], train_x.shape[1]
    channel_rms = train_x.pow(2).mean(dim=(0, 1)).sqrt() if noise > 0 else None
    for step in range(steps):
        # cosine decay to 10% with a short warm-up
        factor = min(1.0, (step + 1) / max(1, steps // 10)) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        for group, lr0 in zip(optimizer.param_groups, base):
            group["lr"] = lr0 * factor
        idx = torch.randperm(n, generator=gen)[: min(batch, n)].to(inputs.device)
        current = replace(mla, **params)
        x, target = train_x[idx], train_t[idx]
        if noise > 0:
            scale = torch.rand(x.shape[0], 1, 1, generator=gen) * noise
            x = x + (scale * torch.randn(x.shape, generator=gen)).to(x.device, x.dtype) * channel_rms
            with torch.no_grad():
                target = teacher(x)
        if 0 < queries < length:
            pos = torch.randperm(length, generator=gen)[:queries].sort().values.to(inputs.device)
            loss = _relative_mse(mla_attention(x, current, cos, sin, pos, cache_store), target[:, pos])
        else:
            loss = _relative_mse(mla_attention(x, current, cos, sin, cache_store=cache_store), target)
        if anchor > 0:
            loss = loss + anchor * sum((params[n] - start_weights[n]).pow(2).sum() / start_norms[n]
                                       for n in names) / len(names)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    refined = solve(replace(mla, **{k: v.detach() for k, v in params.items()}))
    after = evaluate(refined, eval_x, eval_t, cos, sin, batch, cache_store)
    if after > before:  # never hand back something worse than the closed form
        refined, after = start_mla, before
    return refined, RefineReport(before, after, steps, time.time() - start)
