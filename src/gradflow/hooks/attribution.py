"""Captum attributions of the MLM loss to every channel (token position) at every block output.

The attributed quantity is the MLM loss at chosen loss positions with the ``"batch"`` reduction
of :mod:`gradflow.losses`: ``sum of cross-entropies / number of chosen positions in the batch``.
Captum needs one scalar per example, so :class:`MLMObjective` returns, per sequence, the sum of
its cross-entropies divided by the *batch* count; the per-example values add up to the batch
loss, and their gradient is the recorder's gradient (``rec.record(batch, reduction="batch")``).

Sites: ``embeddings.out`` (layer 0) and ``blocks.{i}.out`` (layer i + 1), as in the recorder.

Why taps instead of the block modules themselves: Captum 0.9 hooks a module's *whole* output; for
a tuple it attributes every element and asserts each one is a tensor (DeBERTa-v2 blocks return
``(hidden, None)``), and it keys what it saves by module, so a block applied at several depths
(ALBERT's shared layer) would keep only its last call. gradflow therefore routes each site's
hidden state through its own identity module (a *tap*, one per depth) inside a forward hook and
gives Captum the list of taps: same tensors, same gradients, any output structure.

Methods:

- :func:`gradient_x_activation`: Captum ``LayerGradientXActivation`` over all taps at once
  (``attribute_to_layer_input=False``), run twice: ``multiply_by_inputs=True`` gives g * h,
  ``multiply_by_inputs=False`` gives the gradient g itself (so ``g * h`` can be checked exactly).
- :func:`integrated_gradients`: Captum ``LayerIntegratedGradients``, one site at a time (Captum
  forbids attributing to layers that feed each other in one call): the site's hidden state moves
  on a straight line from its value under a baseline input (non-special tokens replaced by
  ``baseline_token_id``) to its actual value; attributions add up to the loss difference
  (``delta`` is Captum's completeness error).

After the last attention nothing mixes channels, so at ``blocks.{L-1}.out`` the gradient, and
with it every attribution, is exactly zero at non-loss positions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from gradflow.adapters import Adapter
from gradflow.errors import AttributionError
from gradflow.hooks.sites import SiteLayer, model_device, site_hooks, site_names
from gradflow.inputs.masking import MaskedBatch
from gradflow.roles import Role, role_name

PositionsArg = torch.Tensor | Sequence[tuple[int, int]] | None


class _Tap(nn.Identity):
    """An identity module a site's hidden state passes through, so Captum can hook it."""


@contextmanager
def block_taps(model: nn.Module, adapter: Adapter | None = None) -> Iterator[list[nn.Module]]:
    """One identity tap per block-output site (``embeddings.out``, then each block's ``out``), in
    site order; each site's hidden state passes through its tap."""
    sites = SiteLayer(model, adapter, mid=False)
    taps = {name: _Tap() for name in sites.names}
    with sites.hooks(lambda site, hidden: taps[site](hidden)):
        yield [taps[name] for name in sites.names]


# ----------------------------------------------------------------------------------------------
# The objective Captum differentiates
# ----------------------------------------------------------------------------------------------

def chosen_labels(batch: MaskedBatch, positions: PositionsArg = None) -> torch.Tensor:
    """(B, T) labels: the original token at the chosen loss positions, -100 elsewhere.

    ``positions``: None (every loss position of the batch), a (B, T) bool mask, or
    ``(row, position)`` pairs; each must be a loss position (``labels != -100``).
    """
    labels = batch.labels
    if positions is None:
        chosen = labels != -100
    elif isinstance(positions, torch.Tensor):
        if positions.shape != labels.shape:
            raise AttributionError(f"positions mask has shape {tuple(positions.shape)}, "
                                   f"the batch {tuple(labels.shape)}")
        chosen = positions.to(torch.bool).to(labels.device)
    else:
        chosen = torch.zeros_like(labels, dtype=torch.bool)
        for row, t in positions:
            if not (0 <= row < labels.shape[0] and 0 <= t < labels.shape[1]):
                raise AttributionError(f"position ({row}, {t}) is outside the batch of shape {tuple(labels.shape)}")
            chosen[row, t] = True
    off = chosen & (labels == -100)
    if bool(off.any()):
        row, t = (int(v) for v in torch.nonzero(off)[0])
        raise AttributionError(f"position ({row}, {t}) carries no MLM loss (role "
                               f"{role_name(batch.roles[row, t])}); choose masked, random or kept positions")
    if not bool(chosen.any()):
        raise AttributionError("no loss position chosen: the batch has no masked, random or kept position to attribute")
    return torch.where(chosen, labels, torch.full_like(labels, -100))


