"""Pure math: norm linearization, RoPE layouts, the rotary-key plan and the factorization."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from transmla_tool.export import natural_attention, stock_attention
from transmla_tool.ops.decouple import fold_pools, plan_rope
from transmla_tool.ops.factorize import factorize, query_transform
from transmla_tool.ops.linalg import affine_moment
from transmla_tool.ops.linear_norm import (
    input_norm_bound,
    linearization_error,
    linearizing_scale,
    mean_square_bound,
)
from transmla_tool.ops.mla import STOCK_NORM_EPS, GQAWeights, gqa_attention, mla_attention, mla_query
from transmla_tool.ops.rope import apply_interleaved, apply_rotate_half, expected_rotation, rotation_cos_sin


def test_linearized_norm_is_identity_in_fp32():
    """Stock DeepseekV3RMSNorm fed alpha * c with weight w returns c to < 1e-4 (here < 1e-6), for the
    worst input the bound allows and for ordinary ones."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    torch.manual_seed(0)
    hidden, rank, eps = 64, 24, 1e-6
    latent = torch.randn(rank, hidden, dtype=torch.float64) * 3
    ln_weight = torch.rand(hidden, dtype=torch.float64) * 2
    x_sq = input_norm_bound(ln_weight, hidden)
    alpha, w = linearizing_scale(mean_square_bound(latent, None, x_sq), eps)
    assert w == 2.0 ** round(math.log2(w))  # exactly representable in bf16
    norm = DeepseekV3RMSNorm(rank, eps=eps)
    norm.weight.data.fill_(w)
    # ordinary inputs: RMSNorm outputs times the layer norm weight
    h = torch.randn(256, hidden, dtype=torch.float64)
    x = h / h.pow(2).mean(-1, keepdim=True).sqrt() * ln_weight
    # the worst input: all energy on the top right-singular vector, at the norm bound
    _, _, vh = torch.linalg.svd(latent)
    x = torch.cat([x, (vh[0] * math.sqrt(x_sq))[None]])
    c = x @ latent.T
    out = norm((alpha * c).float()).double()
    err = ((out - c).norm(dim=-1) / c.norm(dim=-1)).max()
    assert err < 1e-6  # fp32 rounding dominates; the linearization itself is below 1e-7
    assert linearization_error(c.pow(2).mean(-1), alpha, eps).max() <= 1.01e-7


