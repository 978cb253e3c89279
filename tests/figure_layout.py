"""Layout checks of a drawn matplotlib figure: clipped text, legends over labels, overlapping labels.

:func:`layout_problems` draws the figure once and looks at the window extents (display pixels at
the figure's dpi) of what was actually drawn:

1. **clipped**: a drawn text (title, axis label, tick label, legend text, annotation, suptitle,
   banner with its box) or a legend's box that reaches outside the figure. Saved figures keep
   the figure's size (the column width), so whatever hangs outside is cut off.
2. **legend**: a legend's box that overlaps a text not its own (tick labels, axis labels, titles,
   cell labels, other legends) or the area of an axes other than its own (a figure legend has no
   axes of its own).
3. **overlap**: two drawn texts that overlap (titles, axis labels and tick labels of different
   axes, neighbouring tick labels, a title over an annotation), and a text of one axes (or of the
   figure, such as a banner) that reaches into the area of another axes (a colour bar included).
4. **collapsed**: a data axes (not a colour bar, not switched off) under 0.4 in wide or tall,
   what constrained layout leaves when the decorations do not fit.

Only texts that were drawn count: the check records every :class:`~matplotlib.text.Text` drawn
(visible, non-blank, finite position) while it renders the canvas, so tick labels outside the
view limits and invisible texts are ignored. A text clipped to a box (``clip_on``) counts only
inside it. Rotated texts are compared as rotated rectangles (separating-axis test), so the
45-degree tick labels of a bar chart are not flagged for their bounding boxes' corners.
Everything is compared with a tolerance of ``tol`` pixels (default 1): boxes that touch or share
less than a pixel are fine. A figure of a few hundred texts takes well under a second.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.legend import Legend
from matplotlib.text import Text
from matplotlib.transforms import Bbox

MIN_AXES_INCHES = 0.4


@dataclass
class _Drawn:
    """A drawn text: its display-space polygon (4 corners), bounding box and where it belongs."""

    text: Text
    corners: np.ndarray
    box: Bbox
    axes: Axes | None
    legend: Legend | None
    kind: str

    def name(self) -> str:
        where = f" of {_axes_name(self.axes)}" if self.axes is not None else ""
        return f"{self.kind} {self.text.get_text()!r}{where}"


@contextlib.contextmanager
def _recording_texts() -> Iterator[list[Text]]:
    """Record every Text whose draw() ran (visible, non-empty) while the block runs."""
    drawn: list[Text] = []
    original = Text.draw

    def draw(self: Text, renderer) -> None:  # type: ignore[no-untyped-def]
        if self.get_visible() and self.get_text().strip():
            x, y = self.get_transform().transform(self.get_unitless_position())
            if np.isfinite(x) and np.isfinite(y):
                drawn.append(self)
        original(self, renderer)

    Text.draw = draw  # type: ignore[method-assign]
    try:
        yield drawn
    finally:
        Text.draw = original  # type: ignore[method-assign]


def _axes_name(ax: Axes) -> str:
    if ax.get_gid() == "colorbar":
        return "colour bar"
    title = ax.get_title() or ax.get_title("left")
    fig = ax.figure
    index = fig.axes.index(ax) if fig is not None and ax in fig.axes else -1
    return f"axes {index}" + (f" ({title!r})" if title else "")


def _corners(text: Text, renderer) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The text's rectangle in display space as 4 corners (rotated texts: the rotated rectangle)."""
    box = text.get_window_extent(renderer)
    angle = text.get_rotation() % 180.0
    if min(angle % 90.0, 90.0 - angle % 90.0) < 1e-6:  # axis-aligned: the extent is exact
        return np.array([[box.x0, box.y0], [box.x1, box.y0], [box.x1, box.y1], [box.x0, box.y1]])
    rotation = text.get_rotation()
    text.set_rotation(0.0)
    flat = text.get_window_extent(renderer)
    text.set_rotation(rotation)
    # a rectangle's bounding box is centred on the rectangle, whatever the rotation
    cx, cy, w, h = (box.x0 + box.x1) / 2, (box.y0 + box.y1) / 2, flat.width, flat.height
    rad = math.radians(rotation)
    u, v = np.array([math.cos(rad), math.sin(rad)]), np.array([-math.sin(rad), math.cos(rad)])
    return np.array([cx, cy]) + np.array([-w / 2 * u - h / 2 * v, w / 2 * u - h / 2 * v,
                                          w / 2 * u + h / 2 * v, -w / 2 * u + h / 2 * v])


