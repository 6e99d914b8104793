"""RoPE math in both layouts, and the expected rotation over attention distances.

Source models (Llama family) rotate the pair (i, i + D/2) of every head by angle p * w_i
("rotate_half" layout). DeepSeek-V3 with `rope_interleave: true` rotates the pair (2j, 2j+1) of the
rope part by p * w'_j, where w'_j comes from its own config (rope_theta, rope_dim). Slot j of the
shared rotary key carries exactly only the source frequencies equal to w'_j (see ops/decouple.py).
"""

from __future__ import annotations

import math

import torch


def rotation_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float = 1.0):
    """cos/sin laid out as transformers builds them: (..., 2 * n_freq) with the angles repeated."""
    freqs = positions[..., None].to(torch.float64) * inv_freq.to(torch.float64)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (..., L, D) by cos/sin of shape (L, D) in the rotate_half layout."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (..., L, dr) whose pairs are (2j, 2j+1); cos/sin are (L, dr) as transformers builds them."""
    half = x.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)


def expected_rotation(inv_freq: torch.Tensor, distance_mass: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E[cos(w*delta)], E[sin(w*delta)] under a distribution over query-key distances.

    distance_mass: (..., L) non-negative mass per distance delta = 0..L-1 (rows need not sum to 1).
    Returns two tensors of shape (..., n_freq).
    """
    mass = distance_mass.to(torch.float64)
    mass = mass / mass.sum(-1, keepdim=True).clamp_min(1e-300)
    delta = torch.arange(mass.shape[-1], dtype=torch.float64)
    angle = delta[:, None] * inv_freq.to(torch.float64)[None, :]  # (L, F)
    return mass @ angle.cos(), mass @ angle.sin()


def yarn_inv_freq(base: float, dim: int, factor: float, original_max: int, beta_fast: float,
                  beta_slow: float) -> torch.Tensor:
    """(dim/2,) inverse frequencies of DeepSeek's YaRN as transformers and vLLM compute them (ramp ends
    floored / ceiled to whole dimensions), fp64."""
    def correction_dim(rotations):
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    pos = base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency
    return (1 / (factor * pos)) * (1 - keep) + (1 / pos) * keep


def fit_yarn_betas(source: torch.Tensor, base: float, dim: int, factor: float,
                   original_max: int) -> tuple[float, float, float]:
    """YaRN (beta_fast, beta_slow) whose dim/2 slot frequencies each lie as close as possible to one of the
    `source` frequencies (e.g. Llama-3's scaled ones; the conversion gives each slot its nearest source
    frequencies). Only the whole-dimension ramp ends matter, so every pair of ends is tried.
    Returns (beta_fast, beta_slow, max over slots of the log distance to the nearest source frequency)."""
    def beta_for(corr):  # the rotation count whose correction dim is `corr`
        return original_max / (2 * math.pi) * base ** (-2 * corr / dim)

    log_source = source.double().log()
    best = None
    half = dim // 2
    for low in range(0, half):
        for high in range(low + 1, half + 1):
            fast, slow = beta_for(low + 0.5), beta_for(high - 0.5)
            log_slot = yarn_inv_freq(base, dim, factor, original_max, fast, slow).log()
            if len(log_source) == half:  # one source frequency per slot: slot j carries frequency j
                err = float((log_slot - log_source).abs().max())
            else:
                err = float((log_slot[:, None] - log_source[None, :]).abs().min(1).values.max())
            if best is None or err < best[2]:
                best = (fast, slow, err)
    return best
