"""The channel view of one sentence: its table (every site x every token position) and files.

Every token position is a channel. Per (site, position) the table holds one of:

- ``grad_norm`` (and ``act_norm``): ``||dL/dh||`` and ``||h||`` at every recorder site
  (``embeddings.out``, each block's ``mid`` and ``out``), from :class:`GradFlowRecorder`. After
  the last attention nothing mixes channels, so the last block's ``mid`` and ``out`` are exactly
  zero at every position that carries no loss.
- ``attribution``: Captum gradient x activation at the embeddings and every block output,
  summed (``attribution_sum``, loss units, signed) and L2 (``attribution_norm``) over the hidden
  dimension, with the gradient and activation norms.
- ``integrated_gradients``: the same plus Captum layer integrated gradients from an all-[MASK]
  reference (``ig_sum``, ``ig_norm``).

The loss is the MLM loss with the ``"batch"`` reduction (mean over the chosen positions). Columns:
:data:`gradflow.schema.CHANNEL_VIEW_COLUMNS`; those a quantity does not compute are empty: with
``grad_norm`` the four attribution columns (``attribution_sum``, ``attribution_norm``, ``ig_sum``,
``ig_norm``), with ``attribution`` the two ``ig_*`` ones (and ``grad_norm``/``act_norm`` only at the
embeddings and block outputs, the sites Captum reads). The figure is drawn by
:mod:`gradflow.figures.channel_view` from the table alone.

Seeded BERT masking selects each maskable token independently with probability 0.15, so one
sentence's share is not 15%: :func:`selection` says what was drawn, and :func:`write_channel_view`
records it with the seed in ``meta.json``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pandas as pd
import torch

from gradflow.errors import ChannelViewError
from gradflow.figures.channel_view import save_channel_view
from gradflow.hooks.attribution import attribute_channels, integrated_gradients
from gradflow.hooks.recorder import GradFlowRecorder, RecorderConfig
from gradflow.hooks.records import BatchRecord
from gradflow.inputs.canvas import canvas_batch, split_encoding
from gradflow.inputs.masking import BertMasking, ExplicitMasking, MaskedBatch, MaskingPolicy, encode, mask_batch
from gradflow.models import LoadedModel
from gradflow.roles import LOSS_ROLES, Role, role_name
from gradflow.runs.files import write_csv, write_meta
from gradflow.runs.job import canvas_length, check_head_shift
from gradflow.runs.meta import JobInputs, JobOutcome, job_meta
from gradflow.schema import CHANNEL_VIEW_COLUMNS

VALUE_COLUMN: dict[str, str] = {"grad_norm": "grad_norm", "attribution": "attribution_sum",
                                "integrated_gradients": "ig_sum"}
"""The table column each quantity shows in the figure."""
QUANTITIES: tuple[str, ...] = tuple(VALUE_COLUMN)
"""What the channel view can show."""

SiteValues = tuple[str, int, str, dict[str, torch.Tensor]]
"""(site, layer, point, column -> (T,) values) of one site."""


def channel_batch(loaded: LoadedModel, text: str, mask_positions: Sequence[int] | None = None,
                  seed: int = 0, allow_empty: bool = False, objective: MaskingPolicy | None = None) -> MaskedBatch:
    """One-sentence batch: ``mask_positions`` (token indices, special tokens included, 0 = the first
    special token) become ``[MASK]``; None draws BERT's 15% masking, or ``objective``'s
    (:mod:`gradflow.inputs.objectives`), seeded by ``seed``. An empty ``mask_positions`` is refused
    unless ``allow_empty`` (then no position is selected); a shifted ``objective`` shifts them too. A two-pass model
    (DiffusionGemma) gets the split rule of a plain corpus (:mod:`gradflow.inputs.canvas`: the last ``min(C, n - 1)``
    tokens are the canvas, the rest the prompt, role ``prompt``), its masking on the canvas only, in the (1, P + C)
    layout that keeps every position where it was."""
    check_head_shift(objective if objective is not None else BertMasking(), loaded)
    enc = encode(loaded.tokenizer, text)
    n, limit = len(enc["input_ids"]), loaded.max_positions()
    if n > limit:
        raise ChannelViewError(f"the text has {n} tokens (special tokens included) but {loaded.name} accepts at most "
                               f"{limit}; shorten it to one sentence.")
    special = enc["special_tokens_mask"]
    if all(special):
        raise ChannelViewError("the text tokenizes to special tokens only: pass a sentence with words in it.")
    tokens = loaded.tokenizer.convert_ids_to_tokens(enc["input_ids"])
    prompt = 0
    if loaded.adapter.two_pass is not None:  # the split rule: the last min(C, n - 1) tokens are the canvas
        if n < 2:
            raise ChannelViewError(f"{loaded.name} reads a prompt and a canvas, one token each at least, and the text "
                                   f"has {n} token(s): pass a longer sentence.")
        enc = split_encoding(enc, canvas_length(loaded), "the text")
        prompt = int(enc["prompt_length"])
    if mask_positions is None:
        policy = channel_policy(objective, seed)
    else:
        positions = tuple(int(p) for p in mask_positions)
        if not positions and not allow_empty:
            raise ChannelViewError("mask_positions is empty: give at least one position to mask.")
        for p in positions:
            if not 0 <= p < n:
                raise ChannelViewError(f"mask position {p} is out of range: the text has {n} tokens, positions "
                                       f"0..{n - 1} ({_listing(tokens)}).")
            if special[p]:
                raise ChannelViewError(f"mask position {p} is the special token {tokens[p]!r}, which never carries "
                                       f"the MLM loss; choose a word position ({_listing(tokens)}).")
            if p < prompt:
                raise ChannelViewError(f"mask position {p} is in the prompt (positions 0..{prompt - 1}), which "
                                       f"{loaded.name} encodes and never predicts; choose a canvas position "
                                       f"({prompt}..{n - 1}).")
        policy = ExplicitMasking(positions={0: positions}, action="mask", shift=bool(objective and objective.shift))
    batch = mask_batch(loaded.tokenizer, policy=policy, encodings=[enc], max_length=n)
    if prompt:  # one row: the (P + C) layout keeps every position where it was
        pad = loaded.tokenizer.pad_token_id
        batch = canvas_batch(batch, [prompt], 0 if pad is None else int(pad))
    return batch


def channel_policy(objective: MaskingPolicy | None, seed: int) -> MaskingPolicy:
    """The masking of a drawn channel view: BERT's 15%, or ``objective`` seeded by ``seed``."""
    return BertMasking(seed=seed) if objective is None else replace(objective, seed=seed)