class MLMObjective(nn.Module):
    """Per-example MLM loss at the chosen positions; the values add up to the batch-reduced loss.

    ``forward(input_ids, attention_mask, labels, *extra) -> (N,)``: cross-entropy summed over
    each row's labelled positions, divided by ``denominator`` (the number of chosen positions of
    the *original* batch, so rows Captum repeats for integration steps keep the same scale).
    ``extra`` are the batch's ``extra_inputs`` in the order of ``extra_names``.
    """

    def __init__(self, model: nn.Module, denominator: float, extra_names: Sequence[str] = ()):
        super().__init__()
        self.model = model
        self.denominator = float(denominator)
        self.extra_names = tuple(extra_names)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor,
                *extra: torch.Tensor) -> torch.Tensor:
        kwargs = dict(zip(self.extra_names, extra))
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs).logits
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100,
                             reduction="none").reshape(labels.shape)
        return ce.sum(dim=1) / self.denominator


def _objective_args(model: nn.Module, batch: MaskedBatch, labels: torch.Tensor) -> tuple[MLMObjective, tuple]:
    """The objective and Captum's ``additional_forward_args`` (attention mask, labels, extras)."""
    names = tuple(sorted(batch.extra_inputs))
    objective = MLMObjective(model, float((labels != -100).sum()), names)
    return objective, (batch.attention_mask, labels, *(batch.extra_inputs[n] for n in names))


# ----------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------

@dataclass
class ChannelAttribution:
    """Attributions of one batch at every site. Tensors are CPU float32.

    ``gradient``, ``activation``, ``grad_x_act``: one (B, T, H) tensor per site of ``site_names``
    (lists, because H differs at ``embeddings.out`` for factorised embeddings such as ALBERT's).
    ``integrated``: the same for layer integrated gradients, or None; ``delta``: (S, B) Captum's
    completeness error per site and row. ``labels``: (B, T) chosen labels; ``loss``: the
    attributed loss (sum over rows of the objective).
    """

    site_names: tuple[str, ...]
    layers: tuple[int, ...]
    input_ids: torch.Tensor
    original_ids: torch.Tensor
    roles: torch.Tensor
    labels: torch.Tensor
    sequence_index: torch.Tensor
    loss: float
    gradient: list[torch.Tensor]
    activation: list[torch.Tensor]
    grad_x_act: list[torch.Tensor]
    integrated: list[torch.Tensor] | None = None
    delta: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.site_names) - 1

    def per_position(self, name: str) -> torch.Tensor:
        """(S, B, T) summary: ``attribution_sum``/``attribution_norm`` (g * h summed / L2 over H),
        ``grad_norm``, ``act_norm``, ``ig_sum``, ``ig_norm``."""
        source = {"attribution": self.grad_x_act, "grad": self.gradient, "act": self.activation,
                  "ig": self.integrated}
        kind, _, stat = name.rpartition("_")
        tensors = source.get(kind)
        if tensors is None:
            raise KeyError(f"no {name!r} in this attribution (integrated gradients not computed?)")
        if stat == "sum":
            return torch.stack([t.sum(dim=-1) for t in tensors])
        if stat == "norm":
            return torch.stack([torch.linalg.vector_norm(t, dim=-1) for t in tensors])
        raise KeyError(f"unknown summary {name!r}")

    def frame(self, include_pad: bool = False) -> pd.DataFrame:
        """Tidy: one row per (row, site, position) with the per-position summaries."""
        names = ["attribution_sum", "attribution_norm", "grad_norm", "act_norm"]
        if self.integrated is not None:
            names += ["ig_sum", "ig_norm"]
        values = {n: self.per_position(n) for n in names}
        b, t = self.roles.shape
        keep = torch.ones(b, t, dtype=torch.bool) if include_pad else self.roles != Role.PAD
        rows_b, rows_t = torch.nonzero(keep, as_tuple=True)
        frames = []
        for s, site in enumerate(self.site_names):
            part = {"sequence_index": self.sequence_index[rows_b].numpy(), "row": rows_b.numpy(),
                    "site": site, "layer": self.layers[s], "position": rows_t.numpy(),
                    "token_id": self.original_ids[rows_b, rows_t].numpy(),
                    "input_id": self.input_ids[rows_b, rows_t].numpy(),
                    "role": [role_name(c) for c in self.roles[rows_b, rows_t]],
                    "chosen": (self.labels[rows_b, rows_t] != -100).numpy()}
            for n in names:
                part[n] = values[n][s][rows_b, rows_t].numpy()
            if self.delta is not None:
                part["ig_delta"] = self.delta[s][rows_b].numpy()
            frames.append(pd.DataFrame(part))
        return pd.concat(frames, ignore_index=True)


# ----------------------------------------------------------------------------------------------
# Methods
# ----------------------------------------------------------------------------------------------

def _cpu(tensors: Sequence[torch.Tensor] | torch.Tensor) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        tensors = [tensors]
    return [t.detach().float().cpu() for t in tensors]


