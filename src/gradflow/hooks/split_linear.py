"""A Linear whose weight gradient is computed in two or three parts while a capture runs: no extra product.

Under ``loss.backward()`` autograd computes every Linear's weight gradient ``W = sum_t g_t x_t^T``
over all B * T positions. The per-role split needs ``||G_r||`` for each role; for the largest role
(context, usually) that is a product as large as most of ``W``. While a capture runs, the recorder
replaces the ``forward`` of each Linear sublayer module whose weight gradient comes from that module
alone by :class:`RoleSplitLinear`, whose backward computes ``W`` as two products instead of one: the
largest role's rows ``G_big = g_big^T x_big`` (its norm is the statistic) and then
``W = G_big + g_rest^T x_rest``. The flops are those of the one product; the result is ``W`` up to
float32 summation order (a split product, as a different thread count gives); the rows of roles whose
every term ``g_t x_t^T`` is exactly zero (finite factors: a model's last block past its attention, padding)
are left out of the products, zeros that change no sum. When the role with the most
rows after ``big`` has enough of them (masked diffusion's masked half, say), its rows are a third product
``G_second``, its norm a statistic too: ``W = (G_big + G_second) + G_rest``, the same flops.

A bfloat16 or float16 Linear (weights and input in that dtype, outside autocast) is split the same way in
its own dtype: both products run at the speed of autograd's one (float32 accumulation inside, as
autograd's), ``G_big`` is rounded once to the dtype before ``G_rest`` is added, so ``W`` is autograd's up to
about one unit in the last place of the dtype (a three-way split rounds ``G_second`` and its sum with
``G_big`` once each more); the statistic is ``||G_big||`` (and ``||G_second||``) of the rounded product,
within the dtype's rounding of the float32 norm (float16's narrow range is guarded by the statistics,
:func:`gradflow.hooks.sublayer_stats.sublayer_stats`).

Which rows form ``big`` and ``rest`` is decided by the statistics hook on the module's output, which
runs before this backward and leaves a :class:`DirectSplit` under ``id(weight)``; without one (the
module was called twice, the gradient is not a token gradient) the backward is the plain product.
The input gradient is ``g W`` as in ``nn.Linear``; the bias gradient is ``sum_t g_t``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gradflow.hooks.linear_inputs import RestRows


@dataclass(frozen=True)
class DirectSplit:
    """The rows of one Linear call's weight gradient: ``big`` (n_big,) and ``rest`` (n_rest,) indices
    into the call's B * T rows (together every row once); ``finish`` takes ``G_big`` (D_out, D_in), or
    None when no weight gradient was computed, and stores the statistics. ``rest_grad`` (n_rest, D_out)
    and ``rest_input`` (n_rest, D_in): the ``rest`` rows of the output gradient and the input, when the
    statistics already gathered them (None: the backward gathers them); ``big_input``: returns the ``big``
    rows of the input (n_big, D_in), gathered once for every module reading that input (None: gathered here).
    ``second``: the last ``second`` rows of ``rest`` (in its order) are one role's, computed as their own
    product ``G_second`` (a three-way split), passed as ``finish(G_big, G_second)`` and then added (0: none).
    ``rest_live``: the (start, stop) ranges of ``rest``'s other rows (in its order) that enter ``G_rest``; the rows
    left out are whole roles whose every ``g_t x_t^T`` is exactly zero with finite factors, so ``W`` is the same
    sum without their zero terms (None: every row, one product).
    """

    big: torch.Tensor
    rest: torch.Tensor
    finish: Callable[..., None]
    rest_grad: torch.Tensor | None = None
    rest_input: torch.Tensor | None = None
    big_input: Callable[[], torch.Tensor] | None = None
    second: int = 0
    rest_live: tuple[tuple[int, int], ...] | None = None


WeightSplit = Callable[[nn.Parameter], "DirectSplit | None"]
"""Pops the :class:`DirectSplit` left for a weight by the statistics hook (None: plain product)."""
WeightRuns = Callable[[nn.Linear], bool]
"""Whether the running backward computes the module's weight gradient (``torch.autograd.grad``
towards activations does not)."""


class RoleSplitLinear(torch.autograd.Function):
    """``F.linear(x, weight, bias)`` with the weight gradient computed as ``G_big + G_rest``, or
    ``G_big + G_second + G_rest`` (see module)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, module: nn.Linear,
                take_split: WeightSplit, weight_runs: WeightRuns) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.module, ctx.take_split, ctx.weight_runs = module, take_split, weight_runs
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_x = (g2 @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = None
        if ctx.needs_input_grad[1] and ctx.weight_runs(ctx.module):
            split = ctx.take_split(weight)
            if split is None:
                grad_w = g2.T @ x2
            else:
                x_big = split.big_input() if split.big_input is not None else None
                if x_big is None or x_big.shape != (split.big.numel(), x2.shape[1]) or x_big.dtype != x2.dtype:
                    x_big = x2.index_select(0, split.big)
                grad_w = g2.index_select(0, split.big).T @ x_big
                g_rest, x_rest = split.rest_grad, split.rest_input
                if split.rest.numel() and (g_rest is None or x_rest is None or g_rest.dtype != g2.dtype
                                           or x_rest.dtype != x2.dtype):
                    g_rest, x_rest = g2.index_select(0, split.rest), x2.index_select(0, split.rest)
                if split.second:  # the rest's last rows: the second role's own product, added
                    cut = split.rest.numel() - split.second
                    second = g_rest[cut:].T @ x_rest[cut:]
                    split.finish(grad_w, second)
                    grad_w.add_(second)
                    g_rest, x_rest = g_rest[:cut], x_rest[:cut]
                else:
                    split.finish(grad_w)
                if split.rest_live is not None:  # only the rows with a contribution (see DirectSplit)
                    for start, stop in split.rest_live:
                        grad_w.addmm_(g_rest[start:stop].T, x_rest[start:stop])
                elif split.rest.numel() > split.second:
                    grad_w.addmm_(g_rest.T, x_rest)
        grad_b = g2.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


SECOND_SHARE = 0.05
"""A role's rows are their own product in the weight gradient's backward (the largest role's in a two-way
split; the second role's in a three-way split) when they reach ``n * (D_out + D_in) >= SECOND_SHARE * D_out *
D_in``: below it, their Gram products cost less than the split's overhead (the rows gathered, one more product
launch, one addition of the weight's size). Measured on a 2-core CPU, bert-base shapes (docs/benchmarks.md)."""


def second_role(rest: RestRows, n_live: list[float], d_out: int, d_in: int) -> int | None:
    """The role the weight gradient's backward computes as its own product (see :data:`SECOND_SHARE`): the role
    with the most rows but ``big`` (the last of ``rest``'s order), when it has a contributing row, else None."""
    if not rest.starts:
        return None
    code = max(rest.starts, key=rest.starts.__getitem__)
    rows = rest.index.numel() - rest.starts[code]
    if n_live[code] == 0 or not own_product(rows, d_out, d_in):
        return None
    return code


def live_ranges(rest: RestRows, counts: tuple[int, ...], second: int | None, n_live: list[float],
                unsafe: list[bool]) -> tuple[tuple[int, int], ...] | None:
    """The row ranges of ``rest`` (in its order, ``second``'s rows excluded) whose terms enter ``G_rest``: every
    role's but those without a contributing row (``n_live``) and without a non-finite or extreme factor
    (``unsafe``: ``0 * inf`` is NaN), whose terms are exact zeros. None: every row (nothing to leave out)."""
    ranges: list[tuple[int, int]] = []
    for code, start in sorted(rest.starts.items(), key=lambda item: item[1]):
        if code == second or (n_live[code] == 0 and not unsafe[code]):
            continue
        stop = start + counts[code]
        if ranges and ranges[-1][1] == start:  # adjacent roles: one product
            ranges[-1] = (ranges[-1][0], stop)
        else:
            ranges.append((start, stop))
    kept = sum(stop - start for start, stop in ranges) + (counts[second] if second is not None else 0)
    return None if kept == rest.index.numel() else tuple(ranges)


def own_product(rows: int, d_out: int, d_in: int) -> bool:
    """Whether a role's ``rows`` are computed as their own product in the weight gradient's backward (no flops
    beyond autograd's) rather than from their Gram matrices (float32, in :mod:`gradflow.hooks.sublayer_stats`):
    :data:`SECOND_SHARE`."""
    return rows * (d_out + d_in) >= SECOND_SHARE * d_out * d_in


SPLIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes whose Linear weight gradients are computed as two products (weights and input alike)."""


def splits_weight(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether this call goes through :class:`RoleSplitLinear`: a call of a float32, bfloat16 or float16
    Linear with an input of its dtype, outside autocast, with gradients on (anything else runs the module's
    own forward)."""
    weight = module.weight
    return (x.dtype == weight.dtype and x.dtype in SPLIT_DTYPES and torch.is_grad_enabled()
            and weight.requires_grad and not torch.is_autocast_enabled(x.device.type))


@contextmanager
def split_linear_forwards(modules: list[nn.Linear], take_split: WeightSplit, weight_runs: WeightRuns
                          ) -> Iterator[None]:
    """Route the calls of ``modules`` through :class:`RoleSplitLinear` inside the block (their own
    ``forward`` otherwise and afterwards; restored even when the block raises)."""
    patched: list[tuple[nn.Linear, object]] = []
    try:
        for module in modules:
            own = module.forward
            previous = module.__dict__.get("forward")  # an instance-level forward someone else set

            def forward(x: torch.Tensor, module: nn.Linear = module, own: Callable = own) -> torch.Tensor:
                if not splits_weight(module, x):
                    return own(x)
                return RoleSplitLinear.apply(x, module.weight, module.bias, module, take_split, weight_runs)

            module.forward = forward
            patched.append((module, previous))
        yield
    finally:
        restore_forwards(patched)


def restore_forwards(patched: list[tuple[nn.Module, Callable | None]]) -> None:
    """Undo instance-level ``forward`` patches, last first: ``previous`` is the instance's own ``forward`` before the
    patch (None: it had none, so the class's applies again)."""
    for module, previous in reversed(patched):
        if previous is None:
            del module.forward
        else:
            module.forward = previous


__all__ = ["restore_forwards", "SECOND_SHARE", "SPLIT_DTYPES", "DirectSplit", "RoleSplitLinear", "WeightRuns", "WeightSplit", "live_ranges", "own_product", "second_role", "split_linear_forwards", "splits_weight"]