def selection(batch: MaskedBatch) -> dict:
    """What the masking selected in the batch's first row: ``positions`` (token indices), the count per loss role
    (``masked``, ``random``, ``kept``), ``selected`` of ``maskable`` (the positions that are not special) and
    their ``fraction``. BERT's masking draws each token on its own, so the fraction of one short sentence
    can be far from 15% (the explorer's sentence draws 4 of its 17 tokens at seed 0: 24%)."""
    roles = [role_name(r) for r in batch.roles[0]]
    positions = [t for t, r in enumerate(roles) if r in LOSS_ROLES]
    maskable = sum(r not in ("prompt", "special", "pad") for r in roles)
    return {"positions": positions, "selected": len(positions), "maskable": maskable,
            "fraction": round(len(positions) / maskable, 4) if maskable else 0.0,
            **{role: roles.count(role) for role in LOSS_ROLES}}


def selection_text(batch: MaskedBatch, seed: int | None, objective: MaskingPolicy | None = None) -> str:
    """One line for the terminal: how many tokens carry the loss, and how they were chosen."""
    chosen = selection(batch)
    how = "the positions given" if seed is None else _drawn_how(channel_policy(objective, seed), batch)
    if batch.shifted:
        how += "; shifted: a position carries the loss of the token after it"
    split = ", ".join(f"{chosen[r]} {r}" for r in LOSS_ROLES if chosen[r])
    return (f"{chosen['selected']} of {chosen['maskable']} tokens carry the loss "
            f"({100 * chosen['fraction']:.0f}%; {split}; {how})")


