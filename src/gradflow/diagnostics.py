"""Representation diagnostics of every layer, per position role, streamed over a corpus.

Forward passes only (``torch.no_grad``). Hidden states are taken with forward hooks at the
recorder's sites (``embeddings.out``, ``blocks.{i}.mid``, ``blocks.{i}.out``) rather than from
``output_hidden_states``: for pre-LN models the last entry of ``hidden_states`` already includes
the final LayerNorm, and for factorised embeddings (ALBERT, ELECTRA) the first entry is after the
projection, so the hooks are what keeps these tables aligned with the gradient recordings.

Tables (one row per layer and role; ``layer`` 0 = embeddings, i + 1 = block i; ``loss`` = pooled
masked + random + kept):

- ``logit_lens``: the model's own MLM head (after the final norm of pre-LN models) applied to
  every layer's output; ``top1_original`` is the fraction of positions whose top-1 prediction is
  the original token, ``mean_log_prob_original`` its mean log-probability (nats).
- ``input_shift``: how separable the FFN inputs (``blocks.{i}.mid``) of loss and context
  positions are: cross-validated AUROC of a logistic-regression probe on a seeded uniform sample
  of at most ``max_per_group`` vectors per group (Hanley-McNeil standard error and 95% interval),
  and the Frechet distance between the two groups' Gaussians (means and covariances over *all*
  positions, streamed).
- ``anisotropy``: mean pairwise cosine of the hidden states of a role, from the running sum of
  unit vectors: ``(||sum u||^2 - n) / (n (n - 1))``.
- ``transformation``: per block, relative change ``||h_i - h_{i-1}|| / ||h_{i-1}||`` of each
  position's hidden state (mean and std); the last block (``last_block`` true) is the one whose
  context channels get no gradient.

State per layer is bounded (sums, a fixed-size sample, H x H moments), so memory does not grow
with the corpus.
"""

from __future__ import annotations

import math
import platform
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

from . import __version__
from .adapters import Adapter, block_modules, get_module
from .attribution import site_hooks
from .corpus import CorpusCounts, Document, batches, iter_windows, read_documents
from .errors import CorpusError, GradflowError
from .masking import BertMasking, MaskedBatch, mask_batch
from .models import LoadedModel
from .roles import TOKEN_ROLES, Role

GROUPS: tuple[str, ...] = ("loss", "context")
"""The two groups of the input-shift probe."""
DIAG_ROLES: tuple[str, ...] = ("masked", "random", "kept", "context", "special", "loss")
"""Roles reported in the per-role tables (``loss`` = pooled masked + random + kept)."""

TABLE_COLUMNS: dict[str, tuple[str, ...]] = {
    "logit_lens": ("layer", "site", "role", "n_positions", "top1_original", "mean_log_prob_original"),
    "input_shift": ("layer", "site", "n_loss", "n_context", "n_sample_loss", "n_sample_context", "auroc", "auroc_se",
                    "auroc_ci_low", "auroc_ci_high", "frechet_distance", "mean_shift_sq"),
    "anisotropy": ("layer", "site", "role", "n_positions", "mean_pairwise_cosine"),
    "transformation": ("layer", "role", "n_positions", "rel_change_mean", "rel_change_std", "last_block"),
}
"""Column order of each CSV table (a public contract)."""


class DiagnosticsError(GradflowError):
    """Diagnostics cannot run on this model or input (with what to do about it)."""


# ----------------------------------------------------------------------------------------------
# Hidden states of one batch
# ----------------------------------------------------------------------------------------------

@dataclass
class SiteStates:
    """Hidden states of one batch (CPU float32). ``hidden``: L + 1 tensors (B, T, H) (embeddings,
    then block outputs); ``mid``: L tensors (B, T, H); ``logits``: (B, T, V) or None."""

    hidden: list[torch.Tensor]
    mid: list[torch.Tensor]
    logits: torch.Tensor | None = None

    def select(self, rows: slice | Sequence[int]) -> "SiteStates":
        """The states of some rows (for streaming checks)."""
        pick = (lambda t: t[rows]) if isinstance(rows, slice) else (lambda t: t[list(rows)])
        return SiteStates([pick(h) for h in self.hidden], [pick(m) for m in self.mid],
                          None if self.logits is None else pick(self.logits))


