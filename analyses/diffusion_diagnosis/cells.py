"""The cells of the diagnosis factorial (``figures/diffusion-diagnosis/plan.md``): one recipe change each.

A :class:`Cell` is mini-en's recipe (``analyses/pretraining/pretrain.py``: RoFormer 6 x 256, batch 16 x 128, AdamW
0.9/0.98, clipping at 1.0, bfloat16 autocast) under the masked-diffusion objective as the first member trained it
(LLaDA's: t per window, every selected token masked, the cross-entropy at the selected positions weighted by 1/t,
divided by the batch's real tokens), changed along five factors:

- ``tied``: the output layer shares the word-embedding matrix (RoFormer's default, the first member) or not;
- ``zero_output``: the untied output layer (its weight and bias) initialised to zero (MDLM);
- ``kept``: the fraction of the selected tokens left unchanged in the input (still in the loss): 0 is masked
  diffusion, 0.1 BERT's kept tokens (the action draw ``>= 0.9`` of mini-en's 80/10/10 draw);
- ``sampler``: how t is drawn per window (:data:`SAMPLERS`);
- ``lr`` and ``constant``: the peak learning rate, and whether it stays constant after the warm-up (MDLM) or decays
  linearly to 0 at the member's 3,059 steps (mini-en's schedule).

``objective="bert15"`` is the reference that leaves the unigram stage: mini-en's corruption (BERT 15%, 80/10/10) and
mean loss through the same code. Every cell trains the first ``steps`` steps of its 3,059-step schedule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from analyses.pretraining import objectives

EPS = objectives.EPS
"""LLaDA's lower bound of t."""
SAMPLERS = ("uniform", "antithetic", "bell", "low")
"""``uniform``: t = eps + (1 - eps) u, u ~ U(0, 1) per window (LLaDA, the first member); ``antithetic``: MDLM's
low-discrepancy draw, u_i = (u_0 + i / B) mod 1 for the B windows of a batch from one u_0; ``bell``: the mean of two
uniforms (a triangular density peaked at t = 0.5: fewer nearly clean and nearly all-masked windows);
``low``: t ~ U(eps, 0.5), a lower maximum t."""
SCHEDULE_STEPS = 3059
"""The member's step budget (mini-en's compute for this objective, ``figures/objectives/budget.md``)."""
WARMUP = 212
"""The member's warm-up steps."""


@dataclass(frozen=True)
class Cell:
    """One recipe of the factorial; ``name`` is its label in every table and file name."""

    name: str
    tied: bool = True
    zero_output: bool = False
    kept: float = 0.0
    sampler: str = "uniform"
    lr: float = 1e-3
    constant: bool = False
    objective: str = "diffusion"

    def __post_init__(self) -> None:
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler {self.sampler!r}: choose one of {', '.join(SAMPLERS)}")
        if self.zero_output and self.tied:
            raise ValueError(f"cell {self.name}: a zero output layer needs untied embeddings (tied, it zeroes the input)")
        if self.objective not in ("diffusion", "bert15"):
            raise ValueError(f"cell {self.name}: objective {self.objective!r} is neither 'diffusion' nor 'bert15'")

    @property
    def candidate(self) -> bool:
        """A recipe the member may ship with: the masked-diffusion objective (no kept tokens)."""
        return self.objective == "diffusion" and self.kept == 0.0

    def changes(self) -> tuple[str, ...]:
        """Its differences from the first member's recipe, in words (the base cell has none)."""
        base = CELLS[0]
        out = []
        if self.objective != base.objective:
            return ("BERT 15% (mini-en's corruption)",)
        if self.tied != base.tied:
            out.append("untied embeddings")
        if self.zero_output:
            out.append("zero-initialised output")
        if self.kept:
            out.append(f"{self.kept:.0%} of selected kept")
        if self.sampler != base.sampler:
            out.append(f"t {self.sampler}")
        if self.lr != base.lr or self.constant != base.constant:
            out.append(f"lr {self.lr:g}" + (" constant" if self.constant else ""))
        return tuple(out)


