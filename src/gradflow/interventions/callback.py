"""A ``transformers.TrainerCallback`` that logs where the gradient goes while a model trains.

Every ``every`` optimizer steps (and at step 1) it logs, per parameter group (``embeddings``, each block, ``other`` =
heads, final norms, pooler):

- ``grad_norm`` (role ``all``): L2 norm of the group's gradient for that step, **before** clipping, summed over
  gradient-accumulation micro-batches (read by post-accumulate-grad hooks installed for that step only; exact, nothing
  is recomputed);
- ``drift`` (role ``all``): ``||W - W0|| / ||W0||`` over the group's parameters after the step's update, ``W0`` being
  the weights at ``on_train_begin`` (a copy kept on the parameters' device);

and, when the batch carries MLM labels (a ``*ForMaskedLM`` model and labels shaped like ``input_ids``), per depth and
position role (masked, random, kept, context, special, pad; :mod:`gradflow.roles`), from
:class:`gradflow.hooks.recorder.GradFlowRecorder` in capture mode around that step's first micro-batch:

- ``grad_norm`` (per role): ``sqrt(sum over the block's standard sublayers of ||G_r||^2)``, the norm of role r's
  contribution to the block's weight gradient (exact per-role split);
- ``hidden_grad_mean`` / ``n_positions``: mean norm of the loss gradient w.r.t. the block's output hidden state over
  the positions of role r, and their number.

Roles come from the batch's labels (:func:`gradflow.inputs.masking.mlm_roles`: labels != -100 are selected; masked,
random or kept by the input; unselected positions special, pad or context), with the mask and special ids of the
tokenizer (argument or the Trainer's ``processing_class``); without one, random replacements count as masked and
specials as context. Shifted labels (``shift``, default: the adapter's ``shifted_head``) give a loss position its
successor input's role (:func:`loss_side_roles`); weighted losses (``1/t``) are recorded as computed. The sparse trainer
(:class:`gradflow.training.SparseMLMTrainer`) runs a logged micro-batch densely (:meth:`GradFlowCallback.capture_batch`).

Every row goes to ``gradflow_callback.csv`` (columns and quantities: :data:`gradflow.schema.CALLBACK_FIELDS`,
:data:`gradflow.schema.CALLBACK_QUANTITIES`) in the run's ``output_dir`` (only on the main process), whatever ``log``
says. ``log`` chooses the scalars that also go, per logged step, to ``trainer.log`` when attached with
:meth:`GradFlowCallback.attach` (so the console and every reporting integration get them), else to
``state.log_history``:

- ``"summary"`` (the default): the few scalars of :data:`gradflow.schema.CALLBACK_SUMMARY_SCALARS`
  (:func:`summary_scalars`: the model's gradient norm, the last block's norm, drift and context shares);
- ``"all"``: one scalar per row but ``n_positions``, ``gradflow/{group}/{quantity}[/{role}]`` (about 90 per step on a
  6-block model, 13 per block: the whole log for the reporting integrations);
- ``"none"``: nothing; the CSV only.

Step numbering: ``step`` s is the optimizer step that takes ``global_step`` from s-1 to s; its gradients were computed
with the weights after step s-1, its drift after step s. ALBERT's shared layer is one group (``blocks.0-11``): its
weight gradient is the sum over depths; the per-role rows are per depth. With fp16 mixed precision (a gradient
scaler), ``grad_norm`` includes the loss scale; bf16 and fp32 are exact. Under DDP, the hooks see this process's
gradient before the all-reduce (under FSDP2, its shard), and the rows are rank 0's: on more than one process the
callback says so in one warning; :class:`~gradflow.interventions.accounting_callback.GradAccountingCallback` reduces
across ranks."""

from __future__ import annotations

import csv
import math
import warnings
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import TrainerCallback

from gradflow.adapters import adapter_for
from gradflow.hooks.recorder import BatchRecord, GradFlowRecorder, RecorderConfig, RecorderError
from gradflow.hooks.sites import block_group_name, parse_block_group
from gradflow.inputs.masking import mlm_roles
from gradflow.interventions.accounting import parameter_groups
from gradflow.roles import LOSS_ROLES
from gradflow.schema import CALLBACK_COLUMNS, CALLBACK_FILE

