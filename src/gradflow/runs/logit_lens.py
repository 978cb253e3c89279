"""The logit lens: the model's own MLM head (after the final norm of pre-LN models) on every layer.

``top1_original`` is the fraction of positions whose top-1 prediction is the original token,
``mean_log_prob_original`` its mean log-probability (nats), per layer and role.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from gradflow.adapters import Adapter, adapter_for, get_module
from gradflow.errors import DiagnosticsError
from gradflow.hooks.states import SiteStates
from gradflow.inputs.masking import MaskedBatch
from gradflow.roles import TOKEN_ROLES
from gradflow.runs.representations import diagnostic_role_masks, keyed_arrays, keyed_state, sorted_by_layer_and_role
from gradflow.schema import DIAGNOSTIC_COLUMNS as TABLE_COLUMNS
from gradflow.site_names import layer_site

# ----------------------------------------------------------------------------------------------


def head_function(model: nn.Module, adapter: Adapter | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLM head its adapter declares for ``model``: hidden (..., H) -> logits (..., V).

    The hidden state is the base model's last hidden state (after the final norm, if any).
    """
    adapter = adapter or adapter_for(model)
    try:
        return adapter.head.function(model)
    except LookupError as err:
        raise DiagnosticsError(f"the MLM head declared by the {adapter.family!r} adapter ({adapter.head.describe()}) "
                               f"is not on {type(model).__name__}: {err}. The logit lens needs the model's MLM head; "
                               "fix the adapter's head (gradflow.adapters.HeadSpec).") from None


def final_norm_module(model: nn.Module, adapter: Adapter) -> nn.Module | None:
    """The norm between the last block and the head its adapter declares (pre-LN families), or None."""
    if adapter.final_norm is None:
        return None
    try:
        return get_module(model.base_model, adapter.final_norm)
    except LookupError as err:
        raise DiagnosticsError(f"the final norm declared by the {adapter.family!r} adapter is not on "
                               f"{type(model).__name__}: {err}. Fix the adapter's final_norm.") from None


class LogitLens:
    """``lens(hidden (N, H)) -> logits (N, V)``: final norm (if any) then the model's MLM head.

    Both come from the adapter (``head``, ``final_norm``). :meth:`resolve` checks once, before use,
    that they reproduce the model's logits from the last block output.
    """

    def __init__(self, model: nn.Module, adapter: Adapter):
        self.model = model
        self.adapter = adapter
        self.head = head_function(model, adapter)
        self.final_path: str | None = adapter.final_norm
        self.final = final_norm_module(model, adapter)
        self.max_abs_diff: float | None = None

    def _apply(self, hidden: torch.Tensor) -> torch.Tensor:
        param = next(self.model.parameters())
        h = hidden.to(param.device, param.dtype)
        with torch.no_grad():
            if self.final is not None:
                h = self.final(h)
            return self.head(h).float().cpu()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.max_abs_diff is None:
            raise DiagnosticsError("LogitLens.resolve() must run before the lens is applied")
        return self._apply(hidden)

    def resolve(self, last_hidden: torch.Tensor, logits: torch.Tensor, keep: torch.Tensor) -> None:
        """Check the declared head and final norm; ``last_hidden`` (B, T, H), ``logits`` (B, T, V), ``keep`` (B, T).

        They must reproduce the model's logits within ``1e-3 * max(1, max |logit|)`` (loose enough
        for bfloat16 models); otherwise DiagnosticsError.
        """
        target = logits[keep]
        diff = float((self._apply(last_hidden[keep]) - target).abs().max())
        if diff <= 1e-3 * max(1.0, float(target.abs().max())):
            self.max_abs_diff = diff
            return
        raise DiagnosticsError(
            f"the logit lens cannot reproduce the logits of {type(self.model).__name__} from its last block output "
            f"(max |difference| {diff:.3g}) with the head ({self.adapter.head.describe()}) and final norm "
            f"({self.final_path or 'none'}) that the {self.adapter.family!r} adapter declares: fix the adapter's "
            "head or final_norm (gradflow.adapters).")


class LogitLensAccumulator:
    """Top-1 recovery and log-probability of the original token, per layer and role (running sums)."""

    def __init__(self, lens: LogitLens, chunk: int = 2048):
        self.lens = lens
        self.chunk = chunk
        self.stats: dict[tuple[int, str], np.ndarray] = {}  # (layer, role) -> [n, correct, logprob sum]

    def add(self, states: SiteStates, batch: MaskedBatch) -> None:
        masks = diagnostic_role_masks(batch.roles.cpu())
        original = batch.original_ids.cpu()
        width = states.hidden[-1].shape[-1]
        selected = torch.zeros_like(batch.roles, dtype=torch.bool).cpu()
        for name in TOKEN_ROLES:
            if name in masks:
                selected |= masks[name]
        for layer, hidden in enumerate(states.hidden):
            if hidden.shape[-1] != width:
                continue  # factorised embeddings: the head does not take this width
            correct, logprob = self._score(hidden[selected], original[selected])
            for role, mask in masks.items():
                pick = mask[selected]
                n = int(pick.sum())
                if n == 0:
                    continue
                entry = self.stats.setdefault((layer, role), np.zeros(3))
                entry += (n, float(correct[pick].sum()), float(logprob[pick].double().sum()))

    def _score(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(top-1 == target, log p(target)) for N vectors, in chunks of ``chunk`` rows."""
        correct, logprob = [], []
        for start in range(0, hidden.shape[0], self.chunk):
            logits = self.lens(hidden[start:start + self.chunk])
            tgt = targets[start:start + self.chunk]
            correct.append(logits.argmax(dim=-1) == tgt)
            logprob.append(torch.log_softmax(logits, dim=-1).gather(1, tgt[:, None]).squeeze(1))
        if not correct:
            return torch.zeros(0, dtype=torch.bool), torch.zeros(0)
        return torch.cat(correct), torch.cat(logprob)

    def state_dict(self) -> dict[str, Any]:
        """[n, correct, log-prob sum] per layer and role (float64 tensors, in insertion order) and the lens's
        checked difference (a resumed job does not check the lens again)."""
        return {**keyed_state("stats", self.stats), "max_abs_diff": self.lens.max_abs_diff}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stats = keyed_arrays("stats", state)
        self.lens.max_abs_diff = state["max_abs_diff"]

    def frame(self) -> pd.DataFrame:
        rows = [{"layer": layer, "site": layer_site(layer), "role": role, "n_positions": int(s[0]),
                 "top1_original": s[1] / s[0], "mean_log_prob_original": s[2] / s[0]}
                for (layer, role), s in self.stats.items()]
        return sorted_by_layer_and_role(pd.DataFrame(rows, columns=list(TABLE_COLUMNS["logit_lens"])))
