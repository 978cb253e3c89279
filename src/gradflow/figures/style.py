"""The shipped figure style: column-width presets, role colours, colour maps, a scoped style context.

Colours are Paul Tol's colour-blind-safe schemes (https://personal.sron.nl/~pault/): the
"vibrant" qualitative scheme for roles (warm colours for loss positions, cool for the rest; ``prompt``
takes indigo from the "muted" scheme, darker than context's blue),
"BuRd" for diverging ratios and "YlOrBr" for sequential fractions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import matplotlib as mpl
import matplotlib.style
from matplotlib.colors import LinearSegmentedColormap, to_rgb

STYLE_PATH: Path = Path(__file__).with_name("gradflow.mplstyle")
"""The style sheet shipped with gradflow."""

WIDTHS: dict[str, float] = {"single": 3.5, "double": 7.0}
DEFAULT_WIDTH = "single"
"""The width every figure command and writer uses unless told otherwise: one journal column."""
"""Figure widths in inches: one journal column, two columns."""

ROLE_COLORS: dict[str, str] = {
    "masked": "#CC3311",   # red
    "random": "#EE7733",   # orange
    "kept": "#EE3377",     # magenta
    "context": "#0077BB",  # blue
    "prompt": "#332288",   # indigo (Tol's "muted" scheme: "vibrant" has no colour left): a clean channel like context
    "special": "#009988",  # teal
    "pad": "#BBBBBB",      # grey
    "relpos": "#33BBEE",   # cyan
    "loss": "#000000",     # black: pooled masked + random + kept
}
"""One fixed colour per role, used by every gradflow figure."""

ROLE_LABELS: dict[str, str] = {"loss": "loss (pooled)"}
"""Legend labels that differ from the role name."""

ZERO_COLOR = "#DDDDDD"
"""Fill of heat-map cells whose value is exactly zero."""

WARNING_COLOR = "#A50026"

TOL_BURD = ("#2166AC", "#4393C3", "#92C5DE", "#D1E5F0", "#F7F7F7", "#FDDBC7", "#F4A582", "#D6604D", "#B2182B")
TOL_YLORBR = ("#FFFFE5", "#FFF7BC", "#FEE391", "#FEC44F", "#FB9A29", "#EC7014", "#CC4C02", "#993404", "#662506")

F = TypeVar("F", bound=Callable[..., Any])


def role_color(role: str) -> str:
    """The fixed colour of a role (grey for unknown names)."""
    return ROLE_COLORS.get(role, "#777777")


def role_label(role: str) -> str:
    """The legend label of a role."""
    return ROLE_LABELS.get(role, role)


def diverging_cmap() -> LinearSegmentedColormap:
    """Paul Tol's BuRd diverging colour map (blue below the centre, red above)."""
    return LinearSegmentedColormap.from_list("tol_burd", TOL_BURD).with_extremes(bad="#FFFFFF")


def sequential_cmap() -> LinearSegmentedColormap:
    """Paul Tol's YlOrBr sequential colour map."""
    return LinearSegmentedColormap.from_list("tol_ylorbr", TOL_YLORBR).with_extremes(bad="#FFFFFF")


def lighten(color: str, amount: float) -> tuple[float, float, float]:
    """``color`` mixed with white (``amount`` in [0, 1]) or, for negative amounts, with black."""
    rgb = to_rgb(color)
    if amount < 0:
        return tuple(c * (1.0 + amount) for c in rgb)  # type: ignore[return-value]
    return tuple(c + (1.0 - c) * amount for c in rgb)  # type: ignore[return-value]


def shade(color: str, k: int, n: int) -> tuple[float, float, float]:
    """The k-th of n shades of ``color``: from darker (k=0) through the colour to lighter (k=n-1)."""
    if n <= 1:
        return to_rgb(color)
    return lighten(color, -0.45 + 0.85 * k / (n - 1))


RUN_LINESTYLES = ("-", "--", "-.", ":")
RUN_MARKERS = ("o", "s", "^", "D", "v", "P")
RUN_HATCHES = ("", "////", "....", "xxxx", "\\\\\\\\", "oo")


def run_style(k: int, n: int, role: str = "context") -> dict[str, Any]:
    """Line style of run k of n in a comparison: the role's colour, shaded, with its own dash and marker."""
    return {"color": shade(role_color(role), k, n), "linestyle": RUN_LINESTYLES[k % len(RUN_LINESTYLES)],
            "marker": RUN_MARKERS[k % len(RUN_MARKERS)]}


def figure_width(width: str | float) -> float:
    """Width in inches of a preset (``"single"``, ``"double"``) or a number."""
    if isinstance(width, str):
        try:
            return WIDTHS[width]
        except KeyError:
            raise ValueError(f"unknown width {width!r}; use one of {', '.join(WIDTHS)} or inches") from None
    return float(width)


def figure_size(width: str | float = "single", aspect: float = 0.68) -> tuple[float, float]:
    """(width, height) in inches for a preset width and height/width ``aspect``."""
    w = figure_width(width)
    return (w, w * aspect)


@contextmanager
def gradflow_style(width: str | float = "single") -> Iterator[None]:
    """Apply the gradflow style sheet inside the block; the caller's rcParams come back in ``finally``."""
    saved = dict(mpl.rcParams.copy())
    saved.pop("backend", None)  # never switch (or resolve) the caller's backend
    try:
        matplotlib.style.use(STYLE_PATH)
        mpl.rcParams["figure.figsize"] = figure_size(width)
        yield
    finally:
        dict.update(mpl.rcParams, saved)


def styled(func: F) -> F:
    """Run a plotting function inside :func:`gradflow_style` (using its ``width`` keyword if given)."""
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gradflow_style(kwargs.get("width", "single")):
            return func(*args, **kwargs)
    return wrapper  # type: ignore[return-value]


TOL_BRIGHT = ("#4477AA", "#EE6677", "#228833", "#CCBB44", "#66CCEE", "#AA3377", "#BBBBBB")
"""Paul Tol's bright qualitative palette (colour-blind safe): one colour per model or run in a comparison."""


def series_color(k: int) -> str:
    """The colour of the k-th model or run in a comparison (cycles after seven)."""
    return TOL_BRIGHT[k % len(TOL_BRIGHT)]
