"""The normalisation audit: the gradient's scale relative to the global-token normaliser the objective defines.

An MLM-style objective weighs each loss token t of the global batch (every micro-batch of every rank) by
``w_t / sum_global(w)`` (``w_t`` = 1, or ``1 / t`` for a masked-diffusion ELBO): the loss is the weighted sum
of the token losses over that one global normaliser. For cross-entropy the gradient w.r.t. token t's logits is
``c_t (softmax(z_t) - e_{y_t})``, so each token's actual weight ``c_t`` is measured exactly at a logging step from a
hook on the logits, as ``||dL/dz_t|| / ||softmax(z_t) - e_{y_t}||``. After the ranks' reduction (DDP and FSDP2
average: ``1 / world``) the ideal weights sum to 1, so the gradient's scale is ``sum_global(c_t) / world``.

A loss averaged over each local micro-batch and summed over accumulation steps gives ``grad_accum`` (averaged over
ranks) or ``grad_accum x world`` (summed over ranks): the scale changes with the GPU count and the accumulation
(NVIDIA-NeMo/Automodel #2437); :func:`normalisation_warning` says so in one sentence.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class LossWeights:
    """One micro-batch's audit: ``labels`` (B, T), -100 off the loss; ``weights`` (B, T) the objective's weights
    (None: 1). ``measured``: the sum of the measured per-token weights ``c_t``; ``tokens``: loss tokens."""

    labels: torch.Tensor | None
    weights: torch.Tensor | None = None
    measured: torch.Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.float64))
    tokens: int = 0

    def sums(self) -> torch.Tensor:
        """(3,) float64: measured weight sum, loss tokens, objective weight sum (this micro-batch)."""
        loss = self.labels != -100 if self.labels is not None else None
        objective = 0.0 if loss is None else float(
            self.weights[loss].double().sum() if self.weights is not None else loss.sum())
        return torch.tensor([float(self.measured), float(self.tokens), objective], dtype=torch.float64)


@contextmanager
def token_weights(model: nn.Module, audit: LossWeights) -> Iterator[LossWeights]:
    """Measure each loss token's weight ``c_t`` in the loss of the one forward and backward inside: a forward hook
    on ``model`` takes its output's ``logits`` (B, T, V) and a tensor hook their gradient. Removed on leaving."""
    handles = []

    def on_output(module: nn.Module, args: tuple, output: object) -> None:
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            logits = output[0]
        if not isinstance(logits, torch.Tensor) or not logits.requires_grad or audit.labels is None:
            return
        labels = audit.labels.to(logits.device)
        if labels.shape != logits.shape[:2]:
            return
        loss = labels != -100
        z = logits.detach()[loss].float()  # (n, V): only the loss positions are kept
        target = labels[loss]

        def on_grad(grad: torch.Tensor) -> None:
            g = grad[loss].double()
            p = torch.softmax(z.double(), dim=-1)
            p[torch.arange(len(target), device=p.device), target] -= 1.0
            norms = p.norm(dim=-1)
            keep = norms > 0
            audit.measured = audit.measured + (g.norm(dim=-1)[keep] / norms[keep]).sum().cpu()
            audit.tokens += int(loss.sum())

        handles.append(logits.register_hook(on_grad))

    handles.append(model.register_forward_hook(on_output))
    try:
        yield audit
    finally:
        for handle in handles:
            handle.remove()


def normalisation_warning(scale: float, tolerance: float, micro_batches: int, world: int) -> str | None:
    """One sentence when ``scale`` is off 1 by more than ``tolerance`` (None otherwise), naming what it scales with."""
    if abs(scale - 1.0) <= tolerance:
        return None
    return (f"GradAccounting: the gradient is {scale:.4g}x what the objective's global-token normaliser gives "
            f"({micro_batches} micro-batch(es) on this rank, {world} rank(s)), so it scales with the accumulation "
            "steps and the world size when the loss is averaged over each local micro-batch: divide the summed "
            "token losses by the global batch's loss-token count instead (transformers: num_items_in_batch).")


__all__ = ["LossWeights", "normalisation_warning", "token_weights"]
