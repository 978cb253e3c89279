"""One sentence's channel view as an object: computed once, then shown, saved or sent to the page.

:func:`channel_view` masks a sentence (chosen positions, BERT's seeded 15%, or none), records it
with :class:`GradFlowRecorder` under the MLM or the all-positions loss, and returns a
:class:`ChannelView` holding

- ``table``: the tidy per (site, position) table of ``gradflow channels`` (columns
  :data:`CHANNEL_VIEW_COLUMNS`; ``grad_norm`` = ``||dL/dh||`` and ``act_norm`` = ``||h||`` per site);
- ``sublayers``: the last block's weight-gradient split by role (``share`` of the summed
  per-position magnitudes, per sublayer parameter; the recorder's ``sublayer_frame``);
- ``weight_sharing`` (None unless the last block's module is also applied at earlier depths, as
  ALBERT's shared layer is): ``layers`` applying it and, per sublayer weight, ``last_share`` (context's
  share at the last application: exactly 0 after the last attention) and ``total_context_share``
  (context's share of the shared weight's gradient over all applications; see
  :func:`gradflow.analysis.atlas.shared_context_shares`). The page's text states both.

The object draws itself with the project's plotting code (:meth:`ChannelView.save`), writes its
numbers (:meth:`ChannelView.to_csv`), becomes the explorer page's data (:meth:`ChannelView.payload`)
and a self-contained HTML page (:meth:`ChannelView.to_html`). In Jupyter it displays as that page
without plotly.js, which the first view of a kernel session brings once for every view of the
notebook (:func:`gradflow.explore.page.notebook_html`; :func:`reset_notebook_plotly` makes the next
view bring it again); its text form is one line (:meth:`ChannelView.__repr__`).

Sites are named as everywhere in gradflow (``embeddings.out``, ``blocks.{i}.mid``, ``blocks.{i}.out``,
blocks counted from 0); the page labels its columns with these names.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from gradflow.adapters.base import block_modules
from gradflow.analysis.atlas import shared_context_shares
from gradflow.errors import ChannelViewError
from gradflow.explore.page import notebook_html, static_page
from gradflow.figures.channel_view import save_channel_view
from gradflow.formatting import format_number
from gradflow.hooks.recorder import GradFlowRecorder, RecorderConfig
from gradflow.inputs.masking import MaskingPolicy
from gradflow.models import LoadedModel, load_model
from gradflow.roles import LOSS_ROLES, TOKEN_ROLES, Role, role_name
from gradflow.runs.channels import channel_batch, channel_policy, record_sites, sites_table
from gradflow.runs.check import layers_text, weight_sharing
from gradflow.runs.files import write_csv
from gradflow.schema import CHANNEL_VIEW_COLUMNS, EXPLORE_SUBLAYER_COLUMNS
from gradflow.site_names import block_group_name

LOSSES: dict[str, str] = {"mlm": "MLM: the selected positions only",
                          "all-positions": "all positions: the original token everywhere"}
"""The losses the view can backpropagate, with their labels in the page."""

NO_LOSS_NOTICE = ("No token is selected for the loss, so no gradient flows anywhere. Click a token to mask it, "
                  "or draw BERT's 15% at random.")
NO_LOSS_EXPLANATION = ("The MLM loss is computed at the selected tokens only; with none selected there is nothing "
                       "to backpropagate. Once a token carries the loss, this panel says where its gradient goes.")
"""The explanation panel's text when no token carries the loss (the notice itself is shown once, above)."""

_NOTEBOOK = {"plotly_sent": False}  # whether this kernel session has displayed plotly.js in a notebook output


def reset_notebook_plotly() -> None:
    """Make the next view displayed in Jupyter carry plotly.js again (after the output that carried it was
    cleared and the page reloaded: the views then say plotly.js did not arrive)."""
    _NOTEBOOK["plotly_sent"] = False


