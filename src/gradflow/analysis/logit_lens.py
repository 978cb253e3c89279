"""The logit lens: the model's own MLM head (after the final norm of pre-LN models) on every layer.

``top1_original`` is the fraction of positions whose top-1 prediction is the original token,
``mean_log_prob_original`` its mean log-probability (nats), per layer and role.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
import torch
from torch import nn

from gradflow.adapters import Adapter, get_module
from gradflow.analysis.representations import _role_masks, _site, _sorted
from gradflow.errors import DiagnosticsError
from gradflow.hooks.states import SiteStates
from gradflow.inputs.masking import MaskedBatch
from gradflow.roles import TOKEN_ROLES
from gradflow.runs.schema import DIAGNOSTIC_COLUMNS as TABLE_COLUMNS

# ----------------------------------------------------------------------------------------------

FINAL_NORM_PATHS: tuple[str, ...] = ("final_norm", "encoder.emb_layer_norm_after", "encoder.ln", "encoder.LayerNorm",
                                     "LayerNorm")
"""Where pre-LN families keep the norm between the last block and the head (relative to the base
model): ModernBERT, ESM, Megatron-BERT, XLM-RoBERTa-XL, RoBERTa-PreLayerNorm. A candidate is used
only if it reproduces the model's logits (DeBERTa-v2's ``encoder.LayerNorm`` normalises relative
position embeddings and is correctly rejected)."""


def _head_routes() -> list[tuple[tuple[str, ...], Callable[[nn.Module, torch.Tensor], torch.Tensor]]]:
    """MLM heads keyed by the attribute names of the ForMaskedLM model, most specific first.

    Each maps the base model's last hidden state (B, T, H) to logits (B, T, V), as the model's own
    ``forward`` does.
    """
    return [
        (("generator_predictions", "generator_lm_head"),  # ELECTRA generator
         lambda m, h: m.generator_lm_head(m.generator_predictions(h))),
        (("vocab_transform", "vocab_layer_norm", "vocab_projector"),  # DistilBERT
         lambda m, h: m.vocab_projector(m.vocab_layer_norm(m.activation(m.vocab_transform(h))))),
        (("head", "decoder"), lambda m, h: m.decoder(m.head(h))),  # ModernBERT
        (("lm_predictions",),  # DeBERTa-v2, non-legacy head
         lambda m, h: m.lm_predictions(h, m.base_model.embeddings.word_embeddings)),
        (("cls",), lambda m, h: m.cls(h)),  # BERT, DeBERTa-v2 (legacy), Megatron-BERT, ERNIE, RoFormer
        (("predictions",), lambda m, h: m.predictions(h)),  # ALBERT
        (("lm_head",), lambda m, h: m.lm_head(h)),  # RoBERTa family, ESM, MPNet
    ]


def head_function(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLM head of ``model`` as a function of the base model's last hidden state."""
    for names, route in _head_routes():
        if all(getattr(model, n, None) is not None for n in names):
            return lambda h, route=route: route(model, h)
    raise DiagnosticsError(f"no known MLM head on {type(model).__name__} (looked for "
                           f"{', '.join('+'.join(n) for n, _ in _head_routes())}); the logit lens needs one")


class LogitLens:
    """``lens(hidden (N, H)) -> logits (N, V)``: final norm (if any) then the model's MLM head.

    :meth:`resolve` picks the final norm (none, or one of :data:`FINAL_NORM_PATHS`) that
    reproduces the model's logits from the last block output; it must run once before use.
    """

    def __init__(self, model: nn.Module, adapter: Adapter):
        self.model = model
        self.head = head_function(model)
        self.final: nn.Module | None = None
        self.final_path: str | None = None
        self.max_abs_diff: float | None = None
        self._candidates: list[tuple[str | None, nn.Module | None]] = [(None, None)]
        for path in FINAL_NORM_PATHS:
            try:
                module = get_module(model.base_model, path)
            except LookupError:
                continue
            if isinstance(module, nn.Module) and not isinstance(module, nn.Identity):
                self._candidates.append((path, module))

    def _apply(self, hidden: torch.Tensor, final: nn.Module | None) -> torch.Tensor:
        param = next(self.model.parameters())
        h = hidden.to(param.device, param.dtype)
        with torch.no_grad():
            if final is not None:
                h = final(h)
            return self.head(h).float().cpu()

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.max_abs_diff is None:
            raise DiagnosticsError("LogitLens.resolve() must run before the lens is applied")
        return self._apply(hidden, self.final)

    def resolve(self, last_hidden: torch.Tensor, logits: torch.Tensor, keep: torch.Tensor) -> None:
        """Choose the final norm; ``last_hidden`` (B, T, H), ``logits`` (B, T, V), ``keep`` (B, T).

        Every candidate is tried and the one closest to the model's logits wins; it must match
        within ``1e-3 * max(1, max |logit|)`` (loose enough for bfloat16 models).
        """
        target = logits[keep]
        diffs = [float((self._apply(last_hidden[keep], module) - target).abs().max()) for _, module in self._candidates]
        best = int(np.argmin(diffs))
        if diffs[best] <= 1e-3 * max(1.0, float(target.abs().max())):
            (self.final_path, self.final), self.max_abs_diff = self._candidates[best], diffs[best]
            return
        tried = "; ".join(f"{path or 'no final norm'}: {d:.3g}" for (path, _), d in zip(self._candidates, diffs))
        raise DiagnosticsError(f"the logit lens cannot reproduce the logits of {type(self.model).__name__} from its "
                               f"last block output (max |difference| {tried}): its head or final norm is not in "
                               "gradflow.runs.diagnose' lookup (FINAL_NORM_PATHS, _head_routes)")


class LogitLensAccumulator:
    """Top-1 recovery and log-probability of the original token, per layer and role (running sums)."""

    def __init__(self, lens: LogitLens, chunk: int = 2048):
        self.lens = lens
        self.chunk = chunk
        self.stats: dict[tuple[int, str], np.ndarray] = {}  # (layer, role) -> [n, correct, logprob sum]

    def add(self, states: SiteStates, batch: MaskedBatch) -> None:
        masks = _role_masks(batch.roles.cpu())
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

    def frame(self) -> pd.DataFrame:
        rows = [{"layer": layer, "site": _site(layer), "role": role, "n_positions": int(s[0]),
                 "top1_original": s[1] / s[0], "mean_log_prob_original": s[2] / s[0]}
                for (layer, role), s in self.stats.items()]
        return _sorted(pd.DataFrame(rows, columns=list(TABLE_COLUMNS["logit_lens"])))
