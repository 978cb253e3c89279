"""Every expert's products in one call: the batched arithmetic of :mod:`gradflow.hooks.split_experts`.

The rows of a fused experts call, sorted by expert (then role), are groups of one tensor: ``grouped`` multiplies each
expert's rows by its slab of a 3-D weight (torch's grouped matmul where it has a kernel: float32 and bfloat16 with
16-byte aligned strides; else a loop over the experts, float64 included), and :func:`add_by_role` computes, per
role, every expert's weight-gradient slab ``g_{e,r}^T x_{e,r}`` in one grouped call over the role's rows (gathered
in expert order). Each expert's weight gradient is the sum of its roles' slabs (the products autograd's per-expert
product is the sum of, no product beyond it), and each role's squared norm is that of its (E, D_out, D_in) slabs.
"""

from __future__ import annotations

import torch

from gradflow.hooks.batch_state import BatchState
from gradflow.hooks.experts import ExpertSums, _norm
from gradflow.hooks.safe_norms import flag_unsafe, safe_norm
from gradflow.roles import NUM_ROLES

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def offsets(sizes: torch.Tensor) -> torch.Tensor:
    """The groups' end offsets (int32) of group sizes (E,)."""
    return sizes.cumsum(0).to(torch.int32)


def grouped(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Grouped products over the experts, group e the rows ``ends[e-1]:ends[e]`` (``sizes[e]`` of them): ``a``
    (S, K) and ``b`` (E, K, N) -> (S, N), row block e ``a_e b[e]``; or ``a`` (K, S), ``b`` (S, N) -> (E, K, N), slab
    e ``a[:, e's rows] b[e's rows]`` (zero for an expert without rows)."""
    if a.dtype in _KERNEL_DTYPES and a.dtype == b.dtype and a.device.type in ("cpu", "cuda"):
        try:
            return torch._grouped_mm(a, b, ends)
        except RuntimeError:  # no kernel for these strides or this device: the loop
            pass
    if b.dim() == 3:
        parts, start = [], 0
        for e, size in enumerate(sizes):
            parts.append(a[start:start + size] @ b[e])
            start += size
        return torch.cat(parts) if parts else a.new_zeros(0, b.shape[2])
    out = a.new_zeros(len(sizes), a.shape[0], b.shape[1])
    start = 0
    for e, size in enumerate(sizes):
        if size:
            torch.mm(a[:, start:start + size], b[start:start + size], out=out[e])
        start += size
    return out


def add_by_role(sums: ExpertSums, state: BatchState, g: torch.Tensor, x: torch.Tensor, tokens: torch.Tensor,
                codes: torch.Tensor, table: torch.Tensor, transposed: bool, shape: tuple[int, ...]) -> torch.Tensor:
    """Add the rows ``g`` (S, D_out) and ``x`` (S, D_in) of every expert (positions ``tokens``, roles ``codes``
    (S,), sorted by expert then role; ``table`` (E, NUM_ROLES) the rows per expert and role) to ``sums`` and return
    the (E, D_out, D_in) weight gradient, each expert's slab the sum of its roles' products. A role none of whose
    rows contributes (a zero ``g`` or ``x`` row) gets no arithmetic (its norm exactly 0) unless a factor is
    non-finite. ``transposed``: the parameter is stored (E, D_in, D_out), ``shape`` (materialised matrices)."""
    sums.shape = shape
    gn, xn = _norm(g), _norm(x)
    live = (gn > 0) & (xn > 0)
    mag = (gn * xn).double()
    sums.position_squares.index_add_(0, tokens, mag * mag)
    sums.position_live.index_add_(0, tokens, live.float())
    unsafe = (flag_unsafe(torch.stack([gn, xn])).any(dim=0) if g.dtype != torch.float64
              else torch.zeros_like(live))
    flags = torch.stack([live, unsafe], dim=1).float()
    per_role = torch.zeros(NUM_ROLES, 2, device=g.device).index_add_(0, codes, flags)
    n_live, n_unsafe = per_role.T.tolist()
    counts = table.sum(dim=0).tolist()
    summed = None
    for code in range(NUM_ROLES):
        if counts[code] == 0 or (n_live[code] == 0 and n_unsafe[code] == 0):  # every term exactly zero
            continue
        rows = (codes == code).nonzero().squeeze(1)  # in expert order
        sizes = table[:, code]
        product = grouped(g[rows].T, x[rows], offsets(sizes), sizes.tolist())  # (E, D_out, D_in)
        if n_live[code]:
            flat = product.reshape(-1, product.shape[-1])
            norm = (torch.linalg.vector_norm(flat) if flat.dtype == torch.float64
                    else safe_norm(flat, dim=(-2, -1)))
            sums.squares[code] += norm.double() ** 2
            if state.config.materialize:
                full = sums.matrices.setdefault(code, torch.zeros(shape, dtype=g.dtype, device=g.device))
                full.add_(product.transpose(1, 2) if transposed else product)
        summed = product if summed is None else summed.add_(product)
    if summed is None:
        summed = g.new_zeros(table.shape[0], g.shape[1], x.shape[1])
    return summed


__all__ = ["add_by_role", "grouped", "offsets"]
