"""Weights of one attention layer before and after conversion, and reference forwards for both.

`MLAWeights` is the *natural* parametrization of a converted layer: the latent is used as computed
(no RMSNorm) and the query has an optional bias. export.py turns it into stock DeepSeek-V3 tensors
(linearized kv_a_layernorm, q_lora path for a query bias); these forwards are the math the stock
model must reproduce. A converted layer may keep one RMSNorm over its whole query (`q_b`, for sources that
normalize their queries, ops/qk_norm.py): that is DeepSeek's q_lora path with a genuine q_a_layernorm.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

from .rope import apply_interleaved, apply_rotate_half

STOCK_NORM_EPS = 1e-6  # what transformers' DeepseekV3RMSNorm uses for the latent and query norms


@dataclass
class GQAWeights:
    """One source attention layer. Shapes: q (H*D, d), k/v (G*D, d), o (d, H*D).

    A source whose query is normalized (ops/qk_norm.py) may keep one RMSNorm over the whole query: its query is
    then q_a_out @ RMSNorm(q_a x + q_a_bias) (q_a (n, d), q_a_out (H*D, n)), and q / q_bias stay its per-head
    linear fold, which the closed form's statistics read.
    """

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_a: torch.Tensor | None = None
    q_a_bias: torch.Tensor | None = None
    q_a_out: torch.Tensor | None = None

    def to(self, dtype: torch.dtype, device=None) -> "GQAWeights":
        return _cast(self, dtype, device)


@dataclass
class MLAWeights:
    """One converted layer in natural form.

    q (H*(dn+dr), d) already carries the softmax-scale correction; kv_a (r+dr, d) holds the latent
    rows then the interleaved rotary-key rows; kv_b (H*(dn+dv), r); o (d, H*dv).
    With q_b (H*(dn+dr), n) the query is q_b @ RMSNorm(q x + q_bias) instead, q (n, d) and q_bias (n,) then
    being the projection read through one RMSNorm (no weight: its weight is folded into q_b's columns).
    """

    q: torch.Tensor
    kv_a: torch.Tensor
    kv_b: torch.Tensor
    o: torch.Tensor
    num_heads: int
    latent_dim: int
    rope_dim: int
    nope_dim: int
    v_dim: int
    q_bias: torch.Tensor | None = None
    kv_a_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_b: torch.Tensor | None = None

    @property
    def softmax_scale(self) -> float:
        return (self.nope_dim + self.rope_dim) ** -0.5

    def to(self, dtype: torch.dtype, device=None) -> "MLAWeights":
        return _cast(self, dtype, device)


def _cast(weights, dtype, device):
    changes = {
        f.name: getattr(weights, f.name).to(dtype=dtype, device=device)
        for f in fields(weights)
        if isinstance(getattr(weights, f.name), torch.Tensor)
    }
    return replace(weights, **changes)


def _linear(x, weight, bias):
    return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def mla_query(x, w: MLAWeights) -> torch.Tensor:
    """The converted layer's query on x (..., d): (..., H*(dn+dr)), rotary part not yet rotated."""
    q = _linear(x, w.q, w.q_bias)
    if w.q_b is None:
        return q
    return F.linear(q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + STOCK_NORM_EPS), w.q_b.to(x.dtype))


