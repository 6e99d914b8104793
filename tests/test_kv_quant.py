"""Cache types (ops/kv_quant.py) and the exact changes of basis that make a latent quantize well (ops/basis.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_ops import _moment, _random_layer

from transmla_tool.ops.basis import (
    ROPE_KEY_BALANCES,
    balance_latent,
    balance_rope_key,
    hadamard,
    latent_rotation,
    latent_sensitivity,
    latent_statistics,
    rope_pair_energy,
    rotate_latent,
    scale_rope_pairs,
)
from transmla_tool.ops.decouple import fold_pools, plan_rope
from transmla_tool.ops.factorize import factorize
from transmla_tool.ops.kv_quant import (
    CACHE_TYPES,
    SIMULATED_CACHE_TYPES,
    bytes_per_token_per_layer,
    cache_row_store,
    query_dot_store,
    quantize_dequantize,
    straight_through,
)
from transmla_tool.ops.linalg import affine_moment
from transmla_tool.ops.mla import mla_attention
from transmla_tool.ops.rope import rotation_cos_sin


@pytest.mark.parametrize("name", [n for n in SIMULATED_CACHE_TYPES if n != "iq4_nl"])  # gguf-py cannot write iq4_nl
def test_quantize_dequantize_matches_ggml_reference(name):
    """Bit-equal to gguf-py's numpy port of ggml's reference quantizers (an implementation we did not write),
    on values with outliers and on a block of zeros."""
    import gguf
    from gguf import quants

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 128, generator=gen) * torch.rand(16, 1, generator=gen) * 5
    x[3, 5] = 40.0  # an outlier that sets its block's scale
    x[4, :32] = 0.0
    qtype = gguf.GGMLQuantizationType[name.upper()]
    reference = quants.dequantize(quants.quantize(x.numpy(), qtype), qtype)
    ours = quantize_dequantize(x, name).numpy()
    assert np.array_equal(ours, reference.astype(np.float32))
    if name != "f16":
        assert not np.array_equal(ours, x.numpy())  # it does lose something


def test_iq4_nl_is_its_grid_times_one_scale_per_block():
    """iq4_nl (ggml's reference matches bit for bit in test_engines.py): every value read back is a grid level times
    its block's fp16 scale, the block's largest value lands on the grid's end level, a zero block stays zero, and on
    Gaussian values (what a Hadamard-rotated latent looks like) it loses less than q4_0 at the same 4.5 bits."""
    from transmla_tool.ops.kv_quant import IQ4NL_LEVELS

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128, generator=gen)
    x[0, :32] = 0.0
    out = quantize_dequantize(x, "iq4_nl")
    blocks, back = x.reshape(-1, 32), out.reshape(-1, 32)
    assert torch.equal(back[0], torch.zeros(32))
    levels = torch.tensor(IQ4NL_LEVELS, dtype=torch.float32)
    for block, read in zip(blocks[1:], back[1:]):
        top = block.abs().argmax()  # the largest value sets the scale: it reads back as level -127 times it
        codes = read / (read[top] / -127.0)
        assert torch.allclose(codes, codes.round(), atol=1e-3)
        assert set(codes.round().int().tolist()) <= set(IQ4NL_LEVELS)
    error = {name: float((quantize_dequantize(x, name) - x).pow(2).mean()) for name in ("iq4_nl", "q4_0")}
    assert error["iq4_nl"] < 0.9 * error["q4_0"], error  # 0.83 here


def test_bytes_per_token_per_layer():
    """The bytes llama.cpp allocates: SmolLM2's 3 KV heads x 64 at f16 = 768, q4_0 = 216; a 128 + 64 latent
    at q8_0 (K only: V is a view of the latent) = 204."""
    assert bytes_per_token_per_layer(192, 192, "f16") == 768
    assert bytes_per_token_per_layer(192, 192, "q4_0") == 216
    assert bytes_per_token_per_layer(192, 192, "q8_0", "q4_0") == 204 + 108
    assert bytes_per_token_per_layer(192, 0, "q8_0") == 204
    assert {n: t.bytes_per_block for n, t in CACHE_TYPES.items()} == {
        "f32": 128, "f16": 64, "bf16": 64, "q8_0": 34, "q5_1": 24, "q5_0": 22, "q4_1": 20, "q4_0": 18, "iq4_nl": 18}


def test_straight_through_gradient_is_identity():
    x = torch.randn(2, 64, requires_grad=True)
    quant = straight_through("q4_0")
    y = quant(x)
    assert torch.equal(y.detach(), quantize_dequantize(x.detach(), "q4_0"))
    y.pow(2).sum().backward()
    assert torch.allclose(x.grad, 2 * y.detach())
    assert straight_through(None) is None and straight_through("f32") is None


def test_cache_row_store_pads_like_the_engine():
    """With the latent padded (--pad-latent-to), blocks fall on the padded row: quantizing [latent | 0 | rope]
    and dropping the zeros, not the unpadded row."""
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(3, 48 + 64, generator=gen)
    store = cache_row_store("q4_0", 48, 64)
    padded = torch.cat([row[:, :48], torch.zeros(3, 16), row[:, 48:]], -1)
    expected = quantize_dequantize(padded, "q4_0")
    assert torch.equal(store(row), torch.cat([expected[:, :48], expected[:, 64:]], -1))
    assert cache_row_store(None, 48) is None


@pytest.mark.parametrize("size", [8, 32, 56, 96, 128])
@pytest.mark.parametrize("kind", ["hadamard", "random"])
def test_latent_rotation_is_orthogonal_and_spreads(size, kind):
    rot = latent_rotation(size, kind, seed=3)
    assert torch.allclose(rot @ rot.T, torch.eye(size, dtype=torch.float64), atol=1e-12)
    # PCA order: all the energy on channel 0; after the rotation no channel holds more than a few times its share
    energy = rot[:, 0] ** 2
    assert energy.max() <= 12.0 / size
    if kind == "hadamard" and size & (size - 1) == 0:
        assert torch.allclose(energy, torch.full_like(energy, 1.0 / size))  # one Hadamard block: perfectly even
    assert latent_rotation(size, "pca") is None
    assert torch.equal(rot, latent_rotation(size, kind, seed=3))  # deterministic


def test_hadamard_rejects_other_orders():
    assert torch.allclose(hadamard(4) @ hadamard(4).T, torch.eye(4, dtype=torch.float64))
    with pytest.raises(ValueError):
        hadamard(12)


def _converted(bias=False, latent=16, rope=8):
    layer = _random_layer(heads=4, kv_heads=2, dim=16, hidden=48, bias=bias)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 40, 48, generator=gen, dtype=torch.float64) * torch.linspace(0.2, 3, 48, dtype=torch.float64)
    inv = 1.0 / 10000 ** (torch.arange(0, rope, 2, dtype=torch.float64) / rope)
    cos, sin = rotation_cos_sin(inv, torch.arange(40))
    plan = plan_rope(affine_moment(layer.k, layer.k_bias, _moment(x)), fold_pools(16, rope), 2, 16)
    mla, _ = factorize(layer, _moment(x), plan, rope_dim=rope, latent_dim=latent)
    return mla, x, cos, sin


@pytest.mark.parametrize("bias", [False, True])
def test_changes_of_basis_are_exact(bias):
    """A rotated latent and a balanced rotary key compute the same attention (fp64), and do change the
    cached row (otherwise they could not change how it quantizes)."""
    from dataclasses import replace

    mla, x, cos, sin = _converted(bias)
    mla = _loud_first_pair(mla, 4.0)
    r = mla.latent_dim
    reference = mla_attention(x, mla, cos, sin)
    rotated = rotate_latent(mla, latent_rotation(mla.latent_dim, "hadamard", seed=1))
    balanced = balance_rope_key(rotated, _moment(x))
    partial = balance_rope_key(rotated, _moment(x), ROPE_KEY_BALANCES["partial"])
    scales = torch.rand(mla.rope_dim // 2, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4 + 0.1
    scaled = scale_rope_pairs(rotated, scales)  # any positive scales, not only a power of the energies
    for changed in (rotated, balanced, partial, scaled):
        assert torch.allclose(mla_attention(x, changed, cos, sin), reference, atol=1e-10)
    assert not torch.allclose(rotated.kv_a[:r], mla.kv_a[:r])
    unbalanced = rope_pair_energy(mla, _moment(x))
    assert unbalanced[0] > 4 * unbalanced[1:].max()
    energy = rope_pair_energy(balanced, _moment(x))
    assert torch.allclose(energy, energy.mean().expand_as(energy), rtol=1e-9)
    # power p keeps (1 - 2p) of each pair's log-energy distance from the others
    spread, kept = unbalanced.log(), rope_pair_energy(partial, _moment(x)).log()
    assert torch.allclose(kept - kept.mean(), (1 - 2 * 0.3) * (spread - spread.mean()), atol=1e-9)


def test_cached_row_is_laid_out_as_llamacpp_caches_it():
    """The row a simulated cache quantizes is the row llama.cpp's deepseek2 stores: [latent | rotary key], the
    key rotated pair by pair with each pair's two values side by side (pair i at 2i, 2i + 1, angle position x
    10000^(-2i/dr)). Which 32-value block a value falls in decides what a block quantizer does to it: with
    transformers' rope layout (the pair's halves dr/2 apart) the simulation missed llama.cpp's q4_0 perplexity by a
    third of its cost (tests/test_engines.py::test_eval_in_llamacpp_cache_types)."""
    mla, x, cos, sin = _converted(latent=16, rope=8)
    seen = []
    mla_attention(x, mla, cos, sin, cache_store=lambda row: seen.append(row) or row)
    row = seen[0]
    r, dr = mla.latent_dim, mla.rope_dim
    key = x @ mla.kv_a[r:].T  # before RoPE
    positions = torch.arange(x.shape[1], dtype=torch.float64)
    expected = torch.empty_like(key)
    for i in range(dr // 2):
        angle = positions * 10000 ** (-2 * i / dr)
        a, b = key[..., 2 * i], key[..., 2 * i + 1]
        expected[..., 2 * i] = a * torch.cos(angle) - b * torch.sin(angle)
        expected[..., 2 * i + 1] = a * torch.sin(angle) + b * torch.cos(angle)
    assert torch.allclose(row[..., r:], expected, atol=1e-10)
    assert torch.allclose(row[..., :r], x @ mla.kv_a[:r].T, atol=1e-10)  # the latent as the checkpoint caches it


def _loud_first_pair(mla, factor: float):
    """The same layer with its first rotary-key pair `factor` times louder (its queries divided by it)."""
    from dataclasses import replace

    r, dn, dr = mla.latent_dim, mla.nope_dim, mla.rope_dim
    key_scale = torch.ones(r + dr, dtype=torch.float64)
    key_scale[r:r + 2] = factor
    q_scale = torch.ones(dn + dr, dtype=torch.float64)
    q_scale[dn:dn + 2] = 1.0 / factor
    q_scale = q_scale.repeat(mla.num_heads)
    return replace(mla, kv_a=mla.kv_a * key_scale[:, None], q=mla.q * q_scale[:, None],
                   kv_a_bias=None if mla.kv_a_bias is None else mla.kv_a_bias * key_scale,
                   q_bias=None if mla.q_bias is None else mla.q_bias * q_scale)


def test_balanced_rotary_key_quantizes_better():
    """The reason for the balance: with one loud rotary pair, a q4_0 cache loses less of the layer's output
    once the pairs are evened out (either power)."""
    mla, x, cos, sin = _converted(latent=48, rope=16)  # row of 64: the rotary key shares a block with the latent
    mla = _loud_first_pair(mla, 8.0)
    mla, x, cos, sin = mla.to(torch.float32), x.float(), cos.float(), sin.float()
    reference = mla_attention(x, mla, cos, sin)
    store = cache_row_store("q4_0", mla.latent_dim)

    def error(w):
        out = mla_attention(x, w, cos, sin, cache_store=store)
        return float((out - reference).pow(2).mean() / reference.pow(2).mean())

    moment = _moment(x.double()).float()
    errors = {name: error(balance_rope_key(mla, moment, power)) for name, power in ROPE_KEY_BALANCES.items()}
    print("q4_0 relative output error by rope_key_balance:", {k: f"{v:.3e}" for k, v in errors.items()})
    assert errors["partial"] < 0.7 * errors["none"] and errors["energy"] < 0.7 * errors["none"]


def test_rope_balance_with_a_kept_query_norm():
    """With a kept query norm (q_b, ops/qk_norm.py) the query leaves through q_b: the rotary-key balance scales
    q_b's rows, not the projection read through the norm, and the layer computes the same attention."""
    from dataclasses import replace

    mla, x, cos, sin = _converted(False)
    gen = torch.Generator().manual_seed(3)
    kept = replace(mla, q=torch.randn(24, mla.q.shape[1], generator=gen, dtype=torch.float64),
                   q_b=torch.randn(mla.q.shape[0], 24, generator=gen, dtype=torch.float64) * 0.3)
    balanced = balance_rope_key(kept, _moment(x))
    assert torch.allclose(mla_attention(x, balanced, cos, sin), mla_attention(x, kept, cos, sin), atol=1e-10)
    assert torch.equal(balanced.q, kept.q) and not torch.allclose(balanced.q_b, kept.q_b)


