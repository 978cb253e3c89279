"""Where the gradient of new vocabulary rows comes from: the input side by role, the output side by role.

A vocabulary row ``v`` (after :func:`gradflow.interventions.vocabulary.extend_vocabulary`) gets
gradient from two places, whose sum is the row's weight gradient when the decoder is tied to the
input embeddings (and each is the gradient of its own matrix when not):

- **input side**: every position whose input token is ``v`` sends ``dL/de`` (H,), the gradient
  w.r.t. the embedding lookup's output there. A selected-and-masked occurrence reads ``[MASK]``,
  not ``v``: the row's input side never sees the positions it is asked to predict. Split by the
  role of the reading position (``kept``, ``random``, ``context``, ...);
- **output side**: the decoder's row ``v`` gets ``sum_t dL/dz[t, v] h[t]`` over the positions t
  with a loss (``z``: logits, ``h``: the decoder's input), from every loss position whatever its
  label (the softmax pushes every row). Split by the role of the loss position.

:class:`NewRowGradients` hooks the input embeddings and the output embeddings around one
forward/backward; :meth:`NewRowGradients.split` returns, per side and role, the norm
``sqrt(sum_v ||g_v||^2)`` over the new rows and the number of positions that contributed.
:class:`NewRowsCallback` logs them during continued MLM training to ``new_rows.csv``
(:data:`gradflow.schema.NEW_ROWS_FIELDS`).
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import TrainerCallback

from gradflow.errors import GradflowError
from gradflow.inputs.masking import mlm_roles
from gradflow.roles import Role, role_name
from gradflow.schema import NEW_ROWS_COLUMNS, NEW_ROWS_FILE

CSV_NAME = NEW_ROWS_FILE
"""The log's file name (:data:`gradflow.schema.NEW_ROWS_FILE`; this alias is kept for older imports)."""
CSV_COLUMNS = NEW_ROWS_COLUMNS
"""The log's columns (:data:`gradflow.schema.NEW_ROWS_FIELDS` explains them; alias kept for older imports)."""


class NewRowGradients:
    """Context manager: capture what the new rows ``new_ids`` receive in one forward/backward.

    After the backward, :meth:`vectors` gives the per-role (K, H) gradients of each side and
    :meth:`split` their norms. Hooks are removed on exit; captured tensors are detached.
    """

    def __init__(self, model: nn.Module, new_ids: Sequence[int]):
        if not new_ids:
            raise GradflowError("NewRowGradients: no new token ids to watch")
        self.model = model
        self.new_ids = torch.tensor(list(new_ids), dtype=torch.long)
        self._handles: list = []
        self._input_ids: torch.Tensor | None = None
        self._embed_grad: torch.Tensor | None = None
        self._decoder_input: torch.Tensor | None = None
        self._logit_grad: torch.Tensor | None = None

    def __enter__(self) -> "NewRowGradients":
        inputs, outputs = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        if outputs is None:
            raise GradflowError(f"{type(self.model).__name__} has no output embeddings (an MLM decoder) to watch")
        try:
            self._handles.append(inputs.register_forward_hook(self._on_embedding))
            self._handles.append(outputs.register_forward_hook(self._on_decoder))
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_embedding(self, module, args, output):
        if self._input_ids is not None or not output.requires_grad:
            return
        self._input_ids = args[0].detach()

        def keep(grad):
            self._embed_grad = grad.detach()
        output.register_hook(keep)

    def _on_decoder(self, module, args, output):
        if self._decoder_input is not None or not output.requires_grad:
            return
        self._decoder_input = args[0].detach()
        ids = self.new_ids.to(output.device)

        def keep(grad):
            self._logit_grad = grad.detach().index_select(-1, ids)
        output.register_hook(keep)

    def vectors(self, roles: torch.Tensor) -> dict[tuple[str, str], tuple[torch.Tensor, int]]:
        """``{(side, role): (grad (K, H) float64, n_positions)}`` for the roles present and role ``all``
        (their sum: the side's whole gradient of the new rows); ``roles``: (B, T) codes."""
        if self._embed_grad is None or self._logit_grad is None:
            raise GradflowError("NewRowGradients: no backward was seen inside the context (call loss.backward())")
        out: dict[tuple[str, str], tuple[torch.Tensor, int]] = {}
        roles = roles.to(self._input_ids.device)
        ids = self.new_ids.to(self._input_ids.device)
        reads_new = self._input_ids.unsqueeze(-1) == ids                                # (B, T, K)
        has_loss = self._logit_grad.abs().sum(-1) > 0                                   # (B, T)
        for role in Role:
            at = roles == int(role)
            if not bool(at.any()):
                continue
            reads = at.unsqueeze(-1) & reads_new
            grad_in = torch.einsum("btk,bth->kh", reads.double(), self._embed_grad.double())
            out[("input", role_name(role))] = (grad_in, int(reads.any(-1).sum()))
            dz = self._logit_grad.double() * at.unsqueeze(-1)                         # (B, T, K)
            grad_out = torch.einsum("btk,bth->kh", dz, self._decoder_input.double())
            loss_positions = int(has_loss[at].sum())
            out[("output", role_name(role))] = (grad_out, loss_positions)
        for side in ("input", "output"):
            parts = [(g, n) for (s, _), (g, n) in out.items() if s == side]
            out[(side, "all")] = (torch.stack([g for g, _ in parts]).sum(0), sum(n for _, n in parts))
        return out

    def split(self, roles: torch.Tensor) -> list[dict]:
        """Rows ``{side, role, grad_norm, n_positions}`` (norm over the new rows, float64 sums)."""
        return [{"side": side, "role": role, "grad_norm": float(g.norm()), "n_positions": n}
                for (side, role), (g, n) in self.vectors(roles).items()]


