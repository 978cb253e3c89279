"""Numbers as text: the one rule of summaries, tables, figures and option ranges.

:func:`format_number` writes a number with ``digits`` significant digits:

- NaN and ``None`` are ``–`` (an en dash: "no value"); zero (``-0.0`` too) is ``0``;
- magnitudes below ``1e-3`` or from ``1e5`` up are scientific with ``digits`` significant digits
  (``digits - 1`` after the point, trailing zeros kept): ``0.000123456`` -> ``1.23e-04``,
  ``123456`` -> ``1.23e+05``;
- everything else is Python's ``g`` format with ``digits`` significant digits (rounded half to
  even on the binary value, trailing zeros dropped): ``0.50123`` -> ``0.501``, ``0.5`` -> ``0.5``,
  ``12.345`` -> ``12.3``, ``-2`` -> ``-2``; like ``g``, a number with more integer digits than
  ``digits`` is scientific: ``1234.5`` -> ``1.23e+03``, ``99999.4`` -> ``1e+05``;
- infinities are ``inf`` and ``-inf``; a value that is not a number (a label) is ``str(value)``.

``digits=None`` writes the number exactly instead (its shortest round-trip form, an integral
value without ``.0``: ``1.0`` -> ``1``, ``0.15`` -> ``0.15``, ``65535`` -> ``65535``): the form
of option ranges in usage messages (``in (0, 1]``).

:func:`format_estimate` is an estimate with its interval, ``value [low, high]``, each part by
:func:`format_number` (``0.501 [0.43, 0.57]``; a missing bound is ``–``: ``0.5 [–, –]``).
:func:`format_p_value` is a p-value: three decimals, scientific below 0.001.

Tables a paper prints use **fixed decimals per column** instead (:func:`column_decimals`,
:func:`format_fixed`, :func:`format_fixed_estimate`): every number of a column has the same number
of digits after the point (``0.480 [0.465, 0.494]`` above ``0.376 [0.365, 0.387]``), chosen so the
column's smallest non-zero estimate keeps two significant digits (3 to 5 decimals). An exact zero is
written ``0`` with no decimals, so a structural zero never reads like a small number rounded
(``0.000``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

MISSING = "–"
"""What a missing number (NaN, ``None``) is written as."""


def _float(x: Any) -> float | None:
    """``x`` as a float; ``None`` when it is not a number (``None`` itself is NaN)."""
    if x is None:
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def format_number(x: Any, digits: int | None = 3) -> str:
    """``x`` with ``digits`` significant digits (the module's rule); ``–`` for NaN or ``None``."""
    v = _float(x)
    if v is None:
        return str(x)
    if math.isnan(v):
        return MISSING
    if digits is None:
        return str(int(v)) if v.is_integer() else repr(v)
    if v == 0:
        return "0"
    if abs(v) < 1e-3 or abs(v) >= 1e5:
        return f"{v:.{digits - 1}e}"
    return f"{v:.{digits}g}"


def format_estimate(value: Any, low: Any, high: Any, digits: int = 3) -> str:
    """``value [low, high]``, each by :func:`format_number` (``0.501 [0.43, 0.57]``)."""
    return f"{format_number(value, digits)} [{format_number(low, digits)}, {format_number(high, digits)}]"


def format_p_value(p: Any) -> str:
    """A p-value: ``0.042``; scientific below 0.001 (``3.2e-05``); ``–`` for NaN or ``None``."""
    v = _float(p)
    if v is None:
        return str(p)
    if math.isnan(v):
        return MISSING
    return f"{v:.1e}" if v < 1e-3 else f"{v:.3f}"


MIN_DECIMALS = 3
"""Fewest decimals of a fixed-decimal column."""
MAX_DECIMALS = 5
"""Most decimals of a fixed-decimal column (smaller values show as ``0.00000`` or ``-0.00000``: not zero)."""


def column_decimals(values: Iterable[Any], significant: int = 2) -> int:
    """Decimals of a fixed-decimal column: enough for ``significant`` digits of its smallest non-zero finite
    magnitude, within [:data:`MIN_DECIMALS`, :data:`MAX_DECIMALS`] (``[0.48, 0.0193]`` -> 3, ``[0.0012]`` -> 4)."""
    magnitudes = [abs(v) for v in (_float(x) for x in values) if v is not None and math.isfinite(v) and v != 0]
    if not magnitudes:
        return MIN_DECIMALS
    needed = significant - 1 - math.floor(math.log10(min(magnitudes)))
    return max(MIN_DECIMALS, min(MAX_DECIMALS, needed))


def format_fixed(x: Any, decimals: int) -> str:
    """``x`` with exactly ``decimals`` decimals; an exact zero is ``0``; ``–`` for NaN or ``None``."""
    v = _float(x)
    if v is None:
        return str(x)
    if math.isnan(v):
        return MISSING
    if v == 0:
        return "0"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    return f"{v:.{decimals}f}"


def format_fixed_estimate(value: Any, low: Any, high: Any, decimals: int) -> str:
    """``value [low, high]``, each by :func:`format_fixed` with ``decimals`` (``0.480 [0.465, 0.494]``)."""
    return f"{format_fixed(value, decimals)} [{format_fixed(low, decimals)}, {format_fixed(high, decimals)}]"


def fixed_column(values: Iterable[Any], lows: Iterable[Any] | None = None, highs: Iterable[Any] | None = None,
                 decimals: int | None = None) -> list[str]:
    """One table column with fixed decimals: each value (``value [low, high]`` when bounds are given) with the
    decimals :func:`column_decimals` picks from the values, or ``decimals``; a missing value is ``–`` alone."""
    values = list(values)
    places = column_decimals(values) if decimals is None else decimals
    if lows is None or highs is None:
        return [format_fixed(v, places) for v in values]
    return [MISSING if format_fixed(v, places) == MISSING else format_fixed_estimate(v, lo, hi, places)
            for v, lo, hi in zip(values, lows, highs)]


def masking_label(masking: Any) -> str:
    """A short name of a meta.json ``masking`` description, for tables that compare objectives side by side:
    ``BERT 15% (80/10/10)``, ``span 40% (80/10/10)``, ``diffusion t ~ U(0.001, 1), 1/t``, ``diffusion t in {0.1,
    0.5}, 1/t``, ``diffusion t = 0.3, 1/t``, ``explicit positions``; ``, whole words`` and ``, shifted`` where they
    apply. Anything else: its text."""
    if not isinstance(masking, dict):
        return str(masking)
    policy = masking.get("policy")
    split = masking.get("split")
    parts = "/".join(format_number(100 * x, None) for x in split) if isinstance(split, list) else ""
    if policy in ("bert", "span"):
        label = f"{'BERT' if policy == 'bert' else 'span'} {format_number(100 * masking.get('rate', 0.15), None)}%"
        label += f" ({parts})" if parts else ""
        label += ", whole words" if masking.get("whole_word") else ""
    elif policy == "diffusion":
        if masking.get("ratio") is not None:
            t = f"t = {format_number(masking['ratio'], None)}"
        elif masking.get("ratios"):
            t = "t in {" + ", ".join(format_number(x, None) for x in masking["ratios"]) + "}"
        else:
            t = f"t ~ U({format_number(masking.get('eps'), None)}, 1)"
        label = f"diffusion {t}, 1/t"
    elif policy == "explicit":
        label = "explicit positions"
    else:
        return str(masking)
    return label + (", shifted" if masking.get("shift") else "")


def objective_label(meta: Any) -> str:
    """The training objective a run was recorded under, named from its meta.json (``loss`` and ``masking``):
    ``masked diffusion`` (masking policy ``diffusion``: cross-entropy at the masked positions, weighted 1/t),
    ``masked diffusion, SFT`` (with a prompt/response corpus), ``MLM`` (the loss ``mlm`` under any other masking),
    else the loss's name (``all-positions``). meta.json's ``loss`` alone says ``mlm`` for a diffusion run: the
    loss is computed at the selected positions either way; the masking makes it masked diffusion."""
    if not isinstance(meta, dict):
        return str(meta)
    masking, loss = meta.get("masking"), meta.get("loss")
    if isinstance(masking, dict) and masking.get("policy") == "diffusion" and loss in (None, "mlm"):
        return "masked diffusion" + (", SFT" if meta.get("prompted") else "")
    if loss in (None, "mlm"):
        return "MLM"
    return str(loss)


__all__ = ["MAX_DECIMALS", "MIN_DECIMALS", "MISSING", "column_decimals", "fixed_column", "format_estimate", "format_fixed",
           "format_fixed_estimate", "format_number", "format_p_value", "masking_label", "objective_label"]
