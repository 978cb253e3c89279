"""Training objectives beyond BERT's, as data: masked diffusion and span masking.

Each objective is a frozen dataclass that says which positions of a sequence are *selected* and
what happens to their input; :func:`gradflow.inputs.masking.mask_sequence` applies it (special
ids, [UNK], the mask token, labels, roles) exactly as it applies :class:`BertMasking`. All draws
come from the sequence's own generator, seeded by ``(seed, sequence index)``.

- :class:`MaskedDiffusion` (LLaDA, MDLM): a masking ratio ``t`` per sequence, drawn as LLaDA's
  ``forward_process`` draws it (``t = (1 - eps) u + eps``, ``u ~ U(0, 1)``; so ``t ~ U(eps, 1)``),
  fixed, or taken from a grid by sequence index; every token is selected independently with
  probability ``t`` and every selected token becomes the mask token (no random or kept tokens);
  the loss weighs each selected position by ``1 / t``. With ``corruption="random"`` (DiffusionGemma's published
  recipe, ``--objective random-canvas``) every selected token becomes a random token instead and every maskable
  token carries the loss, unweighted: the corrupted ones as ``random``, the others as ``kept``. The reference normalisation (LLaDA's
  ``GUIDELINES.md``): pre-training divides the weighted sum by the number of tokens of the batch
  (``b * l``; here the real tokens, so padding changes nothing), supervised fine-tuning divides
  each sequence's weighted sum by its response length and averages over the batch.
- :class:`SpanMasking` (SpanBERT): contiguous spans of whole words, lengths from a geometric
  distribution (``p = 0.2``) clipped at 10 words, until ``ceil(rate * n)`` tokens are selected;
  each span is masked, replaced by random tokens or kept as a whole (80/10/10).

Every objective may be *shifted* (``shift=True``; Dream, DiffuLLaMA, LLM2Vec's MNTP): the logits at
position ``p`` predict the token at ``p + 1``. The roles then name the loss side: see
:func:`gradflow.inputs.masking.shift_to_loss_side`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gradflow.errors import MaskingError

DIFFUSION_EPS = 1e-3
"""LLaDA's default lower bound of the masking ratio t."""
SPAN_GEOMETRIC_P = 0.2
SPAN_MAX_WORDS = 10


def _check_ratio(name: str, value: float) -> None:
    if not 0.0 < value <= 1.0:
        raise MaskingError(f"{name} must be in (0, 1], got {value}: it is the fraction of tokens masked")


@dataclass(frozen=True)
class MaskedDiffusion:
    """Masked diffusion (LLaDA, MDLM): one masking ratio ``t`` per sequence, every selected token masked, 1/t weights.

    ``ratio``: a fixed ``t`` for every sequence; ``ratios``: a grid, sequence ``i`` gets
    ``ratios[i % len(ratios)]``; neither: ``t = (1 - eps) u + eps`` with ``u`` uniform, drawn per
    sequence. ``min_selected`` (default 0, as the reference): a sequence that draws fewer selected
    tokens gets that many drawn uniformly. ``shift``: the head is shifted (logits at p predict p + 1).
    ``corruption``: ``"mask"`` (the selected tokens masked, the loss on them weighted 1/t) or ``"random"`` (the
    selected tokens replaced by random tokens, the loss on every maskable token, weight 1: DiffusionGemma's canvas).
    """

    eps: float = DIFFUSION_EPS
    ratio: float | None = None
    ratios: tuple[float, ...] = ()
    seed: int = 0
    min_selected: int = 0
    shift: bool = False
    corruption: str = "mask"

    def __post_init__(self) -> None:
        if not 0.0 < self.eps < 1.0:
            raise MaskingError(f"eps must be in (0, 1), got {self.eps}: the masking ratio is drawn from U(eps, 1)")
        if self.ratio is not None and self.ratios:
            raise MaskingError("give a fixed masking ratio or a grid of ratios, not both")
        if self.ratio is not None:
            _check_ratio("the masking ratio t", self.ratio)
        for value in self.ratios:
            _check_ratio("every masking ratio of the grid", value)
        if self.min_selected < 0:
            raise MaskingError(f"min_selected must be >= 0, got {self.min_selected}")
        if self.corruption not in ("mask", "random"):
            raise MaskingError(f"the corruption of masked diffusion must be mask or random, got {self.corruption!r}")

    def mask_ratio(self, rng: np.random.Generator, index: int) -> float:
        """The ratio t of sequence ``index`` (drawn first from its generator when neither fixed nor a grid)."""
        if self.ratio is not None:
            return float(self.ratio)
        if self.ratios:
            return float(self.ratios[index % len(self.ratios)])
        return float((1.0 - self.eps) * rng.random() + self.eps)

    def describe(self) -> dict:
        """JSON-ready description, for meta.json."""
        t = ("fixed" if self.ratio is not None else "grid" if self.ratios else "uniform")
        described = {"policy": "diffusion", "t": t, "eps": self.eps, "ratio": self.ratio, "ratios": list(self.ratios),
                     "weights": "1/t", "normalisation": "real tokens (pre-training); response tokens, mean over "
                     "sequences (with a prompt)", "seed": self.seed, "min_selected": self.min_selected,
                     "shift": self.shift}
        if self.corruption == "random":  # (the masked corruption's description stays as it was)
            described.update(corruption="random", weights="1", loss="every maskable token outside the prompt")
        return described