def _clip(corners: np.ndarray, clip: Bbox | None) -> tuple[np.ndarray, Bbox] | None:
    box = Bbox([corners.min(axis=0), corners.max(axis=0)])
    if clip is None:
        return corners, box
    inside = Bbox.intersection(box, clip)
    if inside is None or inside.width <= 0 or inside.height <= 0:
        return None
    if inside.bounds == box.bounds:
        return corners, box
    pts = np.array([[inside.x0, inside.y0], [inside.x1, inside.y0], [inside.x1, inside.y1], [inside.x0, inside.y1]])
    return pts, inside


def _overlap_1d(a0: float, a1: float, b0: float, b1: float) -> float:
    return min(a1, b1) - max(a0, b0)


def _boxes_overlap(a: Bbox, b: Bbox, tol: float) -> bool:
    return _overlap_1d(a.x0, a.x1, b.x0, b.x1) > tol and _overlap_1d(a.y0, a.y1, b.y0, b.y1) > tol


def _polygons_overlap(p: np.ndarray, q: np.ndarray, tol: float) -> bool:
    """Separating-axis test of two convex quadrilaterals: overlap deeper than ``tol`` on every axis."""
    for poly in (p, q):
        for i in range(len(poly)):
            edge = poly[(i + 1) % len(poly)] - poly[i]
            axis = np.array([-edge[1], edge[0]])
            norm = np.hypot(*axis)
            if norm == 0:
                continue
            axis /= norm
            a, b = p @ axis, q @ axis
            if _overlap_1d(a.min(), a.max(), b.min(), b.max()) <= tol:
                return False
    return True


def _kind(text: Text, ax: Axes | None, legend: Legend | None) -> str:
    if legend is not None:
        return "legend text"
    if ax is None:
        return "figure text"
    if any(text is t for t in _titles(ax)):
        return "title"
    if text is ax.xaxis.label or text is ax.yaxis.label:
        return "axis label"
    if text is ax.xaxis.get_offset_text() or text is ax.yaxis.get_offset_text():
        return "offset text"
    if any(text is t.label1 or text is t.label2 for axis in (ax.xaxis, ax.yaxis)
           for t in (*axis.get_major_ticks(), *axis.get_minor_ticks())):
        return "tick label"
    return "text"


def _titles(ax: Axes) -> list[Text]:
    """The axes' centre, left and right titles: its Text children that are not in ``ax.texts``."""
    return [c for c in ax.get_children() if isinstance(c, Text) and c not in ax.texts]


def _legends(fig: Figure) -> list[Legend]:
    found = [ax.get_legend() for ax in fig.axes]
    return [leg for leg in (*found, *fig.legends) if leg is not None and leg.get_visible()]


