"""The value path of a converted layer fitted in closed form, for fixed attention weights.

With the scores fixed (queries, latent and rotary key as they are), a converted layer's output is linear in
its value path:

    y_t = sum_h O_h W_uv,h z_{h,t} + b,    z_{h,t} = sum_s p_h(t, s) c_s    (c: the latent, (r,))

where O_h (d, dv) is head h's block of o_proj and W_uv,h (dv, r) its value rows of kv_b_proj. The fit to the
source block's outputs Y needs only the statistics G = E[z z^T] ((H r)^2, heads stacked) and B = E[y z^T]
((d, H r)), gathered in one pass. With dv < r each M_h = O_h W_uv,h has rank <= dv, so the fit alternates
(ALS): the best o_proj for the value rows (one (H dv)^2 solve), then each head's value rows for o_proj and
the other heads (a d x dv by r x r two-sided solve), each step never increasing the loss. The start is the
layer's own weights, so the fit can only improve on them (checked on the statistics).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from .mla import MLAWeights, _linear, mla_query
from .rope import apply_interleaved


@torch.no_grad()
def latent_readout(x, w: MLAWeights, cos, sin, cache_store=None) -> torch.Tensor:
    """z (B, L, H, r): each head's attention-weighted sum of the latent (what W_uv then maps to its values)."""
    bsz, length, _ = x.shape
    heads, dn, dr, r = w.num_heads, w.nope_dim, w.rope_dim, w.latent_dim
    q = mla_query(x, w).view(bsz, length, heads, dn + dr).transpose(1, 2)
    q_nope, q_rope = q.split([dn, dr], dim=-1)
    latent, k_rope = _linear(x, w.kv_a, w.kv_a_bias).split([r, dr], dim=-1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    q_rope = apply_interleaved(q_rope, cos, sin)
    k_rope = apply_interleaved(k_rope[:, None], cos, sin)
    if cache_store is not None:
        latent, k_rope = cache_store(torch.cat([latent, k_rope[:, 0]], dim=-1)).split([r, dr], dim=-1)
        k_rope = k_rope[:, None]
    k_nope = F.linear(latent, w.kv_b.to(x.dtype).view(heads, dn + w.v_dim, r)[:, :dn]
                      .reshape(heads * dn, r)).view(bsz, length, heads, dn).transpose(1, 2)
    key = torch.cat([k_nope, k_rope.expand(bsz, heads, length, dr)], dim=-1)
    query = torch.cat([q_nope, q_rope], dim=-1)
    values = latent[:, None].expand(bsz, heads, length, r)
    z = F.scaled_dot_product_attention(query, key, values, is_causal=True, scale=w.softmax_scale)
    return z.transpose(1, 2)  # (B, L, H, r)


@torch.no_grad()
def value_statistics(w: MLAWeights, inputs, targets, cos, sin, batch: int, cache_store=None):
    """(G, B, yy, n): sums of z z^T, (y - b) z^T and |y - b|^2 over every token of inputs/targets (N, L, d)."""
    heads, r = w.num_heads, w.latent_dim
    gram = torch.zeros(heads * r, heads * r, dtype=torch.float64, device=inputs.device)
    cross = torch.zeros(targets.shape[-1], heads * r, dtype=torch.float64, device=inputs.device)
    yy, n = 0.0, 0
    for start in range(0, inputs.shape[0], batch):
        x, y = inputs[start:start + batch], targets[start:start + batch]
        z = latent_readout(x, w, cos, sin, cache_store).reshape(-1, heads * r).float()
        y = y.reshape(-1, y.shape[-1]).float()
        if w.o_bias is not None:
            y = y - w.o_bias.to(y)
        gram += (z.T @ z).double()
        cross += (y.T @ z).double()
        yy += float(y.double().pow(2).sum())
        n += z.shape[0]
    return gram, cross, yy, n


def _loss(o_blocks, w_uv, gram, cross, yy):
    """|Y - sum_h O_h W_h Z_h|^2 from the statistics, relative to |Y|^2."""
    m = torch.cat([o @ wv for o, wv in zip(o_blocks, w_uv)], dim=1)  # (d, H r)
    return float((yy - 2 * (m * cross).sum() + (m @ gram * m).sum()) / max(yy, 1e-30))


def solve_value_path(w: MLAWeights, gram, cross, yy, iterations: int = 8, ridge: float = 1e-6):
    """The layer with o_proj and kv_b's value rows refitted by ALS on the statistics. Returns (weights, loss
    before, loss after), losses relative to |Y|^2 over the statistics' tokens."""
    heads, dn, dv, r = w.num_heads, w.nope_dim, w.v_dim, w.latent_dim
    kv_b = w.kv_b.double().view(heads, dn + dv, r)
    w_uv = [kv_b[h, dn:] for h in range(heads)]  # each (dv, r)
    o = w.o.double()
    o_blocks = [o[:, h * dv:(h + 1) * dv] for h in range(heads)]  # each (d, dv)
    gram, cross = gram.double(), cross.double()
    eye_r = torch.eye(r, dtype=torch.float64, device=gram.device)
    before = _loss(o_blocks, w_uv, gram, cross, yy)
    blocks = [slice(h * r, (h + 1) * r) for h in range(heads)]
    for _ in range(iterations):
        # o_proj for the current value rows: U = blockdiag(W_h) Z, O = B Wt^T (Wt G Wt^T)^-1
        wt = torch.block_diag(*w_uv)  # (H dv, H r)
        u_gram = wt @ gram @ wt.T
        u_cross = cross @ wt.T  # (d, H dv)
        o = torch.linalg.solve(u_gram + ridge * u_gram.diagonal().mean() * torch.eye(u_gram.shape[0], dtype=torch.float64,
                                                                                      device=gram.device),
                               u_cross.T).T
        o_blocks = [o[:, h * dv:(h + 1) * dv] for h in range(heads)]
        # each head's value rows for o_proj and the other heads: O_h^T O_h W_h G_hh = O_h^T (B_h - sum_h' O_h' W_h' G_h'h)
        for h in range(heads):
            others = sum(o_blocks[g] @ w_uv[g] @ gram[blocks[g], blocks[h]] for g in range(heads) if g != h)
            rhs = o_blocks[h].T @ (cross[:, blocks[h]] - others)  # (dv, r)
            oo = o_blocks[h].T @ o_blocks[h]
            g_hh = gram[blocks[h], blocks[h]]
            g_hh = g_hh + ridge * g_hh.diagonal().mean() * eye_r
            oo = oo + ridge * oo.diagonal().mean() * torch.eye(dv, dtype=torch.float64, device=gram.device)
            w_uv[h] = torch.linalg.solve(oo, torch.linalg.solve(g_hh, rhs.T).T)
    after = _loss(o_blocks, w_uv, gram, cross, yy)
    if after >= before:
        return w, before, before
    new_kv_b = kv_b.clone()
    for h in range(heads):
        new_kv_b[h, dn:] = w_uv[h]
    return (replace(w, o=torch.cat(o_blocks, dim=1).to(w.o.dtype),
                    kv_b=new_kv_b.reshape(-1, r).to(w.kv_b.dtype)), before, after)
