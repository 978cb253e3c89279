"""Per-role split of mixture-of-experts weights: each expert's weight gradient by the role of its routed rows.

An expert's weight gradient is a sum over the rows routed to it: for the fused layout (3-D parameters, see
:mod:`gradflow.adapters.experts`) expert e's gate/up slab gets ``sum_p du_p x_p^T`` and its down slab
``sum_p dz_p h_p^T`` over the (position, slot) pairs p routed to e, with ``x_p`` the position's row,
``dz_p = w_p g_p`` (the routing weight times the loss gradient of the experts' output at the position),
``h_p = act(gate_p) * up_p`` and ``du_p`` the gradient of ``h_p`` w.r.t. the gate/up output for ``dh_p = dz_p W_down``.
A pair's role is its position's. Per role r and parameter, ``G_r`` is the (E, ...) tensor of the per-expert
sums over r's pairs; the roles' ``G_r`` sum to the parameter's gradient, and ``||G_r||^2 = sum_e ||G_{e,r}||^2``.

While a capture runs, gradflow runs fused experts of the plain layout itself (:mod:`gradflow.hooks.split_experts`:
the weight gradients as sums of the per-role products, no product beyond autograd's). Otherwise
(``ExpertsSpec.own_forward=False``, or another layout of the module) the fused split recomputes these per-pair
products in float32 (float64 for a float64 model) from what the experts' call received (the rows, top-k indices and
weights, captured by a forward hook) and the gradient of its output (a tensor hook): it does not depend on the
experts implementation transformers runs inside (eager loop, ``batched_mm``, ``grouped_mm``), recomputes two
products of the experts' size (the gate/up output and the down-side gradient) and agrees with autograd's gradient to
float32 rounding (docs/benchmarks.md: its cost). The list layout (``nn.ModuleList`` of expert modules, each called
on the rows routed to it) finds each expert's rows among the MoE block's input rows (exact equality), so each row's
role is its position's; each expert Linear's ``sum_t g_t x_t^T`` is then split by those roles from its own input and
output gradient.

Per block and experts module the recorder also counts the rows of each role routed to each expert
(:attr:`BatchState.expert_counts`). A role none of whose rows has a nonzero contribution gets exactly zero (no
arithmetic on it), so the last block's experts get exactly 0.0 from positions without a loss. A role's norm comes
from its Gram matrices, ``||G_{e,r}||^2 = <g_r g_r^T, x_r x_r^T>``, where that is cheaper than its product (few
rows; float32, unless a row's norm is outside the safe range: then from the product), else from the product.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from gradflow.adapters.base import get_module
from gradflow.adapters.experts import FUSED_PARAMS, ExpertsSpec
from gradflow.errors import ExpertLayoutError
from gradflow.hooks.batch_state import BatchState
from gradflow.hooks.linear_inputs import float32
from gradflow.hooks.safe_norms import flag_unsafe, safe_norm
from gradflow.roles import ALL_ROLES, NUM_ROLES

StateFn = Callable[[], "tuple[BatchState | None, int | None]"]
"""Returns the capture's batch state and the current depth (None outside a capture or a block)."""

_INDEX_NAMES = ("top_k_index", "router_indices", "selected_experts", "expert_indices")
_WEIGHT_NAMES = ("top_k_weights", "routing_weights", "router_scores", "expert_weights")


