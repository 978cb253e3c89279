"""A plain-training-loop probe: a model's training state measured on one probe batch, leaving no trace.

``training_snapshot(model, input_ids, labels)`` runs one forward and backward of the loss on a fixed probe batch
(roles as :class:`~gradflow.interventions.callback.GradFlowCallback` derives them) and one ``torch.no_grad()``
forward with ``output_hidden_states`` (and ``output_attentions``), and returns a :class:`TrainingSnapshot` of Python
floats:

- per layer (0 = embeddings output, 1..L = block outputs) and role, the mean norm of the loss gradient w.r.t. the
  hidden state, and the context / loss-position ratio of those means (:func:`context_loss_ratio`);
- per layer, representation collapse: the mean cosine similarity of the hidden states of pairs of real positions of
  one sequence that hold different input tokens (:func:`pair_collapse`);
- per block, the attention entropy over keys and its uniform reference ``log(n real keys)`` (:func:`attention_entropy`);
- the Frobenius norms of the word-embedding matrix's gradient, split by the role of the position that looked the row
  up (:func:`embedding_role_gradients`), the output projection's part and the whole.

Nothing is left behind: parameters' ``.grad`` are never written (``torch.autograd.grad``) and are re-assigned as they
were, every module's ``training`` flag is restored (the probe runs in eval mode: no dropout, so two calls agree), and
every hook is removed, also on exceptions. No optimizer step is taken. Call it every N steps of your own loop and
``append_csv`` the result: its rows have the callback log's columns (:data:`gradflow.schema.CALLBACK_COLUMNS`).
"""

from __future__ import annotations

import csv
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gradflow.adapters import adapter_for
from gradflow.errors import UsageError
from gradflow.hooks.recorder import BatchRecord, GradFlowRecorder, RecorderConfig
from gradflow.hooks.sites import block_group_name, model_device
from gradflow.interventions.callback import EMBEDDINGS_GROUP, loss_side_roles
from gradflow.roles import LOSS_ROLES, TOKEN_ROLES, Role, role_code
from gradflow.schema import CALLBACK_COLUMNS

LossFn = Callable[[nn.Module, torch.Tensor, "torch.Tensor | None", torch.Tensor], torch.Tensor]
"""``loss_fn(model, input_ids, attention_mask, labels) -> scalar tensor`` (e.g. masked diffusion's 1/t weighting)."""
WORD_EMBEDDINGS_GROUP = "embeddings.word"
"""The group of the ``embedding_grad_norm`` rows (the word-embedding matrix)."""
MODEL_GROUP = "model"
"""The group of the ``loss`` row."""
EMBEDDING_KEYS: tuple[str, ...] = (*TOKEN_ROLES, "input", "output", "all", "tied")
"""The keys of :attr:`TrainingSnapshot.embedding_grad`, in order."""


