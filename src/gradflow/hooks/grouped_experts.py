"""Every expert's products in one call: the batched arithmetic of :mod:`gradflow.hooks.split_experts`.

The rows of a fused experts call, sorted by expert (then role), are groups of one tensor: ``grouped`` multiplies each
expert's rows by its slab of a 3-D weight (torch's grouped matmul where it has a kernel: float32 and bfloat16 with
16-byte aligned strides; else a loop over the experts, float64 included). :func:`add_by_role` computes a parameter's
weight gradient as :mod:`gradflow.hooks.split_linear` does a Linear's: every expert's slab of the largest
contributing role ``g_{e,big}^T x_{e,big}`` in one grouped call (its norm is the role's statistic), then the other
roles' rows in one more, added (the flops of autograd's one product); the other roles' norms come from their
per-(expert, role) Gram matrices, all blocks in one batched product (few rows each), or from their own product where
that is cheaper or a row is unsafe. Materialised, each role's slabs are their own grouped call, kept and summed.
"""

from __future__ import annotations

import math

import torch

from gradflow.hooks.batch_state import BatchState
from gradflow.hooks.experts import ExpertSums, _norm
from gradflow.hooks.safe_norms import SAFE_MIN, flag_unsafe, safe_norm
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
                codes: torch.Tensor, expert: torch.Tensor, table: torch.Tensor, transposed: bool,
                shape: tuple[int, ...]) -> torch.Tensor:
    """Add the rows ``g`` (S, D_out) and ``x`` (S, D_in) of every expert (positions ``tokens``, roles ``codes``,
    experts ``expert`` (S,), sorted by expert, then role; ``table`` (E, NUM_ROLES) the rows per expert and role) to
    ``sums`` and return the (E, D_out, D_in) weight gradient. ``transposed``: the parameter is stored
    (E, D_in, D_out), ``shape`` (materialised matrices).

    As :mod:`gradflow.hooks.split_linear` splits a Linear's, the gradient is two grouped products: the largest
    contributing role's rows (its slabs' norm is the role's statistic), then the other rows added (the flops of
    autograd's one product). Another role's norm comes from its per-expert Gram matrices (:func:`_gram_squares`,
    float32) where cheaper than its product and its rows are safe, else from its own product. A role none of whose
    rows contributes (a zero ``g`` or ``x`` row) gets no arithmetic (its norm exactly 0, its zero terms left out of
    the sum) unless a factor is non-finite. Materialised: every role's own product (:func:`_role_products`)."""
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
    if state.config.materialize:
        return _role_products(sums, g, x, codes, table, transposed, shape, n_live, n_unsafe)
    per_expert = table.T.tolist()
    counts = [sum(rows) for rows in per_expert]
    live_codes = [code for code in range(NUM_ROLES) if n_live[code]]
    first = max(live_codes, key=counts.__getitem__, default=None)
    gram, own = [], []
    for code in live_codes:
        if code != first:
            cheap = sum(n * n for n in per_expert[code]) * (g.shape[1] + x.shape[1]) < \
                counts[code] * g.shape[1] * x.shape[1]
            (gram if cheap and n_unsafe[code] == 0 else own).append(code)
    # the other roles' norms first: their Gram blocks and own products are freed before the gradient's slabs exist
    for group in _by_block_size(gram, per_expert):
        _gram_squares(sums, g, x, codes, expert, group)
    for code in own:  # its own product, for its norm only
        sums.squares[code] += _squares(_product(g, x, codes, [code], table), per_expert[code])
    rest = [code for code in range(NUM_ROLES) if code != first and counts[code] and (n_live[code] or n_unsafe[code])]
    if first is None:
        return _product(g, x, codes, rest, table) if rest else g.new_zeros(table.shape[0], g.shape[1], x.shape[1])
    summed = _product(g, x, codes, [first], table)
    sums.squares[first] += _squares(summed, per_expert[first])
    if rest:  # added into the slabs in place: one parameter-sized gradient at a time, as autograd's
        _add_product(summed, g, x, codes, rest, table)
    return summed


