"""RoPE math in both layouts, and the expected rotation over attention distances.

Source models (Llama family) rotate the pair (i, i + D/2) of every head by angle p * w_i
("rotate_half" layout). DeepSeek-V3 with `rope_interleave: true` rotates the pair (2j, 2j+1) of the
rope part by p * w'_j, where w'_j comes from its own config (rope_theta, rope_dim). Slot j of the
shared rotary key carries exactly only the source frequencies equal to w'_j (see ops/decouple.py).
"""

from __future__ import annotations

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