@dataclass(repr=False)
class ChannelView:
    """The channel view of one sentence (see the module docstring).

    ``tokens``/``input_tokens``/``roles``: per position (special tokens included), the original
    token, what the model read, and the role name. ``table`` and ``sublayers`` are empty when no
    position carries the loss (``notice`` then says why). ``loss_value``: the loss (nats) or None.
    ``after_mixing``: the sublayers that read only their own channel after the last attention (in the
    last block they get exactly zero gradient from positions without loss). ``weight_sharing``: see the
    module docstring (None for a last block applied once).
    """

    model: str
    text: str
    loss: str
    masking: dict
    tokens: list[str]
    input_tokens: list[str]
    roles: list[str]
    num_blocks: int
    after_mixing: list[str] = field(default_factory=list)
    table: pd.DataFrame = field(default_factory=pd.DataFrame)
    sublayers: pd.DataFrame = field(default_factory=pd.DataFrame)
    loss_value: float | None = None
    notice: str | None = None
    weight_sharing: dict | None = None

    @property
    def has_gradient(self) -> bool:
        """Whether a loss was backpropagated (some position carries it)."""
        return not self.table.empty

    def sites(self) -> list[str]:
        """Site names in order, from the embeddings to the last block's output."""
        return list(dict.fromkeys(self.table["site"])) if self.has_gradient else []

    def grid(self, column: str = "grad_norm") -> list[list[float]]:
        """(T, S) values of ``column``: one row per token position, one column per site."""
        pivot = self.table.pivot_table(index="position", columns="site", values=column, aggfunc="first")
        return pivot.reindex(index=range(len(self.tokens)), columns=self.sites()).to_numpy(dtype=float).tolist()

    def last_block_zero(self) -> list[bool]:
        """Per position: every last-block site has an exactly zero gradient there."""
        if not self.has_gradient:
            return [False] * len(self.tokens)
        last = self.table[self.table["layer"] == self.num_blocks]
        zero = last.groupby("position")["grad_norm"].apply(lambda g: bool((g == 0).all()))
        return [bool(zero.get(t, False)) for t in range(len(self.tokens))]

    def payload(self) -> dict:
        """JSON-ready data of the explorer page (exact zeros stay ``0.0``; no NaN or infinity)."""
        info = self.table.drop_duplicates("site")[["site", "layer", "point"]] if self.has_gradient else None
        sites = [] if info is None else [{"name": r.site, "layer": int(r.layer), "point": r.point,
                                          "label": _site_label(r.site, int(r.layer), r.point)}
                                         for r in info.itertuples()]
        last_start = next((i for i, s in enumerate(sites) if s["layer"] == self.num_blocks), None)
        return {"model": self.model, "text": self.text, "loss": self.loss, "loss_label": LOSSES[self.loss],
                "masking": self.masking, "tokens": self.tokens, "input_tokens": self.input_tokens,
                "roles": self.roles, "num_blocks": self.num_blocks, "sites": sites, "last_block_start": last_start,
                "grad_norm": _finite(self.grid("grad_norm")) if self.has_gradient else None,
                "act_norm": _finite(self.grid("act_norm")) if self.has_gradient else None,
                "last_block_zero": self.last_block_zero(), "sublayers": self._sublayer_rows(),
                "after_mixing": self.after_mixing, "weight_sharing": self.weight_sharing,
                "loss_value": self.loss_value, "notice": self.notice, "explanation": explanation(self),
                "csv_columns": list(CHANNEL_VIEW_COLUMNS)}

    def _sublayer_rows(self) -> list[dict]:
        if self.sublayers.empty:
            return []
        cols = list(EXPLORE_SUBLAYER_COLUMNS)
        return [{k: (v if not isinstance(v, float) or math.isfinite(v) else None) for k, v in row.items()}
                for row in self.sublayers[cols].to_dict("records")]

    def to_csv(self, path: str | Path) -> Path:
        """Write the per (site, position) table as CSV (columns :data:`CHANNEL_VIEW_COLUMNS`)."""
        self._require_gradient("write its numbers")
        path = Path(path)
        write_csv(self.table, path, CHANNEL_VIEW_COLUMNS)
        return path

    def save(self, path_stem: str | Path, formats: Sequence[str] = ("pdf", "png")) -> list[Path]:
        """Draw the view with :func:`gradflow.figures.channel_view.save_channel_view`; returns the paths."""

        self._require_gradient("draw it")
        return save_channel_view(self.table, path_stem, "grad_norm", title=Path(self.model).name or self.model,
                                 formats=formats)

    def to_html(self, path: str | Path | None = None) -> str:
        """One self-contained HTML page (data, script and plotting library inline; opens offline)."""

        page = static_page(self.payload())
        if path is not None:
            Path(path).write_text(page, encoding="utf-8")
        return page

    def _repr_html_(self) -> str:
        """Jupyter: the page in a sandboxed frame (its script runs apart from the notebook's); plotly.js comes
        with the first view of the kernel session only (see :func:`gradflow.explore.page.notebook_html`)."""
        carry = not _NOTEBOOK["plotly_sent"]
        output = notebook_html(self.payload(), height=260 + 16 * len(self.tokens), carry_plotly=carry)
        _NOTEBOOK["plotly_sent"] = True
        return output

    def __repr__(self) -> str:
        """One line: model, loss, the roles' counts, the table's shape and the sentence (cut to 60 characters)."""
        counts = ", ".join(f"{self.roles.count(r)} {r}" for r in TOKEN_ROLES if r in self.roles)
        text = self.text if len(self.text) <= 60 else self.text[:57] + "..."
        shape = (f"{len(self.sites())} sites x {len(self.tokens)} positions" if self.has_gradient
                 else "no gradient: no token carries the loss")
        return (f"<ChannelView {self.model}, loss {self.loss}: {len(self.tokens)} tokens ({counts}); {shape}; "
                f"text {text!r}>")

    def _require_gradient(self, what: str) -> None:
        if not self.has_gradient:
            raise ChannelViewError(f"cannot {what}: {NO_LOSS_NOTICE}")


