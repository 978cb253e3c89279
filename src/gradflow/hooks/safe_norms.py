"""Norms that neither underflow nor overflow, and zero decided from elements, never from a norm.

A float32 norm of rows of tiny nonzero gradients (a loss scaled by 1e-18, say) underflows to 0 and
would make a role look exactly zero; a norm of huge values overflows to inf. These helpers keep
the plain float32 result wherever it is safe (so ordinary magnitudes give the same bits as
``torch.linalg.vector_norm(..., dtype=float32)``) and recompute in float64 only where it is not.
"""

from __future__ import annotations

import math

import torch

# Float32 squares below ~1e-38 are subnormal (imprecise) or flushed to 0. A norm of at least 1e-15
# has a sum of squares of at least 1e-30, next to which what the subnormal squares of up to 1e8
# elements can lose is below float32 rounding; smaller (or non-finite) float32 norms are recomputed.
SAFE_MIN = 1e-15
SAFE_MAX = 1 / SAFE_MIN


def safe_norm(x: torch.Tensor, dim: int | tuple[int, ...], native: bool = False) -> torch.Tensor:
    """Float32 L2 norm of ``x`` over ``dim`` (the last dimension, or the last two for one matrix) that
    neither underflows nor overflows.

    The plain float32 norm is kept wherever it is at least :data:`SAFE_MIN` and finite; where it
    is smaller (0 included: float32 squares of tiny elements vanish) or infinite, the rows with a
    nonzero element are recomputed in float64, where the square of any float32 value is
    representable, and rounded back to float32. Rows that are exactly zero keep 0 without a float64
    pass. So a returned norm is 0 exactly when its row has no nonzero element (zero is decided from
    the elements, never from a float32 norm).

    ``native``: a bfloat16 ``x`` on a CPU is reduced in bfloat16 (float32 accumulation, each norm rounded
    once to bfloat16, so within 2^-8 relative of the float32 norm; 2-3x faster there than a float32 reduction,
    which converts every element); the safe range, zero and the float64 pass are decided as above.
    """
    if _without_syncs(x):
        return _safe_norm_on_device(x, dim)
    native = native and x.dtype == torch.bfloat16
    if not native and x.dtype in (torch.bfloat16, torch.float16):  # exact in float32, where the CPU's
        x = x.float()  # reductions are 2-3x faster than with a conversion inside
    if x.dim() == 2 and dim in ((-2, -1), (0, 1)):  # one matrix: the norm of its row norms, computed in
        # parallel over rows (one whole-matrix reduction runs on one thread); one sync decides
        norm = torch.linalg.vector_norm(_plain_norm(x, -1, native))
    else:
        norm = _plain_norm(x, dim, native)
    if norm.dim() == 0:
        value = float(norm)
        if value >= SAFE_MIN and value != math.inf:
            return norm
        return torch.linalg.vector_norm(x.double(), dim=dim).float()
    if norm.numel():
        low, high = torch.stack(torch.aminmax(norm)).tolist()  # one host read; NaN fails the test below, as it should
        if low >= SAFE_MIN and high != math.inf:
            return norm
    unsafe = ~(norm >= SAFE_MIN) | torch.isinf(norm)
    if dim not in (-1, x.dim() - 1):
        return _recompute_rows(x, norm, unsafe, dim)
    # a row has a nonzero element when its largest or smallest element is not 0 (NaN included): two
    # reductions over all rows cost less than gathering the unsafe rows (mostly exactly zero rows)
    live = unsafe & ((x.amax(dim=-1) != 0) | (x.amin(dim=-1) != 0))
    if bool(live.any()):
        norm[live] = torch.linalg.vector_norm(x[live].double(), dim=-1).float()
    return norm


def role_norms(sums: torch.Tensor, present: list[int]) -> torch.Tensor:
    """:func:`safe_norm` over the last dimension of per-role float32 sums (NUM_ROLES, ..., D), whose roles not in
    ``present`` have no rows (their sums are exactly zero, untouched by arithmetic). The same result, from one
    host read of the norms instead of the element checks an empty role's zero norm would trigger: only the
    present roles' norms are tested, and any unsafe one sends the call to :func:`safe_norm`."""
    if _without_syncs(sums):
        return safe_norm(sums, dim=-1)
    norm = torch.linalg.vector_norm(sums, dim=-1, dtype=torch.float32)
    if all(SAFE_MIN <= v < math.inf for v in norm[present].flatten().tolist()):  # NaN fails, as it should
        return norm
    return safe_norm(sums, dim=-1)