def test_hadamard_latent_quantizes_better_than_pca_order():
    """The reason for the rotation: on a q4_0 cache, the PCA-ordered latent loses more of the layer's output
    than the same layer in a Hadamard basis."""
    mla, x, cos, sin = _converted(latent=48, rope=16)  # row of 64: two q4_0 blocks
    mla, x = mla.to(torch.float32), x.float()
    cos, sin = cos.float(), sin.float()
    reference = mla_attention(x, mla, cos, sin)

    def error(w):
        out = mla_attention(x, w, cos, sin, cache_store=cache_row_store("q4_0", w.latent_dim))
        return float((out - reference).pow(2).mean() / reference.pow(2).mean())

    pca, rotated = error(mla), error(rotate_latent(mla, latent_rotation(48, "hadamard", seed=0)))
    print(f"q4_0 relative output error: pca order {pca:.3e}, hadamard {rotated:.3e}")
    assert rotated < 0.7 * pca


def test_latent_balanced_to_its_sensitivity():
    """balance_latent: an invertible (not orthogonal) change of the latent's basis; the same attention (fp64), every
    direction's energy equal to its output sensitivity (both Lambda^(1/2), diagonal), and through a q4_0 cache, after
    the same Hadamard rotation, less of the layer's output lost than with the energy-balanced latent alone."""
    mla, x, cos, sin = _converted(latent=48, rope=16)
    moment = _moment(x)
    balanced = balance_latent(mla, moment)
    reference = mla_attention(x, mla, cos, sin)
    assert torch.allclose(mla_attention(x, balanced, cos, sin), reference, atol=1e-10)
    _, energy = latent_statistics(balanced, moment)
    sensitivity = latent_sensitivity(balanced, moment)
    assert torch.allclose(energy, torch.diag(energy.diagonal()), atol=1e-8 * float(energy.max()))
    assert torch.allclose(energy, sensitivity, rtol=1e-3, atol=1e-8 * float(energy.max()))  # to the ridge

    def error(w):
        w = rotate_latent(w, latent_rotation(48, "hadamard", seed=0)).to(torch.float32)
        out = mla_attention(x.float(), w, cos.float(), sin.float(), cache_store=cache_row_store("q4_0", 48))
        return float((out - reference.float()).pow(2).mean() / reference.pow(2).mean())

    plain, turned = error(mla), error(balanced)
    print(f"q4_0 relative output error: hadamard {plain:.3e}, balanced then hadamard {turned:.3e}")
    assert turned < 0.7 * plain