def collect_states(model: nn.Module, batch: MaskedBatch, adapter: Adapter | None = None,
                   keep_logits: bool = True) -> SiteStates:
    """One no-grad forward of ``batch``; every site's hidden state (hooks removed afterwards)."""
    store: dict[str, torch.Tensor] = {}

    def keep(site: str, hidden: torch.Tensor) -> None:
        store[site] = hidden.detach().float().cpu()

    device = next(model.parameters()).device
    with torch.no_grad(), site_hooks(model, keep, adapter, mid=True) as names:
        logits = model(**batch.to(device).model_inputs()).logits
    num_blocks = (len(names) - 1) // 2
    hidden = [store["embeddings.out"], *[store[f"blocks.{i}.out"] for i in range(num_blocks)]]
    mid = [store[f"blocks.{i}.mid"] for i in range(num_blocks)]
    return SiteStates(hidden, mid, logits.detach().float().cpu() if keep_logits else None)


def _role_masks(roles: torch.Tensor) -> dict[str, torch.Tensor]:
    """(B, T) bool mask of each reported role, ``loss`` pooled."""
    masks = {name: roles == code for code, name in enumerate(TOKEN_ROLES) if name in DIAG_ROLES}
    masks["loss"] = roles <= Role.KEPT
    return masks


# ----------------------------------------------------------------------------------------------
# Logit lens
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
                               "gradflow.diagnostics' lookup (FINAL_NORM_PATHS, _head_routes)")


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


def _site(layer: int) -> str:
    return "embeddings.out" if layer == 0 else f"blocks.{layer - 1}.out"


def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    if frame.empty:
        return frame
    frame = frame.assign(_r=frame["role"].map(DIAG_ROLES.index))
    return frame.sort_values(["layer", "_r"]).drop(columns="_r").reset_index(drop=True)


# ----------------------------------------------------------------------------------------------
# Input shift: probe AUROC and Frechet distance
# ----------------------------------------------------------------------------------------------

class Reservoir:
    """A uniform sample of at most ``capacity`` vectors from a stream (bottom-k random keys).

    Every vector gets a key from a generator seeded by ``seed``; the ``capacity`` smallest keys
    are kept. Keys are drawn in stream order, so the sample does not depend on how the stream is
    batched.
    """

    def __init__(self, capacity: int, seed: Sequence[int]):
        self.capacity = capacity
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(list(seed))))
        self.keys = np.empty(0)
        self.values: np.ndarray | None = None
        self.seen = 0

    def add(self, x: np.ndarray) -> None:
        """Offer (N, H) vectors."""
        if x.shape[0] == 0:
            return
        keys = self.rng.random(x.shape[0])
        self.seen += x.shape[0]
        values = x if self.values is None else np.concatenate([self.values, x])
        keys = np.concatenate([self.keys, keys])
        if keys.size > self.capacity:
            keep = np.argpartition(keys, self.capacity - 1)[: self.capacity]
        else:
            keep = np.arange(keys.size)
        keep = keep[np.argsort(keys[keep], kind="stable")]
        self.keys, self.values = keys[keep], values[keep]

    def sample(self) -> np.ndarray:
        """(n, H) the current sample, in key order (a random order)."""
        return self.values if self.values is not None else np.empty((0, 0))