@dataclass
class ExpertSums:
    """One (depth, sublayer, param)'s statistics accumulated over experts: float64 squared norms of each role's
    per-expert sums (NUM_ROLES,), the per-position squared magnitudes (N,) (a position's rows go to distinct
    experts' slabs, so their squares add) and the per-position count of contributing rows (N,); ``matrices``:
    role code -> the role's summed gradient (materialised only)."""

    squares: torch.Tensor
    position_squares: torch.Tensor
    position_live: torch.Tensor
    matrices: dict[int, torch.Tensor]
    shape: tuple[int, ...] = ()

    @classmethod
    def of(cls, state: BatchState, key: tuple[int, str, str]) -> "ExpertSums":
        sums = state.experts.get(key)
        if sums is None:
            n, device = state.partition.codes.numel(), state.partition.codes.device
            sums = state.experts[key] = cls(torch.zeros(NUM_ROLES, dtype=torch.float64, device=device),
                                            torch.zeros(n, dtype=torch.float64, device=device),
                                            torch.zeros(n, dtype=torch.float32, device=device), {})
        return sums

    def add(self, state: BatchState, g: torch.Tensor, x: torch.Tensor | None, tokens: torch.Tensor,
            codes: torch.Tensor, where: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, ...],
            total: bool = False) -> torch.Tensor | None:
        """Add rows ``g`` (m, D_out) and ``x`` (m, D_in) (None: a bias, whose rows are ``g``) of positions ``tokens``
        (m,) with role ``codes`` (m,), sorted by role. ``where(matrix)``: the view of a role's full (materialised)
        gradient of ``shape`` that this slab fills. ``total``: every role's norm from its own product, and their sum
        returned (the slab's weight gradient ``g^T x``, without the exactly zero terms of roles without a
        contributing row); else None."""
        self.shape = shape
        gn = _norm(g)
        xn = _norm(x) if x is not None else torch.ones_like(gn)
        live = (gn > 0) & (xn > 0)
        mag = (gn * xn).double()
        self.position_squares.index_add_(0, tokens, mag * mag)
        self.position_live.index_add_(0, tokens, live.float())
        unsafe = (flag_unsafe(torch.stack([gn, xn])).any(dim=0) if g.dtype != torch.float64
                  else torch.zeros_like(live))  # float64 Gram products of float32-range values are safe
        flags = torch.stack([live, unsafe], dim=1).float()
        per_role = torch.zeros(NUM_ROLES, 2, device=g.device).index_add_(0, codes, flags)
        counts = torch.bincount(codes, minlength=NUM_ROLES).tolist()
        n_live, n_unsafe = per_role.T.tolist()
        start = 0
        summed = None
        for code in range(NUM_ROLES):
            rows = slice(start, start + counts[code])
            start += counts[code]
            if n_live[code] == 0:  # every term of this role is exactly zero: so is its sum
                if total and n_unsafe[code] and counts[code]:  # (a non-finite factor: its 0 * inf terms count)
                    product = g[rows].T @ x[rows] if x is not None else g[rows].sum(dim=0)
                    summed = product if summed is None else summed.add_(product)
                continue
            gr, xr = g[rows], x[rows] if x is not None else None
            if xr is not None and not total and not state.config.materialize and n_unsafe[code] == 0 and \
                    gram_cheaper(counts[code], gr.shape[1], xr.shape[1]):  # ||gr^T xr||^2 = <gr gr^T, xr xr^T>
                self.squares[code] += ((gr @ gr.T) * (xr @ xr.T)).sum(dtype=torch.float64).clamp(min=0)
                continue
            product = gr.T @ xr if xr is not None else gr.sum(dim=0)
            self.squares[code] += _norm(product.reshape(1, -1))[0].double() ** 2
            if state.config.materialize:
                full = self.matrices.setdefault(code, torch.zeros(shape, dtype=g.dtype, device=g.device))
                where(full).add_(product)
            if total:
                summed = product.clone() if summed is None else summed.add_(product)
        if total and summed is None:
            summed = torch.zeros(g.shape[1], x.shape[1], dtype=g.dtype, device=g.device) if x is not None else \
                torch.zeros(g.shape[1], dtype=g.dtype, device=g.device)
        return summed


def gram_cheaper(rows: int, d_out: int, d_in: int) -> bool:
    """Whether a role's norm costs less from its Gram matrices (``rows^2 (d_out + d_in)`` multiply-adds) than from
    its product (``rows d_out d_in``)."""
    return rows * (d_out + d_in) < d_out * d_in


def _norm(values: torch.Tensor) -> torch.Tensor:
    """Row norms (..., D) -> (...): safe float32 ones (:func:`~gradflow.hooks.safe_norms.safe_norm`; bfloat16 rows
    reduced in bfloat16 and rounded once, as the Linear split's row norms: no float32 copy of the rows), float64 ones
    of float64 rows (no float64 square underflows or overflows for float32-range values; 0 only for a zero row)."""
    if values.dtype == torch.float64:
        return torch.linalg.vector_norm(values, dim=-1)
    return safe_norm(values, dim=-1, native=True)


def finish_experts(state: BatchState) -> None:
    """Turn the accumulated expert sums into sublayer statistics (:data:`~gradflow.hooks.batch_state.SublayerStats`)
    and materialised matrices; called once the backward is done."""
    part = state.partition
    for key, sums in state.experts.items():
        depth, name, param = key
        magnitude = sums.position_squares.sqrt().float()
        columns = torch.stack([(sums.position_live > 0).float(), magnitude], dim=1)
        per_role = torch.zeros(NUM_ROLES, 2, device=magnitude.device).index_add_(0, part.codes, columns)
        position = magnitude.reshape(state.b, -1)[:, :state.t] if state.config.position_magnitudes else None
        state.sublayers[key] = (part.counts.clone(), per_role[:, 0], per_role[:, 1],
                                sums.squares.sqrt().float(), position)
        for code in range(NUM_ROLES):
            if state.config.materialize and part.count_list[code]:
                matrix = sums.matrices.get(code)
                matrix = torch.zeros(sums.shape) if matrix is None else matrix.cpu()
                state.matrices[(depth, name, param, ALL_ROLES[code])] = matrix
    state.experts = {}