class NewRowsCallback(TrainerCallback):
    """Log :class:`NewRowGradients` of the first micro-batch every ``every`` steps (and step 1) to ``csv_path``."""

    def __init__(self, new_ids: Sequence[int], csv_path: str | Path, every: int = 50, tokenizer=None):
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.new_ids, self.csv_path, self.every, self.tokenizer = list(new_ids), Path(csv_path), every, tokenizer
        self.rows: list[dict] = []
        self._watch: NewRowGradients | None = None
        self._pre_hook = None
        self._roles: torch.Tensor | None = None
        self._step: int | None = None

    def on_train_begin(self, args, state, control, processing_class=None, **kwargs):
        self.tokenizer = self.tokenizer if self.tokenizer is not None else processing_class
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        with self.csv_path.open("w", newline="") as fh:
            csv.writer(fh).writerow(NEW_ROWS_COLUMNS)

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        step = state.global_step + 1
        if step % self.every and step != 1:
            return
        self._step, self._roles = step, None
        self._watch = NewRowGradients(model, self.new_ids).__enter__()
        self._pre_hook = model.register_forward_pre_hook(self._on_forward, with_kwargs=True)

    def _on_forward(self, module, args, kwargs):
        if self._roles is not None:
            return None
        ids, labels = kwargs.get("input_ids", args[0] if args else None), kwargs.get("labels")
        if ids is not None and labels is not None:
            tok = self.tokenizer
            self._roles = mlm_roles(ids, labels, kwargs.get("attention_mask"), getattr(tok, "mask_token_id", None),
                                    tuple(getattr(tok, "all_special_ids", ())))
        return None

    def _finish(self) -> None:
        if self._watch is None:
            return
        watch, self._watch = self._watch, None
        watch.__exit__(None, None, None)
        self._pre_hook.remove()
        if self._roles is not None:
            rows = [{"step": self._step, **r} for r in watch.split(self._roles)]
            self.rows.extend(rows)
            with self.csv_path.open("a", newline="") as fh:
                csv.writer(fh).writerows([[r[c] for c in NEW_ROWS_COLUMNS] for r in rows])

    def on_substep_end(self, args, state, control, **kwargs):
        self._finish()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._finish()

    def on_train_end(self, args, state, control, **kwargs):
        self._finish()


__all__ = ["CSV_COLUMNS", "CSV_NAME", "NewRowGradients", "NewRowsCallback"]