def _drawn_how(policy: MaskingPolicy, batch: MaskedBatch) -> str:
    """How ``policy`` drew the sentence's loss positions, in words."""
    described = policy.describe()
    if described["policy"] == "diffusion":
        return (f"masked diffusion, seed {policy.seed}: each token masked with probability t = "
                f"{float(batch.mask_ratio[0]):.3g}, loss weight 1/t")
    if described["policy"] == "span":
        return f"span masking, seed {policy.seed}: whole-word spans until {described['rate']:g} of the tokens"
    return (f"BERT's masking, seed {policy.seed}: each token is selected on its own with probability "
            f"{described['rate']:g}")


def _listing(tokens: Sequence[str], limit: int = 40) -> str:
    items = [f"{i}={t}" for i, t in enumerate(tokens[:limit])]
    return " ".join(items) + (" ..." if len(tokens) > limit else "")


def _check_quantity(quantity: str) -> None:
    if quantity not in QUANTITIES:
        raise ChannelViewError(f"unknown quantity {quantity!r}; choose one of {', '.join(QUANTITIES)}")


def _recorded_sites(loaded: LoadedModel, batch: MaskedBatch) -> list[SiteValues]:
    """Gradient and activation norms of the batch's first row at every recorder site."""
    with GradFlowRecorder(loaded.model, RecorderConfig(sublayers=False), loaded.adapter) as rec:
        record = rec.record(batch, loss="mlm", reduction="batch")
    return record_sites(record)


def record_sites(record: BatchRecord) -> list[SiteValues]:
    """Per site of a recorder's :class:`BatchRecord`: the first row's ``grad_norm`` and ``act_norm``, each (T,)."""
    where = zip(record.site_names, record.site_layers, record.site_points)
    return [(name, layer, point, {"grad_norm": record.grad_norm[s, 0], "act_norm": record.act_norm[s, 0]})
            for s, (name, layer, point) in enumerate(where)]


def _attributed_sites(loaded: LoadedModel, batch: MaskedBatch, integrated: bool, n_steps: int) -> list[SiteValues]:
    """Captum attributions of the batch's first row at the embeddings and every block output."""
    result = attribute_channels(loaded.model, batch, adapter=loaded.adapter)
    names = ("attribution_sum", "attribution_norm", "grad_norm", "act_norm")
    values = {n: result.per_position(n)[:, 0] for n in names}
    if integrated:
        ig, _ = integrated_gradients(loaded.model, batch, baseline_token_id=loaded.tokenizer.mask_token_id,
                                     n_steps=n_steps, adapter=loaded.adapter)
        values["ig_sum"] = torch.stack([a.sum(dim=-1) for a in ig])[:, 0]
        values["ig_norm"] = torch.stack([torch.linalg.vector_norm(a, dim=-1) for a in ig])[:, 0]
    return [(name, layer, "out", {k: v[s] for k, v in values.items()})
            for s, (name, layer) in enumerate(zip(result.site_names, result.layers))]


def channel_table(loaded: LoadedModel, batch: MaskedBatch, quantity: str = "grad_norm",
                  n_steps: int = 32) -> pd.DataFrame:
    """Tidy per (site, position) table of one sentence (columns :data:`CHANNEL_VIEW_COLUMNS`)."""
    _check_quantity(quantity)
    if quantity == "grad_norm":
        sites = _recorded_sites(loaded, batch)
    else:
        sites = _attributed_sites(loaded, batch, quantity == "integrated_gradients", n_steps)
    return sites_table(loaded, batch, sites)