class RunningMoments:
    """Count, mean and scatter matrix of a stream of vectors (Chan et al. merge, float64)."""

    def __init__(self) -> None:
        self.n = 0
        self.mean: np.ndarray | None = None
        self.m2: np.ndarray | None = None

    def add(self, x: np.ndarray) -> None:
        """Add (N, H) vectors."""
        nb = x.shape[0]
        if nb == 0:
            return
        x = x.astype(np.float64)
        mb = x.mean(axis=0)
        centred = x - mb
        m2b = centred.T @ centred
        if self.mean is None:
            self.n, self.mean, self.m2 = nb, mb, m2b
            return
        n = self.n + nb
        delta = mb - self.mean
        self.mean = self.mean + delta * (nb / n)
        self.m2 = self.m2 + m2b + np.outer(delta, delta) * (self.n * nb / n)
        self.n = n

    def covariance(self) -> np.ndarray:
        """Unbiased (H, H) covariance (needs n >= 2)."""
        return self.m2 / max(self.n - 1, 1)


def _sqrt_psd(matrix: np.ndarray) -> np.ndarray:
    vals, vecs = np.linalg.eigh((matrix + matrix.T) / 2)
    return (vecs * np.sqrt(np.clip(vals, 0.0, None))) @ vecs.T


def frechet_distance(mu1: np.ndarray, cov1: np.ndarray, mu2: np.ndarray, cov2: np.ndarray) -> float:
    """Frechet (2-Wasserstein squared) distance of two Gaussians, in squared activation units.

    ``||mu1 - mu2||^2 + tr(C1 + C2 - 2 (C1^1/2 C2 C1^1/2)^1/2)``, with symmetric square roots.
    """
    root1 = _sqrt_psd(cov1)
    cross = np.linalg.eigvalsh((root1 @ cov2 @ root1 + (root1 @ cov2 @ root1).T) / 2)
    trace = np.trace(cov1) + np.trace(cov2) - 2.0 * np.sqrt(np.clip(cross, 0.0, None)).sum()
    return float(np.sum((mu1 - mu2) ** 2) + max(trace, 0.0))


def auroc_standard_error(auc: float, n_pos: int, n_neg: int) -> float:
    """Hanley and McNeil (1982) standard error of an AUROC."""
    q1 = auc / (2 - auc)
    q2 = 2 * auc * auc / (1 + auc)
    var = (auc * (1 - auc) + (n_pos - 1) * (q1 - auc * auc) + (n_neg - 1) * (q2 - auc * auc)) / (n_pos * n_neg)
    return math.sqrt(max(var, 0.0))


