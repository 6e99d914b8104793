"""Turn one GQA attention layer into MLA weights (natural form), in closed form.

Inputs are the source weights, the second moment of the attention input E[[x;1][x;1]^T] and a
RopePlan. Everything is fp64; every choice that matters for quality is an argument so the
ablations in eval/quality.py can switch it.

Exact rewrites used here (no approximation):
- the query of head h in group g reads the rotary key through a_{g,i} (RopePlan), so q.k is unchanged
  for the part carried by the rotary key;
- the bias of the RoPE-free key adds q.b to every score of a query: a constant softmax ignores, so
  it is dropped;
- the value bias passes through softmax (weights sum to 1) and o_proj unchanged: it becomes part of
  the o_proj bias (value_bias="output"), or, for an output without biases, the joint latent treats the
  value map as the affine [W_v | b_v] under the augmented moment, so the latent spends its directions on the
  bias as on any signal and carries it as a latent bias (value_bias="latent"; ops/bias_fold.py folds it).
Approximations: the residual key components lose RoPE (replaced by the expected rotation when
`nope_rotation` is given), neighbouring frequencies folded into one slot share its frequency, and
the latent keeps `latent_dim` directions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .decouple import RopePlan
from .linalg import affine_moment, psd_sqrt, top_eigvecs
from .mla import GQAWeights, MLAWeights, head_blocks, softmax_fold

LATENT_WEIGHTINGS = ("attention", "plain")
KV_BALANCES = ("output", "norm")
VALUE_BIASES = ("output", "latent")


@dataclass
class FactorizeReport:
    kept_energy: float  # fraction of the weighted latent energy the latent keeps
    kv_balance: float  # factor applied to the key block before the joint PCA


def _rows(block: int, size: int) -> slice:
    return slice(block * size, (block + 1) * size)


def query_transform(plan: RopePlan, num_heads: int, head_dim: int, rope_dim: int, nope_rotation=None):
    """Per-head map from the source query (rotate_half layout, D) to [q_nope (D) | q_rope (dr)].

    nope_rotation: optional (cos, sin), each (H, D/2): the expected rotation E[R(-w*delta)] the
    RoPE-free part applies in place of RoPE. Returns (H, D + dr, D) with the softmax fold included.
    """
    half = head_dim // 2
    kv_heads = plan.a.shape[1]
    rep = num_heads // kv_heads
    transform = torch.zeros(num_heads, head_dim + rope_dim, head_dim, dtype=torch.float64)
    i = torch.arange(half)
    if nope_rotation is None:
        c = torch.ones(num_heads, half, dtype=torch.float64)
        s = torch.zeros_like(c)
    else:
        c, s = (t.to(torch.float64) for t in nope_rotation)
    # nope pair = M^T q with M = [[C, S], [-S, C]] = E[R(-w delta)]
    transform[:, i, i] = c
    transform[:, i, i + half] = -s
    transform[:, i + half, i] = s
    transform[:, i + half, i + half] = c
    # rope slot j: sum_i a_j[g, i] * (q_first_i, q_second_i)
    share = plan.a.repeat_interleave(rep, dim=1).permute(1, 0, 2)  # (H, slots, D/2)
    slots = torch.arange(plan.num_slots)
    transform[:, head_dim + 2 * slots, :half] = share
    transform[:, head_dim + 2 * slots + 1, half:] = share
    return transform * softmax_fold(head_dim, rope_dim, head_dim)


def rope_selection(plan: RopePlan, head_dim: int, rope_dim: int):
    """P (dr, G*D): rotary key = P k.  A (G*D, dr): the rotary key's share of each key, A P k."""
    slots, kv_heads, half = plan.a.shape
    select = torch.zeros(rope_dim, kv_heads, head_dim, dtype=torch.float64)
    select[0::2, :, :half] = plan.b  # first coordinate of each pair feeds the even rotary dim
    select[1::2, :, half:] = plan.b
    share = torch.zeros(rope_dim, kv_heads, head_dim, dtype=torch.float64)
    share[0::2, :, :half] = plan.a
    share[1::2, :, half:] = plan.a
    return select.reshape(rope_dim, -1), share.reshape(rope_dim, -1).T


