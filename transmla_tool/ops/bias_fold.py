"""Attention biases folded into bias-free weights through the input's near-constant direction.

Stock DeepSeek-V3 attention in the engines has no biases (vLLM and llama.cpp drop them), but Qwen2's q/k/v biases
carry the model: on Qwen2.5-Coder-1.5B, dropping the value bias alone takes held-out perplexity from 5.5 to 8e5.
An affine map W x + b equals a linear one wherever some direction u of the input reads 1: W x + b = (W + b u^T) x
when u.x = 1. The attention input x = RMSNorm(h) w has no constant channel, but a direction that is nearly
constant over real text exists (on Qwen2.5-Coder-1.5B the least-squares u.x ~ 1 has a held-out spread of 3-9%), so

    u = argmin E[(u.x - 1)^2] + ridge |u|^2 = (E[x x^T] + ridge I)^-1 E[x]

from the layer's calibration moment, and each bias becomes a rank-one term:
- the query's bias (and the rotary key's, carried in kv_a's rotary rows): added to q and kv_a as b u^T;
- the value bias (carried by the factorization as o_bias = o v_bias, since attention weights sum to 1): a latent
  direction t whose values reproduce it through o (least squares), added to kv_a's latent rows as t u^T.
The error is b (u.x - 1) per token, and what the latent cannot express of the value bias; the layer-local refinement
then fits the rest. The RoPE-free key's bias needs none of this: it adds one logit to every key of a query and the
softmax drops it (ops/factorize.py already leaves it out).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .mla import MLAWeights

RIDGE = 1e-4  # relative to the mean input energy: keeps u bounded where the calibration text is thin


@dataclass
class FoldReport:
    constant_mse: float  # E[(u.x - 1)^2] on the calibration moment
    value_residual: float  # |o kv_b_v t - o_bias| / |o_bias| (0 without a value bias)


def constant_direction(x_moment: torch.Tensor, ridge: float = RIDGE) -> tuple[torch.Tensor, float]:
    """(u, E[(u.x - 1)^2]) from the augmented moment E[[x;1][x;1]^T] of shape (d+1, d+1)."""
    m = x_moment.to(torch.float64)
    d = m.shape[0] - 1
    second, mean = m[:d, :d], m[:d, d]
    scale = second.diagonal().mean()
    u = torch.linalg.solve(second + ridge * scale * torch.eye(d, dtype=m.dtype, device=m.device), mean)
    mse = float(u @ second @ u - 2 * (u @ mean) + 1)
    return u, mse


def fold_biases(w: MLAWeights, x_moment: torch.Tensor, ridge: float = RIDGE) -> tuple[MLAWeights, FoldReport]:
    """The same layer without biases: q_bias, kv_a_bias and o_bias folded into q and kv_a (module doc)."""
    u, mse = constant_direction(x_moment, ridge)
    u = u.to(w.q.dtype)
    q, kv_a = w.q, w.kv_a.clone()
    if w.q_bias is not None:
        q = q + torch.outer(w.q_bias.to(q.dtype), u)
    if w.kv_a_bias is not None:
        kv_a = kv_a + torch.outer(w.kv_a_bias.to(kv_a.dtype), u)
    residual = 0.0
    if w.o_bias is not None and float(w.o_bias.norm()) > 0:
        heads, dn, dv = w.num_heads, w.nope_dim, w.v_dim
        value_rows = w.kv_b.view(heads, dn + dv, -1)[:, dn:].reshape(heads * dv, -1)  # (H*dv, r)
        through = w.o.to(torch.float64) @ value_rows.to(torch.float64)  # (d, r): a latent direction's output
        target = w.o_bias.to(torch.float64)
        t = torch.linalg.lstsq(through, target[:, None]).solution[:, 0]  # (r,)
        residual = float((through @ t - target).norm() / target.norm())
        kv_a[: w.latent_dim] += torch.outer(t.to(kv_a.dtype), u)
    folded = replace(w, q=q, kv_a=kv_a, q_bias=None, kv_a_bias=None, o_bias=None)
    return folded, FoldReport(constant_mse=mse, value_residual=residual)
