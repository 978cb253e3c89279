"""Per-role statistics of one sublayer call's weight gradient (Linear and LayerNorm).

For a Linear ``y = x W^T + b`` the weight gradient is ``sum_t g_t x_t^T`` over positions t. The
contribution of a role r is ``G_r = sum_{t in r} g_t x_t^T``; the contributions of all roles (plus
``relpos`` for non-token inputs) sum exactly to ``W.grad``. Per (depth, sublayer, parameter, role):

- ``contribution_norm``: ``||G_r||_F``, from the Gram identity ``||G_r||^2 = <G G^T, X X^T>``
  when that is cheaper, else from ``G_r`` itself; for the role with the most rows (context, usually)
  under ``loss.backward()``, ``G_r`` is one of the two products the weight gradient is computed from
  (:mod:`gradflow.hooks.split_linear`: ``W = G_big + G_rest``, no product beyond autograd's own), and so
  is the second-largest role's when it has enough rows (``W = G_big + G_second + G_rest``, :data:`~gradflow.hooks.split_linear.SECOND_SHARE`);
- ``magnitude_sum``: ``sum_{t in r} ||g_t|| * ||x_t||`` (per-position Frobenius norms, additive);
- ``n_positions`` and ``n_nonzero`` (positions whose per-position contribution ``g_t x_t^T`` has a
  nonzero element, i.e. ``g_t`` and ``x_t`` both have one).

For a LayerNorm ``y = gamma * xhat + beta`` the gain's per-position contribution is
``g_t * xhat_t`` and the bias's is ``g_t``; for an RMSNorm-like module (no bias, or one) ``xhat`` is
the module's own output with unit gain and zero bias (:func:`gradflow.adapters.norms.unit_affine`).
Roles none of whose per-position contributions has a nonzero element get an exactly zero contribution
(no arithmetic is done on them). Zero is decided
from the elements, never from a norm, and norms are safe from underflow and overflow (see
:mod:`gradflow.hooks.safe_norms`). Results accumulate in
:attr:`BatchState.sublayers` (and ``matrices`` when materialised).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gradflow.adapters.base import SublayerSpec
from gradflow.adapters.norms import splittable, unit_affine
from gradflow.hooks.batch_state import BatchState, RolePartition
from gradflow.hooks.linear_inputs import InputRows, float32
from gradflow.hooks.safe_norms import flag_unsafe, gram_float64, role_norms, safe_norm
from gradflow.hooks.split_linear import SPLIT_DTYPES, DirectSplit, live_ranges, own_product, second_role
from gradflow.roles import ALL_ROLES, NUM_ROLES, Role

LOW_PRECISION = (torch.bfloat16, torch.float16)
"""Dtypes whose largest products the statistics take in the call's own dtype (float32 ones are 3-4x slower)."""


@dataclass(frozen=True)
class SublayerEntry:
    """One standard sublayer name served by a module; ``chunk`` = (i, n): the i-th of n equal
    output slices of a fused module, or None for the whole output."""

    name: str
    chunk: tuple[int, int] | None
    groups: int = 1  # with chunk: the output rows form this many groups, the chunk taken in each (DeBERTa v1)
    outside_bias: bool = False  # a Parameter added to these rows outside the module is this sublayer's bias
    acts_as: str | None = None  # "linear"/"layer_norm": a module computing one though not of that class (I-BERT)
    call: int | None = None  # only this call (0-based) of the module in a block (X-MOD); None: the first, later relpos
    flat: bool = False  # the module reads the positions as (B * T, D) rows (an MoE router)


def sublayer_stats(state: BatchState, depth: int, mod: nn.Module, entries: list[SublayerEntry], x: torch.Tensor,
                   grad: torch.Tensor, token: bool, direct: bool = False) -> None:
    """Add one call's statistics. ``x``: the module's input (..., D_in); ``grad``: the loss gradient
    w.r.t. its output (..., D_out); ``token``: the rows are the batch's B * T positions (else
    ``relpos`` rows). A Conv1d of kernel size 1 takes ``x`` and ``grad`` already as (B, T, C).
    ``direct``: an ``nn.Linear`` called through :class:`~gradflow.hooks.split_linear.RoleSplitLinear` whose
    weight gradient this backward computes, from this call alone: the largest role's product is left to it
    (``state.deferred[id(mod.weight)]``, a :class:`~gradflow.hooks.split_linear.DirectSplit`)."""
    if pointwise_conv(mod):
        _grouped_stats(state, depth, mod, entries, x, grad, token)
    elif isinstance(mod, nn.Linear) or entries[0].acts_as == "linear":
        _linear_stats(state, depth, mod, entries, x, grad, token, direct and isinstance(mod, nn.Linear))
    else:
        _norm_stats(state, depth, mod, entries, x, grad, token)