def test_rope_layouts_agree():
    """Interleaved rotation of the permuted vector equals rotate_half rotation, permuted."""
    dim = 8
    inv = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    cos, sin = rotation_cos_sin(inv, torch.arange(5))
    x = torch.randn(5, dim, dtype=torch.float64)
    perm = torch.stack([torch.arange(dim // 2), torch.arange(dim // 2) + dim // 2], 1).reshape(-1)
    assert torch.allclose(apply_rotate_half(x, cos, sin)[:, perm], apply_interleaved(x[:, perm], cos, sin))


def test_expected_rotation():
    inv = torch.tensor([1.0, 0.0])
    mass = torch.tensor([[0.0, 1.0, 0.0]])  # all attention at distance 1
    c, s = expected_rotation(inv, mass)
    assert torch.allclose(c, torch.tensor([[math.cos(1.0), 1.0]], dtype=torch.float64))
    assert torch.allclose(s, torch.tensor([[math.sin(1.0), 0.0]], dtype=torch.float64))


def test_fold_pools():
    assert fold_pools(8, 8) == [([0], [0]), ([1], [1]), ([2], [2]), ([3], [3])]
    assert fold_pools(8, 4) == [([0, 1], [0]), ([2, 3], [1])]
    assert fold_pools(8, 8, pool_size=2) == [([0, 1], [0, 1]), ([2, 3], [2, 3])]
    with pytest.raises(ValueError):
        fold_pools(8, 6)


def _random_layer(heads=4, kv_heads=2, dim=8, hidden=32, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

    return GQAWeights(
        q=rnd(heads * dim, hidden, scale=hidden**-0.5), k=rnd(kv_heads * dim, hidden, scale=hidden**-0.5),
        v=rnd(kv_heads * dim, hidden, scale=hidden**-0.5), o=rnd(hidden, heads * dim, scale=(heads * dim) ** -0.5),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
        q_bias=rnd(heads * dim) if bias else None, k_bias=rnd(kv_heads * dim) if bias else None,
        v_bias=rnd(kv_heads * dim) if bias else None, o_bias=rnd(hidden) if bias else None,
    )


def _moment(x):
    flat = x.reshape(-1, x.shape[-1])
    aug = torch.cat([flat, torch.ones(flat.shape[0], 1, dtype=flat.dtype)], 1)
    return aug.T @ aug / flat.shape[0]


@pytest.mark.parametrize("bias", [False, True])
def test_single_candidate_rotary_key_is_exact(bias):
    """MQA with rope_dim = head_dim: the rotary key is the source key, the latent holds the values,
    so the natural MLA layer equals the source layer, biases included (exact rewrites)."""
    layer = _random_layer(kv_heads=1, bias=bias)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    cos, sin = rotation_cos_sin(inv, torch.arange(12))
    plan = plan_rope(affine_moment(layer.k, layer.k_bias, _moment(x)), fold_pools(8, 8), 1, 8)
    mla, _ = factorize(layer, _moment(x), plan, rope_dim=8, latent_dim=8)
    assert torch.allclose(mla_attention(x, mla, cos, sin), gqa_attention(x, layer, cos, sin), atol=1e-10)


def test_stock_round_trip_with_biases():
    """natural -> stock tensors -> natural is the identity (q_lora path and biases included)."""
    from transformers import DeepseekV3Config

    layer = _random_layer(bias=True)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    plan = plan_rope(affine_moment(layer.k, layer.k_bias, _moment(x)), fold_pools(8, 4), 2, 8)
    mla, _ = factorize(layer, _moment(x), plan, rope_dim=4, latent_dim=10)
    config = DeepseekV3Config(kv_lora_rank=10, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                              num_attention_heads=4, q_lora_rank=33, hidden_size=32)
    tensors = stock_attention(mla, torch.ones(32), q_lora=True, attention_bias=True)
    back = natural_attention(tensors, config)
    for name in ("q", "q_bias", "kv_a", "kv_a_bias", "kv_b", "o", "o_bias"):
        assert torch.allclose(getattr(back, name), getattr(mla, name), rtol=1e-9, atol=1e-12), name


def test_stock_round_trip_with_a_kept_query_norm():
    """A layer whose query keeps one RMSNorm (q_b): natural -> stock (q_lora path, q_a_layernorm weight 1) ->
    natural is the identity, the width of the q_lora path telling it from a query bias's (hidden + 1)."""
    from transformers import DeepseekV3Config

    layer = _random_layer(bias=True)
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    plan = plan_rope(affine_moment(layer.k, layer.k_bias, _moment(x)), fold_pools(8, 4), 2, 8)
    scale = torch.rand(layer.q.shape[0], dtype=torch.float64) + 0.5
    kept = replace(layer, q_a=layer.q, q_a_bias=layer.q_bias, q_a_out=torch.diag(scale))
    mla, _ = factorize(kept, _moment(x), plan, rope_dim=4, latent_dim=10)
    assert mla.q_b is not None and torch.equal(mla.q, layer.q)
    config = DeepseekV3Config(kv_lora_rank=10, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                              num_attention_heads=4, q_lora_rank=layer.q.shape[0], hidden_size=32)
    tensors = stock_attention(mla, torch.ones(32), q_lora=True, attention_bias=True)
    assert torch.equal(tensors["q_a_layernorm.weight"], torch.ones(layer.q.shape[0], dtype=torch.float64))
    back = natural_attention(tensors, config)
    for name in ("q", "q_bias", "q_b", "kv_a", "kv_a_bias", "kv_b", "o", "o_bias"):
        assert torch.allclose(getattr(back, name), getattr(mla, name), rtol=1e-9, atol=1e-12), name
    # the query it computes: the whole query's RMSNorm, per-row scales, then each head's [nope | rope] map
    raw = x @ layer.q.T + layer.q_bias
    normed = (raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + STOCK_NORM_EPS) * scale).view(2, 12, 4, 8)
    expected = torch.einsum("hnd,blhd->blhn", query_transform(plan, 4, 8, 4), normed).reshape(2, 12, -1)
    assert torch.allclose(mla_query(x, mla), expected, atol=1e-10)


def test_weighted_plan_prefers_queried_heads():
    """With two KV heads of equal key energy, score weighting puts the head whose queries are larger
    in the rotary key; plain key-energy PCA cannot tell them apart."""
    dim, kv = 2, 2
    moment = torch.eye(kv * dim, dtype=torch.float64)
    weight = torch.tensor([[1.0], [10.0]], dtype=torch.float64)
    plan = plan_rope(moment, fold_pools(dim, dim), kv, dim, candidate_weight=weight)
    assert plan.b[0, 1, 0].abs() > 0.99 * plan.b[0].abs().sum()


def test_moment_shrinkage():
    from transmla_tool.ops.stats import shrink_moment

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(500, 6, generator=gen, dtype=torch.float64) @ torch.randn(6, 6, generator=gen, dtype=torch.float64) + 2
    aug = torch.cat([x, torch.ones(500, 1, dtype=torch.float64)], 1)
    moment = aug.T @ aug / 500
    assert torch.equal(shrink_moment(moment, 0.0), moment)
    mean = x.mean(0)
    cov = moment[:6, :6] - torch.outer(mean, mean)
    for target, prior in (("diag", torch.diag(cov.diagonal())), ("identity", torch.eye(6, dtype=torch.float64) * cov.trace() / 6)):
        full = shrink_moment(moment, 1.0, target)
        assert torch.allclose(full[:6, :6] - torch.outer(mean, mean), prior)
        half = shrink_moment(moment, 0.5, target)
        assert torch.allclose(half[:6, 6], moment[:6, 6]) and half[6, 6] == 1  # mean and constant kept
        assert torch.allclose(half[:6, :6] - torch.outer(mean, mean), 0.5 * cov + 0.5 * prior)
        assert torch.linalg.eigvalsh(half).min() > -1e-12


def test_refine_anchor_holds_weights_near_the_start():
    """refine_anchor: the larger the pull toward the closed-form start, the less the weights move and the
    less the fitted loss drops; anchor 0 is the plain fit."""
    from transmla_tool.ops.refine import refine

    torch.manual_seed(0)
    layer = _random_layer(kv_heads=2)
    x = torch.randn(6, 12, 32, dtype=torch.float64)
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    cos, sin = rotation_cos_sin(inv, torch.arange(12))
    plan = plan_rope(affine_moment(layer.k, layer.k_bias, _moment(x)), fold_pools(8, 8), 2, 8)
    start, _ = factorize(layer, _moment(x), plan, rope_dim=8, latent_dim=6)
    target = gqa_attention(x, layer, cos, sin).float()
    start32 = start.to(torch.float32)

    def moved(mla):
        return float((mla.kv_b - start32.kv_b).norm() / start32.kv_b.norm())

    results = {}
    for anchor in (0.0, 1.0, 100.0):
        fitted, report = refine(start, x.float(), target, cos.float(), sin.float(), steps=40, lr=1e-2, batch=6,
                                anchor=anchor)
        results[anchor] = (moved(fitted), report.loss_after)
    print("anchor -> (relative change of kv_b, loss after):", results)
    assert results[0.0][0] > results[1.0][0] > results[100.0][0]
    assert results[0.0][1] < results[100.0][1]


def test_refine_noise_fits_inputs_off_the_calibration_subspace():
    """refine_noise: calibration inputs that span only part of the model's input space leave the plain fit
    free to be wrong elsewhere; fitting on noisy inputs (targets from the source block) makes the
    converted layer closer to the source on inputs unlike the calibration ones."""
    from transmla_tool.ops.refine import refine

    torch.manual_seed(0)
    layer = _random_layer(kv_heads=2)
    basis = torch.randn(10, 32, dtype=torch.float64)
    x = torch.randn(6, 12, 10, dtype=torch.float64) @ basis + 0.05 * torch.randn(6, 12, 32, dtype=torch.float64)
    other = torch.randn(6, 12, 32, dtype=torch.float64) * x.pow(2).mean(dim=(0, 1)).sqrt()
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    cos, sin = rotation_cos_sin(inv, torch.arange(12))
    plan = plan_rope(affine_moment(layer.k, layer.k_bias, _moment(x)), fold_pools(8, 8), 2, 8)
    start, _ = factorize(layer, _moment(x), plan, rope_dim=8, latent_dim=6)

    def teacher(z):
        return gqa_attention(z.double(), layer, cos, sin).float()

    with pytest.raises(ValueError, match="teacher"):
        refine(start, x.float(), teacher(x), cos.float(), sin.float(), steps=1, noise=1.0)
    errors = {}
    for noise in (0.0, 1.0):
        fitted, report = refine(start, x.float(), teacher(x), cos.float(), sin.float(), steps=150, lr=1e-2,
                                batch=6, noise=noise, teacher=teacher)
        off = float((mla_attention(other.float(), fitted, cos.float(), sin.float()) - teacher(other)).pow(2).mean()
                    / teacher(other).pow(2).mean())
        errors[noise] = (report.loss_after, off)
    print("noise -> (loss on the calibration inputs, relative error off their subspace):", errors)
    assert errors[1.0][1] < 0.8 * errors[0.0][1]


def test_bias_fold_is_exact_where_the_input_has_a_constant_direction():
    """ops/bias_fold.py: where some direction of the attention input reads the same on every token, the folded
    bias-free layer computes what the biased one did (query, rotary-key and value biases); where none does, it
    says how far from constant the best direction is."""
    from transmla_tool.ops.bias_fold import fold_biases
    from transmla_tool.ops.mla import MLAWeights, mla_attention

    torch.manual_seed(0)
    d, heads, dn, dr, dv, r = 24, 2, 8, 4, 8, 12
    x = torch.randn(2, 10, d, dtype=torch.float64)
    x[..., 0] = 0.7  # a constant channel (real inputs only come close: the fold then approximates)
    w = MLAWeights(q=torch.randn(heads * (dn + dr), d, dtype=torch.float64), kv_a=torch.randn(r + dr, d,
                   dtype=torch.float64), kv_b=torch.randn(heads * (dn + dv), r, dtype=torch.float64),
                   o=torch.randn(d, heads * dv, dtype=torch.float64), num_heads=heads, latent_dim=r, rope_dim=dr,
                   nope_dim=dn, v_dim=dv, q_bias=torch.randn(heads * (dn + dr), dtype=torch.float64),
                   kv_a_bias=torch.cat([torch.zeros(r, dtype=torch.float64), torch.randn(dr, dtype=torch.float64)]))
    values = w.kv_b.view(heads, dn + dv, r)[:, dn:].reshape(heads * dv, r)
    w.o_bias = w.o @ values @ torch.randn(r, dtype=torch.float64)  # a value bias the latent can express
    flat = torch.cat([x.reshape(-1, d), torch.ones(20, 1, dtype=torch.float64)], 1)
    moment = flat.T @ flat / flat.shape[0]
    positions = torch.arange(10, dtype=torch.float64)[:, None] * torch.tensor([1.0, 0.1], dtype=torch.float64)
    cos, sin = positions.cos().repeat_interleave(2, -1), positions.sin().repeat_interleave(2, -1)
    folded, report = fold_biases(w, moment, ridge=1e-12)
    assert folded.q_bias is None and folded.kv_a_bias is None and folded.o_bias is None
    assert report.constant_mse < 1e-9 and report.value_residual < 1e-9
    reference, result = mla_attention(x, w, cos, sin), mla_attention(x, folded, cos, sin)
    assert float((result - reference).norm() / reference.norm()) < 1e-6
    many = torch.randn(400, d, dtype=torch.float64) + 0.3  # no constant direction (more tokens than dimensions)
    flat = torch.cat([many, torch.ones(400, 1, dtype=torch.float64)], 1)
    _, worse = fold_biases(w, flat.T @ flat / flat.shape[0])
    assert worse.constant_mse > 1e-3


def test_value_bias_in_the_joint_latent_folds_exactly_where_the_input_has_a_constant_direction():
    """factorize(value_bias="latent") hands the value bias to the joint latent (the affine map [W_v | b_v] under the
    augmented moment): with a constant input channel and the latent at full rank, the bias-free folded layer equals
    the biased source layer; at a lower rank the latent carries the value bias better than fitting it into the span
    chosen without it (value_bias="output", then fold_biases' least squares)."""
    from transmla_tool.ops.bias_fold import fold_biases

    layer = _random_layer(kv_heads=1, bias=True)
    layer = replace(layer, o_bias=None, v_bias=layer.v_bias * 20)  # a value bias that carries the layer (Qwen2.5)
    x = torch.randn(3, 12, 32, dtype=torch.float64)
    x[..., 5] = 0.8
    inv = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    cos, sin = rotation_cos_sin(inv, torch.arange(12))
    plan = plan_rope(affine_moment(layer.k, layer.k_bias, _moment(x)), fold_pools(8, 8), 1, 8)
    source = gqa_attention(x, layer, cos, sin)

    def error(value_bias, rank):
        mla, _ = factorize(layer, _moment(x), plan, rope_dim=8, latent_dim=rank, value_bias=value_bias)
        assert (mla.o_bias is None) == (value_bias == "latent")
        folded, _ = fold_biases(mla, _moment(x), ridge=1e-12)
        assert folded.q_bias is None and folded.kv_a_bias is None and folded.o_bias is None
        return float((mla_attention(x, folded, cos, sin) - source).norm() / source.norm())

    assert error("latent", 8) < 1e-6
    assert error("latent", 2) < 0.5 * error("output", 2)
    with pytest.raises(ValueError, match="value_bias"):
        factorize(layer, _moment(x), plan, rope_dim=8, latent_dim=2, value_bias="o_proj")


def test_heldout_spread_scores_the_constant_direction_off_the_windows_it_was_fitted_on():
    """LayerStats(split=True) keeps the even and odd windows' moments whatever the chunking; heldout_spread fits u on
    each half and scores it on the other: with few tokens for the width the fit's own E[(u.x - 1)^2] is near 0 and
    says nothing, the held-out one shows the direction does not hold; with many tokens the two agree."""
    from transmla_tool.ops.bias_fold import constant_direction, heldout_spread
    from transmla_tool.ops.stats import LayerStats

    torch.manual_seed(0)
    d = 16
    for windows, length, tol in ((6, 2, None), (64, 64, 0.5)):
        x = torch.randn(windows, length, d, dtype=torch.float64) + 0.5
        x[..., 0] = 1.0 + 0.2 * torch.randn(windows, length, dtype=torch.float64)  # nearly constant channel
        stats = LayerStats.empty(d, 1, length, split=True)
        for rows in (slice(0, 1), slice(1, 4), slice(4, windows)):  # odd-sized chunks: parity must carry over
            stats.add(x[rows].float())
        stats = stats.finalize()
        assert torch.allclose(stats.halves[0], _moment(x[0::2].float().double()), atol=1e-5)
        assert torch.allclose(stats.halves[1], _moment(x[1::2].float().double()), atol=1e-5)
        _, fitted = constant_direction(stats.raw_moment, ridge=1e-8)
        held = heldout_spread(stats.halves, ridge=1e-8)
        print(f"{windows * length} tokens of width {d}: fit {fitted:.4f}, held out {held:.4f}")
        if tol is None:
            assert fitted < 1e-3 and held > 0.01
        else:
            assert abs(held / fitted - 1) < tol
    assert LayerStats.empty(d, 1, 4).finalize().halves is None


def test_constant_channel_makes_the_normalized_embedding_read_one_value():
    """with_constant_channel: the least-used embedding channel is replaced so that RMSNorm (with its eps) reads the
    same value on it for every token, and the other channels of every normalized row barely move."""
    from transmla_tool.ops.bias_fold import with_constant_channel

    torch.manual_seed(0)
    embed = torch.randn(500, 24) * torch.linspace(0.5, 2.0, 24)
    embed[:, 7] *= 0.1  # the quietest channel
    eps = 1e-5
    out, chosen = with_constant_channel(embed, eps, rows=64)  # in row blocks: the same as at once
    assert chosen.channel == 7 and 0 < chosen.value < 0.2
    assert torch.equal(out[:, :7], embed[:, :7]) and torch.equal(out[:, 8:], embed[:, 8:])

    def norm(e):
        return e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + eps)

    read = norm(out.double())[:, 7]
    assert torch.allclose(read, torch.full_like(read, chosen.value), rtol=1e-6)
    moved = (norm(out.double()) - norm(embed.double()))[:, [i for i in range(24) if i != 7]]
    assert float(moved.abs().max()) < 0.01


def test_rotary_key_bias_folded_as_far_as_it_rotates():
    """ops/bias_fold.rope_bias_share: the bias of a rotary slot that does not turn over the distances attention reads
    only adds a logit the softmax drops, so it is not folded (share ~0), while a slot that turns is (share ~1). On a
    layer whose slow slot carries a large bias and whose input is only nearly constant along u, folding by share is
    far closer to the biased layer than folding it all (the spread of u.x multiplies the whole bias logit)."""
    from transmla_tool.ops.bias_fold import CACHE_SPREAD, constant_direction, fold_biases, rope_bias_share
    from transmla_tool.ops.mla import MLAWeights

    length = 16
    mass = torch.zeros(3, length, dtype=torch.float64)
    mass[:, :8] = 1.0  # attention reads distances 0..7
    inv = torch.tensor([1.0, 1e-6], dtype=torch.float64)  # a fast slot and one that turns 1e-5 rad in 8 tokens
    share = rope_bias_share(inv, mass, spread=1e-3)
    assert share.shape == (4,) and share[0] == share[1] and share[2] == share[3]
    assert share[0] > 0.99 and share[2] < 1e-3
    # an exactly constant u.x (layer 0's embedding channel) still leaves the slow slot's bias to the softmax: a
    # folded bias would be stored in every cached rotary key, which a cache reads back only to its own precision
    exact = rope_bias_share(inv, mass, spread=0.0)
    assert torch.equal(exact, rope_bias_share(inv, mass, spread=CACHE_SPREAD))
    assert exact[0] > 0.99 and exact[2] < 0.01

    torch.manual_seed(0)
    d, heads, dn, dr, dv, r = 24, 2, 8, 4, 8, 12
    x = torch.randn(2, length, d, dtype=torch.float64)
    x[..., 0] = 0.7 + 0.05 * torch.randn(2, length, dtype=torch.float64)  # nearly constant, as real inputs are
    w = MLAWeights(q=torch.randn(heads * (dn + dr), d, dtype=torch.float64) * 0.3,
                   kv_a=torch.randn(r + dr, d, dtype=torch.float64) * 0.3,
                   kv_b=torch.randn(heads * (dn + dv), r, dtype=torch.float64) * 0.3,
                   o=torch.randn(d, heads * dv, dtype=torch.float64), num_heads=heads, latent_dim=r, rope_dim=dr,
                   nope_dim=dn, v_dim=dv,
                   kv_a_bias=torch.cat([torch.zeros(r + 2, dtype=torch.float64),
                                        torch.tensor([30.0, -20.0], dtype=torch.float64)]))  # the slow slot's bias
    cos, sin = rotation_cos_sin(inv, torch.arange(length))
    moment = _moment(x)
    reference = mla_attention(x, w, cos, sin)
    _, spread = constant_direction(moment)
    errors = {}
    for name, share_fn in (("all", None), ("rotating", lambda v: rope_bias_share(inv, mass, v))):
        folded, report = fold_biases(w, moment, rope_share=share_fn)
        errors[name] = float((mla_attention(x, folded, cos, sin) - reference).norm() / reference.norm())
        assert (report.rope_bias_folded < 0.01) == (name == "rotating")
    print("relative error of the folded layer:", errors, "spread", spread)
    assert errors["rotating"] < 0.2 * errors["all"] and errors["rotating"] < 0.05


def test_attention_distance_mass_in_query_blocks_equals_the_full_map(monkeypatch):
    """The distance statistics computed a block of queries at a time (bounded memory at 8192 tokens) equal the sums
    over the diagonals of the whole attention map."""
    from transmla_tool.ops import stats
    from transmla_tool.ops.mla import GQAWeights

    torch.manual_seed(0)
    d, heads, kv_heads, dim, length = 16, 4, 2, 8, 40
    attn = GQAWeights(q=torch.randn(heads * dim, d), k=torch.randn(kv_heads * dim, d), v=torch.randn(kv_heads * dim, d),
                      o=torch.randn(d, heads * dim), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim)
    x = torch.randn(2, length, d)
    angles = torch.arange(length)[:, None] * torch.logspace(0, -2, dim // 2)[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    probs = stats.attention_probs(x, attn, cos, sin)  # (B, H, L, L) at once
    full = torch.stack([probs.diagonal(offset=-delta, dim1=-2, dim2=-1).sum(dim=(0, 2)) for delta in range(length)], 1)
    monkeypatch.setattr(stats, "QUERY_BLOCK", 7)
    blocked = stats.attention_distance_mass(x, attn, cos, sin)
    assert torch.allclose(blocked, full.double(), atol=1e-5)
    assert torch.allclose(blocked.sum(1), torch.full((heads,), 2.0 * length, dtype=torch.float64), atol=1e-4)
