"""Exact changes of basis of a converted layer that only change how its cache quantizes.

The model's function is unchanged by each of them (in the natural form, hence in every stock form):
- the latent basis: any orthogonal R acts as latent -> R latent with kv_b -> kv_b R^T. The linearized
  kv_a_layernorm has one weight for every channel, so it commutes with R. The closed form leaves the
  latent in PCA order, which piles the energy into the first channels; a 32-value block quantizer
  (q4_0, q8_0) then scales each block to its loudest channel and loses the quiet ones. A (randomized)
  Hadamard rotation spreads every token's energy evenly over the channels.
- the rotary key: RoPE rotates each pair (2j, 2j+1) in its own plane, so nothing may mix pairs, but a
  pair may be scaled by s_j with the queries' matching pair scaled by 1 / s_j (scores unchanged).
  This matters more than the latent basis: the rotary key is one or two blocks of the cached row, shared by
  every head, and its pairs' energies differ by up to ~40x (SmolLM2), so a loud low frequency sets the scale
  of its block and the quiet pairs keep one or two bits. On SmolLM2 160 + 32, a q4_0 rotary key alone cost
  1.32x perplexity and a q4_0 latent 1.02x (torch simulation). s_j = energy_j^-p evens the pairs out:
  p = 1/2 ("energy") makes them equal; p = 0.3 ("partial") keeps some of the spread and measured better
  (the loud pairs are also the ones whose queries weigh most).
- the latent's balance between energy and use: a block quantizer's step follows the values' scale, so a loud
  latent direction that the output barely reads sets the step of quiet ones it reads closely. balance_latent
  gives every direction an energy equal to its output sensitivity (an invertible, not orthogonal, change of basis:
  the linearized kv_a_layernorm allows it). Measured in eval/cache_split.py only (not a conversion setting):
  on Qwen2.5-Coder-1.5B's default 160 + 64 it took a simulated q4_0 latent from 1.015x to 1.004x, on SmolLM2's
  160 + 32 from 1.011x to 1.008x (iq4_nl 1.013x to 1.020x).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from .linalg import affine_moment
from .mla import MLAWeights

LATENT_BASES = ("pca", "hadamard", "random")
# rope_key_balance -> the power p of s_j = energy_j^-p (ops/basis.py's docstring)
ROPE_KEY_BALANCES = {"none": 0.0, "energy": 0.5, "partial": 0.3}


def hadamard(n: int) -> torch.Tensor:
    """Sylvester's Hadamard matrix of order n (a power of two), orthonormal, fp64."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two order, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def latent_rotation(size: int, kind: str, seed: int = 0) -> torch.Tensor | None:
    """An orthogonal (size, size) fp64 matrix R (new latent = R old latent), or None for "pca".

    hadamard: random signs, then Hadamard blocks of the largest power of two dividing `size`, after
    dealing the PCA channels round-robin over the blocks (every block gets loud and quiet channels);
    for a power-of-two size this is one randomized Hadamard transform. random: a seeded Haar rotation.
    """
    if kind not in LATENT_BASES:
        raise ValueError(f"latent basis must be one of {LATENT_BASES}, got {kind!r}")
    if kind == "pca":
        return None
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        q, r = torch.linalg.qr(torch.randn(size, size, generator=gen, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r))  # sign fix: Haar-distributed and deterministic
    block = size & -size  # largest power of two dividing size
    blocks = size // block
    signs = torch.randint(0, 2, (size,), generator=gen).to(torch.float64) * 2 - 1
    deal = torch.arange(size).view(block, blocks).T.reshape(-1)  # block b holds channels b, b + blocks, ...
    rotation = torch.block_diag(*[hadamard(block)] * blocks)  # (size, size)
    return rotation[:, torch.argsort(deal)] * signs  # R = H P S: sign flip, deal out, rotate each block


def rotate_latent(w: MLAWeights, rotation: torch.Tensor | None) -> MLAWeights:
    """The same layer with its latent expressed in another orthonormal basis (exact)."""
    if rotation is None:
        return w
    return _latent_map(w, rotation, rotation.T)