def _role_rows(state: BatchState, rows: int, token: bool) -> RolePartition:
    """The role partition of one sublayer call's rows: the batch's positions, or all ``relpos``."""
    if token:
        return state.partition
    device = state.partition.codes.device
    return RolePartition.of_codes(torch.full((rows,), int(Role.RELPOS), dtype=torch.long, device=device))


def _linear_stats(state: BatchState, depth: int, mod: nn.Linear, entries: list[SublayerEntry], x: torch.Tensor,
                  grad: torch.Tensor, token: bool, direct: bool = False) -> None:
    """Linear weight (``G_r`` norms) and bias (per-role gradient sums) of each served name.

    The input side (row norms, the small roles' rows and Gram matrices) is shared with the other modules
    reading the same input (:mod:`gradflow.hooks.linear_inputs`). Every per-position quantity of the call
    is summed per role in one operation. Each small role's norm comes from its Gram matrices; ``big``'s
    contribution (the role with the most live rows, usually context), when its own product is the cheaper
    way, is that product: computed here, or with ``direct`` (see :func:`sublayer_stats`) by the weight
    gradient's backward as one of its two parts, finished there (:attr:`BatchState.deferred`).
    """
    g2 = grad.reshape(-1, grad.shape[-1])
    part = _role_rows(state, g2.shape[0], token)
    counts = part.count_list
    if token:
        inputs = state.inputs.get(x, part.codes, part.index, counts)
    else:
        inputs = InputRows.of(x, part.codes, part.index, counts)
    x2, xn = inputs.x2, inputs.xn
    gn_all = safe_norm(g2, dim=-1, native=True)  # 0 exactly for a gradient row without a nonzero element
    live_all = inputs.nonzero & (gn_all > 0)
    calls = []  # per entry: (g, gn, g_nonzero, contributes, mag, column of its first per-role sum)
    columns = [live_all, gn_all * xn]  # the second: per role, a bound on every element of G_r (whole output)
    for entry in entries:
        g = g2 if entry.chunk is None else _rows(g2, entry.chunk, entry.groups)
        gn = gn_all if entry.chunk is None else safe_norm(g, dim=-1, native=True)
        g_nonzero = gn > 0
        contributes = live_all if entry.chunk is None else g_nonzero & inputs.nonzero  # g_t x_t^T has a nonzero
        mag = gn * xn
        calls.append((g, gn, g_nonzero, contributes, mag, len(columns)))
        columns += [contributes, mag, inputs.unsafe | flag_unsafe(torch.stack([gn, mag])).any(dim=0)]
        if getattr(mod, "bias", None) is not None or entry.outside_bias:
            columns += [g_nonzero, gn]
    sums = _scatter_columns(columns, part.codes)  # (NUM_ROLES, K)
    table = sums.T.tolist()  # one sync for every count of the call
    big = max(range(NUM_ROLES), key=lambda code: (table[0][code], counts[code]))
    rest = inputs.rest(big)
    low = g2.dtype in LOW_PRECISION and x2.dtype == g2.dtype and not state.config.materialize
    limit = torch.finfo(g2.dtype).max / 2 if g2.dtype.is_floating_point else 0.0
    direct = (direct and x2.dtype == g2.dtype == mod.weight.dtype and g2.dtype in SPLIT_DTYPES
              and not state.config.materialize and sum(table[1]) < limit)  # neither product can overflow
    second = second_role(rest, table[0], g2.shape[1], x2.shape[1]) if direct else None
    pending: list[tuple] = []
    zero = torch.zeros((), dtype=torch.float64, device=g2.device)
    rest_rows: tuple = (None, None)  # the whole output's rest rows of g and x, for the backward's second product
    for entry, (g, gn, g_nonzero, contributes, mag, col) in zip(entries, calls):
        d_out, d_in = g.shape[1], x2.shape[1]
        n_contributing, unsafe = table[col], table[col + 2]
        g_rest = g.index_select(0, rest.index)  # in the call's dtype (the backward's second product)
        squares = [zero] * NUM_ROLES  # float64 squared norms from Gram matrices (0: no contribution)
        products: dict[int, torch.Tensor] = {}  # float32 norms from a role's own product
        deferred: list[int] = []  # the roles whose norms come from the backward's own products
        for code in range(NUM_ROLES):
            if n_contributing[code] == 0:  # every g_t x_t^T of this role is exactly zero: so is G_r
                if state.config.materialize and counts[code]:
                    state.matrices[(depth, entry.name, "weight", ALL_ROLES[code])] = torch.zeros(d_out, d_in)
                continue
            gram_cheaper = counts[code] * (d_out + d_in) < d_out * d_in
            if direct and (code == big and own_product(counts[code], d_out, d_in) or code == second):
                deferred.append(code)  # the weight gradient's own product of these rows (split_linear)
                continue
            if low and not gram_cheaper and table[1][code] < limit:  # the product in the call's dtype, as fast
                rows = part.index[code]  # as autograd's (float32's is 3-4x slower on a CPU)
                products[code] = _rounded_norm(g.index_select(0, rows).T @ inputs.role_rows(code, big, native=True),
                                               lambda r=rows, c=code: float32(g.index_select(0, r)).T @ inputs.role_rows(c, big))
                continue
            if code == big:
                gr = float32(g.index_select(0, part.index[code]))
            else:  # a float32 copy of this role's rows only (roles without a contribution are never converted)
                gr = float32(g_rest[rest.starts[code]: rest.starts[code] + counts[code]])
            if state.config.materialize:
                matrix = gr.T @ inputs.role_rows(code, big)
                state.matrices[(depth, entry.name, "weight", ALL_ROLES[code])] = matrix.cpu()
                products[code] = safe_norm(matrix, dim=(-2, -1))
            elif gram_cheaper and not unsafe[code]:
                squares[code] = ((gr @ gr.T) * inputs.gram(code, big)).sum(dtype=torch.float64)
            elif gram_cheaper:  # float32 products of these rows could underflow or overflow
                squares[code] = gram_float64(gr, inputs.role_rows(code, big))
            else:
                products[code] = safe_norm(gr.T @ inputs.role_rows(code, big), dim=(-2, -1))
        norms = torch.stack(squares).clamp_(min=0).sqrt_().float()  # float64 square roots rounded once; 0 stays 0
        for code, value in products.items():
            norms[code] = value
        weight_sums = (sums[:, col], sums[:, col + 1])
        if deferred:
            pending.append((entry, g, mag, weight_sums, norms, deferred))
            if entry.chunk is None:  # in the call's dtype
                rest_rows = (g_rest, rest.native)
        else:
            _store(state, depth, entry.name, "weight", part, *weight_sums, norms, mag)
        if getattr(mod, "bias", None) is not None or entry.outside_bias:
            role_sums = _role_sums(g, part, state)
            _store(state, depth, entry.name, "bias", part, sums[:, col + 3], sums[:, col + 4],
                   role_norms(role_sums, part.present), gn)
            if state.config.materialize:
                for code in range(NUM_ROLES):
                    if counts[code]:
                        state.matrices[(depth, entry.name, "bias", ALL_ROLES[code])] = role_sums[code].cpu()
    if pending:
        def finish(big_product: torch.Tensor | None, second_product: torch.Tensor | None = None) -> None:
            _finish_big_role(state, depth, part, big, x2, pending, big_product, second_product)

        def big_input() -> torch.Tensor:
            return inputs.big_rows(big)

        unsafe_any = [any(table[col + 2][code] for *_, col in calls) for code in range(NUM_ROLES)]
        state.deferred[id(mod.weight)] = DirectSplit(part.index[big], rest.index, finish, *rest_rows, big_input=big_input,
                                                     second=0 if second is None else counts[second],
                                                     rest_live=live_ranges(rest, counts, second, table[0], unsafe_any))