def _plain_norm(x: torch.Tensor, dim: int | tuple[int, ...], native: bool) -> torch.Tensor:
    """The plain float32 norm over ``dim`` (``native``: reduced in ``x``'s dtype, then converted)."""
    if native:
        return torch.linalg.vector_norm(x, dim=dim).float()
    return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float32)


def _without_syncs(x: torch.Tensor) -> bool:
    """Whether ``x`` lives on an accelerator, where each host-side decision (``float``, ``bool``) waits
    for the device: there :func:`safe_norm` decides nothing on the host."""
    return x.device.type != "cpu"


def scaled_norm(x: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """Float32 L2 norm over ``dim`` as ``m * ||x / m||`` with ``m`` the largest magnitude (LAPACK's
    ``nrm2`` scaling): no element of ``x / m`` exceeds 1 and the largest is 1, so the sum of squares
    neither overflows nor underflows. 0 exactly for rows without a nonzero element (``m`` = 0), NaN
    for rows with a NaN, infinity for rows with an infinite element (and no NaN). About 1 float32 rounding
    per element from the plain norm; used for the rows whose plain float32 norm is unsafe."""
    m = torch.amax(x.abs(), dim=dim, keepdim=True).float()
    y = x.float() / torch.where((m > 0) & ~m.isinf(), m, torch.ones_like(m))
    m = m.squeeze(dim)
    return torch.where(m.isinf(), m, torch.linalg.vector_norm(y, dim=dim) * m)


def _safe_norm_on_device(x: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """:func:`safe_norm` without a host-device synchronisation: the plain float32 norm where it is
    safe (the same bits), :func:`scaled_norm` elsewhere, chosen element by element with ``torch.where``."""
    if x.dim() == 2 and dim in ((-2, -1), (0, 1)):  # one matrix: the norm of its row norms
        return _safe_norm_on_device(_safe_norm_on_device(x, -1), -1)
    plain = torch.linalg.vector_norm(x, dim=dim, dtype=torch.float32)
    unsafe = ~(plain >= SAFE_MIN) | torch.isinf(plain)
    return torch.where(unsafe, scaled_norm(x, dim), plain)


def _recompute_rows(x: torch.Tensor, norm: torch.Tensor, unsafe: torch.Tensor, dim: int | tuple[int, ...]
                    ) -> torch.Tensor:
    """:func:`safe_norm`'s float64 pass for ``unsafe`` rows when ``dim`` is not the last dimension."""
    if not bool(unsafe.any()):
        return norm
    # the reduced dimensions last, as one (trailing tuples, e.g. (-2, -1) over a stack of matrices)
    moved = x.movedim(dim, -1) if isinstance(dim, int) else x.flatten(start_dim=x.dim() - len(dim))
    rows = moved[unsafe]  # (k, d): the unsafe rows only
    live = rows.any(dim=-1)
    if bool(live.any()):
        fixed = norm[unsafe]
        fixed[live] = torch.linalg.vector_norm(rows[live].double(), dim=-1).float()
        norm[unsafe] = fixed
    return norm


def flag_unsafe(norms: torch.Tensor) -> torch.Tensor:
    """Bool of ``norms``' shape: nonzero and outside [SAFE_MIN, SAFE_MAX] (NaN included: it equals nothing).
    For the Gram identity, with no such value among a role's rows of g, x and their products, every
    float32 product of two rows stays far inside the float32 range."""
    return (norms != norms.clamp(SAFE_MIN, SAFE_MAX)) & (norms != 0)


def gram_float64(gr: torch.Tensor, xr: torch.Tensor) -> torch.Tensor:
    """``||gr^T xr||_F^2`` as ``<gr gr^T, xr xr^T>``, all in float64 (for rows of extreme magnitude)."""
    g64, x64 = gr.double(), xr.double()
    return ((g64 @ g64.T) * (x64 @ x64.T)).sum()
