"""The channel view of one sentence: a tokens x sites heat map of where the MLM gradient goes.

Every token position is a channel; rows are the sentence's tokens (their role coloured on the
axis), columns the recorder's sites from the embeddings to the last block. Quantities:

- ``grad_norm``: ``||dL/dh||`` at every site (``embeddings.out``, ``blocks.{i}.mid``,
  ``blocks.{i}.out``), log colour scale; exact zeros are hatched grey cells. After the last
  attention nothing mixes channels, so the last block's ``mid`` and ``out`` columns are exactly
  zero at every position that carries no loss.
- ``attribution``: Captum gradient x activation summed over the hidden dimension at
  ``embeddings.out`` and every ``blocks.{i}.out`` (loss units, signed, symmetric-log scale).
- ``integrated_gradients``: Captum layer integrated gradients summed over the hidden dimension,
  all-[MASK] reference (signed).

The loss is the MLM loss with the ``"batch"`` reduction (mean over the chosen positions).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from matplotlib.artist import Artist
from matplotlib.axes import Axes

from gradflow.errors import ChannelViewError
from gradflow.hooks.attribution import attribute_channels, integrated_gradients
from gradflow.hooks.recorder import GradFlowRecorder, RecorderConfig
from gradflow.inputs.masking import BertMasking, ExplicitMasking, MaskedBatch, encode, mask_batch
from gradflow.models import LoadedModel
from gradflow.roles import TOKEN_ROLES, Role

QUANTITIES: tuple[str, ...] = ("grad_norm", "attribution", "integrated_gradients")
"""What the heat map can show."""
TABLE_COLUMNS: tuple[str, ...] = ("position", "token", "input_token", "role", "site", "layer", "point", "grad_norm",
                                  "act_norm", "attribution_sum", "attribution_norm", "ig_sum", "ig_norm")
"""Column order of ``channel_view.csv`` (columns a quantity does not compute are empty)."""
VALUE_COLUMN = {"grad_norm": "grad_norm", "attribution": "attribution_sum", "integrated_gradients": "ig_sum"}
VALUE_LABEL = {"grad_norm": "gradient norm ||dL/dh||", "attribution": "gradient x activation (sum over h)",
               "integrated_gradients": "integrated gradients (sum over h)"}



# ----------------------------------------------------------------------------------------------
# Input
# ----------------------------------------------------------------------------------------------

def channel_batch(loaded: LoadedModel, text: str, mask_positions: Sequence[int] | None = None,
                  seed: int = 0) -> MaskedBatch:
    """One-sentence batch: ``mask_positions`` (token indices, special tokens included, 0 = the first
    special token) become ``[MASK]``; None draws BERT's 15% masking seeded by ``seed``."""
    enc = encode(loaded.tokenizer, text)
    n, limit = len(enc["input_ids"]), loaded.max_positions()
    if n > limit:
        raise ChannelViewError(f"the text has {n} tokens (special tokens included) but {loaded.name} accepts at most "
                               f"{limit}; shorten it to one sentence.")
    special = enc["special_tokens_mask"]
    if all(special):
        raise ChannelViewError("the text tokenizes to special tokens only: pass a sentence with words in it.")
    tokens = loaded.tokenizer.convert_ids_to_tokens(enc["input_ids"])
    if mask_positions is None:
        policy: BertMasking | ExplicitMasking = BertMasking(seed=seed)
    else:
        positions = tuple(int(p) for p in mask_positions)
        if not positions:
            raise ChannelViewError("mask_positions is empty: give at least one position to mask.")
        for p in positions:
            if not 0 <= p < n:
                raise ChannelViewError(f"mask position {p} is out of range: the text has {n} tokens, positions "
                                       f"0..{n - 1} ({_listing(tokens)}).")
            if special[p]:
                raise ChannelViewError(f"mask position {p} is the special token {tokens[p]!r}, which never carries "
                                       f"the MLM loss; choose a word position ({_listing(tokens)}).")
        policy = ExplicitMasking(positions={0: positions}, action="mask")
    return mask_batch(loaded.tokenizer, policy=policy, encodings=[enc], max_length=n)


def _listing(tokens: Sequence[str], limit: int = 40) -> str:
    items = [f"{i}={t}" for i, t in enumerate(tokens[:limit])]
    return " ".join(items) + (" ..." if len(tokens) > limit else "")


def _display(token: str) -> str:
    """A token as shown on the axis (byte-level BPE and SentencePiece space marks removed)."""
    return token.replace("Ġ", "").replace("▁", "") or token


# ----------------------------------------------------------------------------------------------
# Table
# ----------------------------------------------------------------------------------------------

