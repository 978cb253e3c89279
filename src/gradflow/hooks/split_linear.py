"""A Linear whose weight gradient is computed in two or three parts while a capture runs: no extra product.

Under ``loss.backward()`` autograd computes every Linear's weight gradient ``W = sum_t g_t x_t^T``
over all B * T positions. The per-role split needs ``||G_r||`` for each role; for the largest role
(context, usually) that is a product as large as most of ``W``. While a capture runs, the recorder
replaces the ``forward`` of each Linear sublayer module whose weight gradient comes from that module
alone by :class:`RoleSplitLinear`, whose backward computes ``W`` as two products instead of one: the
largest role's rows ``G_big = g_big^T x_big`` (its norm is the statistic) and then
``W = G_big + g_rest^T x_rest``. The flops are those of the one product; the result is ``W`` up to
float32 summation order (a split product, as a different thread count gives). When the role with the most
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
    """

    big: torch.Tensor
    rest: torch.Tensor
    finish: Callable[..., None]
    rest_grad: torch.Tensor | None = None
    rest_input: torch.Tensor | None = None
    big_input: Callable[[], torch.Tensor] | None = None
    second: int = 0


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
                if split.rest.numel() > split.second:
                    grad_w.addmm_(g_rest.T, x_rest)
        grad_b = g2.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None


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
        for module, previous in reversed(patched):
            if previous is None:
                del module.forward
            else:
                module.forward = previous


__all__ = ["SPLIT_DTYPES", "DirectSplit", "RoleSplitLinear", "WeightRuns", "WeightSplit", "split_linear_forwards", "splits_weight"]