def latent_statistics(w: MLAWeights, x_moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean (r,), second moment (r, r)) of the latent over the inputs with augmented moment x_moment, fp64."""
    r = w.latent_dim
    bias = None if w.kv_a_bias is None else w.kv_a_bias[:r].double()
    weight = w.kv_a[:r].double()
    mean = weight @ x_moment[:-1, -1].double()  # E[x] is the augmented moment's last column
    if bias is not None:
        mean = mean + bias
    return mean, affine_moment(weight, bias, x_moment.double())


def _latent_map(w: MLAWeights, forward: torch.Tensor, inverse: torch.Tensor) -> MLAWeights:
    """latent -> forward @ latent, kv_b -> kv_b @ inverse (inverse = forward^-1): the same function."""
    r = w.latent_dim
    fwd = forward.to(w.kv_a.dtype).to(w.kv_a.device)
    kv_a = torch.cat([fwd @ w.kv_a[:r], w.kv_a[r:]])
    bias = w.kv_a_bias
    if bias is not None:
        bias = torch.cat([fwd @ bias[:r], bias[r:]])
    return replace(w, kv_a=kv_a, kv_a_bias=bias, kv_b=w.kv_b @ inverse.to(w.kv_b.dtype).to(w.kv_b.device))


def latent_sensitivity(w: MLAWeights, x_moment: torch.Tensor) -> torch.Tensor:
    """(r, r) fp64 G: an error e in the cached latent moves the layer's output by about e^T G e (mean square).

    Keys: a latent error moves head h's scores by softmax_scale * q_h^T W_kh e, which moves the output by about
    that times the head's typical output deviation (factorize's `kv_balance=output` reasoning); values: by
    o_h W_vh e. Query moments from the inputs' augmented moment x_moment; no kept query norm (q_b)."""
    if w.q_b is not None:
        raise ValueError("latent sensitivity needs the query as a linear map of the input (no kept query norm)")
    r, heads, dn, dv, dr = w.latent_dim, w.num_heads, w.nope_dim, w.v_dim, w.rope_dim
    mean, second = latent_statistics(w, x_moment)
    cov = second - torch.outer(mean, mean)
    kv_b = w.kv_b.double().view(heads, dn + dv, r)
    o = w.o.double().view(w.o.shape[0], heads, dv).permute(1, 0, 2)  # (H, d, dv)
    q = w.q.double().view(heads, dn + dr, -1)[:, :dn]  # (H, dn, d): the RoPE-free query
    q_bias = None if w.q_bias is None else w.q_bias.double().view(heads, dn + dr)[:, :dn]
    keys = torch.zeros(r, r, dtype=torch.float64)
    values = torch.zeros(r, r, dtype=torch.float64)
    spread = 0.0
    for h in range(heads):
        w_k, w_v = kv_b[h, :dn], kv_b[h, dn:]  # (dn, r), (dv, r)
        q_moment = affine_moment(q[h], None if q_bias is None else q_bias[h], x_moment.double())
        out = o[h].T @ o[h]  # (dv, dv)
        keys += w_k.T @ q_moment @ w_k
        values += w_v.T @ out @ w_v
        spread += float(torch.trace(out @ w_v @ cov @ w_v.T))
    return w.softmax_scale**2 * spread / heads * keys + values


