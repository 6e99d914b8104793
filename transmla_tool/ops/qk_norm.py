"""Linearize per-head q/k RMSNorms (Qwen3) into the projections, with one calibrated scale per head.

Qwen3 computes each head's query as RMSNorm(W_h x) = w * (W_h x) / rms(W_h x) before RoPE (keys alike).
The division by the token's rms is not linear, so no stock DeepSeek layer reproduces it; what is linear is
the elementwise weight w (RoPE comes after, and a fixed per-dim scale before it is just another
projection). We write  s_h * diag(w) W_h  where s_h is the least-squares fit of 1/rms over the calibration
tokens of head h:  s_h = sum_t <u_t / rms_t, u_t> / sum_t |u_t|^2  with u_t = w * W_h x_t, i.e. the scale
that best reproduces the normalized vectors themselves. What remains (the per-token deviation of 1/rms from
s_h) is left to the layer-local refinement, which fits the true normalized attention's output.

The query side can do better in a stock layer (method setting query_norm=keep): DeepSeek's q_lora path has a
genuine RMSNorm, q_a_layernorm, between q_a_proj and q_b_proj. With q_a_proj = the source's q_proj, that norm
divides each token's whole query (every head) by its rms, and q_b_proj applies t_h * w per head: what remains
is the deviation of each head's rms from the whole query's, about half the per-head fold's error on small
Qwen3 models (`eval/families.py --probe-query-norm`). t_h is fitted as s_h is. The key has no stock norm (the
rotary key is never normalized), so it is always folded.

A query wider than the hidden size (H*D > d: Qwen3-0.6B, -4B, -32B) spans at most d directions, so q_a_proj
need not be H*D wide: with W = U S V^T, q_a = S V^T (d, d) has |q_a x| = |W x| for every x, and the norm of the
whole query is U RMSNorm(q_a x) sqrt(H*D / d): q_b then reads d values instead of H*D (`compact_query`).
"""

from __future__ import annotations

import torch


def fold_head_norm(weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                   x: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(weight', bias', scales): weight (heads*D, d) and bias (heads*D,) of a projection followed by a per-head
    RMSNorm with `norm_weight` (D,) and `eps`, folded into one linear map fitted on inputs x (..., d).
    Returns fp32 tensors; scales (heads,) are the fitted s_h."""
    dim = norm_weight.shape[0]
    w64 = weight.double()
    b64 = None if bias is None else bias.double()
    x64 = x.reshape(-1, x.shape[-1]).double()
    y = x64 @ w64.T  # (T, heads*D)
    if b64 is not None:
        y = y + b64
    y = y.view(-1, heads, dim)  # (T, heads, D)
    inv_rms = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)  # (T, heads, 1)
    u = y * norm_weight.double()  # (T, heads, D)
    energy = u.pow(2).sum((0, 2))  # (heads,)
    scales = (u.pow(2) * inv_rms).sum((0, 2)) / energy.clamp_min(1e-300)  # (heads,)
    per_row = (scales[:, None] * norm_weight.double()[None, :]).reshape(-1)  # (heads*D,)
    folded = (w64 * per_row[:, None]).float()
    folded_bias = None if b64 is None else (b64 * per_row).float()
    return folded, folded_bias, scales.float()


def normalized_error(weight, bias, norm_weight, eps, x, heads, folded, folded_bias) -> float:
    """Relative error of the folded projection against the true normalized one on inputs x (a diagnostic)."""
    dim = norm_weight.shape[0]
    x2 = x.reshape(-1, x.shape[-1]).float()
    y = x2 @ weight.float().T + (0 if bias is None else bias.float())
    y = y.view(-1, heads, dim)
    true = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    approx = (x2 @ folded.T + (0 if folded_bias is None else folded_bias)).view(-1, heads, dim)
    return float((approx - true).norm() / true.norm().clamp_min(1e-30))


def fold_query_norm(weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    x: torch.Tensor, heads: int, outer_eps: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(row_scales, scales, error) for a projection followed by a per-head RMSNorm, approximated by one RMSNorm
    over the whole projection (eps `outer_eps`, no weight) then a per-row scale: row_scales (heads*D,) =
    t_h * norm_weight, with t_h the least-squares fit on inputs x (..., d); error: relative error against the
    true per-head norms there (what fold_head_norm's diagnostic measures for the per-head fold)."""
    dim = norm_weight.shape[0]
    x64 = x.reshape(-1, x.shape[-1]).double()
    y = x64 @ weight.double().T + (0 if bias is None else bias.double())  # (T, heads*D)
    outer = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + outer_eps)
    y, outer = y.view(-1, heads, dim), outer.view(-1, heads, dim)
    true = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.double()
    u = outer * norm_weight.double()
    scales = (u * true).sum((0, 2)) / u.pow(2).sum((0, 2)).clamp_min(1e-300)  # (heads,)
    error = float((u * scales[None, :, None] - true).norm() / true.norm().clamp_min(1e-300))
    rows = (scales[:, None] * norm_weight.double()[None, :]).reshape(-1)
    return rows.float(), scales.float(), error


def compact_width(rows: int, hidden: int, has_bias: bool) -> int:
    """How many values q_a_proj gives a kept query norm of a `rows`-wide query: min(rows, hidden), or all rows for
    a query with a bias (compact_query keeps it as it is). The output config's q_lora_rank."""
    return rows if has_bias else min(rows, hidden)


def compact_query(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_a, out): a projection q_a (n, d) with RMSNorm(weight x) = out RMSNorm(q_a x) for every x (up to the
    norm's eps), n = compact_width(H*D, d, bias); out (H*D, n). A query with a bias, or no wider than d, is kept
    as it is."""
    rows, hidden = weight.shape
    if compact_width(rows, hidden, bias is not None) == rows:
        return weight, torch.eye(rows, dtype=weight.dtype, device=weight.device)
    u, s, vh = torch.linalg.svd(weight.double(), full_matrices=False)  # u (H*D, d)
    return (s[:, None] * vh).to(weight.dtype), (u * (rows / hidden) ** 0.5).to(weight.dtype)