def _wide(values: torch.Tensor) -> torch.Tensor:
    """``values`` in float32, or as they are in float64."""
    return values if values.dtype == torch.float64 else float32(values)


def _count(state: BatchState, depth: int, name: str, experts: int, expert: torch.Tensor, codes: torch.Tensor) -> None:
    table = torch.bincount(expert * NUM_ROLES + codes, minlength=experts * NUM_ROLES).view(experts, NUM_ROLES)
    old = state.expert_counts.get((depth, name))
    state.expert_counts[(depth, name)] = table if old is None else old + table


def routing_of(spec_path: str, mod: nn.Module, args: tuple, kwargs: dict
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden (N, H), top-k indices (N, k), top-k weights (N, k)) of a fused experts call, or ExpertLayoutError."""
    values = list(args)
    hidden = values[0] if values else kwargs.get("hidden_states")
    index = values[1] if len(values) > 1 else next((kwargs[n] for n in _INDEX_NAMES if n in kwargs), None)
    weights = values[2] if len(values) > 2 else next((kwargs[n] for n in _WEIGHT_NAMES if n in kwargs), None)
    ok = (isinstance(hidden, torch.Tensor) and isinstance(index, torch.Tensor) and isinstance(weights, torch.Tensor)
          and not index.is_floating_point() and weights.is_floating_point())
    if ok:
        hidden = hidden.reshape(-1, hidden.shape[-1])
        index, weights = index.reshape(hidden.shape[0], -1), weights.reshape(hidden.shape[0], -1)
        ok = index.shape == weights.shape
    if not ok:
        raise ExpertLayoutError(
            f"the experts module {spec_path!r} ({type(mod).__name__}) was not called with the routing gradflow reads "
            "(hidden rows (N, H), top-k expert indices (N, k), top-k weights (N, k)), so its weights cannot be split "
            "by role: record with --norms-only (sites only), or describe its layout in an Adapter's ExpertsSpec")
    return hidden, index, weights


def _fused_weights(spec: ExpertsSpec, mod: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up (E, 2I, H), down (E, H, I)) detached, as views in the untransposed layout."""
    params = [getattr(mod, name, None) for name in FUSED_PARAMS]
    if (any(not isinstance(p, torch.Tensor) or p.dim() != 3 for p in params) or getattr(mod, "has_bias", False)
            or getattr(mod, "has_post_expert_norm", False)):
        raise ExpertLayoutError(
            f"the experts module {spec.path!r} ({type(mod).__name__}) does not hold the fused layout gradflow splits "
            f"(3-D {' and '.join(FUSED_PARAMS)} without biases or a post-expert norm), so its weights cannot be split "
            "by role: record with "
            "--norms-only (sites only), or describe its layout in an Adapter's ExpertsSpec")
    gate_up, down = (p.detach() for p in params)
    if spec.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    return gate_up, down


def expert_gate(mod: nn.Module, u: torch.Tensor) -> torch.Tensor:
    """The experts' activation of the gate/up output ``u`` (m, 2I) -> (m, I), as the module computes it."""
    apply = getattr(mod, "_apply_gate", None)
    if callable(apply):
        return apply(u)
    gate, up = u.chunk(2, dim=-1)
    return mod.act_fn(gate) * up