def channel_view(loaded: LoadedModel | str, text: str, mask: Sequence[int] | str = "random", seed: int = 0,
                 loss: str = "mlm", objective: MaskingPolicy | None = None) -> ChannelView:
    """Record one sentence and return its :class:`ChannelView`.

    ``loaded``: a :class:`LoadedModel` or a model name for :func:`gradflow.load_model` (embedded,
    ``zoo:NAME``, a local directory or a hub name).
    ``mask``: token positions to replace by the mask token (special tokens count, 0 is the first),
    ``"random"`` for BERT's 15% (80% mask, 10% random, 10% kept) seeded by ``seed``, or ``[]`` for
    none. ``loss``: ``"mlm"`` or ``"all-positions"``. ``objective``: the masking ``"random"`` draws
    (masked diffusion, span masking, a shift: :mod:`gradflow.inputs.objectives`) instead of BERT's;
    a shifted one shifts given positions too (each carries the loss of the token after it).
    """
    if isinstance(loaded, str):
        loaded = load_model(loaded)
    if loss not in LOSSES:
        raise ChannelViewError(f"unknown loss {loss!r}; choose one of {', '.join(LOSSES)}")
    if isinstance(mask, str):
        if mask != "random":
            raise ChannelViewError(f"mask must be a list of token positions or 'random', got {mask!r}")
        batch = channel_batch(loaded, text, None, seed=seed, objective=objective)
        masking = ({"policy": "bert", "seed": int(seed)} if objective is None
                   else channel_policy(objective, seed).describe())
    else:
        positions = sorted({int(p) for p in mask})
        batch = channel_batch(loaded, text, positions, allow_empty=True, objective=objective)
        masking = {"policy": "explicit", "positions": positions, **({"shift": True} if batch.shifted else {})}
    tok = loaded.tokenizer
    blocks = block_modules(loaded.adapter, loaded.model.base_model)
    roles = [role_name(r) for r in batch.roles[0]]
    masking["selected"] = [t for t, r in enumerate(roles) if r in LOSS_ROLES]
    view = ChannelView(model=loaded.name, text=text, loss=loss, masking=masking,
                       tokens=tok.convert_ids_to_tokens(batch.original_ids[0].tolist()),
                       input_tokens=tok.convert_ids_to_tokens(batch.input_ids[0].tolist()), roles=roles,
                       num_blocks=len(blocks),
                       after_mixing=list(loaded.adapter.after_mixing()))
    if loss == "mlm" and not bool((batch.roles <= Role.KEPT).any()):
        view.notice = NO_LOSS_NOTICE
        return view
    with GradFlowRecorder(loaded.model, RecorderConfig(sublayers=True), loaded.adapter) as rec:
        record = rec.record(batch, loss=loss, reduction="batch")
    view.num_blocks = record.num_blocks
    view.table = sites_table(loaded, batch, record_sites(record))
    frame = record.sublayer_frame()
    view.sublayers = frame[frame["layer"] == record.num_blocks].reset_index(drop=True)
    shared = next((group for group in weight_sharing(blocks) if record.num_blocks in group), [])
    if shared:
        rows = shared_context_shares(frame, shared).drop(columns="param").to_dict("records")
        view.weight_sharing = {"layers": shared, "sublayers": [{k: _number(v) for k, v in r.items()} for r in rows]}
    view.loss_value = record.loss
    return view


