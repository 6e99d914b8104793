"""Attention biases folded into bias-free weights through the input's near-constant direction.

Stock DeepSeek-V3 attention in the engines has no biases (vLLM and llama.cpp drop them), but Qwen2's q/k/v biases
carry the model: on Qwen2.5-Coder-1.5B, dropping the value bias alone takes held-out perplexity from 5.5 to 8e5.
An affine map W x + b equals a linear one wherever some direction u of the input reads 1: W x + b = (W + b u^T) x
when u.x = 1. The attention input x = RMSNorm(h) w has no constant channel, but a direction that is nearly
constant over real text exists (on Qwen2.5-Coder-1.5B the least-squares u.x ~ 1 has a held-out spread of 3-9%), so

    u = argmin E[(u.x - 1)^2] + ridge |u|^2 = (E[x x^T] + ridge I)^-1 E[x]

from the layer's calibration moment, and each bias becomes a rank-one term:
- the query's bias (and the rotary key's, carried in kv_a's rotary rows, as far as it rotates: below): added to q
  and kv_a as b u^T;
- the value bias: either carried by the joint latent as a latent bias (ops/factorize.py, value_bias="latent"; on
  Qwen2.5-Coder-1.5B's layer 1 at 160 latent values: held-out error 0.60 -> 0.44), folded like the others, or
  carried by the factorization as o_bias = o v_bias (attention weights sum to 1) and given a latent direction t
  whose values reproduce it through o (least squares), added to kv_a's latent rows as t u^T.
The error is b (u.x - 1) per token, and what the latent cannot express of the value bias; the layer-local refinement
then fits the rest. The RoPE-free key's bias needs none of this: it adds one logit to every key of a query and the
softmax drops it (ops/factorize.py already leaves it out).

The rotary key's bias is folded only as far as it rotates (`rope_share`). Its score term q_i^T R(j - i) b splits into
q_i^T b, the same for every key of query i (the softmax drops it), and q_i^T (R(j - i) - I) b, which carries the
position. Folded through u it becomes s_j q_i^T R(j - i) b with s_j = u.x_j: the key-independent part is then
multiplied by a per-key spread. On Qwen2.5-Coder-1.5B's first layer the bias sits in the slowest rotary slots (norm
up to 628 in a slot turning 1.6e-6 rad per token) where the first part is everything, and folding it all took the
layer's held-out error from 0.32 (biases kept) to 1.30; folded by share, 0.36-0.38. Per slot of frequency w, with
rho = E_delta[|R(delta) - I|^2 / 2] = E_delta[2 (1 - cos w delta)] over the calibration's attention distances and V
the spread E[(u.x - 1)^2], the share minimizing the expected score error (query isotropic within a slot) is
    beta = rho / (rho (1 + V) + V),
near 1 for slots that turn over the distances attention reads and near 0 for those that do not. V is taken no smaller
than CACHE_SPREAD: a folded bias is stored in the engine's cache, which reads it back only to its own precision, so
even where u.x = 1 exactly (layer 0's constant embedding channel) a bias that does not turn is left to the softmax,
not written into every cached rotary key.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .mla import MLAWeights

RIDGE = 1e-4  # relative to the mean input energy: keeps u bounded where the calibration text is thin
# conversion.json warns when u.x strays from 1 by more than this (root mean square) on held-out calibration windows
SPREAD_WARNING = 0.1
# the smallest spread the rotary-key share assumes: a cached value is read back to about this relative squared
# precision (q8_0 rounds to 1/254 of its block's largest value: (1/254)^2 / 3 = 5e-6). Measured on
# Qwen2.5-Coder-1.5B (160 + 64, llama.cpp, held-out docs): layer 0 fitted u.x = 1 to the last digit once (V = 0)
# and folded its whole rotary-key bias (norm up to 628) into the cache: q4_0 15.22, q5_0 9.36, q8_0 5.95; a
# conversion whose layer 0 read V = 9e-6 (share 0.026) and was otherwise the same to 4 digits: 6.10, 5.87, 5.79.
CACHE_SPREAD = 1e-5


@dataclass
class FoldReport:
    constant_mse: float  # E[(u.x - 1)^2] on the calibration moment
    value_residual: float  # |o kv_b_v t - o_bias| / |o_bias| (0 without an o_proj bias to fold)
    rope_bias_folded: float = 1.0  # |share * rotary-key bias| / |rotary-key bias| (1 when all of it is folded)
    heldout_spread: float | None = None  # E[(u.x - 1)^2] on windows u was not fitted on (heldout_spread)


def rope_bias_share(slot_inv_freq: torch.Tensor, distance_mass: torch.Tensor, spread: float) -> torch.Tensor:
    """(2 * slots,) share of each interleaved rotary dim's bias to fold (module doc): slot_inv_freq (slots,) the
    target's rotary frequencies, distance_mass (H, L) attention probability at each query-key distance; spread
    taken no smaller than CACHE_SPREAD."""
    spread = max(spread, CACHE_SPREAD)
    mass = distance_mass.to(torch.float64).sum(0)
    p = mass / mass.sum().clamp_min(1e-300)
    delta = torch.arange(p.shape[0], dtype=torch.float64, device=p.device)
    angle = slot_inv_freq.to(p.device, torch.float64)[:, None] * delta[None, :]
    rho = (p[None, :] * 2 * (1 - torch.cos(angle))).sum(1)  # (slots,)
    share = rho / (rho * (1 + spread) + spread)
    return share.repeat_interleave(2)


@dataclass
class ConstantChannel:
    channel: int  # the embedding channel replaced
    value: float  # what the first layer's input norm makes of it on every token, before its weight


def with_constant_channel(embed: torch.Tensor, eps: float, rows: int = 16384) -> tuple[torch.Tensor, ConstantChannel]:
    """The embedding (V, d) with its least-used channel k (smallest energy over the vocabulary) replaced, in each
    row e, by the value v that makes the first layer's RMSNorm read the same c on channel k for every token:
    v / sqrt((|e without k|^2 + v^2) / d + eps) = c, i.e. v = c sqrt((|e without k|^2 / d + eps) / (1 - c^2 / d)),
    with c = the channel's own root-mean-square share, so its magnitude stays what it was.

    The first layer's input is RMSNorm(embedding) and has no direction that reads nearly the same on every token
    (Qwen2.5-Coder-1.5B: u.x spreads by 0.10 over the whole vocabulary, 0.03-0.06 in later layers); there its biases,
    the largest of the model (key bias norm 1237), fold badly. With the channel, they fold exactly. What it costs the
    model: the channel's own content (on Qwen2.5-Coder-1.5B: held-out perplexity 5.466 -> 5.449 with it replaced,
    every layer as it was)."""
    d = embed.shape[1]
    energy = torch.zeros(d, dtype=torch.float64)
    for start in range(0, embed.shape[0], rows):
        energy += embed[start : start + rows].double().pow(2).sum(0)
    k = int(energy.argmin())
    c = float((energy[k] / energy.mean()).sqrt())
    out = embed.clone()
    for start in range(0, embed.shape[0], rows):
        block = embed[start : start + rows].double()
        rest = block.pow(2).sum(1) - block[:, k].pow(2)
        out[start : start + rows, k] = (c * ((rest / d + eps) / (1 - c * c / d)).sqrt()).to(embed.dtype)
    return out, ConstantChannel(channel=k, value=c)


def _misfit(u: torch.Tensor, m: torch.Tensor) -> float:
    """E[(u.x - 1)^2] under the augmented moment m = E[[x;1][x;1]^T] (>= 0 up to rounding: an exact constant
    channel)."""
    d = m.shape[0] - 1
    return max(0.0, float(u @ m[:d, :d] @ u - 2 * (u @ m[:d, d]) + m[d, d]))


def constant_direction(x_moment: torch.Tensor, ridge: float = RIDGE) -> tuple[torch.Tensor, float]:
    """(u, E[(u.x - 1)^2]) from the augmented moment E[[x;1][x;1]^T] of shape (d+1, d+1)."""
    m = x_moment.to(torch.float64)
    d = m.shape[0] - 1
    second, mean = m[:d, :d], m[:d, d]
    scale = second.diagonal().mean()
    u = torch.linalg.solve(second + ridge * scale * torch.eye(d, dtype=m.dtype, device=m.device), mean)
    return u, _misfit(u, m)


def heldout_spread(halves: tuple[torch.Tensor, torch.Tensor], ridge: float = RIDGE) -> float:
    """E[(u.x - 1)^2] on windows the direction was not fitted on: u fitted on each half of the calibration windows
    (their augmented moments), scored on the other, averaged. The fit's own E[(u.x - 1)^2] is far lower where the
    tokens are few for the width (Qwen2.5-Coder-1.5B's first layer, hidden 1536: the root mean square of u.x - 1 is
    0.002 on 4096 calibration tokens and 0.53 on held-out text; with 16384 tokens 0.031 and 0.080)."""
    scores = [_misfit(constant_direction(fit, ridge)[0], other.to(torch.float64))
              for fit, other in (halves, halves[::-1])]
    return sum(scores) / len(scores)


def fold_biases(w: MLAWeights, x_moment: torch.Tensor, ridge: float = RIDGE, rope_share=None,
                spread: float | None = None) -> tuple[MLAWeights, FoldReport]:
    """The same layer without biases: q_bias, kv_a_bias and o_bias folded into q and kv_a (module doc).
    rope_share: None (fold all of the rotary key's bias) or spread -> (dr,) shares (`rope_bias_share`), given
    `spread` (E[(u.x - 1)^2] on held-out windows: `heldout_spread`) or, without it, the fit's own."""
    u, mse = constant_direction(x_moment, ridge)
    u = u.to(w.q.dtype)
    q, kv_a = w.q, w.kv_a.clone()
    if w.q_bias is not None:
        q = q + torch.outer(w.q_bias.to(q.dtype), u)
    folded_share = 1.0
    if w.kv_a_bias is not None:
        bias = w.kv_a_bias.to(kv_a.dtype).clone()
        rope = bias[w.latent_dim :]
        if rope_share is not None and float(rope.norm()) > 0:
            kept = rope * rope_share(mse if spread is None else spread).to(rope.dtype)
            folded_share = float(kept.norm() / rope.norm())
            bias[w.latent_dim :] = kept
        kv_a = kv_a + torch.outer(bias, u)
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
    return folded, FoldReport(constant_mse=mse, value_residual=residual, rope_bias_folded=folded_share,
                              heldout_spread=spread)