CELLS: tuple[Cell, ...] = (
    Cell("base"),
    Cell("kept", kept=0.1),
    Cell("untied", tied=False),
    Cell("untied-kept", tied=False, kept=0.1),
    Cell("untied-zero", tied=False, zero_output=True),
    Cell("untied-zero-kept", tied=False, zero_output=True, kept=0.1),
    Cell("antithetic", sampler="antithetic"),
    Cell("bell", sampler="bell"),
    Cell("low-t", sampler="low"),
    Cell("mdlm-lr", lr=3e-4, constant=True),
    Cell("mdlm", tied=False, zero_output=True, sampler="antithetic", lr=3e-4, constant=True),
    Cell("bert15", objective="bert15"),
)
"""The pre-registered cells, in the plan's order (``base`` is the first member's recipe)."""


def cell(name: str) -> Cell:
    """The cell called ``name``; a clear error naming the cells otherwise."""
    for c in CELLS:
        if c.name == name:
            return c
    raise ValueError(f"no cell {name!r}; the cells are {', '.join(c.name for c in CELLS)}")


def draw_t(sampler: str, batch: int, gen: torch.Generator, eps: float = EPS) -> torch.Tensor:
    """(batch,) float32 masking ratios t in [eps, 1] (``low``: [eps, 0.5]) drawn by ``sampler`` from ``gen``."""
    if sampler == "uniform":
        u = torch.rand(batch, generator=gen)
    elif sampler == "antithetic":
        u = (torch.rand(1, generator=gen) + torch.arange(batch) / batch) % 1.0
    elif sampler == "bell":
        u = (torch.rand(batch, generator=gen) + torch.rand(batch, generator=gen)) / 2
    elif sampler == "low":
        return eps + (0.5 - eps) * torch.rand(batch, generator=gen)
    else:
        raise ValueError(f"sampler {sampler!r}: choose one of {', '.join(SAMPLERS)}")
    return (1 - eps) * u + eps


def corrupt(c: Cell, ids: torch.Tensor, tokenizer, gen: torch.Generator, ratio_gen: torch.Generator
            ) -> objectives.Corrupted:
    """``ids`` (B, T) corrupted as cell ``c`` trains: mini-en's three draws from ``gen`` (selection, action, random
    token), t from ``ratio_gen``. Diffusion: selected where u < t; a selected token is kept where its action draw is
    >= 1 - kept, else masked. bert15: :func:`objectives.corrupt_bert` at 0.15."""
    if c.objective == "bert15":
        return objectives.corrupt_bert(ids, tokenizer, gen, 0.15)
    special = objectives.special_positions(ids, tokenizer)
    u = torch.rand(ids.shape, generator=gen)
    action = torch.rand(ids.shape, generator=gen)
    torch.randint(len(tokenizer), ids.shape, generator=gen)  # mini-en's random-token draw, unused (keeps the order)
    ratio = draw_t(c.sampler, ids.shape[0], ratio_gen)
    selected = (u < ratio[:, None]) & ~special
    masked = selected & (action < 1.0 - c.kept)
    inputs = torch.where(masked, torch.full_like(ids, tokenizer.mask_token_id), ids)
    return objectives.Corrupted(inputs, torch.where(selected, ids, torch.full_like(ids, -100)), selected, ratio)


def corrupt_at(ids: torch.Tensor, tokenizer, t: float, gen: torch.Generator) -> objectives.Corrupted:
    """The acceptance corruption: every non-special token of ``ids`` (B, T) replaced by [MASK] with probability ``t``
    (one draw per position from ``gen``), the loss at the masked positions, ``ratio`` t for every window."""
    special = objectives.special_positions(ids, tokenizer)
    selected = (torch.rand(ids.shape, generator=gen) < t) & ~special
    inputs = torch.where(selected, torch.full_like(ids, tokenizer.mask_token_id), ids)
    ratio = torch.full((ids.shape[0],), float(t))
    return objectives.Corrupted(inputs, torch.where(selected, ids, torch.full_like(ids, -100)), selected, ratio)


def unweighted(batch: objectives.Corrupted) -> objectives.Corrupted:
    """``batch`` with its 1/t weights dropped: the BERT objectives' mean loss at the loss positions."""
    return dataclasses.replace(batch, ratio=None)