def _add_product(summed: torch.Tensor, g: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, chosen: list[int],
                 table: torch.Tensor) -> None:
    """Add every expert's ``g_c^T x_c`` over the rows of the roles ``chosen`` (gathered in expert order) into its slab
    of ``summed`` (E, D_out, D_in), in place, in one ``baddbmm_``: each expert's rows zero-padded to the most any
    expert has (a zero row adds exact zeros; no second slab-sized product)."""
    rows = torch.isin(codes, torch.tensor(chosen, device=codes.device)).nonzero().squeeze(1)
    sizes = table[:, chosen].sum(dim=1)
    block = torch.repeat_interleave(torch.arange(sizes.numel(), device=g.device), sizes)
    place = torch.arange(rows.numel(), device=g.device) - (sizes.cumsum(0) - sizes)[block]
    width = int(sizes.max())

    def padded(values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(sizes.numel(), width, values.shape[1])
        out[block, place] = values[rows]
        return out

    summed.baddbmm_(padded(g).transpose(1, 2), padded(x))


def _product(g: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, chosen: list[int], table: torch.Tensor
             ) -> torch.Tensor:
    """Every expert's slab ``g_c^T x_c`` (E, D_out, D_in) over the rows of the roles ``chosen`` (gathered in expert
    order; all of them when every role is chosen), in one grouped call."""
    sizes = table[:, chosen].sum(dim=1)
    if int(sizes.sum()) == codes.numel():
        return grouped(g.T, x, offsets(sizes), sizes.tolist())
    rows = (codes == chosen[0]).nonzero().squeeze(1) if len(chosen) == 1 else \
        torch.isin(codes, torch.tensor(chosen, device=codes.device)).nonzero().squeeze(1)
    return grouped(g[rows].T, x[rows], offsets(sizes), sizes.tolist())


def _squares(slabs: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The float64 squared Frobenius norm of slabs (E, D_out, D_in), safe in float32 and bfloat16, slab e the product
    of ``rows[e]`` rows. A bfloat16 slab's norm is reduced in bfloat16 (float32 accumulation, rounded once: within
    2^-8 of the float32 norm, as the Linear split's bfloat16 products; converting the slabs to float32 first took
    2 ms a parameter at 8 x 1024 x 256). The slab of an expert without rows is exactly zero (the grouped product
    writes zeros): it is left out of the safe-range check, which would otherwise gather it for a second look
    (48 MiB of copies at an OLMoE block, where a role leaves 12 of 64 experts without rows); any other slab whose
    norm is 0 or outside the safe range is recomputed by :func:`safe_norm`."""
    if slabs.dtype == torch.float64:
        return torch.linalg.vector_norm(slabs).square()
    norms = torch.linalg.vector_norm(slabs, dim=(-2, -1), dtype=None if slabs.dtype == torch.bfloat16
                                     else torch.float32).double()
    values = norms.tolist()  # one host read
    for e, (value, n) in enumerate(zip(values, rows)):
        if n and not SAFE_MIN <= value < math.inf:  # NaN included
            norms[e] = safe_norm(slabs[e], dim=(-2, -1), native=True).double()
    return norms.square().sum()


def _by_block_size(codes: list[int], per_expert: list[list[int]]) -> list[list[int]]:
    """The roles ``codes`` in groups whose largest (expert, role) blocks are within 2x of each other: each group's
    Gram blocks are zero-padded to its largest, so a role of a few rows an expert is not padded to a role of many
    (at 8 experts, 60 masked rows and 6 random rows each, one group would spend 5x the multiply-adds)."""
    groups: list[list[int]] = []
    for code in sorted(codes, key=lambda c: max(per_expert[c])):
        if groups and max(per_expert[code]) <= 2 * max(1, max(per_expert[groups[-1][0]])):
            groups[-1].append(code)
        else:
            groups.append([code])
    return groups


def _gram_squares(sums: ExpertSums, g: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, expert: torch.Tensor,
                  chosen: list[int]) -> None:
    """Add the squared norms of the roles ``chosen``: ``||G_{e,r}||^2 = <g_{e,r} g_{e,r}^T, x_{e,r} x_{e,r}^T>`` for
    every (expert, role) block at once, the blocks' rows zero-padded to the longest (float32; float64 rows in
    float64)."""
    rows = torch.isin(codes, torch.tensor(chosen, device=codes.device)).nonzero().squeeze(1)
    keys, sizes = torch.unique_consecutive(expert[rows] * NUM_ROLES + codes[rows], return_counts=True)
    block = torch.repeat_interleave(torch.arange(keys.numel(), device=g.device), sizes)
    place = torch.arange(rows.numel(), device=g.device) - (sizes.cumsum(0) - sizes)[block]
    wide = torch.float64 if g.dtype == torch.float64 else torch.float32
    width = int(sizes.max())

    def padded(values: torch.Tensor) -> torch.Tensor:
        out = values.new_zeros(keys.numel(), width, values.shape[1], dtype=wide)
        out[block, place] = values[rows].to(wide)
        return out

    gp, xp = padded(g), padded(x)
    per_block = (gp @ gp.transpose(1, 2) * (xp @ xp.transpose(1, 2))).sum(dim=(1, 2), dtype=torch.float64)
    sums.squares.index_add_(0, keys % NUM_ROLES, per_block.clamp(min=0))


def _role_products(sums: ExpertSums, g: torch.Tensor, x: torch.Tensor, codes: torch.Tensor, table: torch.Tensor,
                   transposed: bool, shape: tuple[int, ...], n_live: list[float], n_unsafe: list[float]
                   ) -> torch.Tensor:
    """Materialised: every role's (E, D_out, D_in) slabs in one grouped call over its rows (gathered in expert
    order), its norm from them, kept, and their sum returned."""
    counts = table.sum(dim=0).tolist()
    summed = None
    for code in range(NUM_ROLES):
        if counts[code] == 0 or (n_live[code] == 0 and n_unsafe[code] == 0):  # every term exactly zero
            continue
        product = _product(g, x, codes, [code], table)
        if n_live[code]:
            sums.squares[code] += _squares(product, table[:, code].tolist())
            full = sums.matrices.setdefault(code, torch.zeros(shape, dtype=g.dtype, device=g.device))
            full.add_(product.transpose(1, 2) if transposed else product)
        summed = product if summed is None else summed.add_(product)
    if summed is None:
        summed = g.new_zeros(table.shape[0], g.shape[1], x.shape[1])
    return summed


__all__ = ["add_by_role", "grouped", "offsets"]