def probe_auroc(positive: np.ndarray, negative: np.ndarray, folds: int = 5, seed: int = 0) -> tuple[float, float]:
    """(AUROC, standard error) of a stratified ``folds``-fold cross-validated linear probe.

    Standardised features, L2 logistic regression; the AUROC is computed on the pooled
    out-of-fold decision values. NaN when a group has fewer than 2 vectors. The standard error
    is Hanley and McNeil's, which ignores the probe's fitting noise: for two identical 8-d
    Gaussians (600 vectors each) cross-validated AUROCs spread about 1.35x wider, so the 95%
    interval covers 0.5 about 85% of the time. Read AUROCs within ~0.05 of 0.5 as "no shift".
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import roc_auc_score
    from sklearn.model_selection import StratifiedKFold, cross_val_predict
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    k = min(folds, positive.shape[0], negative.shape[0])
    if k < 2:
        return float("nan"), float("nan")
    x = np.concatenate([positive, negative]).astype(np.float64)
    y = np.concatenate([np.ones(positive.shape[0]), np.zeros(negative.shape[0])])
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    scores = cross_val_predict(probe, x, y, cv=StratifiedKFold(k, shuffle=True, random_state=seed),
                               method="decision_function")
    auc = float(roc_auc_score(y, scores))
    return auc, auroc_standard_error(auc, positive.shape[0], negative.shape[0])


class InputShiftAccumulator:
    """Per block: a sample and the moments of the FFN inputs of loss and context positions."""

    def __init__(self, num_blocks: int, max_per_group: int = 2000, seed: int = 0):
        self.seed = seed
        self.reservoirs = {(i, g): Reservoir(max_per_group, (seed, i, k)) for i in range(num_blocks)
                           for k, g in enumerate(GROUPS)}
        self.moments = {(i, g): RunningMoments() for i in range(num_blocks) for g in GROUPS}

    def add(self, states: SiteStates, batch: MaskedBatch) -> None:
        roles = batch.roles.cpu()
        groups = {"loss": roles <= Role.KEPT, "context": roles == Role.CONTEXT}
        for i, mid in enumerate(states.mid):
            for g, mask in groups.items():
                x = mid[mask].numpy()
                self.reservoirs[(i, g)].add(x.astype(np.float32))
                self.moments[(i, g)].add(x)

    def frame(self) -> pd.DataFrame:
        rows = []
        for i in sorted({i for i, _ in self.moments}):
            loss, ctx = self.moments[(i, "loss")], self.moments[(i, "context")]
            a, b = self.reservoirs[(i, "loss")].sample(), self.reservoirs[(i, "context")].sample()
            auc, se = probe_auroc(a, b, seed=self.seed) if a.size and b.size else (float("nan"), float("nan"))
            fd = shift = float("nan")
            if loss.n >= 2 and ctx.n >= 2:
                fd = frechet_distance(loss.mean, loss.covariance(), ctx.mean, ctx.covariance())
                shift = float(np.sum((loss.mean - ctx.mean) ** 2))
            rows.append({"layer": i + 1, "site": f"blocks.{i}.mid", "n_loss": loss.n, "n_context": ctx.n,
                         "n_sample_loss": a.shape[0] if a.size else 0, "n_sample_context": b.shape[0] if b.size else 0,
                         "auroc": auc, "auroc_se": se, "auroc_ci_low": auc - 1.96 * se,
                         "auroc_ci_high": auc + 1.96 * se, "frechet_distance": fd, "mean_shift_sq": shift})
        return pd.DataFrame(rows, columns=list(TABLE_COLUMNS["input_shift"]))


# ----------------------------------------------------------------------------------------------
# Anisotropy and last-block transformation
# ----------------------------------------------------------------------------------------------

def mean_pairwise_cosine(unit_sum: np.ndarray, n: int) -> float:
    """Mean cosine over ordered pairs i != j of n unit vectors whose sum is ``unit_sum``."""
    if n < 2:
        return float("nan")
    return float((np.dot(unit_sum, unit_sum) - n) / (n * (n - 1)))


class AnisotropyAccumulator:
    """Running sum of unit hidden vectors and their count, per layer and role (float64)."""

    def __init__(self) -> None:
        self.sums: dict[tuple[int, str], np.ndarray] = {}
        self.counts: dict[tuple[int, str], int] = {}

    def add(self, states: SiteStates, batch: MaskedBatch) -> None:
        masks = _role_masks(batch.roles.cpu())
        for layer, hidden in enumerate(states.hidden):
            norms = torch.linalg.vector_norm(hidden.double(), dim=-1, keepdim=True)
            units = hidden.double() / norms.clamp_min(1e-300)  # zero vectors are left out below
            nonzero = norms.squeeze(-1) > 0
            for role, mask in masks.items():
                pick = mask & nonzero
                n = int(pick.sum())
                if n == 0:
                    continue
                key = (layer, role)
                total = units[pick].sum(dim=0).numpy()
                self.sums[key] = self.sums.get(key, 0.0) + total
                self.counts[key] = self.counts.get(key, 0) + n

    def frame(self) -> pd.DataFrame:
        rows = [{"layer": layer, "site": _site(layer), "role": role, "n_positions": self.counts[(layer, role)],
                 "mean_pairwise_cosine": mean_pairwise_cosine(s, self.counts[(layer, role)])}
                for (layer, role), s in self.sums.items()]
        return _sorted(pd.DataFrame(rows, columns=list(TABLE_COLUMNS["anisotropy"])))


class TransformationAccumulator:
    """Per block and role: count, sum and sum of squares of ``||h_i - h_{i-1}|| / ||h_{i-1}||``."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.stats: dict[tuple[int, str], np.ndarray] = {}

    def add(self, states: SiteStates, batch: MaskedBatch) -> None:
        masks = _role_masks(batch.roles.cpu())
        for i in range(1, len(states.hidden)):
            before, after = states.hidden[i - 1].double(), states.hidden[i].double()
            if before.shape != after.shape:
                continue  # factorised embeddings: block 0's input is the projection, not this site
            ref = torch.linalg.vector_norm(before, dim=-1)
            rel = torch.linalg.vector_norm(after - before, dim=-1) / ref.clamp_min(1e-30)
            valid = ref > 0
            for role, mask in masks.items():
                values = rel[mask & valid]
                if values.numel():
                    entry = self.stats.setdefault((i, role), np.zeros(3))
                    entry += (values.numel(), float(values.sum()), float((values * values).sum()))

    def frame(self) -> pd.DataFrame:
        rows = []
        for (layer, role), (n, s, ss) in self.stats.items():
            mean = s / n
            var = max(ss / n - mean * mean, 0.0) * n / (n - 1) if n > 1 else float("nan")
            rows.append({"layer": layer, "role": role, "n_positions": int(n), "rel_change_mean": mean,
                         "rel_change_std": math.sqrt(var) if n > 1 else float("nan"),
                         "last_block": layer == self.num_blocks})
        return _sorted(pd.DataFrame(rows, columns=list(TABLE_COLUMNS["transformation"])))