def channel_table(loaded: LoadedModel, batch: MaskedBatch, quantity: str = "grad_norm",
                  n_steps: int = 32) -> pd.DataFrame:
    """Tidy per (site, position) table of one sentence (columns :data:`TABLE_COLUMNS`)."""
    if quantity not in QUANTITIES:
        raise ChannelViewError(f"unknown quantity {quantity!r}; choose one of {', '.join(QUANTITIES)}")
    tok = loaded.tokenizer
    original = tok.convert_ids_to_tokens(batch.original_ids[0].tolist())
    inputs = tok.convert_ids_to_tokens(batch.input_ids[0].tolist())
    roles = [TOKEN_ROLES[int(r)] for r in batch.roles[0]]
    if quantity == "grad_norm":
        with GradFlowRecorder(loaded.model, RecorderConfig(sublayers=False), loaded.adapter) as rec:
            record = rec.record(batch, loss="mlm", reduction="batch")
        where = zip(record.site_names, record.site_layers, record.site_points)
        sites = [(name, layer, point, {"grad_norm": record.grad_norm[s, 0], "act_norm": record.act_norm[s, 0]})
                 for s, (name, layer, point) in enumerate(where)]
    else:
        result = attribute_channels(loaded.model, batch, adapter=loaded.adapter)
        names = ("attribution_sum", "attribution_norm", "grad_norm", "act_norm")
        values = {n: result.per_position(n)[:, 0] for n in names}
        if quantity == "integrated_gradients":
            ig, _ = integrated_gradients(loaded.model, batch, baseline_token_id=tok.mask_token_id, n_steps=n_steps,
                                         adapter=loaded.adapter)
            values["ig_sum"] = torch.stack([a.sum(dim=-1) for a in ig])[:, 0]
            values["ig_norm"] = torch.stack([torch.linalg.vector_norm(a, dim=-1) for a in ig])[:, 0]
        sites = [(name, layer, "out", {k: v[s] for k, v in values.items()})
                 for s, (name, layer) in enumerate(zip(result.site_names, result.layers))]
    rows = []
    for name, layer, point, cols in sites:
        for t in range(len(roles)):
            rows.append({"position": t, "token": original[t], "input_token": inputs[t], "role": roles[t], "site": name,
                         "layer": layer, "point": point, **{k: float(v[t]) for k, v in cols.items()}})
    return pd.DataFrame(rows).reindex(columns=list(TABLE_COLUMNS))


# ----------------------------------------------------------------------------------------------
# Figure
# ----------------------------------------------------------------------------------------------

def _site_label(site: str) -> str:
    if site == "embeddings.out":
        return "emb"
    _, depth, point = site.split(".")
    return f"{int(depth) + 1} {point}"


def _token_label(row: pd.Series) -> str:
    label = _display(str(row["token"]))
    if row["input_token"] != row["token"]:
        label = f"{label} \u2192 {_display(str(row['input_token']))}"
    return f"{label}  {int(row['position'])}"


def _norm(values: np.ndarray, signed: bool):
    from matplotlib.colors import LogNorm, Normalize, SymLogNorm

    nonzero = np.abs(values[np.isfinite(values) & (values != 0)])
    if nonzero.size == 0:
        return Normalize(-1, 1) if signed else Normalize(0, 1)
    top = float(nonzero.max())
    if signed:
        return SymLogNorm(linthresh=max(top * 1e-3, float(nonzero.min())), vmin=-top, vmax=top, base=10)
    return LogNorm(vmin=max(float(nonzero.min()), top * 1e-8), vmax=top)


