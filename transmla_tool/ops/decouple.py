"""Choose what each slot of the shared rotary key carries.

At one RoPE frequency every KV head's 2-D pair is rotated by the same angle, so any real mixing
across heads commutes with RoPE. Frequencies are gathered into *pools*; each pool owns some slots
of the rotary key. Within a pool we keep the components that matter most for attention scores in
its slots; every other component loses RoPE and joins the latent. A component that mixes several
frequencies rotates at its slot's frequency: exact for that frequency, approximate for neighbours.

Reconstruction per candidate c = (kv head g, frequency i):
    k_c ~= sum_j a_j[c] * k_rope_j + residual_c,   k_rope_j = sum_c b_j[c] k_c.
Minimising sum_c w_c E|residual_c|^2 within a pool is a weighted PCA: with u_j the top eigenvectors
of W^1/2 C W^1/2, a_j = W^-1/2 u_j and b_j = W^1/2 u_j.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .linalg import top_eigvecs


@dataclass
class RopePlan:
    """How keys split into the shared rotary key and the RoPE-free residual, for one layer."""

    a: torch.Tensor  # (slots, G, D/2) share of rotary key j in candidate (g, i)
    b: torch.Tensor  # (slots, G, D/2) mixing weight of candidate (g, i) into rotary key j

    @property
    def num_slots(self) -> int:
        return self.a.shape[0]


def fold_pools(head_dim: int, rope_dim: int, pool_size: int = 1) -> list[tuple[list[int], list[int]]]:
    """Pools of (source frequencies, slots) for a target that keeps the source rope_theta.

    With stride s = D / rope_dim, slot j has frequency w_{s*j}. pool_size p gathers p consecutive
    slots and their s*p source frequencies into one pool (TransMLA's "freqfold" when p > 1).
    """
    if rope_dim <= 0 or rope_dim % 2:
        raise ValueError(f"rope_dim must be a positive even number, got {rope_dim}")
    if head_dim % rope_dim:
        raise ValueError(f"rope_dim {rope_dim} must divide head_dim {head_dim}")
    stride, slots = head_dim // rope_dim, rope_dim // 2
    if pool_size < 1 or slots % pool_size:
        raise ValueError(f"pool size {pool_size} must divide the {slots} rotary slots")
    return [
        (list(range(stride * j0, stride * (j0 + pool_size))), list(range(j0, j0 + pool_size)))
        for j0 in range(0, slots, pool_size)
    ]


def match_pools(source_log_freq: torch.Tensor, slot_log_freq: torch.Tensor,
                pool_size: int = 1) -> tuple[list[tuple[list[int], list[int]]], float]:
    """Pools for a target whose slot frequencies are not exactly every (D/rope_dim)-th source frequency
    (a scaled rope mapped onto YaRN). Both lists are ordered by frequency, so the source frequencies
    are cut into as many consecutive, non-empty runs as there are slots, run j going to slot j; the cut
    minimises the largest distance between a slot's frequency and its nearest member, then the summed
    distance of all members (dynamic programming over the cuts). `pool_size` consecutive slots share a
    pool.

    Returns (pools, error): error = max over slots of |log(slot frequency / nearest member frequency)|.
    """
    src = [float(x) for x in source_log_freq.double()]
    slot = [float(x) for x in slot_log_freq.double()]
    n, m = len(src), len(slot)
    if n < m:
        raise ValueError(f"{m} rotary slots but only {n} source frequencies")
    if m % pool_size:
        raise ValueError(f"pool size {pool_size} must divide the {m} rotary slots")
    inf = (float("inf"), float("inf"))
    # best[j][k]: cost of giving sources [0, k) to slots [0, j); cut[j][k]: where slot j-1's run starts
    best = [[inf] * (n + 1) for _ in range(m + 1)]
    cut = [[0] * (n + 1) for _ in range(m + 1)]
    best[0][0] = (0.0, 0.0)
    for j in range(m):
        for start in range(j, n - (m - j) + 1):
            if best[j][start] == inf:
                continue
            nearest, total = float("inf"), 0.0
            for end in range(start + 1, n - (m - j - 1) + 1):
                d = abs(src[end - 1] - slot[j])
                nearest, total = min(nearest, d), total + d
                cost = (max(best[j][start][0], nearest), best[j][start][1] + total)
                if cost < best[j + 1][end]:
                    best[j + 1][end], cut[j + 1][end] = cost, start
    runs, end = [], n
    for j in range(m, 0, -1):
        runs.append(list(range(cut[j][end], end)))
        end = cut[j][end]
    runs.reverse()
    pools = [(sorted(i for j in range(j0, j0 + pool_size) for i in runs[j]), list(range(j0, j0 + pool_size)))
             for j0 in range(0, m, pool_size)]
    return pools, best[m][n][0]


def pair_energy(key_moment: torch.Tensor, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """E[k_c . k_c'] for every pair of (head, frequency) candidates: (G, F, G, F) with F = D/2."""
    half = head_dim // 2
    m = key_moment.reshape(num_kv_heads, 2, half, num_kv_heads, 2, half)
    # sum over the two coordinates of each rotating pair (first with first, second with second)
    return m[:, 0, :, :, 0, :] + m[:, 1, :, :, 1, :]


def plan_rope(
    key_moment: torch.Tensor,
    pools: list[tuple[list[int], list[int]]],
    num_kv_heads: int,
    head_dim: int,
    candidate_weight: torch.Tensor | None = None,
    slot_log_freq: torch.Tensor | None = None,
    source_log_freq: torch.Tensor | None = None,
) -> RopePlan:
    """Weighted PCA per pool.

    key_moment: (G*D, G*D) second moment of the keys (bias included).
    candidate_weight: (G, D/2) importance of each candidate's score contribution; None weighs all
        candidates equally (plain key-energy PCA).
    slot_log_freq / source_log_freq: log frequencies used to hand a pool's components to its slots
        (the component whose energy sits at lower frequencies gets the lower-frequency slot). Only
        needed for pools with more than one slot.
    """
    half = head_dim // 2
    slots = sum(len(s) for _, s in pools)
    energy = pair_energy(key_moment.to(torch.float64), num_kv_heads, head_dim)  # (G, F, G, F)
    a = torch.zeros(slots, num_kv_heads, half, dtype=torch.float64)
    b = torch.zeros_like(a)
    weight = torch.ones(num_kv_heads, half, dtype=torch.float64)
    if candidate_weight is not None:
        weight = candidate_weight.to(torch.float64)
    for freqs, pool_slots in pools:
        f = torch.tensor(freqs)
        n = num_kv_heads * len(freqs)
        c = energy[:, f][:, :, :, f].reshape(n, n)
        w = weight[:, f].reshape(-1)
        w = w.clamp_min(w.max() * 1e-8 + 1e-300)
        root = w.sqrt()
        _, vecs = top_eigvecs(root[:, None] * c * root[None, :], len(pool_slots))  # (n, k)
        order = _assign(vecs, len(freqs), pool_slots, f, slot_log_freq, source_log_freq)
        for component, j in zip(order, pool_slots):
            u = vecs[:, component]
            a[j][:, f] = (u / root).reshape(num_kv_heads, len(freqs))
            b[j][:, f] = (u * root).reshape(num_kv_heads, len(freqs))
    return RopePlan(a=a, b=b)


def _assign(vecs, pool_freqs, pool_slots, freqs, slot_log_freq, source_log_freq) -> list[int]:
    """Order the components so the k-th goes to the k-th slot of the pool."""
    k = vecs.shape[1]
    if k == 1 or slot_log_freq is None or source_log_freq is None:
        return list(range(k))
    # energy-weighted mean log frequency of each component, matched by rank to the slots' frequencies
    share = vecs.pow(2).reshape(-1, pool_freqs, k).sum(0)  # (F_pool, k)
    centre = (share * source_log_freq[freqs][:, None]).sum(0) / share.sum(0).clamp_min(1e-300)
    by_centre = torch.argsort(centre, descending=True, stable=True).tolist()
    slot_order = torch.argsort(slot_log_freq[pool_slots], descending=True, stable=True).tolist()
    order = [0] * k
    for comp, slot_rank in zip(by_centre, slot_order):
        order[slot_rank] = comp
    return order