# ----------------------------------------------------------------------------------------------
# All four over a stream of batches
# ----------------------------------------------------------------------------------------------

class Diagnostics:
    """The four accumulators of one model; ``add(states, batch)`` per batch, ``tables()`` at the end."""

    def __init__(self, model: nn.Module, adapter: Adapter, max_per_group: int = 2000, seed: int = 0):
        self.num_blocks = len(block_modules(adapter, model.base_model))
        self.lens = LogitLens(model, adapter)
        self.logit_lens = LogitLensAccumulator(self.lens)
        self.input_shift = InputShiftAccumulator(self.num_blocks, max_per_group, seed)
        self.anisotropy = AnisotropyAccumulator()
        self.transformation = TransformationAccumulator(self.num_blocks)

    def add(self, states: SiteStates, batch: MaskedBatch) -> None:
        """Fold one batch's states into every accumulator (resolves the lens on the first call)."""
        if self.lens.max_abs_diff is None:
            if states.logits is None:
                raise DiagnosticsError("the first batch must come with the model's logits to check the logit lens")
            self.lens.resolve(states.hidden[-1], states.logits, batch.roles.cpu() != Role.PAD)
        batch = batch.to("cpu")
        self.logit_lens.add(states, batch)
        self.input_shift.add(states, batch)
        self.anisotropy.add(states, batch)
        self.transformation.add(states, batch)

    def tables(self) -> dict[str, pd.DataFrame]:
        """Tidy tables keyed ``logit_lens``, ``input_shift``, ``anisotropy``, ``transformation``."""
        return {"logit_lens": self.logit_lens.frame(), "input_shift": self.input_shift.frame(),
                "anisotropy": self.anisotropy.frame(), "transformation": self.transformation.frame()}


def _documents(texts: str | Path | Sequence[str] | None) -> tuple[Iterator[Document], str]:
    if texts is None:
        from importlib import resources

        texts = str(resources.files("gradflow") / "data" / "sotu_sample.txt")
    if isinstance(texts, (str, Path)):
        return read_documents(texts), str(texts)
    docs = (Document(i, t, "<texts>", i + 1) for i, t in enumerate(texts) if t.strip())
    return docs, f"<{len(texts)} texts>"