def test_absorbed_query_as_llamacpp_reads_it():
    """query_store runs attention absorbed (W_UK into the query, values read from the latent, then W_UV): with an
    identity store it is the same attention; with the engine's rounding (q8_0 for a q4_0 key, the query row
    [q_nope W_UK | q_rope] quantized in 32-value blocks, computed here by hand) it differs a little; an f16 or f32
    key's query is read as it is."""
    mla, x, cos, sin = _converted(latent=48, rope=16)
    reference = mla_attention(x, mla, cos, sin)
    assert torch.allclose(mla_attention(x, mla, cos, sin, query_store=lambda q: q), reference, atol=1e-10)
    seen = []
    rounding = query_dot_store("q4_0")

    def store(row):
        seen.append(row)
        return rounding(row)

    rounded = mla_attention(x, mla, cos, sin, query_store=store)
    (row,) = seen
    assert row.shape[-1] == 48 + 16
    assert torch.equal(rounding(row), quantize_dequantize(row, "q8_0"))
    change = float((rounded - reference).pow(2).mean() / reference.pow(2).mean())
    assert 0 < change < 1e-3, change
    assert query_dot_store("f16") is None and query_dot_store(None) is None


def test_quantization_aware_refinement_beats_plain_refinement_on_that_cache():
    """refine(cache_store=q4_0) ends with a lower loss through a q4_0 cache than the plain fit read through
    the same cache."""
    from transmla_tool.ops.mla import gqa_attention
    from transmla_tool.ops.refine import evaluate, refine

    torch.manual_seed(0)
    layer = _random_layer(heads=4, kv_heads=2, dim=16, hidden=48)
    x = torch.randn(8, 24, 48, dtype=torch.float64)
    # rope_dim = head_dim: the target's rotary slots turn at the source's frequencies, one each
    inv = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    cos, sin = rotation_cos_sin(inv, torch.arange(24))
    plan = plan_rope(affine_moment(layer.k, layer.k_bias, _moment(x)), fold_pools(16, 16), 2, 16)
    start, _ = factorize(layer, _moment(x), plan, rope_dim=16, latent_dim=16)
    target = gqa_attention(x, layer, cos, sin).float()  # the teacher: the source layer
    cos, sin = cos.float(), sin.float()
    store = cache_row_store("q4_0", 16)
    plain, _ = refine(start, x.float(), target, cos, sin, steps=60, lr=1e-2, batch=8)
    aware, report = refine(start, x.float(), target, cos, sin, steps=60, lr=1e-2, batch=8, cache_store=store)
    plain_q = evaluate(plain, x.float(), target, cos, sin, 8, store)
    assert report.loss_after == pytest.approx(evaluate(aware, x.float(), target, cos, sin, 8, store), rel=1e-5)
    print(f"loss through a q4_0 cache: plain fit {plain_q:.4f}, quantization-aware {report.loss_after:.4f}")
    assert report.loss_after < plain_q


