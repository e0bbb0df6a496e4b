"""Newton–Schulz polar step: the orthogonalisation at the heart of Muon and SignMuon."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

__all__ = ["MUON_COEFFICIENTS", "NS_PRECISIONS", "as_matrix", "assign_owners", "newton_schulz", "newton_schulz_cost"]

NS_PRECISIONS = {
    "float32": (torch.float32, "highest"),
    "tfloat32": (torch.float32, "high"),
    "bfloat16": (torch.bfloat16, None),
}
"""Newton–Schulz's compute precisions by name: (dtype, float32 matmul precision for the call)."""

# Keller Jordan's quintic: steepest growth of small singular values at the price of landing
# them in a band around 1 instead of on 1, which is all the update direction needs.
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def as_matrix(tensor: torch.Tensor) -> torch.Tensor:
    """View a parameter as the matrix Muon orthogonalises: conv kernels (out, in, kh, kw) -> (out, in*kh*kw)."""
    if tensor.dim() < 2:
        raise ValueError(f"a {tensor.dim()}-D tensor has no matrix view; Newton–Schulz needs 2 or more dimensions")
    return tensor.reshape(tensor.shape[0], -1)


def newton_schulz(
    X: torch.Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = MUON_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype | str | None = None,
) -> torch.Tensor:
    """Approximate the polar factor U·Vᵀ of ``X = U·S·Vᵀ`` (batched over leading dims).

    ``X`` is scaled to unit Frobenius norm (so every singular value is at most 1), made wide
    by transposing if tall (so ``X·Xᵀ`` is the smaller Gram matrix), then iterated
    ``X <- a·X + (b·A + c·A²)·X`` with ``A = X·Xᵀ``. With the default coefficients and 5 steps
    in float32, singular values at or above 3e-3 of the Frobenius norm end in [0.65, 1.25] (a
    tested band); smaller ones grow but may not reach it, and zero singular values stay zero,
    so an all-zero input returns zeros.

    Precision: SignMuon votes the *signs* of the result, and NS multiplies small singular values
    by up to ``a`` ≈ 3.4 per step, so rounding noise in the null space of a low-rank momentum
    grows to the size of the signal: bfloat16 flips many of the signs of low-rank inputs that a
    float64 reference keeps, float32 almost none (``signmuon-bench ns-precision`` measures it;
    the figures are in ``benchmarks/results/``). So the default is float32 on every device, with full-precision matmuls
    (TF32, which ``allow_tf32`` / ``set_float32_matmul_precision("high")`` would switch on,
    rounds with bfloat16's 8-bit mantissa: a global TF32 setting is switched off for the call).
    ``"tfloat32"`` asks for TF32 matmuls for the call (much faster on Ampere and later GPUs, at
    bfloat16's rounding of the products); for Muon, where a rounding error is a small error,
    bfloat16 is the usual faster choice.

    Only the call changes the float32 matmul precision, and only where it differs from the
    process's: it is restored when the call returns (torch has no per-thread setting, so
    float32 matmuls another thread runs meanwhile share it).

    Args:
        X: [..., m, n] matrix or batch of matrices.
        steps: iterations, at least 1.
        coefficients: (a, b, c) of the quintic.
        eps: added to the norm, so that a zero input gives zeros and not NaN.
        dtype: compute dtype, or a name of :data:`NS_PRECISIONS` (``"tfloat32"``: float32 with TF32
            matmuls); default ``"float32"``. The result is returned in ``X``'s dtype.
    """
    if X.dim() < 2:
        raise ValueError(f"X must have at least 2 dimensions, got shape {tuple(X.shape)}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps={steps!r} must be an int >= 1")
    if isinstance(dtype, str):
        if dtype not in NS_PRECISIONS:
            raise ValueError(f"dtype={dtype!r} names no Newton–Schulz precision; use one of {tuple(NS_PRECISIONS)}")
        dtype, precision = NS_PRECISIONS[dtype]
    else:
        dtype = torch.float32 if dtype is None else dtype
        precision = "highest" if dtype == torch.float32 else None
    with _matmul_precision(precision):
        a, b, c = coefficients
        Y = X.to(dtype)
        tall = X.size(-2) > X.size(-1)
        if tall:
            Y = Y.mT
        Y = Y / (Y.norm(dim=(-2, -1), keepdim=True) + eps)
        for _ in range(steps):
            A = Y @ Y.mT  # [..., m, m] with m <= n
            B = b * A + c * (A @ A)
            Y = a * Y + B @ Y
        if tall:
            Y = Y.mT
    return Y.to(X.dtype)


@contextlib.contextmanager
def _matmul_precision(precision: str | None):
    """float32 matmuls at ``precision`` for the duration (None: as they are), restored after."""
    previous = torch.get_float32_matmul_precision()
    if precision is None or previous == precision:
        yield
        return
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def newton_schulz_cost(param: torch.Tensor) -> float:
    """Newton–Schulz's cost of a parameter (m*n*min(m, n) for a matrix, its size otherwise): what
    :func:`assign_owners` balances."""
    if param.dim() < 2:
        return float(param.numel())
    rows, cols = param.shape[0], param.numel() // param.shape[0]
    return float(rows * cols * min(rows, cols))


def assign_owners(costs: Sequence[float], ranks_per_node: int) -> list[int]:
    """Where Newton–Schulz runs in the node-aware vote: the local rank that owns each item
    (cost :func:`newton_schulz_cost`): largest cost first, to the least loaded rank (ties:
    lowest rank). Deterministic, so every rank computes the same assignment."""
    load = [0.0] * ranks_per_node
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks_per_node), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += costs[i]
    return owner