def diagnose_corpus(loaded: LoadedModel, texts: str | Path | Sequence[str] | None, out_dir: str | Path,
                    max_length: int = 128, batch_size: int = 8, limit: int | None = None, seed: int = 0, *,
                    max_per_group: int = 2000, command: str = "") -> dict[str, pd.DataFrame]:
    """Stream a corpus through ``loaded`` and write the four diagnostics tables and meta.json.

    ``texts``: a corpus path (see :func:`gradflow.corpus.read_documents`), a list of strings, or
    None for the committed SOTU sample. Masking is BERT's (15%, 80/10/10) seeded by ``seed``;
    ``limit`` stops after that many windows. Writes ``<table>.csv`` for each of
    :data:`TABLE_COLUMNS` and ``meta.json`` (``complete`` false if interrupted) into ``out_dir``.
    """
    start = time.time()
    if max_length > loaded.max_positions():
        raise DiagnosticsError(f"max_length {max_length} is longer than the {loaded.max_positions()} positions "
                               f"{loaded.name} accepts; pass a max_length of {loaded.max_positions()} or less.")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise DiagnosticsError(f"output path {out} exists and is a file; pass a directory.")
    documents, source = _documents(texts)
    policy = BertMasking(seed=seed)
    diag = Diagnostics(loaded.model, loaded.adapter, max_per_group, seed)
    counts = CorpusCounts()
    tokens = {r: 0 for r in TOKEN_ROLES}
    sequences, complete, error = 0, False, None
    try:
        for group in batches(iter_windows(loaded.tokenizer, documents, max_length, counts, limit), batch_size):
            batch = mask_batch(loaded.tokenizer, policy=policy, indices=[w.sequence_index for w in group],
                               encodings=[w.encoding for w in group], max_length=max_length)
            diag.add(collect_states(loaded.model, batch, loaded.adapter, keep_logits=sequences == 0), batch)
            for code, n in enumerate(torch.bincount(batch.roles.reshape(-1).long(), minlength=len(TOKEN_ROLES))):
                tokens[TOKEN_ROLES[code]] += int(n)
            sequences += len(group)
        complete = True
    except KeyboardInterrupt:
        error = "interrupted (SIGINT)"
        if sequences == 0:
            raise
    if complete and sequences == 0:
        raise CorpusError(f"the corpus {source} has no text to diagnose (no non-blank document with a maskable token).")
    tables = diag.tables()
    _write(out, tables, _meta(loaded, diag, source, policy, seed, max_length, batch_size, limit, max_per_group,
                              counts, sequences, tokens, complete, error, command, start))
    if error is not None:
        raise KeyboardInterrupt(error)
    return tables


def _write(out: Path, tables: dict[str, pd.DataFrame], meta: dict) -> None:
    from .tables import write_csv, write_meta

    out.mkdir(parents=True, exist_ok=True)
    for name, frame in tables.items():
        write_csv(frame, out / f"{name}.csv", TABLE_COLUMNS[name])
    write_meta(out / "meta.json", meta)


def _meta(loaded: LoadedModel, diag: Diagnostics, source: str, policy: BertMasking, seed: int, max_length: int,
          batch_size: int, limit: int | None, max_per_group: int, counts: CorpusCounts, sequences: int,
          tokens: dict[str, int], complete: bool, error: str | None, command: str, start: float) -> dict:
    import sklearn
    import transformers

    return {
        "complete": complete, "error": error, "model": loaded.name, "model_path": loaded.path,
        "family": loaded.adapter.family, "model_type": loaded.model.config.model_type,
        "config_hash": loaded.config_hash, "num_layers": diag.num_blocks, "texts": source,
        "masking": policy.describe(), "seed": seed, "max_length": max_length, "batch_size": batch_size,
        "limit": limit, "max_per_group": max_per_group,
        "logit_lens": {"final_norm": diag.lens.final_path, "max_abs_logit_diff": diag.lens.max_abs_diff},
        "counts": {"documents": counts.documents, "windows": counts.windows, "sequences": sequences,
                   "tokens_per_role": tokens},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "scikit-learn": sklearn.__version__,
                     "gradflow": __version__},
        "command": command or " ".join(sys.argv),
        "wall_s": round(time.time() - start, 2),
    }