@dataclass(frozen=True)
class TrainingSnapshot:
    """One probe batch's measurements at optimizer step ``step`` (every value a Python float).

    ``layers``: 0 = embeddings output, 1..L = block outputs. ``hidden_grad_mean``: role -> per layer mean
    ``||dL/dh||`` over the role's positions (every role of :data:`TOKEN_ROLES`; nan where it has no position).
    ``context_loss_ratio``: per layer, the context mean over the loss positions' mean (masked, random, kept pooled);
    nan if either is empty. ``collapse``: per layer, mean cosine similarity (in [-1, 1]; 1 = parallel states).
    ``attention_entropy`` / ``attention_entropy_max``: per block (L values, nats; empty with ``attention=False``).
    ``embedding_grad``: Frobenius norms (the loss's units per embedding unit) keyed by :data:`EMBEDDING_KEYS`:
    one per position role (input side, that role's lookups), ``input`` (all lookups), ``output`` (the output
    projection's weight gradient; tied weights: the part not from the lookups), ``all`` (the input matrix's whole
    gradient; nan where a weight is frozen), ``tied`` (1.0 or 0.0).
    """

    step: int
    loss: float
    layers: tuple[int, ...]
    hidden_grad_mean: dict[str, tuple[float, ...]]
    context_loss_ratio: tuple[float, ...]
    collapse: tuple[float, ...]
    attention_entropy: tuple[float, ...]
    attention_entropy_max: tuple[float, ...]
    embedding_grad: dict[str, float]

    def rows(self) -> list[dict]:
        """Tidy rows with the callback log's columns: ``loss`` (group ``model``); per layer ``hidden_grad_mean``
        (per role present in the batch), ``context_loss_ratio`` and ``collapse`` (role ``all``), per block
        ``attention_entropy`` and ``attention_entropy_max``; ``embedding_grad_norm`` (group ``embeddings.word``, role =
        the :attr:`embedding_grad` key). Groups: ``embeddings`` for layer 0, ``blocks.{layer - 1}`` for blocks."""
        rows = [self._row(MODEL_GROUP, "all", "loss", self.loss)]
        present = {role: values for role, values in self.hidden_grad_mean.items()
                   if not all(math.isnan(v) for v in values)}
        for i, layer in enumerate(self.layers):
            group = EMBEDDINGS_GROUP if layer == 0 else block_group_name(layer - 1)
            rows += [self._row(group, role, "hidden_grad_mean", values[i]) for role, values in present.items()]
            rows.append(self._row(group, "all", "context_loss_ratio", self.context_loss_ratio[i]))
            rows.append(self._row(group, "all", "collapse", self.collapse[i]))
            if layer > 0 and self.attention_entropy:
                rows.append(self._row(group, "all", "attention_entropy", self.attention_entropy[layer - 1]))
                rows.append(self._row(group, "all", "attention_entropy_max", self.attention_entropy_max[layer - 1]))
        rows += [self._row(WORD_EMBEDDINGS_GROUP, key, "embedding_grad_norm", value)
                 for key, value in self.embedding_grad.items()]
        return rows

    def append_csv(self, path: str | Path) -> None:
        """Append :meth:`rows` to the CSV at ``path`` (the header first when the file is new or empty)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists() or path.stat().st_size == 0
        with path.open("a", newline="") as fh:
            writer = csv.writer(fh)
            if new:
                writer.writerow(CALLBACK_COLUMNS)
            writer.writerows([[row[c] for c in CALLBACK_COLUMNS] for row in self.rows()])

    def _row(self, group: str, role: str, quantity: str, value: float) -> dict:
        return {"step": self.step, "group": group, "role": role, "quantity": quantity, "value": float(value)}


def training_snapshot(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, *, tokenizer=None, loss_fn: LossFn | None = None,
                      step: int = 0, attention: bool = True, shift: bool | None = None) -> TrainingSnapshot:
    """Measure ``model``'s training state on one probe batch (see the module docstring); leaves no trace.

    ``input_ids``, ``labels``, ``attention_mask``: (B, T) long; labels -100 outside the loss. ``tokenizer``: for the
    mask and special ids of the roles (without one, random replacements count as masked, specials as context).
    ``loss_fn(model, input_ids, attention_mask, labels)``: a scalar (default: the model's own ``.loss`` with
    ``labels``). ``step``: written into the rows. ``attention``: also the attention entropies (needs
    ``attn_implementation="eager"``). ``shift``: labels at p are token p + 1 (None: the adapter's ``shifted_head``).
    Raises :class:`~gradflow.errors.UsageError` (a ``ValueError``) on unusable inputs or a model without attentions.
    """
    embeddings = _check_inputs(model, input_ids, labels, attention_mask)
    device = model_device(model)
    input_ids, labels = input_ids.to(device), labels.to(device)
    attention_mask = attention_mask.to(device) if attention_mask is not None else None
    shift = bool(adapter_for(model).shifted_head) if shift is None else shift
    mask_id = getattr(tokenizer, "mask_token_id", None) if tokenizer is not None else None
    specials = tuple(getattr(tokenizer, "all_special_ids", ())) if tokenizer is not None else ()
    roles = loss_side_roles(input_ids, labels, attention_mask, mask_id, specials, shift)
    loss_fn = loss_fn if loss_fn is not None else _model_loss
    modes = [(module, module.training) for module in model.modules()]
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        model.eval()
        loss, record, embedding_grad = _backward(model, embeddings, input_ids, labels, attention_mask, roles, loss_fn)
        with torch.no_grad():
            out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                        **({"output_attentions": True} if attention else {}))
        hidden, attentions = out.hidden_states, (out.attentions if attention else ())
        del out
    finally:
        for module, mode in modes:
            module.training = mode
        for p, grad in grads:
            p.grad = grad
    layers, hidden_grad_mean, ratio = _hidden_grads(record)
    if hidden is None or len(hidden) != len(layers):
        raise UsageError(f"the model returned {0 if hidden is None else len(hidden)} hidden states for "
                         f"{len(layers)} recorded layers (embeddings + blocks): it cannot be probed for collapse")
    real = (roles != Role.SPECIAL) & (roles != Role.PAD)
    t = input_ids.shape[1]
    collapse = tuple(pair_collapse(h[:, :t], input_ids, real) for h in hidden)
    entropy, entropy_max = (), ()
    if attention:
        if attentions is None or len(attentions) != len(layers) - 1 or any(a is None for a in attentions):
            raise UsageError("the model returned no attention probabilities (an SDPA or flash implementation "
                             "computes none): load it with attn_implementation=\"eager\" (or call "
                             "model.set_attn_implementation(\"eager\")), or pass attention=False")
        keys = attention_mask != 0 if attention_mask is not None else torch.ones_like(input_ids, dtype=torch.bool)
        pairs = [attention_entropy(a[:, :, :t, :t], keys) for a in attentions]
        entropy, entropy_max = tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
    return TrainingSnapshot(step, loss, layers, hidden_grad_mean, ratio, collapse, entropy, entropy_max,
                            embedding_grad)


# ---------------------------------------------------------------------------------------- the gradient part
def _model_loss(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def _backward(model: nn.Module, embeddings: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
              attention_mask: torch.Tensor | None, roles: torch.Tensor,
              loss_fn: LossFn) -> tuple[float, BatchRecord, dict[str, float]]:
    """One forward and ``torch.autograd.grad`` under the recorder (site norms only) with the word embeddings'
    outputs kept: (loss, record, embedding norms)."""
    looked_up: list[torch.Tensor] = []

    def keep(module: nn.Module, args: tuple, output: object) -> None:
        if isinstance(output, torch.Tensor) and output.shape[:2] == input_ids.shape:
            if not output.requires_grad:  # frozen embeddings: still let the gradient reach the lookups
                output.requires_grad_(True)
            looked_up.append(output)

    weight_in = embeddings.weight
    output_module = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    weight_out = getattr(output_module, "weight", None)
    tied = weight_out is weight_in
    with warnings.catch_warnings():  # transformers 5 deprecates is_gradient_checkpointing (read by the recorder)
        warnings.simplefilter("ignore", FutureWarning)
        recorder = GradFlowRecorder(model, RecorderConfig(sublayers=False)).__enter__()
    try:
        handle = embeddings.register_forward_hook(keep)
        try:
            with recorder.capture(roles), torch.enable_grad():
                value = loss_fn(model, input_ids, attention_mask, labels)
                if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.requires_grad:
                    raise UsageError("loss_fn must return a scalar tensor that requires grad (got "
                                     f"{type(value).__name__}): compute it from the model's output")
                if not looked_up:
                    raise UsageError("the model never called its input embeddings on the (B, T) input_ids: "
                                     "pass input_ids (not inputs_embeds) to the model in loss_fn")
                weights = [w if w is not None and w.requires_grad else None
                           for w in (weight_in, None if tied else weight_out)]
                targets = [*looked_up, *(w for w in weights if w is not None)]
                found = list(torch.autograd.grad(value, targets, allow_unused=True))
                loss = float(value.detach())
                del value
        finally:
            handle.remove()
        record = recorder.result()
    finally:
        recorder.__exit__(None, None, None)
    g_lookups = [g if g is not None else torch.zeros_like(o) for g, o in zip(found, looked_up)]
    g_weights = iter(found[len(looked_up):])
    g_in, g_out = (next(g_weights) if w is not None else None for w in weights)
    return loss, record, _embedding_norms(g_lookups, input_ids, roles, embeddings, g_in, g_out, tied)


def _embedding_norms(g_lookups: list[torch.Tensor], input_ids: torch.Tensor, roles: torch.Tensor,
                     embeddings: nn.Module, g_in: torch.Tensor | None, g_out: torch.Tensor | None,
                     tied: bool) -> dict[str, float]:
    vocab = embeddings.weight.shape[0]
    padding_idx = getattr(embeddings, "padding_idx", None)
    norms = {}
    for role in TOKEN_ROLES:
        matrix = sum(embedding_role_gradients(g, input_ids, roles, vocab, padding_idx, (role,))[role]
                     for g in g_lookups)
        norms[role] = float(torch.linalg.vector_norm(matrix))
        del matrix
    lookups = sum(embedding_role_gradients(g, input_ids, None, vocab, padding_idx)["input"] for g in g_lookups)
    norms["input"] = float(torch.linalg.vector_norm(lookups))
    norms["all"] = float(torch.linalg.vector_norm(g_in)) if g_in is not None else math.nan
    if tied:
        norms["output"] = float(torch.linalg.vector_norm(g_in.float() - lookups)) if g_in is not None else math.nan
    else:
        norms["output"] = float(torch.linalg.vector_norm(g_out)) if g_out is not None else math.nan
    norms["tied"] = 1.0 if tied else 0.0
    return {key: norms[key] for key in EMBEDDING_KEYS}


def embedding_role_gradients(grad: torch.Tensor, input_ids: torch.Tensor, roles: torch.Tensor | None,
                             vocab_size: int, padding_idx: int | None = None,
                             which: tuple[str, ...] = TOKEN_ROLES) -> dict[str, torch.Tensor]:
    """The word-embedding matrix's gradient from the lookups of each role: ``G_r = index_add`` of the (B, T, E)
    gradient ``grad`` w.r.t. the lookups into (V, E) float32 rows by token id, over role r's positions.

    ``roles``: (B, T) role codes, or None for one matrix over every position (key ``"input"``). Positions holding
    ``padding_idx`` are left out (``nn.Embedding`` gives that row no gradient). The matrices of all roles sum to
    the ``"input"`` one: the lookups' part of the matrix's gradient.
    """
    ids = input_ids.reshape(-1)
    flat = grad.reshape(ids.shape[0], -1).float()
    keep = ids != padding_idx if padding_idx is not None else torch.ones_like(ids, dtype=torch.bool)
    selections = {"input": keep} if roles is None else \
        {role: keep & (roles.reshape(-1).long() == role_code(role)) for role in which}
    return {name: torch.zeros(vocab_size, flat.shape[1], dtype=torch.float32, device=flat.device)
            .index_add_(0, ids[sel], flat[sel]) for name, sel in selections.items()}


def _hidden_grads(record: BatchRecord) -> tuple[tuple[int, ...], dict[str, tuple[float, ...]], tuple[float, ...]]:
    """(layers, role -> per layer mean ||dL/dh||, per layer context / loss ratio) from the record's ``out`` sites."""
    outs = sorted((layer, s) for s, (layer, point) in enumerate(zip(record.site_layers, record.site_points))
                  if point == "out")
    roles = record.roles.long()
    means: dict[str, list[float]] = {role: [] for role in TOKEN_ROLES}
    ratios = []
    loss_sel = torch.zeros_like(roles, dtype=torch.bool)
    for role in LOSS_ROLES:
        loss_sel |= roles == role_code(role)
    for _, s in outs:
        grad = record.grad_norm[s].double()
        for role in TOKEN_ROLES:
            means[role].append(_mean(grad, roles == role_code(role)))
        ratios.append(context_loss_ratio(grad, roles == role_code("context"), loss_sel))
    return tuple(layer for layer, _ in outs), {role: tuple(v) for role, v in means.items()}, tuple(ratios)


def _mean(values: torch.Tensor, sel: torch.Tensor) -> float:
    return float(values[sel].mean()) if bool(sel.any()) else math.nan


def context_loss_ratio(grad_norm: torch.Tensor, context: torch.Tensor, loss: torch.Tensor) -> float:
    """Mean of the (B, T) ``grad_norm`` over the ``context`` positions over its mean over the ``loss`` positions
    (boolean (B, T) masks); nan if either set is empty or the loss positions' mean is 0."""
    num, den = _mean(grad_norm, context), _mean(grad_norm, loss)
    return num / den if den and not math.isnan(num) else math.nan


# ---------------------------------------------------------------------------------------- the forward part
def pair_collapse(hidden: torch.Tensor, input_ids: torch.Tensor, real: torch.Tensor) -> float:
    """Mean cosine similarity (float64) of the hidden states (B, T, H) of every pair of distinct positions of one
    sequence that hold different input ids, both ``real`` ((B, T) bool: neither special nor pad); pooled over the
    batch's pairs. 1 when all states are parallel (collapse); nan without a pair."""
    unit = torch.nn.functional.normalize(hidden.double(), dim=-1)
    cosine = unit @ unit.transpose(1, 2)
    pairs = real[:, :, None] & real[:, None, :] & (input_ids[:, :, None] != input_ids[:, None, :])
    n = int(pairs.sum())
    return float(cosine[pairs].sum() / n) if n else math.nan


def attention_entropy(probs: torch.Tensor, keys: torch.Tensor) -> tuple[float, float]:
    """(mean entropy, mean ``log(n real keys)``) in nats of the attention probabilities (B, heads, T, T) over the
    heads and the real query positions; ``keys``: (B, T) bool, the real (not padding) positions."""
    entropy = -torch.special.xlogy(probs.double(), probs.double()).sum(-1)  # (B, heads, T)
    sel = keys[:, None, :].expand_as(entropy)
    uniform = keys.sum(-1).double().log()[:, None, None].expand_as(entropy)
    return float(entropy[sel].mean()), float(uniform[sel].mean())


def _check_inputs(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                  attention_mask: torch.Tensor | None) -> nn.Module:
    """The model's input embeddings, after checking the batch; UsageError saying what to fix otherwise."""
    if input_ids.dim() != 2:
        raise UsageError(f"input_ids must be (B, T), got shape {tuple(input_ids.shape)}: add a batch dimension")
    if labels.shape != input_ids.shape:
        raise UsageError(f"labels have shape {tuple(labels.shape)} but input_ids {tuple(input_ids.shape)}: pass MLM "
                         "labels shaped like input_ids (the target id at loss positions, -100 elsewhere)")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise UsageError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids "
                         f"{tuple(input_ids.shape)}: pass the batch's own (B, T) mask or None")
    if not bool((labels != -100).any()):
        raise UsageError("labels hold no loss position (every label is -100): mask the probe batch first, e.g. with "
                         "gradflow.mask_batch or a DataCollatorForLanguageModeling, and keep at least one label")
    getter = getattr(model, "get_input_embeddings", None)
    try:
        embeddings = getter() if callable(getter) else None
    except NotImplementedError:
        embeddings = None
    if not isinstance(embeddings, nn.Module) or getattr(getattr(embeddings, "weight", None), "dim", lambda: 0)() != 2:
        raise UsageError(f"{type(model).__name__} has no input embeddings with a (V, E) weight "
                         "(get_input_embeddings()): pass a transformers masked LM, e.g. *ForMaskedLM")
    return embeddings


__all__ = ["EMBEDDING_KEYS", "LossFn", "MODEL_GROUP", "TrainingSnapshot", "WORD_EMBEDDINGS_GROUP",
           "attention_entropy", "context_loss_ratio", "embedding_role_gradients", "pair_collapse",
           "training_snapshot"]