def factorize(attn: GQAWeights, x_moment: torch.Tensor, plan: RopePlan, rope_dim: int, latent_dim: int,
              **options) -> tuple[MLAWeights, FactorizeReport]:
    """Closed-form conversion of one layer, computed on the device of the inputs (fp64 on a GPU too)."""
    with torch.device(attn.q.device):  # factories below (zeros, eye, arange) follow the inputs
        return _factorize(attn, x_moment, plan, rope_dim, latent_dim, **options)


def _factorize(
    attn: GQAWeights,
    x_moment: torch.Tensor,
    plan: RopePlan,
    rope_dim: int,
    latent_dim: int,
    *,
    nope_rotation=None,
    latent_weighting: str = "attention",
    kv_balance: str = "output",
    value_bias: str = "output",
) -> tuple[MLAWeights, FactorizeReport]:
    if value_bias not in VALUE_BIASES:
        raise ValueError(f"value_bias must be one of {VALUE_BIASES}")
    if latent_weighting not in LATENT_WEIGHTINGS:
        raise ValueError(f"latent_weighting must be one of {LATENT_WEIGHTINGS}")
    if kv_balance not in KV_BALANCES:
        raise ValueError(f"kv_balance must be one of {KV_BALANCES}")
    if kv_balance == "output" and latent_weighting != "attention":
        raise ValueError("kv_balance='output' puts keys in output units and needs latent_weighting='attention'")
    attn = attn.to(torch.float64)
    x_moment = x_moment.to(torch.float64)
    heads, kv_heads, dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    rep, hidden = heads // kv_heads, attn.q.shape[1]

    # Queries: [nope | rope] per head.
    transform = query_transform(plan, heads, dim, rope_dim, nope_rotation)  # (H, D+dr, D)
    q_heads = head_blocks(attn.q, heads)  # (H, D, d)
    q_new = torch.einsum("hnd,hdx->hnx", transform, q_heads).reshape(-1, hidden)
    q_bias = None
    if attn.q_bias is not None:
        q_bias = torch.einsum("hnd,hd->hn", transform, attn.q_bias.view(heads, dim)).reshape(-1)

    # Keys: shared rotary key and RoPE-free residual.
    select, share = rope_selection(plan, dim, rope_dim)
    rope_rows = select @ attn.k  # (dr, d)
    rope_bias = select @ attn.k_bias if attn.k_bias is not None else None
    residual = attn.k - share @ rope_rows  # (G*D, d); its bias is softmax-invariant and dropped

    # Joint latent of [residual keys; values], weighted by what attention does with them.
    stacked = torch.cat([residual, attn.v], dim=0)  # (2*G*D, d)
    second = x_moment[:hidden, :hidden]
    mean = x_moment[:hidden, hidden]
    centered = second - torch.outer(mean, mean)
    o_heads = attn.o.view(hidden, heads, dim).permute(1, 0, 2)  # (H, d, D)
    key_weights, value_weights = [], []
    key_energy = value_energy = 0.0
    for g in range(kv_heads):
        rows = _rows(g, dim)
        key_energy += torch.trace(residual[rows] @ second @ residual[rows].T)
        value_energy += torch.trace(attn.v[rows] @ second @ attn.v[rows].T)
        if latent_weighting == "attention":
            q_moment = sum(
                affine_moment(
                    q_new.view(heads, dim + rope_dim, hidden)[h, :dim],
                    None if q_bias is None else q_bias.view(heads, -1)[h, :dim],
                    x_moment,
                )
                for h in range(g * rep, (g + 1) * rep)
            )
            o_metric = sum(o_heads[h].T @ o_heads[h] for h in range(g * rep, (g + 1) * rep))
            key_weights.append(psd_sqrt(q_moment))
            value_weights.append(psd_sqrt(o_metric))
    if kv_balance == "norm":
        balance = float(torch.sqrt(value_energy / key_energy.clamp_min(1e-300)))
    else:
        # A score error e moves the output by about p * e * |W_o (v - mean v)|: weight the key block by
        # the softmax scale times that typical output deviation (the value block is in output units).
        spread = sum(
            torch.trace(o_heads[h] @ attn.v[_rows(h // rep, dim)] @ centered @ attn.v[_rows(h // rep, dim)].T
                        @ o_heads[h].T)
            for h in range(heads)
        ) / heads
        balance = float((dim + rope_dim) ** -0.5 * torch.sqrt(spread.clamp_min(0)))

    size = 2 * kv_heads * dim
    weight = torch.zeros(size, size, dtype=torch.float64)
    weight_inv = torch.zeros_like(weight)
    for g in range(kv_heads):
        k_rows = slice(g * dim, (g + 1) * dim)
        v_rows = slice((kv_heads + g) * dim, (kv_heads + g + 1) * dim)
        if latent_weighting == "attention":
            (kr, kr_inv), (vr, vr_inv) = key_weights[g], value_weights[g]
        else:
            kr = kr_inv = vr = vr_inv = torch.eye(dim, dtype=torch.float64)
        weight[k_rows, k_rows], weight_inv[k_rows, k_rows] = balance * kr, kr_inv / balance
        weight[v_rows, v_rows], weight_inv[v_rows, v_rows] = vr, vr_inv

    in_latent = value_bias == "latent" and attn.v_bias is not None
    if in_latent:  # [W | b] under the augmented moment; the RoPE-free key's bias stays 0 (the softmax drops it)
        column = torch.cat([torch.zeros(kv_heads * dim, dtype=torch.float64), attn.v_bias])
        weighted = weight @ torch.cat([stacked, column[:, None]], dim=1)  # (2GD, d+1)
        moment = weighted @ x_moment @ weighted.T
    else:
        weighted = weight @ stacked  # (2GD, d)
        moment = weighted @ second @ weighted.T
    vals, basis = top_eigvecs(moment, latent_dim)  # (2GD, r)
    total = torch.linalg.eigvalsh(0.5 * (moment + moment.T)).clamp_min(0).sum()
    kept = float(vals.clamp_min(0).sum() / total.clamp_min(1e-300))
    latent_rows = basis.T @ weighted  # (r, d), or (r, d+1) with the latent's bias last
    latent_bias = latent_rows[:, hidden] if in_latent else torch.zeros(latent_dim, dtype=torch.float64)
    latent_rows = latent_rows[:, :hidden]
    recon = weight_inv @ basis  # (2GD, r)

    key_recon = recon[: kv_heads * dim].view(kv_heads, dim, latent_dim)
    value_recon = recon[kv_heads * dim :].view(kv_heads, dim, latent_dim)
    group = torch.arange(heads) // rep
    kv_b = torch.cat([key_recon[group], value_recon[group]], dim=1).reshape(-1, latent_dim)

    o_bias = attn.o_bias.clone() if attn.o_bias is not None else None
    if attn.v_bias is not None and not in_latent:
        v_bias_heads = attn.v_bias.view(kv_heads, dim)[group].reshape(-1)  # (H*D)
        folded = attn.o @ v_bias_heads
        o_bias = folded if o_bias is None else o_bias + folded

    kv_a_bias = None
    if rope_bias is not None or in_latent:
        kv_a_bias = torch.cat([latent_bias, rope_bias if rope_bias is not None else
                               torch.zeros(rope_dim, dtype=torch.float64)])
    q_b = None
    if attn.q_a is not None:  # one RMSNorm over the whole query kept: q_b maps its output head by head
        q_b = torch.einsum("hnd,hdk->hnk", transform, attn.q_a_out.view(heads, dim, -1))
        q_b = q_b.reshape(heads * (dim + rope_dim), -1)  # (H*(D+dr), n)
        q_new, q_bias = attn.q_a, attn.q_a_bias
    weights = MLAWeights(
        q=q_new,
        kv_a=torch.cat([latent_rows, rope_rows], dim=0),
        kv_b=kv_b,
        o=attn.o.clone(),
        num_heads=heads,
        latent_dim=latent_dim,
        rope_dim=rope_dim,
        nope_dim=dim,
        v_dim=dim,
        q_bias=q_bias,
        kv_a_bias=kv_a_bias,
        o_bias=o_bias,
        q_b=q_b,
    )
    return weights, FactorizeReport(kept_energy=kept, kv_balance=balance)