# ----------------------------------------------------------------------------------------------
# Figures
# ----------------------------------------------------------------------------------------------

def _axes(ax, aspect: float = 0.68):
    import matplotlib.pyplot as plt

    from .figures.style import figure_size

    if ax is not None:
        return ax
    _, ax = plt.subplots(figsize=figure_size("single", aspect), layout="constrained")
    return ax


def _role_lines(ax, table: pd.DataFrame, value: str, roles: Iterable[str]) -> list:
    from .figures.style import role_color, role_label

    drawn = []
    for role in roles:
        d = table[table["role"] == role].sort_values("layer")
        if d.empty:
            continue
        style = {"linestyle": "--"} if role == "loss" else {}
        drawn += ax.plot(d["layer"], d[value], marker="o", color=role_color(role), label=role_label(role),
                         gid=f"{value}:{role}", **style)
    return drawn


def _finish(ax, drawn: list, xlabel: str, ylabel: str) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if drawn and any(a.get_label() and not a.get_label().startswith("_") for a in drawn):
        drawn.append(ax.legend(loc="best", ncols=2))


def plot_logit_lens(table: pd.DataFrame, ax=None,
                    roles: Sequence[str] = ("context", "masked", "random", "kept")) -> list:
    """Top-1 recovery of the original token vs layer, one line per role. Returns the artists."""
    from .figures.style import gradflow_style

    with gradflow_style("single"):
        ax = _axes(ax)
        drawn = _role_lines(ax, table, "top1_original", roles)
        ax.set_ylim(-0.03, 1.03)
        _finish(ax, drawn, "layer (0 = embeddings)", "top-1 = original token")
        ax.set_title("logit lens")
    return drawn


def plot_input_shift(table: pd.DataFrame, ax=None) -> list:
    """Probe AUROC (loss vs context FFN inputs) per block with its 95% interval; 0.5 = no shift."""
    from .figures.style import gradflow_style, role_color

    with gradflow_style("single"):
        ax = _axes(ax)
        d = table.sort_values("layer")
        color = role_color("loss")
        band = ax.fill_between(d["layer"], d["auroc_ci_low"], d["auroc_ci_high"], color=color, alpha=0.15,
                               linewidth=0, gid="input_shift:ci")
        line = ax.plot(d["layer"], d["auroc"], marker="o", color=color, label="probe AUROC", gid="input_shift:auroc")
        chance = ax.axhline(0.5, color="#777777", linewidth=0.6, linestyle=":", label="chance")
        ax.set_ylim(0.4, 1.02)
        drawn = [band, *line, chance]
        _finish(ax, drawn, "block (FFN input)", "AUROC loss vs context")
        ax.set_title("input shift")
    return drawn


def plot_frechet(table: pd.DataFrame, ax=None) -> list:
    """Frechet distance between loss and context FFN-input Gaussians per block (log scale if > 0)."""
    from .figures.style import gradflow_style, role_color

    with gradflow_style("single"):
        ax = _axes(ax)
        d = table.sort_values("layer")
        drawn = ax.plot(d["layer"], d["frechet_distance"], marker="o", color=role_color("loss"),
                        label="Frechet distance", gid="frechet:distance")
        drawn += ax.plot(d["layer"], d["mean_shift_sq"], marker="s", linestyle="--", color=role_color("context"),
                         label="mean shift squared", gid="frechet:mean")
        values = d[["frechet_distance", "mean_shift_sq"]].to_numpy(dtype=float)
        if np.all(values > 0) and values.max() / values.min() > 20:
            ax.set_yscale("log")  # only when the values span decades; narrow ranges read better linear
        else:
            ax.set_ylim(bottom=0)
        _finish(ax, drawn, "block (FFN input)", "squared activation units")
        ax.set_title("loss vs context FFN inputs")
    return drawn