def sites_table(loaded: LoadedModel, batch: MaskedBatch, sites: list[SiteValues]) -> pd.DataFrame:
    """The tidy table (columns :data:`CHANNEL_VIEW_COLUMNS`) of per-site values of the batch's first row."""
    tok = loaded.tokenizer
    original = tok.convert_ids_to_tokens(batch.original_ids[0].tolist())
    inputs = tok.convert_ids_to_tokens(batch.input_ids[0].tolist())
    roles = [role_name(r) for r in batch.roles[0]]
    rows = []
    for name, layer, point, cols in sites:
        for t in range(len(roles)):
            rows.append({"position": t, "token": original[t], "input_token": inputs[t], "role": roles[t], "site": name,
                         "layer": layer, "point": point, **{k: float(v[t]) for k, v in cols.items()}})
    return pd.DataFrame(rows).reindex(columns=list(CHANNEL_VIEW_COLUMNS))


def write_channel_view(loaded: LoadedModel, text: str, out_dir: str | Path, mask_positions: Sequence[int] | None = None,
                       quantity: str = "grad_norm", formats: Sequence[str] = ("pdf", "png"), seed: int = 0,
                       command: str | Sequence[str] = "", objective: MaskingPolicy | None = None) -> list[Path]:
    """Channel view of one sentence: ``channel_view.<fmt>``, ``channel_view.csv`` and ``meta.json`` in ``out_dir``.

    ``mask_positions``: token positions to mask (special tokens included in the count, so 0 is
    ``[CLS]``/``<s>``); None draws BERT masking seeded by ``seed`` (each token selected on its own
    with probability 0.15), or ``objective``'s masking. ``quantity``: one of :data:`QUANTITIES`. ``meta.json`` holds the
    provenance block of every job (model, ``masking`` with its seed, ``seed``, versions, ``command``)
    plus ``text``, ``quantity`` and ``selection`` (:func:`selection`). Returns the figures and the
    table (figures first, the table last); ``meta.json`` is written last, beside them.
    """

    _check_quantity(quantity)
    if loaded.adapter.two_pass is not None and quantity != "grad_norm":
        raise ChannelViewError(f"{loaded.name} runs a prompt and a canvas through two passes, which the attributions "
                               f"do not follow: use --quantity grad_norm (got {quantity}).")
    start = time.time()
    batch = channel_batch(loaded, text, mask_positions, seed=seed, objective=objective)
    if not bool((batch.roles <= Role.KEPT).any()):
        raise ChannelViewError("no position was selected for the loss; pass mask_positions.")
    table = channel_table(loaded, batch, quantity)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = save_channel_view(table, out / "channel_view", VALUE_COLUMN[quantity],
                              title=Path(loaded.name).name or loaded.name, formats=formats)
    csv = out / "channel_view.csv"
    write_csv(table, csv, CHANNEL_VIEW_COLUMNS)
    masking = (channel_policy(objective, seed).describe() if mask_positions is None
               else {"policy": "explicit", "action": "mask", "positions": [int(p) for p in mask_positions],
                     **({"shift": True} if batch.shifted else {})})
    inputs = JobInputs(model=loaded.name, texts="--text", masking=masking, seed=int(seed),
                       num_layers=int(table["layer"].max()))
    outcome = JobOutcome(complete=True, error=None, start=start, command=command, out_dir=str(out))
    write_meta(out / "meta.json", job_meta(loaded, inputs, outcome, {"text": text, "quantity": quantity,
                                                                      "selection": selection(batch)}))
    return [*paths, csv]


__all__ = ["QUANTITIES", "VALUE_COLUMN", "SiteValues", "channel_batch", "channel_policy", "channel_table",
           "record_sites", "selection", "selection_text", "sites_table", "write_channel_view"]