def _finish_big_role(state: BatchState, depth: int, part: RolePartition, big: int, x2: torch.Tensor,
                     pending: list[tuple], big_product: torch.Tensor | None,
                     second_product: torch.Tensor | None = None) -> None:
    """Store the weight statistics of deferred entries, each deferred role's norm from its product (D_out, D_in):
    ``sum_{t in r} g_t x_t^T`` as the weight gradient's backward computed it (``big_product`` for ``big``,
    ``second_product`` for the other role of a three-way split), or, when None (no weight gradient was
    computed), from its own product."""
    for entry, g, mag, weight_sums, norms, codes in pending:
        for code in codes:
            idx = part.index[code]

            def exact(g: torch.Tensor = g, idx: torch.Tensor = idx) -> torch.Tensor:
                return float32(g.index_select(0, idx)).T @ float32(x2.index_select(0, idx))

            product = big_product if code == big else second_product
            if product is not None:
                matrix = product if entry.chunk is None else _rows(product.T, entry.chunk, entry.groups).T
                norms[code] = _rounded_norm(matrix, exact)
            else:
                norms[code] = safe_norm(exact(), dim=(-2, -1))
        _store(state, depth, entry.name, "weight", part, *weight_sums, norms, mag)


def _rounded_norm(matrix: torch.Tensor, exact: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The safe norm of a role's product ``matrix`` (D_out, D_in) as computed in the call's dtype (float32
    accumulation, rounded once to the dtype: within the dtype's rounding of the float32 product's norm).

    bfloat16 has float32's range, so its rounded elements underflow only where float32's would. float16's
    smallest normal is 6.1e-5: below it an element keeps an absolute error up to half its subnormal spacing,
    which over ``n`` elements could exceed the dtype's rounding of a norm under ``sqrt(n)`` smallest normals
    (or flush a nonzero product to 0); such a norm, and a non-finite one, is recomputed from ``exact()``, the
    float32 product (one host read per float16 product)."""
    norm = safe_norm(matrix, dim=(-2, -1), native=True)
    if matrix.dtype == torch.float16:
        info = torch.finfo(matrix.dtype)
        if not matrix.numel() ** 0.5 * info.smallest_normal <= float(norm) < info.max:
            return safe_norm(exact(), dim=(-2, -1))
    return norm


def _role_sums(values: torch.Tensor, part: RolePartition, state: BatchState | None = None) -> torch.Tensor:
    """(NUM_ROLES, D) float32 sums of (N, D) ``values`` per role, row by row (``index_add_``: a role whose rows
    are all zero gets exactly zero; 3-5x faster than a product with the role indicator on a CPU). With ``state``,
    a low-precision ``values`` is converted into the batch's float32 scratch buffer (no fresh pages per call)."""
    sums = torch.zeros(NUM_ROLES, values.shape[-1], dtype=torch.float32, device=values.device)
    if values.dtype != torch.float32 and state is not None:
        values = state.buffer("role_sums", tuple(values.shape), values.device).copy_(values)
    return sums.index_add_(0, part.codes, float32(values))


def _scatter_columns(columns: list[torch.Tensor], codes: torch.Tensor) -> torch.Tensor:
    """(NUM_ROLES, K) float32 per-role sums of K (N,) per-position ``columns`` (bool or float32), in one operation."""
    stacked = float32(torch.stack(columns, dim=1))  # bool columns promoted to float32 by the stack itself
    return torch.zeros(NUM_ROLES, len(columns), dtype=torch.float32, device=codes.device).index_add_(0, codes, stacked)


def _norm_stats(state: BatchState, depth: int, mod: nn.Module, entries: list[SublayerEntry], x: torch.Tensor,
                grad: torch.Tensor, token: bool) -> None:
    """Norm gain and bias: per-position contributions ``g * xhat`` and ``g`` (float32, side by side in one
    scratch buffer of the batch), summed per role in one ``index_add_``."""
    d = x.shape[-1]
    g2 = grad.reshape(-1, d)
    if g2.dtype not in (torch.float32, torch.bfloat16, torch.float16):  # (float64: rounded to float32 first)
        g2 = g2.float()
    part = _role_rows(state, g2.shape[0], token)
    if isinstance(mod, nn.LayerNorm) or entries[0].acts_as == "layer_norm":
        unit = torch.ones(d, device=x.device)  # with a gain and bias CPU layer_norm takes a 2.5x faster kernel
        xhat = F.layer_norm(float32(x.reshape(-1, d)), (d,), unit, torch.zeros_like(unit), eps=mod.eps)
    else:
        xhat = float32(unit_affine(mod, x.reshape(-1, d)))
    params = [param for param in ("weight", "bias") if getattr(mod, param, None) is not None]
    n, k = g2.shape[0], len(params)
    per_pos = state.buffer("norm", (n, k, d), g2.device)  # (N, k, D): each parameter's per-position gradient
    for i, param in enumerate(params):
        if param == "weight":
            torch.mul(g2, xhat, out=per_pos[:, i])  # a low-precision g exact in float32, as a conversion first
        else:
            per_pos[:, i].copy_(g2)
    mags = safe_norm(per_pos, dim=-1)  # (N, k)
    sums = _scatter_columns([column for i in range(k) for column in (mags[:, i] > 0, mags[:, i])], part.codes)
    role_sums = torch.zeros(NUM_ROLES, k * d, dtype=torch.float32, device=g2.device)
    role_sums = role_sums.index_add_(0, part.codes, per_pos.view(n, k * d)).view(NUM_ROLES, k, d)
    norms = role_norms(role_sums, part.present)  # (NUM_ROLES, k)
    for i, param in enumerate(params):
        for entry in entries:
            _store(state, depth, entry.name, param, part, sums[:, 2 * i], sums[:, 2 * i + 1], norms[:, i], mags[:, i])
            if state.config.materialize:
                for code in range(NUM_ROLES):
                    if part.count_list[code]:
                        state.matrices[(depth, entry.name, param, ALL_ROLES[code])] = role_sums[code, i].clone().cpu()


def _store(state: BatchState, depth: int, name: str, param: str, part: RolePartition, n_nonzero: torch.Tensor,
           mag_sum: torch.Tensor, norms: torch.Tensor, mag: torch.Tensor) -> None:
    """Add one call's statistics to (depth, name, param); several calls (relpos) accumulate. Everything stays on
    the model's device until the batch's record is made (a copy to the host would wait for the device).

    Per role (NUM_ROLES,): ``n_nonzero`` positions whose contribution has a nonzero element (decided from
    the elements: a tiny magnitude may have underflowed to 0), ``mag_sum`` their summed magnitudes and
    ``norms`` the contribution norms; ``mag`` (N,): the per-position magnitudes.
    """
    key = (depth, name, param)
    position = None
    if state.config.position_magnitudes and part.count_list[Role.RELPOS] == 0:
        position = mag.reshape(state.b, -1)[:, :state.t]  # (positions the model appended: cut)
    if key in state.sublayers:
        old = state.sublayers[key]
        # contributions of separate calls add as matrices; their norms are kept per role, and the
        # calls of one sublayer never share a role (tokens vs relpos), so the norms simply add.
        state.sublayers[key] = (old[0] + part.counts, old[1] + n_nonzero, old[2] + mag_sum,
                                old[3] + norms, old[4] if old[4] is not None else position)
    else:
        state.sublayers[key] = (part.counts.clone(), n_nonzero, mag_sum, norms, position)


def _store_positions(state: BatchState, depth: int, name: str, param: str, part: RolePartition, mag: torch.Tensor,
                     nonzero: torch.Tensor, norms: torch.Tensor) -> None:
    """:func:`_store` from the per-position (N,) magnitudes ``mag`` and nonzero flags ``nonzero``."""
    sums = _scatter_columns([nonzero, mag], part.codes)
    _store(state, depth, name, param, part, sums[:, 0], sums[:, 1], norms, mag)


def _rows(g: torch.Tensor, chunk: tuple[int, int], groups: int = 1) -> torch.Tensor:
    """Columns of the ``chunk`` = (i, n) slice of (N, D) ``g``; with ``groups`` G > 1 the i-th of n equal
    parts of each of G equal column groups, group by group (as SublayerSpec.rows orders them)."""
    i, n = chunk
    if groups > 1:
        return g.reshape(g.shape[0], groups, n, -1)[:, :, i, :].reshape(g.shape[0], -1)
    size = g.shape[1] // n
    return g[:, i * size : (i + 1) * size]


def split_by_role(module: nn.Module, spec: SublayerSpec) -> bool:
    """Whether the recorder splits this sublayer module: a Linear, LayerNorm or RMSNorm-like norm, a pointwise
    Conv1d, or a module the adapter declares to act as a Linear or LayerNorm (``spec.acts_as``)."""
    return splittable(module) or pointwise_conv(module) or spec.acts_as is not None


def pointwise_conv(mod: nn.Module) -> bool:
    """A Conv1d of kernel size 1, stride 1, no padding or dilation: a per-position (grouped) Linear map."""
    return (isinstance(mod, nn.Conv1d) and tuple(mod.kernel_size) == (1,) and tuple(mod.stride) == (1,)
            and mod.padding in ((0,), "valid") and tuple(mod.dilation) == (1,))


def _grouped_stats(state: BatchState, depth: int, mod: nn.Conv1d, entries: list[SublayerEntry], x: torch.Tensor,
                   grad: torch.Tensor, token: bool) -> None:
    """A pointwise Conv1d with G groups as a block-diagonal Linear: group k maps input channels k*ci..(k+1)*ci
    to output rows k*co..(k+1)*co. ``x`` (..., C_in) and ``grad`` (..., C_out) per position.

    The weight (C_out, ci, 1) gets ``sum_t g_tk x_tk^T`` in row block k, so a role's contribution is the
    (C_out, ci, 1) tensor of those sums (its norm: all blocks' elements); a position's magnitude is
    ``sqrt(sum_k (||g_tk|| ||x_tk||)^2)`` (the norm of its block-diagonal contribution)."""
    groups = mod.groups
    x2 = x.reshape(-1, x.shape[-1])
    g2 = grad.reshape(-1, grad.shape[-1])
    part = _role_rows(state, x2.shape[0], token)
    codes, index, counts = part.codes, part.index, part.count_list
    xk = x2.reshape(x2.shape[0], groups, -1)
    gk = g2.reshape(g2.shape[0], groups, -1)
    xn, gn = safe_norm(xk, dim=-1), safe_norm(gk, dim=-1)  # (N, G)
    mag = gn[:, 0] * xn[:, 0] if groups == 1 else safe_norm(gn * xn, dim=-1)
    contributes = ((gn > 0) & (xn > 0)).any(dim=1)
    n_contributing = _scatter_columns([contributes], codes)[:, 0].tolist()
    norms = torch.zeros(NUM_ROLES, device=g2.device)
    for code in range(NUM_ROLES):
        if n_contributing[code] == 0 and not (state.config.materialize and counts[code]):
            continue
        if n_contributing[code] == 0:  # every g_t x_t^T of this role is exactly zero: so is G_r
            matrix = torch.zeros(mod.weight.shape)
        else:
            idx = index[code]
            matrix = torch.einsum("ngo,ngi->goi", gk[idx].float(), xk[idx].float()).reshape(mod.weight.shape)
            norms[code] = safe_norm(matrix.reshape(-1), dim=-1)
        if state.config.materialize:
            for entry in entries:
                state.matrices[(depth, entry.name, "weight", ALL_ROLES[code])] = matrix.cpu()
    for entry in entries:
        _store_positions(state, depth, entry.name, "weight", part, mag, contributes, norms)
    if mod.bias is not None:
        gn_all = safe_norm(g2, dim=-1)
        sums = torch.zeros(NUM_ROLES, g2.shape[1], dtype=torch.float32, device=g2.device)
        sums.index_add_(0, codes, g2.float())
        for entry in entries:
            _store_positions(state, depth, entry.name, "bias", part, gn_all, gn_all > 0, safe_norm(sums, dim=-1))
            if state.config.materialize:
                for code in range(NUM_ROLES):
                    if counts[code]:
                        state.matrices[(depth, entry.name, "bias", ALL_ROLES[code])] = sums[code].cpu()


__all__ = ["SublayerEntry", "pointwise_conv", "split_by_role", "sublayer_stats"]