def plot_anisotropy(table: pd.DataFrame, ax=None,
                    roles: Sequence[str] = ("context", "masked", "special", "loss")) -> list:
    """Mean pairwise cosine of hidden states vs layer, one line per role."""
    from .figures.style import gradflow_style

    with gradflow_style("single"):
        ax = _axes(ax)
        drawn = _role_lines(ax, table, "mean_pairwise_cosine", roles)
        _finish(ax, drawn, "layer (0 = embeddings)", "mean pairwise cosine")
        ax.set_title("anisotropy")
    return drawn


def plot_transformation(table: pd.DataFrame, ax=None, roles: Sequence[str] = ("context", "loss")) -> list:
    """Relative change each block makes to a position's hidden state (mean +- std), last block shaded."""
    from .figures.style import gradflow_style, role_color, role_label

    with gradflow_style("single"):
        ax = _axes(ax)
        drawn = []
        offsets = np.linspace(-0.12, 0.12, len(roles)) if len(roles) > 1 else [0.0]
        for off, role in zip(offsets, roles):
            d = table[table["role"] == role].sort_values("layer")
            if d.empty:
                continue
            bars = ax.errorbar(d["layer"] + off, d["rel_change_mean"], yerr=d["rel_change_std"], marker="o",
                               color=role_color(role), label=role_label(role), linestyle="-",
                               gid=f"transformation:{role}")
            drawn.append(bars)
        last = table.loc[table["last_block"].astype(bool), "layer"]
        if not last.empty:
            drawn.append(ax.axvspan(float(last.iloc[0]) - 0.4, float(last.iloc[0]) + 0.4, color="#DDDDDD", zorder=0,
                                    linewidth=0, gid="transformation:last_block"))
        ax.set_ylim(bottom=0)
        _finish(ax, drawn, "block (last shaded)", r"$\|h_i - h_{i-1}\| \,/\, \|h_{i-1}\|$")
        ax.set_title("how much each block changes a channel")
    return drawn


FIGURES: dict[str, tuple[str, Callable[..., list]]] = {
    "logit_lens": ("logit_lens", plot_logit_lens),
    "input_shift": ("input_shift", plot_input_shift),
    "frechet": ("input_shift", plot_frechet),
    "anisotropy": ("anisotropy", plot_anisotropy),
    "transformation": ("transformation", plot_transformation),
}
"""Figure name -> (table it draws, plot function)."""


def plot_diagnostics(tables: dict[str, pd.DataFrame], out_dir: str | Path,
                     formats: Sequence[str] = ("pdf", "png")) -> list[Path]:
    """One figure per diagnostic (``<name>.<fmt>`` in ``out_dir``, see :data:`FIGURES`); returns paths."""
    import matplotlib.pyplot as plt

    from .figures import save_figure
    from .figures.style import gradflow_style

    paths: list[Path] = []
    for name, (table, plot) in FIGURES.items():
        frame = tables.get(table)
        if frame is None or frame.empty:
            continue
        with gradflow_style("single"):
            ax = _axes(None)
            plot(frame, ax=ax)
            paths += save_figure(ax.figure, Path(out_dir) / name, formats)
            plt.close(ax.figure)
    return paths


__all__ = [
    "DIAG_ROLES", "FIGURES", "GROUPS", "TABLE_COLUMNS", "AnisotropyAccumulator", "Diagnostics", "DiagnosticsError",
    "InputShiftAccumulator", "LogitLens", "LogitLensAccumulator", "Reservoir", "RunningMoments", "SiteStates",
    "TransformationAccumulator", "auroc_standard_error", "collect_states", "diagnose_corpus", "frechet_distance",
    "head_function", "mean_pairwise_cosine", "plot_anisotropy", "plot_diagnostics", "plot_frechet",
    "plot_input_shift", "plot_logit_lens", "plot_transformation", "probe_auroc",
]
