"""Fused experts run by gradflow while a capture runs: the weight gradients computed as the sum of the per-role
products, so the split costs no product beyond autograd's own (as :mod:`gradflow.hooks.split_linear` does for a
Linear).

Without it the split recomputes the experts' gate/up output and the down-side gradient from the call and its
output gradient (:func:`gradflow.hooks.experts.fused_stats`, two products of the experts' size more). While a capture
runs, the recorder replaces the ``forward`` of each fused experts module of the plain layout (``gate_up_proj``,
``down_proj``, no biases, no post-expert norm, no expert parallelism; ``gate_up_proj`` (E, 2I, H) or transposed)
by :class:`RoleSplitExperts`: the rows routed to each expert, sorted by role, go through ``x W_gu[e]^T``, the
module's own gate (``_apply_gate``, or ``act(gate) * up``) and ``h W_down[e]^T``, weighted by the routing weights and
summed per position, the computation of transformers' eager experts (each expert's rows in one product). Its
backward computes what autograd's would: the rows' gradient, the routing weights' gradient ``<g, y>``, and each
expert's weight gradient as the sum of its roles' products ``du_r^T x_r`` and ``dz_r^T h_r``, whose norms are the
statistics. The module's own implementation (``grouped_mm``, ``batched_mm``) does not run during the capture; the
output and gradients are the same up to float rounding (tests/hooks/test_experts.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from gradflow.adapters.experts import FUSED_PARAMS, ExpertsSpec
from gradflow.hooks.batch_state import BatchState
from gradflow.hooks.experts import ExpertSums, expert_gate, routing_of, routing_pairs
from gradflow.hooks.grouped_experts import add_by_role, grouped, offsets
from gradflow.hooks.split_linear import restore_forwards
from gradflow.roles import NUM_ROLES

CallInfo = Callable[[], "tuple[BatchState | None, int | None]"]


def plain_fused(module: nn.Module) -> bool:
    """Whether gradflow can run ``module``'s experts itself: 3-D ``gate_up_proj`` and ``down_proj``, no biases, no
    post-expert norm, not expert-parallel, and a gate it knows (``_apply_gate`` or ``act_fn``)."""
    params = [getattr(module, name, None) for name in FUSED_PARAMS]
    return (all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in params)
            and not getattr(module, "has_bias", False) and not getattr(module, "has_post_expert_norm", False)
            and not getattr(module, "_is_expert_parallel", False)
            and (callable(getattr(module, "_apply_gate", None)) or callable(getattr(module, "act_fn", None))))


class RoleSplitExperts(torch.autograd.Function):
    """The fused experts' forward, with a backward whose weight gradients are sums of per-role products."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                index: torch.Tensor, module: nn.Module, spec: ExpertsSpec, name: str, state: BatchState,
                depth: int) -> torch.Tensor:
        w1 = gate_up.transpose(1, 2) if spec.transposed else gate_up  # (E, 2I, H)
        w2 = down.transpose(1, 2) if spec.transposed else down  # (E, H, I)
        experts = w1.shape[0]
        tokens, expert, slot, role, sizes = routing_pairs(state, depth, name, index, experts)
        table = torch.bincount(expert * NUM_ROLES + role, minlength=experts * NUM_ROLES).view(experts, NUM_ROLES)
        ends = offsets(table.sum(dim=1))
        x = hidden[tokens]
        pair_weights = weights.reshape(-1)[tokens * index.shape[1] + slot]
        u = grouped(x, w1.transpose(1, 2), ends, sizes)  # every expert's rows in one call
        y = grouped(expert_gate(module, u), w2.transpose(1, 2), ends, sizes)
        weighted = (y * pair_weights[:, None]).to(hidden.dtype)
        out = torch.zeros_like(hidden).index_add_(0, tokens, weighted)
        ctx.save_for_backward(hidden, weights, gate_up, down, tokens, expert, slot, role, table, ends)
        ctx.rows = [u, y]  # intermediates, held on ctx so that the backward can free each once it is used
        ctx.module, ctx.spec, ctx.name, ctx.state, ctx.depth, ctx.sizes, ctx.k = (module, spec, name, state, depth,
                                                                                sizes, index.shape[1])
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        hidden, weights, gate_up, down, tokens, expert, slot, role, table, ends = ctx.saved_tensors
        u, y = ctx.rows
        ctx.rows = None
        spec, k, sizes = ctx.spec, ctx.k, ctx.sizes
        w1 = gate_up.transpose(1, 2) if spec.transposed else gate_up
        w2 = down.transpose(1, 2) if spec.transposed else down
        g = grad[tokens]  # (S, H): each pair's position's output gradient
        pair_weights = weights.reshape(-1)[tokens * k + slot]
        grad_weights = torch.zeros(weights.numel(), dtype=torch.float32, device=weights.device)
        grad_weights.index_add_(0, tokens * k + slot, row_dots(y, g))
        dz = (g * pair_weights[:, None]).to(y.dtype)
        del g, y
        with torch.enable_grad():
            ue = u.detach().requires_grad_()
            h = expert_gate(ctx.module, ue)
        du, = torch.autograd.grad(h, ue, grouped(dz, w2, ends, sizes))
        h = h.detach()
        del u, ue
        # each parameter's split once its rows exist, and its rows freed after it (autograd's order: down, then
        # gate/up): fewer (S, D) rows live beside the two weight gradients
        down_grad = _split(ctx, "down_proj", dz, h, tokens, role, expert, table, down)
        del dz, h
        x = hidden[tokens]
        gate_up_grad = _split(ctx, "gate_up_proj", du, x, tokens, role, expert, table, gate_up)
        del x
        grad_hidden = torch.zeros_like(hidden).index_add_(0, tokens, grouped(du, w1, ends, sizes))
        return (grad_hidden, grad_weights.view_as(weights).to(weights.dtype), gate_up_grad, down_grad,
                None, None, None, None, None, None)