def test_block_types_need_whole_blocks():
    """convert's refine_cache check, heal's --cache-type check, eval's and sweep's llama.cpp cache types share one
    rule: float types store any row; block types need whole 32-value blocks in the cached row [latent | rotary key]
    *and* in the latent alone, from which llama.cpp reads the values (176 + 16 fills six blocks, yet llama.cpp
    refuses it: 'V cache type iq4_nl with block size 32 does not divide n_embd_head_v=176')."""
    from transmla_tool.errors import UserError
    from transmla_tool.evaluate.frontier import check_mla_sizes
    from transmla_tool.heal.settings import check_cache_row
    from transmla_tool.ops.kv_quant import fits_blocks, mla_cache_problem

    assert fits_blocks("f16", 40) and fits_blocks("q4_0", 64) and fits_blocks("iq4_nl", 32)
    assert not fits_blocks("q4_0", 40) and not fits_blocks("q8_0", 20)
    assert mla_cache_problem("q4_0", 160, 32) is None and mla_cache_problem("iq4_nl", 128, 64) is None
    assert mla_cache_problem("f16", 176, 16) is None and mla_cache_problem("bf16", 12, 8) is None
    for latent, rope in ((176, 16), (160, 16), (100, 28)):
        assert f"latent ({latent}) or rotary key ({rope})" in mla_cache_problem("q8_0", latent, rope)
    check_cache_row("f16", 24, 8)
    check_cache_row(None, 24, 8)
    check_cache_row("q4_0", 160, 32)
    with pytest.raises(UserError, match=r"whose latent \(24\) or rotary key \(8\) is not a multiple of 32"):
        check_cache_row("q4_0", 24, 8)  # a 32-value row all the same
    check_mla_sizes(["f16", "q8_0", "q4_0"], 128, 64, "x")
    check_mla_sizes(["f16", "bf16"], 176, 16, "x")
    with pytest.raises(UserError, match=r"--cache-types iq4_nl for latent 176 \+ rope 16: llama.cpp stores"):
        check_mla_sizes(["f16", "iq4_nl"], 176, 16, "latent 176 + rope 16")