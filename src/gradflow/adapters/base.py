"""The adapter: where an architecture keeps its embeddings, blocks, mid points and sublayers.

An adapter is data: dotted module paths relative to the model's base model
(``model.base_model``), under gradflow's standard names. The recorder, surgery and diagnostics
read adapters and never branch on ``model_type``.

Standard sublayer names: ``attn.q``, ``attn.k``, ``attn.v``, ``attn.out``, ``attn.norm``,
``ffn.in``, ``ffn.gate`` (gated FFNs), ``ffn.out``, ``ffn.norm``. A fused projection (one Linear
for Q, K and V, or for the FFN input and gate) is split by output rows with ``chunk=(i, n)``: the
i-th of n equal row blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

SUBLAYER_NAMES: tuple[str, ...] = (
    "attn.q", "attn.k", "attn.v", "attn.out", "attn.norm", "ffn.in", "ffn.gate", "ffn.out", "ffn.norm",
)


@dataclass(frozen=True)
class SublayerSpec:
    """One standard sublayer: a module path inside the block and an optional row chunk."""

    path: str
    chunk: tuple[int, int] | None = None


@dataclass(frozen=True)
class Adapter:
    """Where one architecture family keeps its parts (paths relative to ``model.base_model``).

    ``blocks``: path of the ``ModuleList`` of blocks. ``mid``: (path inside a block, "output" or
    "input") of the residual stream after attention and before the FFN. ``attn_norm``: "post" when
    the attention LayerNorm follows attention (post-LN BERT), "pre" when it feeds Q, K and V.
    ``expand_blocks`` (rare): a function ``(base_model) -> list of block modules in call order``
    for models that apply one module several times (ALBERT); otherwise ``blocks`` is used as is.
    """

    family: str
    model_types: tuple[str, ...]
    embeddings: str
    blocks: str
    mid: tuple[str, str]
    sublayers: dict[str, SublayerSpec]
    attn_norm: str = "post"
    expand_blocks: Callable[[nn.Module], list[nn.Module]] | None = field(default=None, compare=False)
    notes: str = ""

    def after_mixing(self) -> tuple[str, ...]:
        """Sublayers of a block that see only the channel's own post-attention state.

        In the last block these receive exactly zero gradient from non-loss channels.
        """
        names = ["attn.q", "attn.out", "ffn.in", "ffn.gate", "ffn.out", "ffn.norm"]
        if self.attn_norm == "post":
            names.append("attn.norm")
        return tuple(n for n in SUBLAYER_NAMES if n in names and n in self.sublayers)


def get_module(root: nn.Module, path: str) -> nn.Module:
    """``root.get_submodule(path)`` with an error that names the missing path."""
    if not path:
        return root
    try:
        return root.get_submodule(path)
    except AttributeError as err:
        raise LookupError(f"module path {path!r} not found in {type(root).__name__}: {err}") from None


def block_modules(adapter: Adapter, base: nn.Module) -> list[nn.Module]:
    """The blocks in call order (a module may repeat, e.g. ALBERT's shared layer)."""
    if adapter.expand_blocks is not None:
        return adapter.expand_blocks(base)
    return list(get_module(base, adapter.blocks))
