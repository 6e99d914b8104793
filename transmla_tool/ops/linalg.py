"""Small deterministic linear-algebra helpers (fp64 in, fp64 out)."""

from __future__ import annotations

import torch


def fix_signs(vectors: torch.Tensor) -> torch.Tensor:
    """Flip each column so its largest-magnitude entry is positive: eigen/singular vectors are only
    defined up to sign, and we want bit-identical outputs run after run."""
    idx = vectors.abs().argmax(dim=0)
    signs = torch.sign(vectors[idx, torch.arange(vectors.shape[1])])
    signs[signs == 0] = 1
    return vectors * signs


def psd_sqrt(matrix: torch.Tensor, ridge: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric square root and its inverse of a PSD matrix, with a relative ridge so the inverse
    exists even when the matrix is rank-deficient."""
    matrix = 0.5 * (matrix + matrix.T)
    vals, vecs = torch.linalg.eigh(matrix)
    floor = ridge * vals.abs().max().clamp_min(1e-300)
    vals = vals.clamp_min(0) + floor
    root = (vecs * vals.sqrt()) @ vecs.T
    inv_root = (vecs * vals.rsqrt()) @ vecs.T
    return root, inv_root


def top_eigvecs(matrix: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k leading eigenpairs of a symmetric matrix, largest first, with fixed signs."""
    vals, vecs = torch.linalg.eigh(0.5 * (matrix + matrix.T))
    order = torch.argsort(vals, descending=True, stable=True)[:k]
    return vals[order], fix_signs(vecs[:, order])


def affine_moment(weight: torch.Tensor, bias: torch.Tensor | None, x_moment: torch.Tensor) -> torch.Tensor:
    """E[y y^T] for y = W x + b, given the augmented moment E[[x;1][x;1]^T] of shape (d+1, d+1)."""
    aug = torch.cat([weight, (bias if bias is not None else weight.new_zeros(weight.shape[0]))[:, None]], 1)
    return aug @ x_moment @ aug.T