CSV_NAME = CALLBACK_FILE
"""The log's file name (:data:`gradflow.schema.CALLBACK_FILE`; this alias is kept for older imports)."""
CSV_COLUMNS = CALLBACK_COLUMNS
"""The log's columns (:data:`gradflow.schema.CALLBACK_COLUMNS`; this alias is kept for older imports)."""
EMBEDDINGS_GROUP = "embeddings"
"""The parameter group of the embeddings (blocks are named by :func:`block_group_name`)."""
LOG_MODES = ("summary", "all", "none")
"""``log``: what reaches ``trainer.log``: the summary scalars (the default), a scalar per row, nothing."""


@dataclass
class _Group:
    """A named set of parameters (deduplicated across groups: tied weights count once)."""

    name: str
    params: list[nn.Parameter]
    initial: list[torch.Tensor] | None = None


class GradFlowCallback(TrainerCallback):
    """Per-block gradient norms (per role for MLM batches) and weight drift, every ``every`` steps.

    ``roles``: ``"auto"`` (per-role rows for MLM batches), ``"off"``; ``sublayers``: the per-role weight-gradient split
    (``False`` keeps only the cheaper hidden-state rows); ``csv_path``: default ``output_dir/gradflow_callback.csv``;
    ``tokenizer``: for mask and special ids (default: the Trainer's ``processing_class``); ``log``: the scalars sent to
    ``trainer.log`` (:data:`LOG_MODES`: ``"summary"``, ``"all"``, ``"none"``; the CSV gets every row in each);
    ``shift``: the labels are shifted (logits at p predict p + 1; None: the adapter's ``shifted_head``).
    """

    def __init__(self, every: int = 50, *, roles: str = "auto", sublayers: bool = True, drift: bool = True,
                 csv_path: str | Path | None = None, tokenizer=None, log_first_step: bool = True,
                 log: str = "summary", shift: bool | None = None):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if roles not in ("auto", "off"):
            raise ValueError(f"roles must be 'auto' or 'off', got {roles!r}")
        if log not in LOG_MODES:
            raise ValueError(f"log must be one of {', '.join(map(repr, LOG_MODES))}, got {log!r}")
        self.log = log
        self.every = every
        self.roles = roles
        self.sublayers = sublayers
        self.drift = drift
        self.csv_path = Path(csv_path) if csv_path is not None else None
        self.tokenizer = tokenizer
        self.log_first_step = log_first_step
        self.shift = shift
        self.trainer = None
        self.rows: list[dict] = []  # every row logged in this process (also written to the CSV)
        self._groups: list[_Group] = []
        self._hooks: list = []
        self._sq: dict[int, torch.Tensor] = {}
        self._grad_rows: list[dict] = []
        self._recorder: GradFlowRecorder | None = None
        self._capture: AbstractContextManager | None = None
        self._record: BatchRecord | None = None
        self._active_step: int | None = None
        self._write = True

    @classmethod
    def attach(cls, trainer, every: int = 50, **kwargs) -> "GradFlowCallback":
        """Create a callback, add it to ``trainer`` and send its scalars (``log=``) through ``trainer.log``."""
        callback = cls(every, **kwargs)
        callback.trainer = trainer
        trainer.add_callback(callback)
        return callback

    # ------------------------------------------------------------------ set-up
    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        self.tokenizer = self.tokenizer if self.tokenizer is not None else processing_class
        self._groups = _param_groups(model)
        if self.drift:
            for group in self._groups:
                group.initial = [p.detach().clone() for p in group.params]
        self._write = bool(state.is_world_process_zero)
        if self._write and int(getattr(args, "world_size", 1) or 1) > 1:
            warnings.warn(f"GradFlowCallback on {args.world_size} processes logs rank 0's own numbers (its gradient "
                          "before DDP's all-reduce or its FSDP2 shard, its first micro-batch's roles): for statistics "
                          "reduced across ranks add GradAccountingCallback (docs/guides/many-devices.md)", stacklevel=2)
        if self.csv_path is None:
            self.csv_path = Path(args.output_dir) / CALLBACK_FILE
        if self._write:
            self.csv_path.parent.mkdir(parents=True, exist_ok=True)
            if not self.csv_path.exists() or self.csv_path.stat().st_size == 0:
                with self.csv_path.open("w", newline="") as fh:
                    csv.writer(fh).writerow(CALLBACK_COLUMNS)

    def _is_logged(self, step: int) -> bool:
        return step % self.every == 0 or (self.log_first_step and step == 1)

    # ------------------------------------------------------------------ arm and disarm
    def on_step_begin(self, args, state, control, model=None, **kwargs):
        step = state.global_step + 1
        if not self._is_logged(step):
            return
        self._active_step, self._sq = step, {}
        for group in self._groups:
            for p in group.params:
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook))
        if self.roles == "auto" and _is_mlm_model(model):
            self.shift = bool(adapter_for(model).shifted_head) if self.shift is None else self.shift
            self._arm_recorder(model)

    def _grad_hook(self, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._sq[id(param)] = param.grad.detach().float().pow(2).sum()

    def _arm_recorder(self, model: nn.Module) -> None:
        try:
            with warnings.catch_warnings():  # transformers 5 deprecates is_gradient_checkpointing (read by the recorder)
                warnings.simplefilter("ignore", FutureWarning)
                self._recorder = GradFlowRecorder(model, RecorderConfig(sublayers=self.sublayers)).__enter__()
        except RecorderError as err:
            warnings.warn(f"GradFlowCallback: no per-role rows this step: {err}", stacklevel=2)
            self._recorder = None
            return
        self._hooks.append(model.register_forward_pre_hook(self._start_capture, with_kwargs=True))

    @property
    def wants_batch(self) -> bool:
        """This step's recorder is armed and waits for its micro-batch (the sparse trainer then runs it densely)."""
        return self._recorder is not None and self._capture is None and self._record is None

    def capture_batch(self, input_ids: torch.Tensor, labels: torch.Tensor,
                      attention_mask: torch.Tensor | None = None) -> bool:
        """Capture the next forward and backward with this batch's roles; False if not armed or not MLM labels."""
        if not self.wants_batch or labels is None or input_ids is None or labels.shape != input_ids.shape:
            return False
        tok = self.tokenizer
        mask_id = getattr(tok, "mask_token_id", None) if tok is not None else None
        specials = tuple(getattr(tok, "all_special_ids", ())) if tok is not None else ()
        roles = loss_side_roles(input_ids, labels, attention_mask, mask_id, specials, bool(self.shift))
        self._capture = self._recorder.capture(roles)
        self._capture.__enter__()
        return True

    def _start_capture(self, module, args, kwargs):
        """On the first forward of the logged step: derive roles and start capturing."""
        self.capture_batch(kwargs.get("input_ids", args[0] if args else None), kwargs.get("labels"),
                           kwargs.get("attention_mask"))

    def _finish_capture(self) -> None:
        """After the first micro-batch's backward: keep its record and remove the recorder."""
        if self._capture is not None:
            self._capture.__exit__(None, None, None)
            self._capture = None
            try:
                self._record = self._recorder.result()
            except RecorderError as err:
                warnings.warn(f"GradFlowCallback: no per-role rows this step: {err}", stacklevel=2)
        if self._recorder is not None:
            self._recorder.__exit__(None, None, None)
            self._recorder = None

    def on_substep_end(self, args, state, control, **kwargs):
        if self._active_step is not None:
            self._finish_capture()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._active_step is None:
            return
        self._finish_capture()
        self._remove_hooks()
        self._grad_rows = [self._row(g.name, "all", "grad_norm", self._group_grad_norm(g)) for g in self._groups]

    def _group_grad_norm(self, group: _Group) -> float:
        parts = [self._sq[id(p)] for p in group.params if id(p) in self._sq]
        return math.sqrt(float(torch.stack(parts).sum())) if parts else 0.0

    # ------------------------------------------------------------------ logging
    def on_step_end(self, args, state, control, **kwargs):
        if self._active_step is None:
            return
        rows = list(self._grad_rows)
        if self.drift:
            rows += [self._row(g.name, "all", "drift", _drift(g)) for g in self._groups]
        if self._record is not None:
            rows += self._role_rows(self._record)
        self._record, self._grad_rows, self._active_step = None, [], None
        # trainer.log() clears control.should_log (CallbackHandler.on_log): keep the Trainer's pending log (its loss)
        pending_log = control.should_log
        self._emit(rows, state)
        control.should_log = control.should_log or pending_log
        if self.trainer is not None:
            self.trainer.control.should_log = self.trainer.control.should_log or pending_log

    def on_train_end(self, args, state, control, **kwargs):
        self._finish_capture()
        self._remove_hooks()

    def _remove_hooks(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    def _row(self, group: str, role: str, quantity: str, value: float) -> dict:
        return {"step": self._active_step, "group": group, "role": role, "quantity": quantity, "value": value}

    def _role_rows(self, record: BatchRecord) -> list[dict]:
        rows = []
        if self.sublayers and record.sublayers:
            frame = record.sublayer_frame()
            frame = frame.assign(sq=frame["contribution_norm"] ** 2).groupby(["layer", "role"], sort=True)["sq"].sum()
            for (layer, role), sq in frame.items():
                rows.append(self._row(block_group_name(layer - 1), role, "grad_norm", math.sqrt(float(sq))))
        sites = record.site_frame()
        sites = sites[sites["point"] == "out"]
        for site in sites.itertuples(index=False):
            group = EMBEDDINGS_GROUP if site.layer == 0 else block_group_name(site.layer - 1)
            rows.append(self._row(group, site.role, "hidden_grad_mean", site.grad_norm_mean))
            rows.append(self._row(group, site.role, "n_positions", float(site.n_positions)))
        return rows

    def _emit(self, rows: list[dict], state) -> None:
        self.rows.extend(rows)
        if self._write and self.csv_path is not None:
            with self.csv_path.open("a", newline="") as fh:
                csv.writer(fh).writerows([[r[c] for c in CALLBACK_COLUMNS] for r in rows])
        if self.log == "summary":
            scalars = summary_scalars(rows)
        else:  # "all"; "none" logs nothing
            scalars = {_scalar_name(r): r["value"] for r in rows if r["quantity"] != "n_positions"}
        if not scalars or self.log == "none":
            return
        if self.trainer is not None:
            self.trainer.log(scalars)
        else:
            state.log_history.append({**scalars, "step": state.global_step})


# ---------------------------------------------------------------------------------------- summary
def summary_scalars(rows: list[dict]) -> dict[str, float]:
    """The scalars of :data:`gradflow.schema.CALLBACK_SUMMARY_SCALARS` from one logged step's rows.

    ``rows``: dicts with the log's columns, all of one step (``callback.rows`` or the CSV's rows of that step:
    ``frame[frame.step == s].to_dict("records")``). The last block is the deepest block group (role ``all``: ALBERT's
    shared ``blocks.0-11``) and, for the per-role scalars, the deepest ``blocks.{i}`` with per-role rows; the loss
    positions are masked, random and kept.

    - ``gradflow/grad_norm``: ``sqrt(sum over groups of grad_norm^2)``, the whole model's norm;
    - ``gradflow/last_block/grad_norm``, ``gradflow/last_block/drift``: the last block group's rows;
    - ``gradflow/last_block/context_share``: ``n * hidden_grad_mean`` of context over its sum over roles (the share of
      the summed per-position hidden-state gradient norms: 0 under MLM);
    - ``gradflow/last_block/context_weight_share``: context's ``grad_norm^2`` over its sum over roles;
    - ``gradflow/{last_block,block_before_last}/context_loss_ratio``: ``hidden_grad_mean`` at context over the loss
      positions' mean (their means weighted by ``n_positions``).

    A scalar whose rows are missing (``roles="off"``, ``drift=False``, ``sublayers=False``, a batch without MLM labels,
    a one-block model) or whose denominator is 0 is left out.
    """
    out: dict[str, float] = {}
    whole = [r for r in rows if r["role"] == "all"]
    norms = [float(r["value"]) for r in whole if r["quantity"] == "grad_norm"]
    if norms:
        out["gradflow/grad_norm"] = math.sqrt(sum(v * v for v in norms))
    last_group = _deepest(r["group"] for r in whole)
    for quantity in ("grad_norm", "drift"):
        values = [float(r["value"]) for r in whole if r["group"] == last_group and r["quantity"] == quantity]
        if values:
            out[f"gradflow/last_block/{quantity}"] = values[0]
    per_role = [r for r in rows if r["role"] != "all"]
    last = _deepest(r["group"] for r in per_role)
    if last is None:
        return out
    depth = parse_block_group(last)[1]
    hidden, count = _per_role(per_role, last, "hidden_grad_mean"), _per_role(per_role, last, "n_positions")
    weight = {role: v * v for role, v in _per_role(per_role, last, "grad_norm").items()}
    mass = {role: m * count.get(role, 0.0) for role, m in hidden.items()}
    for name, parts in (("context_share", mass), ("context_weight_share", weight)):
        if "context" in parts and sum(parts.values()) > 0:
            out[f"gradflow/last_block/{name}"] = parts["context"] / sum(parts.values())
    groups = (("last_block", last), ("block_before_last", block_group_name(depth - 1) if depth > 0 else None))
    for label, group in groups:
        ratio = _context_loss_ratio(_per_role(per_role, group, "hidden_grad_mean"),
                                    _per_role(per_role, group, "n_positions"))
        if ratio is not None:
            out[f"gradflow/{label}/context_loss_ratio"] = ratio
    return out


def _deepest(groups) -> str | None:
    """The block group of the greatest (last) depth among ``groups`` (others: embeddings, other); None without one."""
    blocks = {}
    for group in set(groups):
        try:
            blocks[group] = parse_block_group(group)[1]
        except ValueError:
            continue
    return max(blocks, key=blocks.get) if blocks else None


def _per_role(rows: list[dict], group: str | None, quantity: str) -> dict[str, float]:
    return {r["role"]: float(r["value"]) for r in rows if r["group"] == group and r["quantity"] == quantity}


def _context_loss_ratio(hidden: dict[str, float], count: dict[str, float]) -> float | None:
    loss_n = sum(count.get(role, 0.0) for role in LOSS_ROLES if role in hidden)
    loss_sum = sum(hidden[role] * count.get(role, 0.0) for role in LOSS_ROLES if role in hidden)
    if count.get("context", 0.0) <= 0 or "context" not in hidden or loss_n <= 0 or loss_sum <= 0:
        return None
    return hidden["context"] / (loss_sum / loss_n)


# ---------------------------------------------------------------------------------------- helpers
def _scalar_name(row: dict) -> str:
    role = "" if row["role"] == "all" else f"/{row['role']}"
    return f"gradflow/{row['group']}/{row['quantity']}{role}"


def loss_side_roles(input_ids: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None,
                    mask_token_id: int | None, special_ids: tuple[int, ...], shift: bool) -> torch.Tensor:
    """:func:`mlm_roles`; under ``shift`` (``labels[p]``: token p + 1) the roles ``shift_to_loss_side`` gives."""
    if not shift:
        return mlm_roles(input_ids, labels, attention_mask, mask_token_id, special_ids)
    own = mlm_roles(input_ids, torch.full_like(labels, -100), attention_mask, None,  # a lone mask token: context
                    tuple(i for i in special_ids if i != mask_token_id))
    successor = torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)  # the loss position's input role
    return torch.where(labels != -100, mlm_roles(successor, labels, None, mask_token_id, ()), own)


def _is_mlm_model(model: nn.Module | None) -> bool:
    """A ``*ForMaskedLM``, or output embeddings (LLaDA's ``LLaDAModelLM``, Dream's ``DreamModel``; no classifier)."""
    output = getattr(model, "get_output_embeddings", None)
    return model is not None and ("MaskedLM" in type(model).__name__ or (callable(output) and output() is not None))


def _param_groups(model: nn.Module) -> list[_Group]:
    """``embeddings``, one group per distinct block module (in call order), then ``other``: the accounting's
    :func:`~gradflow.interventions.accounting.parameter_groups`, with room for the drift's initial weights."""
    return [_Group(group.name, group.params) for group in parameter_groups(model)]


def _drift(group: _Group) -> float:
    """``||W - W0|| / ||W0||`` over the group's parameters."""
    if not group.initial:
        return float("nan")
    with torch.no_grad():
        diff = torch.stack([(p.detach().float() - w0.float()).pow(2).sum() for p, w0 in zip(group.params, group.initial)])
        ref = torch.stack([w0.float().pow(2).sum() for w0 in group.initial])
        diff, ref = float(diff.sum()), float(ref.sum())
    return math.sqrt(diff) / math.sqrt(ref) if ref > 0 else float("nan")


__all__ = ["CSV_COLUMNS", "CSV_NAME", "LOG_MODES", "GradFlowCallback", "loss_side_roles",
           "mlm_roles", "summary_scalars"]  # mlm_roles: for older imports