def explanation(view: ChannelView) -> list[str]:
    """A few sentences for a student about what this view shows (plain text, one paragraph each)."""
    selected = [t for t, r in enumerate(view.roles) if r in LOSS_ROLES]
    clean = [t for t, r in enumerate(view.roles) if r == "context"]
    if not view.has_gradient:
        return [NO_LOSS_EXPLANATION]
    zero = view.last_block_zero()
    n_zero = sum(zero[t] for t in clean)
    words = ", ".join(repr(view.tokens[t]) for t in selected[:6]) + (" ..." if len(selected) > 6 else "")
    if view.loss == "mlm":
        first = (f"The loss is computed at {len(selected)} selected position(s) ({words}). Each row is one token's "
                 "channel; each column a point in the network, from the embeddings (left) to the last block (right).")
        second = (f"In the last block ({_block_name(view)}), after the last attention, {n_zero} of the {len(clean)} context "
                  "channels get a gradient of exactly 0 (hatched): nothing mixes channels any more, so no signal "
                  "reaches a token that carries no loss. The last block's query, attention output, feed-forward and "
                  "LayerNorm weights therefore learn nothing from these tokens"
                  + (" in this application of the shared block (see below)." if view.weight_sharing else "."))
    else:
        first = ("The all-positions loss predicts the original token at every word position (the twin model's "
                 "objective), so every channel carries its own loss.")
        second = (f"Now no context channel is dark in the last block ({_block_name(view)}): {n_zero} of {len(clean)} "
                  "are exactly 0. "
                  "Switch back to the MLM loss to see the last block go dark.")
    third = ("Earlier blocks are not dark: attention sends the gradient of a selected token into the keys and values "
             "of every other token, so the clean channels are trained there, one attention later than you might think.")
    return [first, second, *_sharing_text(view), third]


def _sharing_text(view: ChannelView) -> list[str]:
    """For a last block whose weights are shared with earlier depths: what the zeros mean for those weights."""
    sharing = view.weight_sharing
    if not sharing or view.loss != "mlm":
        return []
    layers, n = sharing["layers"], len(sharing["layers"])
    shares = {r["sublayer"]: r["total_context_share"] for r in sharing["sublayers"]}
    zero = ", ".join(f"{s} {format_number(100 * shares[s])}%" for s in view.after_mixing if s in shares)
    if not zero:
        return []
    return [(f"This model shares one block's weights across depths: the block at layer {layers[-1]} is the same module "
             f"as at {layers_text(layers[:-1], 'layer')} ({n} applications; layer = block index + 1). "
             "The zeros are per application: the last "
             "application gets exactly 0 from the context channels, but the same weights learn from context "
             f"through the earlier ones. Over all {n} applications, context gives {zero} of the shared weights' "
             "gradient in this sentence.")]


def _site_label(site: str, layer: int, point: str) -> str:
    """The column label: the site's own name (``blocks.5.mid``), the one numbering of blocks (from 0)."""
    return site


def _block_name(view: ChannelView) -> str:
    """``blocks.5`` for a 6-block model: the last block as its site names count it (from 0)."""
    return block_group_name(view.num_blocks - 1)


def _number(value):
    """A JSON-ready scalar: numpy numbers as Python ones, NaN and infinities as None."""
    value = value.item() if hasattr(value, "item") else value
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _finite(grid: list[list[float]]) -> list[list[float | None]]:
    return [[v if math.isfinite(v) else None for v in row] for row in grid]


__all__ = ["LOSSES", "NO_LOSS_EXPLANATION", "NO_LOSS_NOTICE", "ChannelView", "channel_view", "explanation",
           "reset_notebook_plotly"]