def gradient_x_activation(model: nn.Module, batch: MaskedBatch, positions: PositionsArg = None,
                          adapter: Adapter | None = None) -> ChannelAttribution:
    """Captum ``LayerGradientXActivation`` of the MLM loss at every site (one backward each for
    g * h and for g). The model's mode and parameters' ``.grad`` are left as they are; use eval
    mode (dropout would make the two passes differ)."""
    from captum.attr import LayerGradientXActivation

    batch = batch.to(model_device(model))
    labels = chosen_labels(batch, positions)
    objective, args = _objective_args(model, batch, labels)
    activations: dict[int, torch.Tensor] = {}
    with block_taps(model, adapter) as taps:
        handles = [tap.register_forward_hook(_keep_output(activations, i)) for i, tap in enumerate(taps)]
        try:
            grads = LayerGradientXActivation(objective, taps, multiply_by_inputs=False).attribute(
                batch.input_ids, additional_forward_args=args, attribute_to_layer_input=False)
        finally:
            for handle in handles:
                handle.remove()
        products = LayerGradientXActivation(objective, taps, multiply_by_inputs=True).attribute(
            batch.input_ids, additional_forward_args=args, attribute_to_layer_input=False)
    with torch.no_grad():
        loss = float(objective(batch.input_ids, *args).sum())
    names = site_names(len(taps) - 1)
    return ChannelAttribution(
        names, tuple(range(len(names))), batch.input_ids.cpu(), batch.original_ids.cpu(), batch.roles.cpu(),
        labels.cpu(), batch.sequence_index.cpu(), loss, _cpu([_single(g) for g in grads]),
        _cpu([activations[i] for i in range(len(taps))]), _cpu([_single(p) for p in products]))


def _keep_output(store: dict[int, torch.Tensor], index: int):
    def hook(module, args, output):
        store[index] = output.detach()

    return hook


def _single(value: torch.Tensor | tuple) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else value


def baseline_ids(batch: MaskedBatch, token_id: int) -> torch.Tensor:
    """(B, T) reference input: every non-special, non-pad token replaced by ``token_id``."""
    keep = (batch.roles == Role.SPECIAL) | (batch.roles == Role.PAD)
    return torch.where(keep, batch.input_ids, torch.full_like(batch.input_ids, int(token_id)))


def integrated_gradients(model: nn.Module, batch: MaskedBatch, positions: PositionsArg = None,
                         baseline_token_id: int | None = None, n_steps: int = 32,
                         internal_batch_size: int | None = None,
                         adapter: Adapter | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Captum ``LayerIntegratedGradients`` at each site in turn.

    ``baseline_token_id``: token of the reference input (default ``config.pad_token_id``, else 0;
    pass the tokenizer's mask id for an all-[MASK] reference). Returns per-site attributions
    (S tensors of (B, T, H), loss units) and Captum's completeness error ``delta`` (S, B).
    Cost: about ``S * (n_steps + 2)`` forward and backward passes of the batch.
    """
    from captum.attr import LayerIntegratedGradients

    batch = batch.to(model_device(model))
    labels = chosen_labels(batch, positions)
    objective, args = _objective_args(model, batch, labels)
    if baseline_token_id is None:
        baseline_token_id = getattr(model.config, "pad_token_id", None) or 0
    reference = baseline_ids(batch, baseline_token_id)
    attributions, deltas = [], []
    with block_taps(model, adapter) as taps:
        for tap in taps:
            lig = LayerIntegratedGradients(objective, tap, multiply_by_inputs=True)
            attr, delta = lig.attribute(batch.input_ids, baselines=reference, additional_forward_args=args,
                                        n_steps=n_steps, internal_batch_size=internal_batch_size,
                                        attribute_to_layer_input=False, return_convergence_delta=True)
            attributions.append(_single(attr))
            deltas.append(delta.detach().float().cpu())
    return _cpu(attributions), torch.stack(deltas)


def attribute_channels(model: nn.Module, batch: MaskedBatch, positions: PositionsArg = None,
                       integrated: bool = False, baseline_token_id: int | None = None, n_steps: int = 32,
                       adapter: Adapter | None = None) -> ChannelAttribution:
    """Gradient x activation at every site and, with ``integrated=True``, layer integrated gradients.

    ``positions``: which loss positions' loss to attribute (see :func:`chosen_labels`).
    ``result.frame()`` is the tidy per (row, site, position) table.
    """
    result = gradient_x_activation(model, batch, positions, adapter)
    if integrated:
        result.integrated, result.delta = integrated_gradients(model, batch, positions, baseline_token_id, n_steps,
                                                               adapter=adapter)
    return result


__all__ = [
    "AttributionError", "ChannelAttribution", "MLMObjective", "attribute_channels", "baseline_ids", "block_taps",
    "chosen_labels", "gradient_x_activation", "integrated_gradients", "site_hooks", "site_names",
]
