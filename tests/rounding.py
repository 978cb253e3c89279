"""Rounding bounds for tests that compare two computations of one sum made in different orders.

A float sum of ``n`` terms, computed in any order (one after another, pairwise, in SIMD blocks, with or without
fused multiply-adds: the CPU's kernel decides), differs from the exact sum by at most ``gamma_n`` times the sum
of the terms' magnitudes, ``gamma_n = n u / (1 - n u)`` with ``u`` the unit roundoff (2^-24 for float32; Higham,
*Accuracy and Stability of Numerical Algorithms*, 2nd ed., section 3.1, an order-free bound). Two computations
of it (our decomposition and autograd's product, a split and one matmul) therefore differ by at most twice that,
on every CPU. A test that compares them asserts this bound, elementwise, instead of a constant that a new CPU's
summation order can exceed (issue 59, point 7: on an Intel Xeon with AMX a split's weight gradient was 2.2e-7
from autograd's, past a constant allowance of about 2e-7, where the rounding of its 12-term sums allows 8.6e-6).
A sum of non-negative terms (a norm, a magnitude sum) has no cancellation: its relative error is ``gamma_n``.

Comparisons of one operation on the same data (bit-identical on any CPU) and structural zeros (``== 0``) need
none of this: they stay exact.
"""

from __future__ import annotations

import torch


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    """Half the gap between 1 and the next float of ``dtype``: the largest relative error of one rounding."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype = torch.float32) -> float:
    """``n u / (1 - n u)``: the relative bound of ``n`` successive roundings (a sum of ``n`` products)."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"{n} terms: no bound in {dtype}"
    return nu / (1 - nu)


def matmul_bound(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise bound (float64) on the difference of two ``dtype`` computations of ``a @ b`` that sum the
    ``k = a.shape[-1]`` products in different orders: ``2 (gamma_k (|a| @ |b|) + k tiny)``; the ``k tiny`` term
    covers products that underflow (or are flushed to zero)."""
    k = a.shape[-1]
    magnitudes = a.detach().double().abs() @ b.detach().double().abs()
    return 2 * (gamma(k, dtype) * magnitudes + k * torch.finfo(dtype).tiny)


def sum_bound(x: torch.Tensor, dim: int | tuple[int, ...] | None = None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elementwise bound (float64) on the difference of two ``dtype`` computations of ``x.sum(dim)`` made in
    different orders: ``2 gamma_n sum(|x|)``, ``n`` the number of terms summed into each element."""
    magnitudes = x.detach().double().abs().sum() if dim is None else x.detach().double().abs().sum(dim)
    n = x.numel() // max(magnitudes.numel(), 1)
    return 2 * (gamma(n, dtype) * magnitudes + n * torch.finfo(dtype).tiny)


def assert_within_rounding(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, msg: str = "",
                           rtol: float = 0.0, atol: float = 0.0) -> None:
    """``|actual - expected| <= bound + rtol |expected| + atol`` elementwise (shapes equal, non-finite values where
    ``expected`` has them). ``rtol`` and ``atol`` (none by default) allow for what is not a reordering of the same
    terms, e.g. an upstream gradient that ``rec.record()``'s sparse head computes on other rows."""
    assert actual.shape == expected.shape, (msg, actual.shape, expected.shape)
    a, e = actual.detach().double(), expected.detach().double()
    finite = torch.isfinite(e)
    assert torch.equal(torch.isfinite(a), finite) and torch.equal(a[~finite].nan_to_num(), e[~finite].nan_to_num()), \
        f"{msg}: non-finite values differ"
    error = (a - e).abs()[finite]
    allowed = (bound.double() + rtol * e.abs() + atol).expand_as(e)[finite]
    over = error > allowed
    if bool(over.any()):
        worst = int((error / allowed.clamp_min(torch.finfo(torch.float64).tiny)).argmax())
        raise AssertionError(f"{msg}: {int(over.sum())} of {error.numel()} elements beyond the rounding bound; "
                             f"worst {float(error[worst]):.3g} > {float(allowed[worst]):.3g}")
