"""Sparse MLM training: the MLM head, and the last block's query side, only at the loss positions.

The MLM loss reads the logits at the loss positions (``labels != -100``) only. What the dense model
computes elsewhere in the last block and the head gets exactly zero gradient and changes no loss:

- **head** (every family whose head is position-wise, the ModernBERT "sparse prediction" trick):
  the MLM head (transform and decoder) runs on the N loss positions' hidden states, (N, H) -> (N, V),
  instead of all B * T;
- **block** (families whose adapter has ``subset_block``): the last block computes keys and values at
  every position and its query, attention output, FFN and the norms after attention at the loss
  positions only; the final norm (pre-LN families) and the head follow at those rows.

The loss (mean cross-entropy over the loss positions, as every ``*ForMaskedLM`` computes it; or an
objective's weighted, normalised loss: ``loss_weights`` (B, T), ``loss_norm`` (B,) and
``mean_over_sequences``, :func:`gradflow.losses.weighted_cross_entropy`'s value, e.g. masked
diffusion's ``1/t`` weights) and the gradient of every parameter are the dense model's (tested per
family in float32 to 1e-5). With dropout on, the dense and sparse models draw different dropout
masks (the same distribution).

    sparse = sparse_mlm(model)                       # block and head; sparse_mlm(model, block=False): head only
    loss = sparse.loss(input_ids, attention_mask, labels)
    loss = sparse.batch_loss(batch)                  # a MaskedBatch: its weights, normaliser and extra inputs too
    loss.backward()
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from gradflow.adapters import Adapter, block_modules, get_module, resolve_adapter
from gradflow.adapters.subset import select_rows
from gradflow.errors import SparseTrainingError
from gradflow.losses import weighted_reduction

IGNORE = -100
"""The label of a position outside the loss (transformers' ``ignore_index``)."""


@dataclass(frozen=True)
class SparseMLMOutput:
    """One sparse forward: ``loss`` (scalar: mean cross-entropy over the N loss positions, or the weighted loss),
    ``logits`` (N, V) and ``labels`` (N,) at the loss positions in row-major order, ``positions`` (N, 2): (row,
    position); ``weights`` (N,): each loss position's weight (None: unweighted)."""

    loss: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    weights: torch.Tensor | None = None


def weighted_loss(logits: torch.Tensor, labels: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor,
                  norm: torch.Tensor, mean_over_sequences: bool = False) -> torch.Tensor:
    """:func:`gradflow.losses.weighted_cross_entropy` (reduction ``"batch"``) from the N loss positions alone:
    ``logits`` (N, V), ``labels`` (N,), ``rows`` (N,) their sequence, ``weights`` (N,) theirs, ``norm`` (B,).

    With ``S_b`` the weighted cross-entropy sum of sequence b: ``sum_b S_b / sum_b norm_b``, or with
    ``mean_over_sequences`` ``mean_b S_b / norm_b`` over all B sequences (float32; a norm under 1 counts as 1).
    """
    per = F.cross_entropy(logits.float(), labels, reduction="none")
    sums = per.new_zeros(norm.shape[0]).index_add_(0, rows, per * weights.to(per.dtype))
    return weighted_reduction(sums, norm, "batch", mean_over_sequences)


@dataclass(frozen=True)
class LossIndex:
    """The loss positions of a batch padded per row: ``index`` (B, n) positions (slots past a row's own
    count repeat position 0), ``valid`` (B, n) bool: which slots are loss positions; n = the largest count."""

    index: torch.Tensor
    valid: torch.Tensor


class _StopAtLastBlock(Exception):
    """Raised by the patched last block to end the base model's forward once its arguments are captured."""


def loss_index(labels: torch.Tensor, attention_mask: torch.Tensor | None = None,
               width: int | None = None) -> LossIndex:
    """The per-row loss positions of ``labels`` (B, T); refuses a batch with nothing to learn. A batch where every
    real position carries loss (masked diffusion at t near 1) has nothing to skip and is computed all the same.

    ``width``: a fixed n (constant shapes from batch to batch); a row with more loss positions is refused.
    ``attention_mask`` is accepted for the callers' symmetry; padding carries no label, so it is not read.
    """
    loss_at = labels != IGNORE
    if not bool(loss_at.any()):
        raise SparseTrainingError("the batch has no loss position (every label is -100): there is no MLM loss to "
                                  "compute; skip the batch")
    counts = loss_at.sum(dim=1)
    n = int(counts.max())
    if width is not None and n > width:
        raise SparseTrainingError(f"a row has {n} loss positions, more than rows_per_sequence={width}: raise it")
    if width is not None and width > labels.shape[1]:
        raise SparseTrainingError(f"rows_per_sequence={width} exceeds the sequence length {labels.shape[1]}")
    n = n if width is None else width
    order = torch.argsort((~loss_at).to(torch.int8), dim=1, stable=True)[:, :n]  # loss positions first, in order
    valid = torch.arange(n, device=labels.device)[None, :] < counts[:, None]
    return LossIndex(torch.where(valid, order, torch.zeros_like(order)), valid)


def call_arguments(forward: Callable, args: tuple, kwargs: dict) -> dict:
    """The arguments of a call of ``forward`` (a bound method) by parameter name (``**kwargs`` merged in)."""
    signature = inspect.signature(forward)
    bound = signature.bind(*args, **kwargs).arguments
    var_kw = [p.name for p in signature.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    extra = bound.pop(var_kw[0], {}) if var_kw else {}
    return {**bound, **extra}


class SparseMLM:
    """A ``*ForMaskedLM`` trained with the sparse head (and last block): see :func:`sparse_mlm`."""

    def __init__(self, model: nn.Module, adapter: Adapter, block: bool, head: bool,
                 rows_per_sequence: int | None = None):
        self.model = model
        self.adapter = adapter
        self.block = block
        self.head = head
        self.rows_per_sequence = rows_per_sequence
        self._head = adapter.head.function(model)

    def __enter__(self) -> SparseMLM:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def last_block_call(self, **inputs: object) -> tuple[nn.Module, dict]:
        """Run the base model up to its last block application; return that block and its call's arguments.

        The block's ``forward`` is replaced for this call only (restored in ``finally``); the blocks
        before it run as in the dense model, the last one not at all. With ``Adapter.run_whole_model`` (LLaDA,
        Dream) the whole model's forward is the one interrupted: it builds what the base model takes.
        """
        blocks = block_modules(self.adapter, self.model.base_model)
        last = blocks[-1]
        path = self.adapter.subset_call or ""  # XLM: the block is a view; its "attentions" module is called
        called = get_module(last, path)
        applications = sum(get_module(b, path) is called for b in blocks)  # ALBERT applies one layer at every depth
        original = called.forward
        seen: list[dict] = []

        def forward(*args: object, **kwargs: object) -> object:
            if len(seen) + 1 < applications:
                seen.append({})
                return original(*args, **kwargs)
            seen.append(call_arguments(original, args, kwargs))
            raise _StopAtLastBlock

        called.forward = forward
        runner = self.model if self.adapter.run_whole_model else self.model.base_model
        try:
            runner(**inputs)
        except _StopAtLastBlock:
            pass
        finally:
            del called.forward
        if len(seen) != applications or not seen[-1]:
            raise SparseTrainingError(f"the last block ran {len(seen)} time(s), expected {applications}: the "
                                      "adapter's block list does not match this model's forward, or the model skipped "
                                      "blocks (layerdrop in training mode: set config.layerdrop = 0 to train sparsely)")
        return last, seen[-1]

    def hidden_at_slots(self, where: LossIndex, **inputs: object) -> torch.Tensor:
        """(B, n, H): the hidden state the head reads (after the final norm) at ``where.index``."""
        if not self.block:
            return select_rows(self.model.base_model(**inputs).last_hidden_state, where.index)
        block, call = self.last_block_call(**inputs)
        hidden = self.adapter.subset_block(block, call, where.index)
        if self.adapter.final_norm is not None:
            hidden = get_module(self.model.base_model, self.adapter.final_norm)(hidden)
        return hidden

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor, *,
                loss_weights: torch.Tensor | None = None, loss_norm: torch.Tensor | None = None,
                mean_over_sequences: bool = False, **inputs: object) -> SparseMLMOutput:
        """The MLM loss of one batch (``input_ids``, ``attention_mask``, ``labels``: (B, T); more model
        inputs, e.g. ``token_type_ids``, by name), computed sparsely.

        ``loss_weights`` (B, T) and ``loss_norm`` (B,), given together (a :class:`~gradflow.inputs.MaskedBatch`'s
        fields, e.g. masked diffusion's ``1/t`` and real-token counts), with ``mean_over_sequences``: the loss is
        :func:`gradflow.losses.weighted_cross_entropy`'s (see :func:`weighted_loss`); without them the plain mean.
        A shifted objective needs nothing more: its labels are on the loss side already (``labels[p]`` the token
        at p + 1), and the loss positions are where they are.
        """
        if labels.shape != input_ids.shape:
            raise SparseTrainingError(f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ "
                                      "in shape: give one label per token (-100 outside the loss)")
        weighted = _check_weights(labels, loss_weights, loss_norm)
        where = loss_index(labels, attention_mask, self.rows_per_sequence)
        rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(where.index)
        positions = torch.stack([rows[where.valid], where.index[where.valid]], dim=1)
        hidden = self.hidden_at_slots(where, input_ids=input_ids, attention_mask=attention_mask, **inputs)
        targets = labels[positions[:, 0], positions[:, 1]]
        weights = loss_weights[positions[:, 0], positions[:, 1]] if weighted else None
        if self.rows_per_sequence is None:  # the head at the N loss positions
            logits = self._head(hidden[where.valid])
        else:  # fixed shapes: the head at all B * width slots (the padding slots' logits are dropped)
            slot_logits = self._head(hidden.reshape(-1, hidden.shape[-1]))
            logits = slot_logits[where.valid.reshape(-1)]
        if weighted:
            loss = weighted_loss(logits, targets, positions[:, 0], weights, loss_norm, bool(mean_over_sequences))
        elif self.rows_per_sequence is None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
        else:
            slot_targets = torch.where(where.valid, labels.gather(1, where.index), IGNORE).reshape(-1)
            loss = F.cross_entropy(slot_logits, slot_targets, ignore_index=IGNORE)
        return SparseMLMOutput(loss, logits, targets, positions, weights)

    __call__ = forward

    def loss(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, labels: torch.Tensor,
             **inputs: object) -> torch.Tensor:
        """The scalar MLM loss (see :meth:`forward`; ``loss_weights``, ``loss_norm``, ``mean_over_sequences`` too)."""
        return self.forward(input_ids, attention_mask, labels, **inputs).loss

    def batch_forward(self, batch: object) -> SparseMLMOutput:
        """:meth:`forward` of a :class:`~gradflow.inputs.MaskedBatch`: its inputs, extra inputs, labels and, when
        the objective sets them, ``loss_weights``, ``loss_norm`` and ``mean_over_sequences`` (the loss is then
        ``gradflow.losses.get_loss("mlm", "batch")`` of the dense logits)."""
        weights = {"loss_weights": batch.loss_weights, "loss_norm": batch.loss_norm,
                   "mean_over_sequences": batch.mean_over_sequences} if batch.loss_weights is not None else {}
        return self.forward(batch.input_ids, batch.attention_mask, batch.labels, **weights, **batch.extra_inputs)

    def batch_loss(self, batch: object) -> torch.Tensor:
        """The scalar loss of :meth:`batch_forward`."""
        return self.batch_forward(batch).loss


def _check_weights(labels: torch.Tensor, weights: torch.Tensor | None, norm: torch.Tensor | None) -> bool:
    """True when the loss is weighted; refuses one of ``weights`` and ``norm`` without the other, or wrong shapes."""
    if weights is None and norm is None:
        return False
    if weights is None or norm is None:
        raise SparseTrainingError("give loss_weights (B, T) and loss_norm (B,) together (the weighted loss needs "
                                  "both: weighted cross-entropy sums over each sequence's normaliser), or neither")
    if weights.shape != labels.shape or norm.shape != labels.shape[:1]:
        raise SparseTrainingError(f"loss_weights {tuple(weights.shape)} and loss_norm {tuple(norm.shape)} do not "
                                  f"match labels {tuple(labels.shape)}: give (B, T) weights and one norm per sequence")
    return True


def sparse_mlm(model: nn.Module, *, block: bool = True, head: bool = True,
               adapter: Adapter | str | None = None, rows_per_sequence: int | None = None) -> SparseMLM:
    """Sparse MLM training for ``model`` (a ``*ForMaskedLM``); refuses where it would not be exact.

    ``head``: the MLM head at the loss positions only; ``block``: also the last block's query side
    (needs ``head``). Refusals (:class:`~gradflow.errors.SparseTrainingError`, with the reason): a
    head that mixes positions, a family without a sparse last block (``block=False`` still gives the
    sparse head), a model without a separate base model. Usable as a context manager.
    ``rows_per_sequence``: compute a fixed number of positions per sequence (every batch then has the
    same shapes, which keeps CPU kernel caches from growing; rows with more loss positions are refused).
    """
    adapter = resolve_adapter(model, adapter)
    if not head:
        raise SparseTrainingError("sparse_mlm needs head=True: the sparse last block computes only the loss "
                                  "positions, so the head must run there too (for a dense model, call it directly)")
    if getattr(model, "base_model", model) is model:
        raise SparseTrainingError(f"{type(model).__name__} has no separate base model: give the *ForMaskedLM model")
    if adapter.head_mixes_positions:
        raise SparseTrainingError(f"the {adapter.family} MLM head mixes positions ({adapter.head_mixes_positions}): "
                                  "computing it at the loss positions only would change the logits")
    if not block and adapter.run_whole_model:
        raise SparseTrainingError(f"sparse_mlm(model, block=False) reads the base model's last hidden state, which "
                                  f"the {adapter.family} base model does not give ({adapter.run_whole_model}): use "
                                  "block=True (the default), which stops inside the whole model's forward")
    if block and adapter.subset_block is None:
        raise SparseTrainingError(f"the sparse last block is not implemented for the {adapter.family} family yet "
                                  "(its adapter has no subset_block); use sparse_mlm(model, block=False) for the "
                                  "sparse head alone")
    if block and getattr(model.base_model, "z_steps", 0) > 1:  # DeBERTa's hand-set re-runs of the last layer
        raise SparseTrainingError(f"{type(model.base_model).__name__}.z_steps = {model.base_model.z_steps} runs the "
                                  "last layer again after the encoder, which the sparse last block leaves out: set "
                                  "z_steps = 0 or use sparse_mlm(model, block=False)")
    if rows_per_sequence is not None and rows_per_sequence < 1:
        raise SparseTrainingError(f"rows_per_sequence must be positive, got {rows_per_sequence}")
    return SparseMLM(model, adapter, block=block, head=head, rows_per_sequence=rows_per_sequence)


__all__ = ["IGNORE", "LossIndex", "SparseMLM", "SparseMLMOutput", "call_arguments", "loss_index", "sparse_mlm",
           "weighted_loss"]