def layout_problems(fig: Figure, tol: float = 1.0) -> list[str]:
    """Draw ``fig`` and describe each clipped text, legend over a label, overlap or collapsed axes.

    Returns one sentence per problem (empty: the layout is clean); see the module docstring.
    """
    with _recording_texts() as texts:
        fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    owner: dict[int, Axes] = {}
    for ax in fig.axes:
        for t in ax.findobj(Text):
            owner.setdefault(id(t), ax)
    legends = _legends(fig)
    legend_of: dict[int, Legend] = {}
    for leg in legends:
        for t in (*leg.get_texts(), leg.get_title()):
            legend_of[id(t)] = leg

    drawn: list[_Drawn] = []
    seen: set[int] = set()
    for t in texts:
        if id(t) in seen:
            continue
        seen.add(id(t))
        clipped = _clip(_corners(t, renderer), t.get_clip_box() if t.get_clip_on() else None)
        if clipped is None:
            continue
        ax, leg = owner.get(id(t)), legend_of.get(id(t))
        drawn.append(_Drawn(t, clipped[0], clipped[1], ax, leg, _kind(t, ax, leg)))

    problems: list[str] = []
    figbox = fig.bbox

    def outside(box: Bbox) -> str:
        sides = [name for name, gap in (("left", figbox.x0 - box.x0), ("right", box.x1 - figbox.x1),
                                        ("bottom", figbox.y0 - box.y0), ("top", box.y1 - figbox.y1)) if gap > tol]
        return ", ".join(sides)

    # 1. clipped by the figure's edge
    for d in drawn:
        box = d.box
        patch = d.text.get_bbox_patch()
        if patch is not None:
            box = Bbox.union([box, patch.get_window_extent(renderer)])
        if sides := outside(box):
            problems.append(f"clipped: {d.name()} reaches outside the figure ({sides})")
    for leg in legends:
        if sides := outside(leg.get_window_extent(renderer)):
            problems.append(f"clipped: legend {_legend_name(leg)} reaches outside the figure ({sides})")

    # 2. legends over texts and over other axes
    areas = [(ax, ax.get_window_extent(renderer)) for ax in fig.axes if ax.get_visible() and ax.axison]
    for leg in legends:
        lbox = leg.get_window_extent(renderer)
        for d in drawn:
            if d.legend is not leg and _boxes_overlap(lbox, d.box, tol):
                problems.append(f"legend: legend {_legend_name(leg)} covers {d.name()}")
        own = leg.axes if isinstance(leg.parent, Axes) else None
        for ax, abox in areas:
            if ax is not own and _boxes_overlap(lbox, abox, tol):
                problems.append(f"legend: legend {_legend_name(leg)} covers the area of {_axes_name(ax)}")

    # 3. texts over texts, decorations over other axes
    boxes = np.array([[d.box.x0, d.box.y0, d.box.x1, d.box.y1] for d in drawn]).reshape(-1, 4)
    for i, a in enumerate(drawn):
        if i + 1 >= len(drawn):
            break
        rest = boxes[i + 1:]
        ox = np.minimum(rest[:, 2], a.box.x1) - np.maximum(rest[:, 0], a.box.x0)
        oy = np.minimum(rest[:, 3], a.box.y1) - np.maximum(rest[:, 1], a.box.y0)
        for j in np.nonzero((ox > tol) & (oy > tol))[0]:
            b = drawn[i + 1 + j]
            if a.legend is not None and a.legend is b.legend:
                continue  # a legend's own texts: checked by matplotlib's layout of the legend box
            if _polygons_overlap(a.corners, b.corners, tol):
                problems.append(f"overlap: {a.name()} overlaps {b.name()}")
    for d in drawn:
        if d.legend is not None:
            continue
        for ax, abox in areas:
            if ax is not d.axes and _boxes_overlap(d.box, abox, tol) and _polygons_overlap(
                    d.corners, _box_corners(abox), tol):
                problems.append(f"overlap: {d.name()} reaches into the area of {_axes_name(ax)}")

    # 4. axes squeezed to nothing
    for ax, abox in areas:
        if ax.get_gid() == "colorbar":
            continue
        w, h = abox.width / fig.dpi, abox.height / fig.dpi
        if min(w, h) < MIN_AXES_INCHES:
            problems.append(f"collapsed: {_axes_name(ax)} is {w:.2f} x {h:.2f} in")
    return problems


def _box_corners(box: Bbox) -> np.ndarray:
    return np.array([[box.x0, box.y0], [box.x1, box.y0], [box.x1, box.y1], [box.x0, box.y1]])


def _legend_name(leg: Legend) -> str:
    first = [t.get_text() for t in leg.get_texts()[:2]]
    return "(" + ", ".join(repr(x) for x in first) + (", ..." if len(leg.get_texts()) > 2 else "") + ")"


def assert_clean_layout(fig: Figure, what: str = "figure") -> None:
    """Fail with every layout problem of ``fig`` listed."""
    problems = layout_problems(fig)
    assert not problems, f"{what}:\n  " + "\n  ".join(problems)