def _split(ctx, param: str, rows_out: torch.Tensor, rows_in: torch.Tensor, tokens: torch.Tensor, role: torch.Tensor,
           expert: torch.Tensor, table: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """One fused parameter's weight gradient (its stored layout) from its rows, split by role into the batch's sums."""
    sums = ExpertSums.of(ctx.state, (ctx.depth, f"{ctx.name}.{param}", "weight"))
    summed = add_by_role(sums, ctx.state, rows_out, rows_in, tokens, role, expert, table, ctx.spec.transposed,
                         tuple(full.shape))
    return summed.transpose(1, 2) if ctx.spec.transposed else summed


CHUNK_ELEMENTS = 1 << 20
"""Elements of a float32 temporary in :func:`row_dots` (4 MiB): the rows are taken in chunks of about this size."""


def row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(S,) float32 dot products of the rows of ``a`` and ``b`` (S, D), each exact in float32 as ``(a.float() *
    b.float()).sum(-1)``, taken a chunk of rows at a time: converting whole (S, D) rows of a bfloat16 call to float32
    holds three float32 copies at once (192 MiB at an OLMoE block's S = 8,192 pairs, D = 2,048)."""
    step = max(1, CHUNK_ELEMENTS // max(1, a.shape[1]))
    if a.shape[0] <= step:
        return (a.float() * b.float()).sum(dim=-1)
    out = torch.empty(a.shape[0], dtype=torch.float32, device=a.device)
    for start in range(0, a.shape[0], step):
        end = start + step
        torch.sum(a[start:end].float() * b[start:end].float(), dim=-1, out=out[start:end])
    return out


@contextmanager
def split_experts_forwards(modules: list[tuple[nn.Module, str, ExpertsSpec]], current: CallInfo) -> Iterator[None]:
    """Route the calls of each fused experts module (with its experts name and spec) through
    :class:`RoleSplitExperts` while a capture runs (its own ``forward`` otherwise and afterwards; restored even when
    the block raises)."""
    patched: list[tuple[nn.Module, object]] = []
    try:
        for module, name, spec in modules:
            own = module.forward
            previous = module.__dict__.get("forward")

            def forward(*args, module=module, own=own, name=name, spec=spec, **kwargs):
                state, depth = current()
                if state is None or depth is None or not torch.is_grad_enabled():
                    return own(*args, **kwargs)
                rows, index, weights = routing_of(spec.path, module, args, kwargs)
                if rows.shape[0] != state.partition.codes.numel():  # not the batch's positions: the hook's refusal
                    return own(*args, **kwargs)
                out = RoleSplitExperts.apply(rows, weights, module.gate_up_proj, module.down_proj, index, module,
                                             spec, name, state, depth)
                hidden = args[0] if args else kwargs["hidden_states"]
                return out.view_as(hidden)

            module.forward = forward
            patched.append((module, previous))
        yield
    finally:
        restore_forwards(patched)


__all__ = ["RoleSplitExperts", "plain_fused", "split_experts_forwards"]
