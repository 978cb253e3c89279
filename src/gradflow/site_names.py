"""The names of the residual-stream sites: the one place that spells them (no torch, no modules).

- ``embeddings.out``: output of the embeddings module (layer 0);
- ``blocks.{i}.mid``: the residual stream after attention and before the FFN of block i;
- ``blocks.{i}.out``: output of block i (layer i + 1).

``i`` is the *depth*: a block module applied at several depths (ALBERT's shared layer) reports
each depth, in call order. Parameter groups of the Trainer callback are named ``blocks.{i}``, or
``blocks.{i}-{j}`` for one module applied at depths i to j.

A leaf: every layer may import it (tables name their rows by these sites); the hooks that reach
the sites live in :mod:`gradflow.hooks.sites`.
"""

from __future__ import annotations

from collections.abc import Sequence

EMBEDDINGS_SITE = "embeddings.out"
"""The site of the embeddings output (layer 0)."""
POINTS: tuple[str, ...] = ("mid", "out")
"""The points of a block, in call order."""


# ----------------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------------

def site_name(depth: int, point: str = "out") -> str:
    """``blocks.{depth}.{point}`` (``point``: ``mid`` or ``out``)."""
    if point not in POINTS:
        raise ValueError(f"unknown site point {point!r}; choose one of {', '.join(POINTS)}")
    return f"blocks.{int(depth)}.{point}"


def layer_site(layer: int) -> str:
    """The output site of ``layer``: ``embeddings.out`` for 0, else ``blocks.{layer - 1}.out``."""
    return EMBEDDINGS_SITE if layer == 0 else site_name(layer - 1, "out")


def site_names(num_blocks: int, mid: bool = False) -> tuple[str, ...]:
    """``embeddings.out`` then, per depth, (``blocks.{i}.mid``,) ``blocks.{i}.out``."""
    points = POINTS if mid else ("out",)
    return (EMBEDDINGS_SITE, *[site_name(i, p) for i in range(num_blocks) for p in points])


def parse_site(site: str) -> tuple[int | None, str]:
    """(depth, point) of a site name; depth is None for ``embeddings.out``."""
    if site == EMBEDDINGS_SITE:
        return None, "out"
    parts = site.split(".")
    if len(parts) != 3 or parts[0] != "blocks" or not parts[1].isdigit() or parts[2] not in POINTS:
        raise ValueError(f"not a site name: {site!r} (expected {EMBEDDINGS_SITE} or blocks.<depth>.<mid|out>)")
    return int(parts[1]), parts[2]


def depth_of(site: str) -> int | None:
    """The block depth of a site (None for ``embeddings.out``)."""
    return parse_site(site)[0]


def layer_of(site: str) -> int:
    """The layer of a site: 0 for ``embeddings.out``, depth + 1 for a block's sites."""
    depth = depth_of(site)
    return 0 if depth is None else depth + 1


def point_of(site: str) -> str:
    """The point of a site: ``out`` (embeddings, block output) or ``mid``."""
    return parse_site(site)[1]


def block_group_name(depths: int | Sequence[int]) -> str:
    """``blocks.{i}`` for one depth, ``blocks.{first}-{last}`` for a module applied at several."""
    if isinstance(depths, int):
        depths = (depths,)
    first, last = int(depths[0]), int(depths[-1])
    return f"blocks.{first}" if first == last else f"blocks.{first}-{last}"


def parse_block_group(name: str) -> tuple[int, int]:
    """(first, last) depth of a ``blocks.{i}`` or ``blocks.{i}-{j}`` group name."""
    prefix, _, span = name.partition(".")
    first, _, last = span.partition("-")
    if prefix != "blocks" or not first.isdigit() or not (last or first).isdigit():
        raise ValueError(f"not a block group name: {name!r} (expected blocks.<i> or blocks.<i>-<j>)")
    return int(first), int(last or first)
