"""Calibration statistics of one attention layer, accumulated chunk by chunk."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .mla import GQAWeights, _linear
from .rope import apply_rotate_half


@dataclass
class LayerStats:
    """What the closed-form conversion of one layer needs from calibration data."""

    x_moment: torch.Tensor  # (d+1, d+1) fp64: E[[x;1][x;1]^T] of the attention input
    distance_mass: torch.Tensor  # (H, L) fp64: attention probability mass at each query-key distance
    tokens: int = 0
    # the moment as measured, before any shrinkage (x_moment is what the factorization trusts): the energy the
    # cache will really hold is computed from this one
    raw_moment: torch.Tensor | None = None
    # with split=True: the raw moments of the even and of the odd windows (set by finalize), for what is fitted on
    # some windows to be scored on others (ops/bias_fold.heldout_spread); while accumulating, the even windows' sum
    halves: tuple[torch.Tensor, torch.Tensor] | None = None
    even_moment: torch.Tensor | None = None
    even_tokens: int = 0
    windows: int = 0

    @classmethod
    def empty(cls, hidden: int, heads: int, seq_len: int, device=None, split: bool = False) -> "LayerStats":
        zeros = lambda: torch.zeros(hidden + 1, hidden + 1, dtype=torch.float64, device=device)  # noqa: E731
        return cls(
            x_moment=zeros(),
            distance_mass=torch.zeros(heads, seq_len, dtype=torch.float64, device=device),
            even_moment=zeros() if split else None,
        )

    def add(self, x: torch.Tensor) -> None:
        """Accumulate the input moment of x: (B, L, d) attention inputs of one chunk."""
        for rows, moment in self._parts(x):
            flat = rows.reshape(-1, rows.shape[-1])
            aug = torch.cat([flat, flat.new_ones(flat.shape[0], 1)], dim=1)
            # fp32 products per chunk, fp64 accumulation across chunks
            part = (aug.T.float() @ aug.float()).double()
            self.x_moment += part
            if moment is not None:
                moment += part
                self.even_tokens += flat.shape[0]
        self.tokens += x.shape[0] * x.shape[1]
        self.windows += x.shape[0]

    def _parts(self, x: torch.Tensor):
        if self.even_moment is None:
            return [(x, None)]
        first = self.windows % 2  # the chunk's first window that is even in the whole sequence of windows
        even = x[first::2]
        odd = x[1 - first::2]
        return [(even, self.even_moment), (odd, None)] if even.shape[0] else [(odd, None)]

    def finalize(self, shrinkage: float = 0.0, target: str = "diag") -> "LayerStats":
        raw = self.x_moment / max(self.tokens, 1)
        moment = shrink_moment(raw, shrinkage, target) if shrinkage else raw
        halves = None
        odd_tokens = self.tokens - self.even_tokens
        if self.even_moment is not None and self.even_tokens and odd_tokens:
            halves = (self.even_moment / self.even_tokens, (self.x_moment - self.even_moment) / odd_tokens)
        return LayerStats(moment, self.distance_mass, self.tokens, raw_moment=raw, halves=halves)


SHRINK_TARGETS = ("diag", "identity")


def shrink_moment(moment: torch.Tensor, alpha: float, target: str = "diag") -> torch.Tensor:
    """Pull the input covariance inside an augmented moment [[S, m], [m^T, 1]] toward a prior that
    keeps less of the calibration text: its own diagonal ("diag": per-channel energy kept, the
    correlations one kind of text makes damped) or a scaled identity ("identity": no direction
    preferred). The mean and the constant are kept; alpha = 0 changes nothing, 1 is the prior."""
    if target not in SHRINK_TARGETS:
        raise ValueError(f"shrink target must be one of {SHRINK_TARGETS}")
    if alpha == 0:
        return moment
    hidden = moment.shape[0] - 1
    mean = moment[:hidden, hidden]
    cov = moment[:hidden, :hidden] - torch.outer(mean, mean)
    prior = torch.diag(cov.diagonal()) if target == "diag" else torch.eye(hidden, dtype=cov.dtype,
                                                                          device=cov.device) * cov.trace() / hidden
    out = moment.clone()
    out[:hidden, :hidden] = (1 - alpha) * cov + alpha * prior + torch.outer(mean, mean)
    return out


def attention_probs(x: torch.Tensor, attn: GQAWeights, cos, sin, queries: slice | None = None) -> torch.Tensor:
    """Causal softmax probabilities (B, H, Lq, L) of the source attention on x (B, L, d), for the query rows in
    `queries` (default all)."""
    bsz, length, _ = x.shape
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    rows = queries or slice(0, length)
    q = _linear(x[:, rows], attn.q, attn.q_bias).view(bsz, -1, heads, dim).transpose(1, 2)
    k = _linear(x, attn.k, attn.k_bias).view(bsz, length, kv_heads, dim).transpose(1, 2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    q, k = apply_rotate_half(q, cos[rows], sin[rows]), apply_rotate_half(k, cos, sin)
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    scores = (q @ k.transpose(-1, -2)) * dim**-0.5  # (B, H, Lq, L)
    positions = torch.arange(length, device=x.device)
    mask = positions[None, :] > positions[rows, None]  # keys after the query
    return scores.masked_fill(mask, float("-inf")).softmax(-1)


QUERY_BLOCK = 512  # attention rows computed at once: memory (B, H, 512, L), not (B, H, L, L), at long contexts


def attention_distance_mass(x: torch.Tensor, attn: GQAWeights, cos, sin) -> torch.Tensor:
    """(H, L): summed attention probability at distance delta = query position - key position, computed a block of
    queries at a time (an 8192-token window's full map would be 2.4 GB for SmolLM2's nine heads)."""
    length = x.shape[1]
    heads = attn.num_heads
    mass = torch.zeros(heads, length, dtype=torch.float64, device=x.device)
    keys = torch.arange(length, device=x.device)
    for start in range(0, length, QUERY_BLOCK):
        rows = slice(start, min(length, start + QUERY_BLOCK))
        probs = attention_probs(x, attn, cos, sin, rows).sum(0)  # (H, Lq, L) summed over the batch
        delta = (keys[rows, None] - keys[None, :]).clamp_min(0)  # (Lq, L); keys after the query carry 0 probability
        mass.index_add_(1, delta.reshape(-1), probs.reshape(heads, -1).double())
    return mass