@dataclass(frozen=True)
class SpanMasking:
    """SpanBERT's span masking: whole-word spans of geometric length until ``ceil(rate * n)`` tokens are selected.

    ``geometric_p`` and ``max_words`` give the span length in words (SpanBERT: 0.2 and 10, mean
    3.8); ``split`` = (mask, random, kept) fractions, drawn once per span; ``shift`` as in
    :class:`MaskedDiffusion`. Without word ids (a slow tokenizer) a word is one token.
    """

    rate: float = 0.15
    split: tuple[float, float, float] = (0.8, 0.1, 0.1)
    geometric_p: float = SPAN_GEOMETRIC_P
    max_words: int = SPAN_MAX_WORDS
    seed: int = 0
    shift: bool = False

    def __post_init__(self) -> None:
        _check_ratio("the span masking rate", self.rate)
        if not 0.0 < self.geometric_p <= 1.0:
            raise MaskingError(f"the geometric parameter of span lengths must be in (0, 1], got {self.geometric_p}")
        if self.max_words < 1:
            raise MaskingError(f"the longest span must be at least 1 word, got {self.max_words}")
        if len(self.split) != 3 or any(s < 0 for s in self.split) or abs(sum(self.split) - 1) > 1e-6:
            raise MaskingError(f"mask split must be three non-negative fractions (mask, random, kept) summing to 1, "
                               f"got {self.split}")

    def span_lengths(self) -> np.ndarray:
        """(max_words,) probabilities of a span of 1..max_words words: geometric, clipped and renormalised."""
        k = np.arange(1, self.max_words + 1)
        p = self.geometric_p * (1.0 - self.geometric_p) ** (k - 1)
        return p / p.sum()

    def describe(self) -> dict:
        """JSON-ready description, for meta.json."""
        return {"policy": "span", "rate": self.rate, "split": list(self.split), "geometric_p": self.geometric_p,
                "max_words": self.max_words, "seed": self.seed, "shift": self.shift}


def select_spans(units: list[list[int]], maskable: np.ndarray, policy: SpanMasking,
                 rng: np.random.Generator) -> list[list[int]]:
    """SpanBERT's span selection over ``units`` (words, each a list of token positions, in order).

    An anchor word is drawn uniformly; a span of ``L`` words from it (``L`` from
    :meth:`SpanMasking.span_lengths`) is added token by token until ``ceil(rate * n)`` maskable
    tokens are selected (the last span may stop inside a word, as in SpanBERT); a span also stops
    where it runs into an earlier one (SpanBERT lets it continue beyond and re-draws the action of
    the tokens they share). Returns the spans as lists of token positions; a position appears at most once.
    """
    n = int(maskable.sum())
    if n == 0 or not units:
        return []
    budget = math.ceil(n * policy.rate)
    lengths = policy.span_lengths()
    chosen: set[int] = set()
    spans: list[list[int]] = []
    tries = 0
    while len(chosen) < budget and tries < 100 * len(units):
        tries += 1
        words = int(rng.choice(len(lengths), p=lengths)) + 1
        anchor = int(rng.integers(len(units)))
        if any(t in chosen for t in units[anchor]):
            continue
        span: list[int] = []
        for t in (t for unit in units[anchor:anchor + words] for t in unit):
            if len(chosen) >= budget or t in chosen:
                break  # the budget is spent, or the span runs into an earlier one
            if maskable[t]:
                chosen.add(t)
                span.append(t)
        if span:
            spans.append(span)
    return spans


Objective = MaskedDiffusion | SpanMasking


__all__ = ["DIFFUSION_EPS", "MaskedDiffusion", "Objective", "SpanMasking", "select_spans"]