def routing_pairs(state: BatchState, depth: int, name: str, index: torch.Tensor, experts: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """The (position, slot) pairs of a call's top-k ``index`` (N, k), sorted by expert, then role: (positions,
    experts, slots, roles) (S,) each and the pairs per expert; counted in ``state.expert_counts``. Pairs routed to
    no expert (expert-parallel sentinels) are left out."""
    n, k = index.shape
    tokens = torch.arange(n, device=index.device).repeat_interleave(k)
    slot = torch.arange(k, device=index.device).repeat(n)
    expert = index.reshape(-1).long()
    kept = (expert >= 0) & (expert < experts)
    tokens, slot, expert = tokens[kept], slot[kept], expert[kept]
    role = state.partition.codes[tokens]
    order = torch.argsort(expert * NUM_ROLES + role, stable=True)
    tokens, slot, expert, role = tokens[order], slot[order], expert[order], role[order]
    _count(state, depth, name, experts, expert, role)
    return tokens, expert, slot, role, torch.bincount(expert, minlength=experts).tolist()


def fused_stats(state: BatchState, depth: int, name: str, spec: ExpertsSpec, mod: nn.Module, hidden: torch.Tensor,
                index: torch.Tensor, weights: torch.Tensor, grad: torch.Tensor) -> None:
    """Add one fused experts call's statistics: ``hidden`` (N, H), ``index`` and ``weights`` (N, k) detached,
    ``grad`` (N, H) the loss gradient of the call's output (module docstring)."""
    gate_up, down = _fused_weights(spec, mod)
    tokens, _, slot, role, sizes = routing_pairs(state, depth, name, index, gate_up.shape[0])
    weight = weights.reshape(-1)[tokens * index.shape[1] + slot]
    x, g = _wide(hidden), _wide(grad)
    sums = [ExpertSums.of(state, (depth, f"{name}.{param}", "weight")) for param in FUSED_PARAMS]
    shapes = [tuple(getattr(mod, param).shape) for param in FUSED_PARAMS]  # as stored (materialised matrices)
    start = 0
    for e, size in enumerate(sizes):
        if size == 0:
            continue
        rows = slice(start, start + size)
        start += size
        t, r = tokens[rows], role[rows]
        xe, dz = x[t], g[t] * weight[rows].to(g.dtype)[:, None]  # the pairs' rows and down-output gradients
        with torch.enable_grad():
            u = (xe @ gate_up[e].to(x.dtype).T).requires_grad_()
            h = expert_gate(mod, u)
        du, = torch.autograd.grad(h, u, dz @ down[e].to(x.dtype))
        h = h.detach()
        sums[0].add(state, du, xe, t, r, _slab(e, spec.transposed), shapes[0])
        sums[1].add(state, dz, h, t, r, _slab(e, spec.transposed), shapes[1])


def _slab(e: int, transposed: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    return (lambda full: full[e].T) if transposed else (lambda full: full[e])


def match_rows(rows: torch.Tensor, source: torch.Tensor, codes: torch.Tensor, path: str) -> torch.Tensor:
    """The positions (m,) of ``rows`` (m, H) among ``source`` (N, H) (exact equality): an expert's input rows
    are a gather of the MoE block's input rows. ExpertLayoutError when a row is not one of them, or equals rows
    of positions of different roles (its role is then unknown)."""
    n = source.shape[0]
    _, inverse = torch.unique(torch.cat([source, rows.to(source.dtype)]), dim=0, return_inverse=True)
    ids, row_ids = inverse[:n], inverse[n:]
    size = int(inverse.max()) + 1
    first = torch.full((size,), n, dtype=torch.long, device=source.device)
    first.scatter_reduce_(0, ids, torch.arange(n, device=source.device), "amin")
    low = torch.full((size,), NUM_ROLES, dtype=torch.long, device=source.device).scatter_reduce_(0, ids, codes, "amin")
    high = torch.full((size,), -1, dtype=torch.long, device=source.device).scatter_reduce_(0, ids, codes, "amax")
    tokens = first[row_ids]
    if bool((tokens == n).any()) or bool((low[row_ids] != high[row_ids]).any()):
        raise ExpertLayoutError(
            f"the experts of {path!r} received rows that are not rows of their MoE block's input at positions of one "
            "role, so gradflow cannot tell which position each row came from: record with --norms-only (sites only), "
            "or use the fused layout (experts called with the top-k indices and weights)")
    return tokens


class _ListExperts:
    """Hooks of one ``nn.ModuleList`` of experts: the MoE block's input rows, each expert's rows' positions, and
    each expert Linear's per-role products."""

    def __init__(self, name: str, spec: ExpertsSpec, parent: nn.Module, experts: nn.ModuleList, current: StateFn):
        self.name, self.spec, self.parent, self.experts, self.current = name, spec, parent, experts, current
        self.source: torch.Tensor | None = None
        self.active: tuple[int, torch.Tensor] | None = None  # (expert, positions of its rows)

    def install(self, stack: ExitStack) -> None:
        stack.callback(self.parent.register_forward_pre_hook(self._block_input, with_kwargs=True).remove)
        for e, expert in enumerate(self.experts):
            stack.callback(expert.register_forward_pre_hook(self._enter(e), with_kwargs=True).remove)
            stack.callback(expert.register_forward_hook(self._leave).remove)
            for path in self.spec.linears:
                linear = get_module(expert, path)
                stack.callback(linear.register_forward_hook(self._linear(e, path)).remove)

    def _block_input(self, module, args, kwargs) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        self.source = hidden.detach().reshape(-1, hidden.shape[-1]) if isinstance(hidden, torch.Tensor) else None

    def _enter(self, e: int):
        def hook(module, args, kwargs) -> None:
            state, depth = self.current()
            x = args[0] if args else kwargs.get("hidden_states")
            if state is None or depth is None or self.source is None or not isinstance(x, torch.Tensor):
                return
            if self.source.shape[0] != state.partition.codes.numel():
                return
            codes = state.partition.codes
            tokens = match_rows(x.detach().reshape(-1, x.shape[-1]), self.source, codes, self.spec.path)
            _count(state, depth, self.name, len(self.experts), torch.full_like(tokens, e), codes[tokens])
            self.active = (e, tokens)
        return hook

    def _leave(self, module, args, output) -> None:
        self.active = None

    def _linear(self, e: int, path: str):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            state, depth = self.current()
            active = self.active
            if state is None or depth is None or active is None or active[0] != e:
                return
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            tokens = active[1]
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            if x.shape[0] != tokens.numel():
                raise ExpertLayoutError(
                    f"the Linear {path!r} of expert {e} of {self.spec.path!r} ran on {x.shape[0]} rows, not on the "
                    f"{tokens.numel()} rows routed to its expert, so its weight cannot be split by role: record with "
                    "--norms-only (sites only)")
            order = torch.argsort(state.partition.codes[tokens], stable=True)
            t = tokens[order]
            r = state.partition.codes[t]
            key = f"{self.name}.{path}"
            has_bias = getattr(module, "bias", None) is not None
            weight_shape = (len(self.experts), *module.weight.shape)

            def on_grad(grad: torch.Tensor) -> None:
                g = _wide(grad.reshape(-1, grad.shape[-1]))[order]
                ExpertSums.of(state, (depth, key, "weight")).add(state, g, _wide(x)[order], t, r,
                                                                 lambda full: full[e], weight_shape)
                if has_bias:
                    ExpertSums.of(state, (depth, key, "bias")).add(state, g, None, t, r, lambda full: full[e],
                                                                   (len(self.experts), g.shape[1]))

            output.register_hook(on_grad)
        return hook


@contextmanager
def expert_hooks(blocks: list[nn.Module], experts: dict[str, ExpertsSpec], current: StateFn,
                 own: frozenset[int] = frozenset()) -> Iterator[None]:
    """Install the experts' hooks of every block (removed on exit, also on exceptions), but on the fused modules
    whose ids are in ``own`` (run by :mod:`gradflow.hooks.split_experts`). A spec the adapter marks ``unsplittable``
    raises ExpertLayoutError at once."""
    with ExitStack() as stack:
        for name, spec in experts.items():
            if spec.unsplittable is not None:
                raise ExpertLayoutError(f"{spec.unsplittable}: record with --norms-only (sites only), or describe "
                                        "its routing in an Adapter's ExpertsSpec")
            for block in blocks:
                try:
                    module = get_module(block, spec.path)
                except LookupError:  # a block without experts (Qwen2-MoE's mlp_only_layers: a dense MLP)
                    continue
                if spec.layout == "list":
                    parent_path = spec.path.rpartition(".")[0]
                    _ListExperts(name, spec, get_module(block, parent_path), module, current).install(stack)
                elif id(module) not in own:
                    stack.callback(module.register_forward_hook(_fused_hook(name, spec, current), with_kwargs=True)
                                   .remove)
        yield


def _fused_hook(name: str, spec: ExpertsSpec, current: StateFn):
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        state, depth = current()
        out = output[0] if isinstance(output, tuple) else output
        if state is None or depth is None or not isinstance(out, torch.Tensor) or not out.requires_grad:
            return
        hidden, index, weights = routing_of(spec.path, module, args, kwargs)
        if hidden.shape[0] != state.partition.codes.numel():
            raise ExpertLayoutError(
                f"the experts module {spec.path!r} ({type(module).__name__}) received {hidden.shape[0]} rows, not the "
                f"batch's {state.partition.codes.numel()} positions, so its rows cannot be given roles: record with "
                "--norms-only (sites only)")
        hidden, index, weights = hidden.detach(), index.detach(), weights.detach()

        def on_grad(grad: torch.Tensor) -> None:
            fused_stats(state, depth, name, spec, module, hidden, index, weights, grad.reshape(hidden.shape))

        out.register_hook(on_grad)
    return hook


__all__ = ["ExpertSums", "expert_gate", "expert_hooks", "finish_experts", "fused_stats", "gram_cheaper", "match_rows",
           "routing_of", "routing_pairs"]
