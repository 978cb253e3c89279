"""``GradAccountingCallback``: :class:`~gradflow.interventions.accounting.GradAccounting` in a Hugging Face Trainer.

Opt-in, beside (or instead of) :class:`~gradflow.interventions.callback.GradFlowCallback`: at every ``every``-th
optimizer step (and step 1) every micro-batch of the step is captured, on every rank, from the model's own forward
(roles from the batch's labels, :func:`~gradflow.interventions.callback.loss_side_roles`; ``prompt`` and ``pad`` their
own), and at ``on_pre_optimizer_step`` the parameter gradients are read (after the Trainer's clipping: pass
``max_grad_norm=0`` for the raw ones) and every sum reduced across ranks in one all-reduce, the step's only
synchronisation. The rows (:data:`~gradflow.interventions.accounting.ACCOUNTING_COLUMNS`) are the same on every rank;
the main process appends them to ``output_dir/gradflow_accounting.csv`` and logs the gradient's scale relative to the
global-token normaliser (``gradflow/gradient_scale``) and the model's gradient norm (``gradflow/accounted_grad_norm``)
through ``trainer.log`` when attached with :meth:`GradAccountingCallback.attach`. A loss normalisation that makes the
gradient scale with the accumulation steps or the world size is warned of, once, in one sentence. A Trainer that
takes the labels out of the model's inputs (``compute_loss_func``, label smoothing) is read from its batch instead:
attached, the callback sees each batch's labels in ``trainer.compute_loss`` (wrapped while training, restored after);
a logged step whose forward it cannot label is warned of, once, never dropped silently.
"""

from __future__ import annotations

import csv
import math
import warnings
from contextlib import AbstractContextManager
from pathlib import Path

from transformers import TrainerCallback

from gradflow.adapters import adapter_for
from gradflow.interventions.accounting import ACCOUNTING_COLUMNS, ACCOUNTING_FILE, AccountingConfig, GradAccounting
from gradflow.interventions.callback import GradFlowCallback, loss_side_roles