def balance_latent(w: MLAWeights, x_moment: torch.Tensor, ridge: float = 1e-9) -> MLAWeights:
    """The same layer with its latent in the basis where every direction's energy equals its output sensitivity
    (latent_sensitivity): latent -> T latent with T S T^T = T^-T G T^-1 = Lambda^(1/2), S the latent's second
    moment, kv_b -> kv_b T^-1. Under a block quantizer whose step follows the values' scale, the output error is
    about tr(S) tr(G) / r in an energy-balanced (Hadamard) basis and (sum_i lambda_i^(1/2))^2 / r here, never more
    (Cauchy-Schwarz): loud directions the output barely reads stop setting the step of the quiet ones it reads.
    Not orthogonal, which is why the linearized kv_a_layernorm (one weight for every channel) is needed."""
    _, second = latent_statistics(w, x_moment)
    sensitivity = latent_sensitivity(w, x_moment)
    scale = float(second.diagonal().mean())
    lower = torch.linalg.cholesky(second + ridge * scale * torch.eye(second.shape[0], dtype=torch.float64))
    vals, vecs = torch.linalg.eigh(lower.T @ sensitivity @ lower)
    vals = vals.clamp_min(ridge * float(vals.max()))
    inv_lower = torch.linalg.solve_triangular(lower, torch.eye(lower.shape[0], dtype=torch.float64), upper=False)
    forward = vals.pow(0.25)[:, None] * (vecs.T @ inv_lower)
    inverse = lower @ vecs * vals.pow(-0.25)[None, :]
    return _latent_map(w, forward, inverse)


def rope_pair_energy(w: MLAWeights, x_moment: torch.Tensor) -> torch.Tensor:
    """(dr/2,) mean square of each rotary-key pair over the inputs with augmented moment x_moment."""
    r = w.latent_dim
    bias = None if w.kv_a_bias is None else w.kv_a_bias[r:]
    moment = affine_moment(w.kv_a[r:].double(), None if bias is None else bias.double(), x_moment.double())
    diag = moment.diagonal()
    return diag[0::2] + diag[1::2]  # RoPE keeps each pair's energy: it is the same before and after rotation


def balance_rope_key(w: MLAWeights, x_moment: torch.Tensor, power: float = 0.5) -> MLAWeights:
    """Scale each rotary-key pair by energy^-power (power 1/2: every pair the same mean square; geometric mean
    of the scales 1), queries inverse."""
    energy = rope_pair_energy(w, x_moment).clamp_min(1e-30)
    return scale_rope_pairs(w, energy.pow(-power))


def scale_rope_pairs(w: MLAWeights, scale: torch.Tensor) -> MLAWeights:
    """Scale rotary-key pair j by scale[j] (normalized to a geometric mean of 1) and its queries by the inverse:
    the same function, another cached rotary key."""
    scale = scale / scale.log().mean().exp()  # (dr/2,)
    per_dim = scale.repeat_interleave(2).to(w.kv_a.dtype).to(w.kv_a.device)  # (dr,)
    r, dn = w.latent_dim, w.nope_dim
    kv_a = torch.cat([w.kv_a[:r], w.kv_a[r:] * per_dim[:, None]])
    bias = w.kv_a_bias
    if bias is not None:
        bias = torch.cat([bias[:r], bias[r:] * per_dim])
    q_scale = torch.cat([torch.ones(dn, dtype=per_dim.dtype, device=per_dim.device), 1.0 / per_dim])
    q_scale = q_scale.repeat(w.num_heads)  # (H*(dn+dr),)
    if w.q_b is not None:  # the query leaves through q_b: scale its rows
        return replace(w, kv_a=kv_a, kv_a_bias=bias, q_b=w.q_b * q_scale[:, None])
    q_bias = None if w.q_bias is None else w.q_bias * q_scale
    return replace(w, kv_a=kv_a, kv_a_bias=bias, q=w.q * q_scale[:, None], q_bias=q_bias)


def for_quantized_cache(w: MLAWeights, latent_basis: str, rope_key_balance: str, x_moment: torch.Tensor,
                        seed: int) -> MLAWeights:
    """The layer with the latent rotation (`latent_basis`) and the rotary-key balance (`rope_key_balance`, energies
    from the augmented input moment `x_moment`) a Method asks for, in fp64 on the CPU: the same function, a cache
    that quantizes better."""
    w = rotate_latent(w.to(torch.float64, "cpu"), latent_rotation(w.latent_dim, latent_basis, seed))
    power = ROPE_KEY_BALANCES[rope_key_balance]
    return balance_rope_key(w, x_moment.cpu(), power) if power else w