def plot_channel_view(table: pd.DataFrame, value: str = "grad_norm", ax: Axes | None = None,
                      title: str | None = None, colorbar: bool = True, legend: bool = True) -> list[Artist]:
    """Tokens x sites heat map of ``value`` from :func:`channel_table`.

    Rows: tokens in order, labelled ``token [-> input] position`` and coloured by role, with a
    role strip on the left. Columns: sites from the embeddings to the last block, which is
    bracketed. Exact zeros are hatched grey. Returns the mesh (gid ``channels``), zero patches,
    role strip, bracket, legend and colour bar's axes.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.transforms import ScaledTranslation

    from gradflow.figures.style import ZERO_COLOR, diverging_cmap, gradflow_style, role_color

    signed = value in ("attribution_sum", "ig_sum")
    sites = list(dict.fromkeys(table["site"]))
    tokens = table[table["site"] == sites[0]].sort_values("position")
    grid = table.pivot_table(index="position", columns="site", values=value, aggfunc="first")
    values = grid.reindex(index=tokens["position"], columns=sites).to_numpy(dtype=float)
    n_tok, n_site = values.shape
    with gradflow_style("single"):
        if ax is None:
            _, ax = plt.subplots(figsize=(min(7.0, 2.3 + 0.24 * n_site), 1.1 + 0.14 * n_tok), layout="constrained")
        cmap = diverging_cmap() if signed else plt.get_cmap("viridis").with_extremes(bad="white")
        norm = _norm(values, signed)
        shown = np.ma.masked_where(~np.isfinite(values) | (values == 0), values)
        mesh = ax.pcolormesh(np.arange(n_site + 1) - 0.5, np.arange(n_tok + 1) - 0.5, shown, cmap=cmap, norm=norm,
                             edgecolors="white", linewidth=0.2, gid="channels")
        drawn: list[Artist] = [mesh]
        for i, j in zip(*np.nonzero(values == 0)):
            drawn.append(ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor=ZERO_COLOR, hatch="////",
                                                edgecolor="white", linewidth=0.0, gid="channels:zero")))
        roles = tokens["role"].tolist()
        for i, role in enumerate(roles):
            drawn.append(ax.add_patch(Rectangle((-1.25, i - 0.5), 0.55, 1, facecolor=role_color(role), linewidth=0,
                                                clip_on=False, gid=f"channels:role:{role}")))
        ax.set_xlim(-1.3, n_site - 0.5)
        ax.set_ylim(n_tok - 0.5, -0.5)
        ax.set_yticks(range(n_tok), [_token_label(r) for _, r in tokens.iterrows()], fontsize=6)
        for label, role in zip(ax.get_yticklabels(), roles):
            label.set_color(role_color(role))
            if role in ("masked", "random", "kept"):
                label.set_fontweight("bold")
        ax.set_xticks(range(n_site), [_site_label(s) for s in sites], rotation=90, fontsize=6)
        ax.tick_params(axis="both", length=0)
        for side in ("left", "bottom"):
            ax.spines[side].set_visible(False)
        ax.set_xlabel("site (block, point); layers run left to right")
        drawn += _last_block_bracket(ax, sites, n_tok)
        if title:
            ax.set_title(title, pad=22)
        if legend:
            present = [r for r in TOKEN_ROLES if r in roles]
            handles = [Patch(facecolor=role_color(r), label=r) for r in present]
            handles.append(Patch(facecolor=ZERO_COLOR, hatch="////", edgecolor="white", label="exactly 0"))
            below = ax.transAxes + ScaledTranslation(0, -0.56, ax.figure.dpi_scale_trans)
            drawn.append(ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), bbox_transform=below,
                                   ncols=min(len(handles), 5), fontsize=6, frameon=False, handlelength=1.2,
                                   columnspacing=0.8))
        if colorbar:
            cbar = ax.figure.colorbar(mesh, ax=ax, fraction=0.06, pad=0.02, aspect=25)
            cbar.set_label(VALUE_LABEL.get(_quantity(value), value), fontsize=6)
            cbar.ax.tick_params(labelsize=6, width=0.4, length=2)
            cbar.outline.set_linewidth(0.4)
            cbar.ax.set_gid("colorbar")
            drawn.append(cbar.ax)
    return drawn


def _quantity(value: str) -> str:
    return {v: k for k, v in VALUE_COLUMN.items()}.get(value, value)


def _last_block_bracket(ax: Axes, sites: list[str], n_tok: int) -> list[Artist]:
    """Dashed line before the last block's columns and a label above them."""
    last = max(int(s.split(".")[1]) for s in sites if s.startswith("blocks."))
    cols = [j for j, s in enumerate(sites) if s.startswith(f"blocks.{last}.")]
    left = min(cols) - 0.5
    line = ax.axvline(left, color="#222222", linewidth=0.8, linestyle="--", gid="channels:last_block")
    text = ax.text((left + max(cols) + 0.5) / 2, -0.6, "after the\nlast attention", ha="center", va="bottom",
                   fontsize=5.5, gid="channels:last_block_label")
    return [line, text]


def write_channel_view(loaded: LoadedModel, text: str, out_dir: str | Path, mask_positions: Sequence[int] | None = None,
                       quantity: str = "grad_norm", formats: Sequence[str] = ("pdf", "png")) -> list[Path]:
    """Channel view of one sentence: ``channel_view.<fmt>`` and ``channel_view.csv`` in ``out_dir``.

    ``mask_positions``: token positions to mask (special tokens included in the count, so 0 is
    ``[CLS]``/``<s>``); None draws BERT masking with seed 0. ``quantity``: one of
    :data:`QUANTITIES`. Returns the written paths (figures first, the table last).
    """
    import matplotlib.pyplot as plt

    from gradflow.figures import save_figure
    from gradflow.runs.files import write_csv

    if quantity not in QUANTITIES:
        raise ChannelViewError(f"unknown quantity {quantity!r}; choose one of {', '.join(QUANTITIES)}")
    batch = channel_batch(loaded, text, mask_positions)
    if not bool((batch.roles <= Role.KEPT).any()):
        raise ChannelViewError("no position was selected for the loss; pass mask_positions.")
    table = channel_table(loaded, batch, quantity)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawn = plot_channel_view(table, VALUE_COLUMN[quantity], title=Path(loaded.name).name or loaded.name)
    fig = drawn[0].axes.figure
    try:
        paths = save_figure(fig, out / "channel_view", formats)
    finally:
        plt.close(fig)
    csv = out / "channel_view.csv"
    write_csv(table, csv, TABLE_COLUMNS)
    return [*paths, csv]


__all__ = ["QUANTITIES", "TABLE_COLUMNS", "ChannelViewError", "channel_batch", "channel_table", "plot_channel_view",
           "write_channel_view"]