class GradAccountingCallback(TrainerCallback):
    """Gradient accounting every ``every`` steps: ``t_bins`` (edges; the batch must then carry ``t``, (B,), which is
    taken out of the model's inputs), ``sublayers`` (per-role magnitude sums), ``grad_reduction`` (``mean``: DDP and
    FSDP2 average the ranks' gradients), ``tokenizer`` (mask and special ids; default the Trainer's
    ``processing_class``), ``csv_path`` (default ``output_dir/gradflow_accounting.csv``), ``shift`` (shifted labels;
    None: the adapter's ``shifted_head``)."""

    def __init__(self, every: int = 50, *, t_bins: tuple[float, ...] = (), sublayers: bool = False,
                 grad_reduction: str = "mean", tokenizer=None, csv_path: str | Path | None = None,
                 shift: bool | None = None):
        self.config = AccountingConfig(every=every, t_bins=tuple(t_bins), sublayers=sublayers,
                                       grad_reduction=grad_reduction)
        self.tokenizer = tokenizer
        self.csv_path = Path(csv_path) if csv_path is not None else None
        self.shift = shift
        self.trainer = None
        self.accounting: GradAccounting | None = None
        self._step: AbstractContextManager | None = None
        self._micro: AbstractContextManager | None = None
        self._hook = None
        self._taken = 0
        self._write = True
        self._labels = None  # the labels of the Trainer's current batch (compute_loss's inputs), when attached
        self._own_compute_loss = None
        self._warned_unlabelled = False

    attach = classmethod(GradFlowCallback.attach.__func__)
    """Create a callback, add it to ``trainer`` and send its scalars through ``trainer.log`` (as
    :meth:`GradFlowCallback.attach`)."""

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        self.tokenizer = self.tokenizer if self.tokenizer is not None else processing_class
        self.accounting = GradAccounting(model, self.config)
        if self.shift is None:
            self.shift = bool(adapter_for(self.accounting.model).shifted_head)
        self._write = bool(state.is_world_process_zero)
        self.csv_path = self.csv_path or Path(args.output_dir) / ACCOUNTING_FILE
        if self.trainer is not None and self._own_compute_loss is None:
            self._read_labels_in(self.trainer)
        if self._write and (not self.csv_path.exists() or self.csv_path.stat().st_size == 0):
            self.csv_path.parent.mkdir(parents=True, exist_ok=True)
            with self.csv_path.open("w", newline="") as fh:
                csv.writer(fh).writerow(ACCOUNTING_COLUMNS)

    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step + 1
        if self.accounting is None or not self.accounting.is_logged(step):
            return
        self._step = self.accounting.open_step(step)
        self._step.__enter__()
        self._hook = self.accounting.model.register_forward_pre_hook(self._start_micro, with_kwargs=True)

    def _read_labels_in(self, trainer) -> None:
        """Wrap ``trainer.compute_loss`` so that each batch's labels are seen before the Trainer may take them out of
        the model's inputs (restored at the end of training)."""
        own = trainer.compute_loss
        self._own_compute_loss = (own, "compute_loss" in vars(trainer))

        def compute_loss(model, inputs, *args, **kwargs):
            self._labels = inputs.get("labels") if hasattr(inputs, "get") else None
            return own(model, inputs, *args, **kwargs)

        trainer.compute_loss = compute_loss

    def _restore_compute_loss(self) -> None:
        if self._own_compute_loss is not None and self.trainer is not None:
            own, was_set = self._own_compute_loss
            if was_set:
                self.trainer.compute_loss = own
            else:
                del self.trainer.compute_loss
        self._own_compute_loss = None

    def _start_micro(self, module, args, kwargs):
        """Each forward of a logged step: its roles from the labels (the model's inputs', else the Trainer's batch's),
        then capture it."""
        self._end_micro()
        input_ids, labels = kwargs.get("input_ids", args[0] if args else None), kwargs.get("labels")
        labels, self._labels = (labels if labels is not None else self._labels), None
        if input_ids is None or labels is None or labels.shape != input_ids.shape:
            if not self._warned_unlabelled:
                self._warned_unlabelled = True
                warnings.warn("GradAccountingCallback: a forward of a logged step came without labels matching its "
                              "input_ids, so it is not accounted; attach the callback with "
                              "GradAccountingCallback.attach(trainer) (it then reads the labels from the Trainer's "
                              "batch) or pass labels of the inputs' shape", UserWarning, stacklevel=2)
            return None
        tok = self.tokenizer
        mask_id = getattr(tok, "mask_token_id", None) if tok is not None else None
        specials = tuple(getattr(tok, "all_special_ids", ())) if tok is not None else ()
        roles = loss_side_roles(input_ids, labels, kwargs.get("attention_mask"), mask_id, specials, bool(self.shift))
        t = kwargs.pop("t", None)
        self._micro = self.accounting.micro_batch(roles, labels=labels, t=t)
        self._micro.__enter__()
        return args, kwargs

    def _end_micro(self) -> None:
        if self._micro is not None:
            micro, self._micro = self._micro, None
            micro.__exit__(None, None, None)

    def on_substep_end(self, args, state, control, **kwargs):
        self._end_micro()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self._step is None:
            return
        self._end_micro()
        self._close()

    def _close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._step is not None:
            step, self._step = self._step, None
            step.__exit__(None, None, None)

    def on_step_end(self, args, state, control, **kwargs):
        if self.accounting is None or self._taken == len(self.accounting.rows):
            return
        rows = self.accounting.rows[self._taken:]
        self._taken = len(self.accounting.rows)
        if self._write:
            with self.csv_path.open("a", newline="") as fh:
                csv.writer(fh).writerows([[r[c] for c in ACCOUNTING_COLUMNS] for r in rows])
        scalars = {f"gradflow/{r['quantity']}": r["value"] for r in rows
                   if r["group"] == "model" and r["quantity"] == "gradient_scale"}
        norms = [r["value"] for r in rows if r["quantity"] == "grad_norm"]
        if norms:
            scalars["gradflow/accounted_grad_norm"] = math.sqrt(sum(v * v for v in norms))
        if self.trainer is not None and scalars:
            pending = control.should_log
            self.trainer.log(scalars)
            control.should_log = control.should_log or pending

    def on_train_end(self, args, state, control, **kwargs):
        self._end_micro()
        self._close()
        self._restore_compute_loss()


__all__ = ["GradAccountingCallback"]
