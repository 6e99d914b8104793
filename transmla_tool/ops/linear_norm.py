"""Make DeepSeek's latent RMSNorm act as the identity.

RMSNorm(y) = y / sqrt(mean(y^2) + eps) * w. Feeding it y = alpha * c with alpha^2 * mean(c^2) << eps
puts it in its linear regime: output = c * alpha * w / sqrt(eps) / sqrt(1 + alpha^2 mean(c^2) / eps),
so w = sqrt(eps) / alpha gives c with relative error ~ alpha^2 * mean(c^2) / (2 eps).

We bound mean(c^2) for *every possible* token, not only calibration tokens: the attention input is
RMSNorm(h) * w_ln, whose squared norm is below d * max(w_ln^2), so |c| <= ||A||_2 |x| + |bias|.
w is rounded up to a power of two so it is exact in bf16 as well as fp32. fp16 cannot hold the
resulting tiny activations (they fall into its subnormal range), which is why export refuses it.
"""

from __future__ import annotations

import math

import torch

DEFAULT_TOLERANCE = 1e-7  # worst-case relative error of the linearized norm


def input_norm_bound(input_norm_weight: torch.Tensor, hidden: int) -> float:
    """Upper bound on |x|^2 for x = RMSNorm(h) * w over every h."""
    return float(hidden * input_norm_weight.double().pow(2).max())


def mean_square_bound(weight: torch.Tensor, bias: torch.Tensor | None, x_sq_bound: float) -> float:
    """Upper bound on mean(y^2) for y = W x + b with |x|^2 <= x_sq_bound."""
    spectral = float(torch.linalg.matrix_norm(weight.double(), ord=2)) if weight.numel() else 0.0
    bias_norm = float(bias.double().norm()) if bias is not None else 0.0
    return (spectral * math.sqrt(x_sq_bound) + bias_norm) ** 2 / weight.shape[0]


def linearizing_scale(ms_bound: float, eps: float, tolerance: float = DEFAULT_TOLERANCE) -> tuple[float, float]:
    """(alpha, w): scale the norm's input by alpha and set its weight to w (a power of two)."""
    ms_bound = max(ms_bound, 1e-30)
    alpha_max = math.sqrt(2.0 * tolerance * eps / ms_bound)
    weight = 2.0 ** math.ceil(math.log2(math.sqrt(eps) / alpha_max))
    return math.sqrt(eps) / weight, weight


def linearization_error(ms: torch.Tensor, alpha: float, eps: float) -> torch.Tensor:
    """Relative error 1 - 1/sqrt(1 + alpha^2 ms / eps) of the linearized norm at mean square ms."""
    return 1.0 - torch.rsqrt(1.0 + alpha * alpha * ms.double() / eps)