def gqa_attention(x, w: GQAWeights, cos, sin, scale: float | None = None):
    """Source attention on x (B, L, d) with rotate_half cos/sin (L, D); causal. Returns (B, L, d)."""
    bsz, length, _ = x.shape
    heads, kv_heads, dim = w.num_heads, w.num_kv_heads, w.head_dim
    q = _linear(x, w.q, w.q_bias).view(bsz, length, heads, dim).transpose(1, 2)  # (B, H, L, D)
    k = _linear(x, w.k, w.k_bias).view(bsz, length, kv_heads, dim).transpose(1, 2)  # (B, G, L, D)
    v = _linear(x, w.v, w.v_bias).view(bsz, length, kv_heads, dim).transpose(1, 2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    q, k = apply_rotate_half(q, cos, sin), apply_rotate_half(k, cos, sin)
    rep = heads // kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, L, D)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale or dim**-0.5)
    return _linear(out.transpose(1, 2).reshape(bsz, length, heads * dim), w.o, w.o_bias)


def mla_attention(x, w: MLAWeights, cos, sin, query_positions: torch.Tensor | None = None, cache_store=None,
                  query_store=None):
    """Converted attention on x (B, L, d); cos/sin (L, dr) or (B, L, dr) of the target rotary embedding.

    query_positions: optional sorted (P,) positions; only those queries are computed (against every
    key they may see), which makes layer refinement much cheaper. cache_store: optional map applied to
    each token's cached row [latent | rotated rotary key] (B, L, r + dr), e.g. a quantized cache's
    store-and-read-back (ops/kv_quant.py); keys and values are read from what it returns, as an engine
    that caches that row (llama.cpp's deepseek2) reads them. query_store: optional map applied to each head's
    absorbed query row [q_nope W_UK | rotated q_rope] (B, H, P, r + dr) before its dot product with the cached
    rows; given one, attention runs absorbed (values read from the latent, then W_UV), as llama.cpp runs it.
    Returns (B, L or P, d).
    """
    bsz, length, _ = x.shape
    heads, dn, dr, dv, r = w.num_heads, w.nope_dim, w.rope_dim, w.v_dim, w.latent_dim
    xq = x if query_positions is None else x[:, query_positions]
    n_q = xq.shape[1]
    q = mla_query(xq, w).view(bsz, n_q, heads, dn + dr).transpose(1, 2)  # (B, H, P, dn+dr)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    ckv = _linear(x, w.kv_a, w.kv_a_bias)  # (B, L, r + dr)
    latent, k_rope = ckv.split([r, dr], dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if cos.dim() == 3:  # per-batch tables: broadcast over heads
        cos, sin = cos[:, None], sin[:, None]
    if query_positions is None:
        q_rope = apply_interleaved(q_rope, cos, sin)
        mask, causal = None, True
    else:
        q_rope = apply_interleaved(q_rope, cos[..., query_positions, :], sin[..., query_positions, :])
        mask = torch.arange(length, device=x.device)[None, :] <= query_positions[:, None]  # (P, L)
        causal = False
    k_rope = apply_interleaved(k_rope[:, None], cos, sin)  # (B, 1, L, dr)
    if cache_store is not None:
        latent, k_rope = cache_store(torch.cat([latent, k_rope[:, 0]], dim=-1)).split([r, dr], dim=-1)
        k_rope = k_rope[:, None]
    if query_store is not None:
        return _absorbed(q_nope, q_rope, latent, k_rope, w, mask, causal, query_store, bsz, n_q)
    k_rope = k_rope.expand(bsz, heads, length, dr)
    kv = F.linear(latent, w.kv_b.to(x.dtype)).view(bsz, length, heads, dn + dv).transpose(1, 2)
    k_nope, v = kv.split([dn, dv], dim=-1)  # (B, H, L, dn), (B, H, L, dv)
    query = torch.cat([q_nope, q_rope], dim=-1)
    key = torch.cat([k_nope, k_rope], dim=-1)
    if causal and dv < dn + dr:
        # Values zero-padded to the key width: the output's first dv columns are unchanged, and PyTorch's flash
        # kernels (they need one head width) replace the math path, whose (L, L) attention map per head is what
        # training at length would otherwise hold (SmolLM2 at 8192: 2.4 GB per layer, times four in the backward)
        padded = F.scaled_dot_product_attention(query, key, F.pad(v, (0, dn + dr - dv)), is_causal=True,
                                                scale=w.softmax_scale)
        out = padded[..., :dv]
    else:
        out = F.scaled_dot_product_attention(query, key, v, attn_mask=mask, is_causal=causal, scale=w.softmax_scale)
    return _linear(out.transpose(1, 2).reshape(bsz, n_q, heads * dv), w.o, w.o_bias)


def _absorbed(q_nope, q_rope, latent, k_rope, w: MLAWeights, mask, causal, query_store, bsz, n_q):
    """Attention with W_UK absorbed into the query and W_UV applied after the latent is read: the query row
    [q_nope W_UK | q_rope] meets the cached row [latent | k_rope] in one dot product (where an engine converts
    the query to its cache's dot-product type, query_store), the values are the latent itself."""
    heads, dn, dv, r = w.num_heads, w.nope_dim, w.v_dim, w.latent_dim
    kv_b = head_blocks(w.kv_b.to(latent.dtype), heads)  # (H, dn + dv, r)
    w_uk, w_uv = kv_b[:, :dn], kv_b[:, dn:]
    query = query_store(torch.cat([torch.einsum("bhpn,hnr->bhpr", q_nope, w_uk), q_rope], dim=-1))
    key = torch.cat([latent[:, None], k_rope], dim=-1)  # (B, 1, L, r + dr)
    heads_key = key.expand(bsz, heads, *key.shape[2:])
    read = F.scaled_dot_product_attention(query, heads_key, heads_key[..., :r], attn_mask=mask, is_causal=causal,
                                          scale=w.softmax_scale)  # (B, H, P, r)
    out = torch.einsum("bhpr,hvr->bhpv", read, w_uv)
    return _linear(out.transpose(1, 2).reshape(bsz, n_q, heads * dv), w.o, w.o_bias)


def head_blocks(matrix: torch.Tensor, heads: int) -> torch.Tensor:
    """(heads*n, m) -> (heads, n, m)."""
    return matrix.reshape(heads, -1, matrix.shape[-1])


def softmax_fold(head_dim: int, rope_dim: int, nope_dim: int) -> float:
    """Factor folded into the query so DeepSeek's (dn+dr)^-1/2 softmax scale equals the source D^-1/2."""
    return math.sqrt((nope_dim + rope_dim) / head_dim)


def pad_latent(w: MLAWeights, size: int) -> MLAWeights:
    """The same layer with the latent zero-padded to `size` channels (exact: padded channels are 0 in
    every token's latent and read by nothing). For engines whose MLA kernels accept only some sizes."""
    extra = size - w.latent_dim
    if extra < 0:
        raise ValueError(f"cannot pad a latent of {w.latent_dim} down to {size}")
    if extra == 0:
        return w
    r = w.latent_dim
    kv_a = torch.cat([w.kv_a[:r], w.kv_a.new_zeros(extra, w.kv_a.shape[1]), w.kv_a[r:]])
    kv_b = torch.cat([w.kv_b, w.kv_b.new_zeros(w.kv_b.shape[0], extra)], dim=1)
    bias = w.kv_a_bias
    if bias is not None:
        bias = torch.cat([bias[:r], bias.new_zeros(extra), bias[r:]])
    return replace(w, kv_a=kv_a, kv_b=kv_b, kv_a_bias=bias, latent_dim=size)
