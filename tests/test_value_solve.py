"""The closed-form value-path fit (ops/value_solve.py) and its use in the layer refinement."""

from __future__ import annotations

import torch

from transmla_tool.ops.decouple import fold_pools, plan_rope
from transmla_tool.ops.factorize import factorize
from transmla_tool.ops.linalg import affine_moment
from transmla_tool.ops.mla import gqa_attention
from transmla_tool.ops.refine import evaluate, refine
from transmla_tool.ops.rope import rotation_cos_sin
from transmla_tool.ops.value_solve import solve_value_path, value_statistics

from test_ops import _moment, _random_layer


def _setup(seed=0):
    torch.manual_seed(seed)
    layer = _random_layer(heads=4, kv_heads=2, dim=16, hidden=48, seed=seed)
    x = torch.randn(64, 32, 48, dtype=torch.float64)
    inv = 1.0 / 10000 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    cos, sin = rotation_cos_sin(inv, torch.arange(32))
    target = gqa_attention(x, layer, cos, sin).float()
    inv_target = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    tcos, tsin = (t.float() for t in rotation_cos_sin(inv_target, torch.arange(32)))
    plan = plan_rope(affine_moment(layer.k, layer.k_bias, _moment(x)), fold_pools(16, 8), 2, 16)
    mla, _ = factorize(layer, _moment(x), plan, rope_dim=8, latent_dim=20)
    return mla.to(torch.float32), x.float(), target, tcos, tsin


def test_statistics_loss_is_the_layer_loss_and_als_lowers_it():
    """The loss computed from the sufficient statistics equals the layer's relative MSE computed directly, before
    and after the fit, and the fit lowers it (never raises it)."""
    mla, x, y, cos, sin = _setup()
    gram, cross, yy, n = value_statistics(mla, x, y, cos, sin, batch=2)
    assert n == x.shape[0] * x.shape[1]
    fitted, before, after = solve_value_path(mla, gram, cross, yy, iterations=6)
    assert abs(before - evaluate(mla, x, y, cos, sin, 2)) < 1e-4 * before
    assert abs(after - evaluate(fitted, x, y, cos, sin, 2)) < 1e-3 * before
    print(f"value-path fit: relative MSE {before:.4f} -> {after:.4f}")
    assert after < 0.95 * before
    # only the value path moved: queries and the latent projection are the closed form's
    assert torch.equal(fitted.q, mla.q) and torch.equal(fitted.kv_a, mla.kv_a)
    dn = mla.nope_dim
    k_rows = mla.kv_b.view(mla.num_heads, dn + mla.v_dim, -1)[:, :dn]
    assert torch.equal(fitted.kv_b.view(mla.num_heads, dn + mla.v_dim, -1)[:, :dn], k_rows)


def test_als_rounds_never_increase_the_loss():
    mla, x, y, cos, sin = _setup(seed=3)
    stats = value_statistics(mla, x, y, cos, sin, batch=3)[:3]
    losses = [solve_value_path(mla, *stats, iterations=k)[2] for k in (1, 2, 4, 8)]
    assert all(b <= a + 1e-9 for a, b in zip(losses, losses[1:])), losses


def test_refine_with_value_solve_lowers_the_training_loss():
    """The same Adam steps (same seed), then the value-path fit: the loss on the windows it fits can only drop; the
    reported loss is the held-out windows' (the never-worse check may hand back the closed form)."""
    mla, x, y, cos, sin = _setup(seed=1)
    train_x, train_y = x[:-8], y[:-8]
    plain, _ = refine(mla, x, y, cos, sin, steps=40, lr=1e-2, batch=4, holdout=8)
    solved, report = refine(mla, x, y, cos, sin, steps=40, lr=1e-2, batch=4, holdout=8, value_solve=4)
    train_plain, train_solved = (evaluate(w, train_x, train_y, cos, sin, 4) for w in (plain, solved))
    print(f"training-window loss after 40 steps: {train_plain:.4f}, then the value fit {train_solved:.4f}")
    assert train_solved < train_plain
    assert report.loss_after == evaluate(solved, x[-8:], y[-8:], cos, sin, 4)
    alone, alone_report = refine(mla, x, y, cos, sin, steps=0, batch=4, holdout=8, value_solve=4)
    assert alone_report.steps == 0 and alone_report.loss_after <= alone_report.loss_before
