"""The site layer: the names of the residual-stream sites and the forward hooks that reach them.

Sites (one hidden vector per position, a (B, T, H) tensor):

- ``embeddings.out``: output of the embeddings module (layer 0);
- ``blocks.{i}.mid``: the residual stream after attention and before the FFN of block i
  (the adapter's ``mid``: a module's output, or its first positional input);
- ``blocks.{i}.out``: output of block i (layer i + 1).

``i`` is the *depth*: a block module applied at several depths (ALBERT's shared layer) reports
each depth, in call order. Blocks never called as one module (XLM's parallel lists; the adapter's
``block_entry``) start at their entry module, and a block's output is the next block's input (the
base model's output for the last block). Parameter groups of the Trainer callback are named ``blocks.{i}``, or
``blocks.{i}-{j}`` for one module applied at depths i to j.

Their names are spelled in :mod:`gradflow.site_names` (re-exported here). :class:`SiteLayer` installs the hooks:
``with SiteLayer(model).hooks(callback):`` calls ``callback(site, hidden)`` at every site of
every forward inside the block (a returned tensor replaces the hidden state) and removes exactly
the hooks it added on exit, also on exceptions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from gradflow.adapters import Adapter, block_modules, get_module, resolve_adapter
from gradflow.adapters.two_pass import first_pass_blocks
from gradflow.errors import SiteError
from gradflow.site_names import (  # noqa: F401  (the site layer re-exports the names)
    EMBEDDINGS_SITE,
    POINTS,
    block_group_name,
    depth_of,
    layer_of,
    layer_site,
    parse_block_group,
    parse_site,
    point_of,
    site_name,
    site_names,
)

SiteCallback = Callable[[str, torch.Tensor], "torch.Tensor | None"]
PassCallback = Callable[[int], None]
"""``on_pass(k)``: pass ``k`` of a two-pass model starts (0: the prompt's, 1: the canvas's)."""
"""``callback(site, hidden (B, T, H))``; a returned tensor replaces the hidden state."""
ForwardHook = Callable[[nn.Module, tuple, object], object]
"""A ``register_forward_hook`` hook: ``hook(module, args, output)``."""


# ----------------------------------------------------------------------------------------------
# Hidden states inside module outputs
# ----------------------------------------------------------------------------------------------

def hidden_state(output: object) -> torch.Tensor:
    """The hidden state of a module output: the tensor, a tuple's or list's first element, or
    ``last_hidden_state`` (a transformers ``ModelOutput``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    raise SiteError(f"cannot find the hidden state in a module output of type {type(output).__name__}")


def replace_hidden_state(output: object, new: torch.Tensor) -> object:
    """``output`` with its hidden state (see :func:`hidden_state`) replaced by ``new``."""
    if isinstance(output, torch.Tensor):
        return new
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (new, *output[1:])
    if isinstance(output, list) and output and isinstance(output[0], torch.Tensor):
        return [new, *output[1:]]
    if isinstance(getattr(output, "last_hidden_state", None), torch.Tensor):
        return type(output)(**{**output, "last_hidden_state": new})
    raise SiteError(f"cannot replace the hidden state in a module output of type {type(output).__name__}")


# ----------------------------------------------------------------------------------------------
# Depths
# ----------------------------------------------------------------------------------------------

def depth_occurrences(blocks: Sequence[nn.Module]) -> dict[int, list[int]]:
    """``id(block)`` -> the depths it is applied at, in call order (several for a shared block)."""
    occurrences: dict[int, list[int]] = {}
    for depth, block in enumerate(blocks):
        occurrences.setdefault(id(block), []).append(depth)
    return occurrences


def distinct_blocks(blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """Each block module once, in order of its first application (modules hash by identity)."""
    return list(dict.fromkeys(blocks))


@dataclass
class DepthStack:
    """The depths of the blocks running now, innermost last.

    A block module's n-th call since :meth:`reset` is its n-th depth (wrapping around, so a
    forward run again without a reset reports the same depths again).
    """

    occurrences: dict[int, list[int]]
    calls: dict[int, int] = field(default_factory=dict)
    stack: list[int] = field(default_factory=list)

    def reset(self) -> None:
        """Start a new forward pass."""
        self.calls.clear()
        self.stack.clear()

    def enter(self, block: nn.Module) -> int:
        """A block starts: push and return its depth."""
        mine = self.occurrences[id(block)]
        count = self.calls.get(id(block), 0)
        self.calls[id(block)] = count + 1
        depth = mine[count % len(mine)]
        self.stack.append(depth)
        return depth

    def leave(self) -> int | None:
        """A block ends: pop and return its depth (None if no block is running)."""
        return self.stack.pop() if self.stack else None

    @property
    def current(self) -> int | None:
        """The depth of the innermost running block, or None."""
        return self.stack[-1] if self.stack else None


# ----------------------------------------------------------------------------------------------
# Hooks
# ----------------------------------------------------------------------------------------------

def _output_hook(callback: SiteCallback, site: Callable[[], str | None], channels_first: bool = False) -> ForwardHook:
    """Forward hook: ``callback(site(), hidden)`` and the hidden state replaced by its result.

    ``channels_first``: the module returns (B, H, T); the callback sees the (B, T, H) transpose, and the
    output is replaced by that transpose transposed back, so gradients reach the tensor the callback saw."""
    def hook(module: nn.Module, args: tuple, output: object) -> object:
        name = site()
        if name is None:
            return None
        hidden = hidden_state(output)
        if channels_first:
            hidden = hidden.transpose(1, 2)
        new = callback(name, hidden)
        if channels_first:
            return replace_hidden_state(output, (hidden if new is None else new).transpose(1, 2))
        return None if new is None else replace_hidden_state(output, new)

    return hook


def _input_hook(callback: SiteCallback, site: Callable[[], str | None]) -> Callable[[nn.Module, tuple], tuple | None]:
    """Forward pre-hook: ``callback(site(), first input)`` and the input replaced by its result."""
    def hook(module: nn.Module, args: tuple) -> tuple | None:
        name = site()
        if name is None or not args:
            return None
        new = callback(name, args[0])
        return None if new is None else (new, *args[1:])

    return hook


def _block_input_hook(callback: SiteCallback, site: Callable[[], str | None]) -> Callable:
    """Forward pre-hook (with kwargs): ``callback(site(), the block's hidden-state input)``, replaced by
    its result; the hidden state is the first positional argument or the ``hidden_states`` keyword."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        name = site()
        if name is None:
            return None
        if args and isinstance(args[0], torch.Tensor):
            new = callback(name, args[0])
            return None if new is None else ((new, *args[1:]), kwargs)
        if isinstance(kwargs.get("hidden_states"), torch.Tensor):
            new = callback(name, kwargs["hidden_states"])
            return None if new is None else (args, {**kwargs, "hidden_states": new})
        raise SiteError(f"cannot find the hidden-state input of {type(module).__name__} (neither its first "
                        "positional argument nor hidden_states=)")

    return hook


class SiteLayer:
    """The sites of one model (``model.base_model``'s embeddings and blocks, from the adapter).

    ``adapter``: an :class:`Adapter`, None for the registered one, or ``"auto"`` for the generic one
    (a model without ``base_model``, a plain ``nn.Module``, is its own base). ``names``: the site
    names (with the ``mid`` sites when ``mid`` and the adapter knows its mid point); ``depths``: the
    depth stack the hooks keep (read ``depths.current`` from other hooks to know the running block's
    depth). ``passes``: the block lists of each pass in call order (one; two for a two-pass adapter, the
    prompt's first: block ``d`` of each pass is depth ``d``); ``hooked``: every block module of every pass, once.
    """

    def __init__(self, model: nn.Module, adapter: Adapter | str | None = None, mid: bool = True):
        self.adapter = resolve_adapter(model, adapter)
        self.base = getattr(model, "base_model", model)
        self.blocks = block_modules(self.adapter, self.base)
        spec = self.adapter.two_pass
        self.passes = [self.blocks] if spec is None else [first_pass_blocks(spec, self.base), self.blocks]
        self.hooked = distinct_blocks([block for blocks in self.passes for block in blocks])
        self.num_blocks = len(self.blocks)
        self.mid = mid and self.adapter.mid is not None
        if self.mid and self.adapter.channels_first and self.adapter.mid[1] != "output":
            # a transposed copy of an input would miss the gradient of the input's other uses (the residual)
            raise SiteError("an adapter with channels_first must name its mid point as a module's output")
        self.names = site_names(self.num_blocks, self.mid)
        self.depths = DepthStack({key: depths for blocks in self.passes
                                  for key, depths in depth_occurrences(blocks).items()})
        self._entered = 0
        self._on_pass: PassCallback | None = None

    @contextmanager
    def hooks(self, callback: SiteCallback, extra: Sequence[tuple[nn.Module, ForwardHook]] = (),
              on_pass: PassCallback | None = None) -> Iterator[tuple[str, ...]]:
        """Call ``callback`` at every site inside the block; yield the site names.

        ``extra``: more ``(module, forward hook)`` pairs to install with the site hooks; ``on_pass``: called
        with the pass's index when a pass of a two-pass model starts (before its first site). Exactly
        the hooks added here are removed on exit, also on exceptions (during installation too).
        """
        handles: list[RemovableHandle] = []
        self._on_pass = on_pass
        try:
            self._install(callback, handles)
            handles.extend(module.register_forward_hook(hook) for module, hook in extra)
            yield self.names
        finally:
            self._on_pass = None
            while handles:
                handles.pop().remove()

    def _install(self, callback: SiteCallback, handles: list[RemovableHandle]) -> None:
        embeddings = get_module(self.base, self.adapter.embeddings)
        handles.append(embeddings.register_forward_pre_hook(self._start_forward))
        at_blocks = self.adapter.embeddings_at == "blocks"
        if not at_blocks:
            handles.append(embeddings.register_forward_hook(_output_hook(callback, lambda: EMBEDDINGS_SITE)))
        entry_path = self.adapter.block_entry  # blocks never called as one module: each starts at its entry module
        transposed = self.adapter.channels_first  # (B, H, T) blocks (SqueezeBERT): sites see (B, T, H)
        exit_path = self.adapter.block_exit  # with block_entry: the module whose output is the block's output
        if len(self.passes) > 1:  # each pass starts at its first block (before that block's own hooks)
            for index, blocks in enumerate(self.passes):
                handles.append(blocks[0].register_forward_pre_hook(self._pass_starts(index)))
        for block in self.hooked:
            entry = block if entry_path is None else get_module(block, entry_path)
            if entry_path is not None and exit_path is None:  # the previous block's output is this block's input
                handles.append(entry.register_forward_pre_hook(_input_hook(callback, self._out_site)))
            handles.append(entry.register_forward_pre_hook(self._entering(block)))
            if entry_path is None:
                handles.append(block.register_forward_hook(_output_hook(callback, self._out_site, transposed)))
            elif exit_path is not None:
                handles.append(get_module(block, exit_path).register_forward_hook(
                    _output_hook(callback, self._out_site, transposed)))
            if self.mid:
                path, kind = self.adapter.mid
                module = get_module(block, path)
                handles.append(module.register_forward_hook(_output_hook(callback, self._mid_site, transposed))
                               if kind == "output" else
                               module.register_forward_pre_hook(_input_hook(callback, self._mid_site)))
        if at_blocks:
            for blocks in self.passes:
                first = blocks[0] if entry_path is None else get_module(blocks[0], entry_path)
                handles.append(first.register_forward_pre_hook(_block_input_hook(callback, self._first_block),
                                                               with_kwargs=True))
        if entry_path is not None and exit_path is None:  # the last block's output is the base model's
            handles.append(self.base.register_forward_hook(_output_hook(callback, self._out_site)))

    def _start_forward(self, module: nn.Module, args: tuple) -> None:
        self.depths.reset()
        self._entered = 0

    def _pass_starts(self, index: int) -> Callable[[nn.Module, tuple], None]:
        """Forward pre-hook on a pass's first block: a new forward of that pass's blocks starts."""
        def hook(module: nn.Module, args: tuple) -> None:
            self._start_forward(module, args)
            if self._on_pass is not None:
                self._on_pass(index)

        return hook

    def _entering(self, block: nn.Module) -> Callable[[nn.Module, tuple], None]:
        """Forward pre-hook (on ``block`` or its entry module): ``block`` starts."""
        return lambda module, args: self._enter_block(block)

    def _enter_block(self, block: nn.Module) -> None:
        if self.adapter.embeddings_at == "blocks" and self._entered == len(self.blocks) and block is self.blocks[0]:
            # a new forward whose base model was called as ``.forward(...)`` (LLaDA's LLaDAModelLM does), so the
            # pre-hook that starts a forward never ran: the first block starting again starts it
            self._start_forward(block, ())
        depth = self.depths.enter(block)
        if self.adapter.embeddings_at == "blocks" and depth != self._entered:
            raise SiteError(f"a block ran out of the discovered order (depth {depth} ran as block call "
                            f"{self._entered}): the generic adapter's block order does not hold for this forward; "
                            "describe the model with an Adapter instead")
        self._entered += 1

    def _first_block(self) -> str | None:
        return EMBEDDINGS_SITE if self.depths.current == 0 else None

    def _out_site(self) -> str | None:
        depth = self.depths.leave()
        return None if depth is None else site_name(depth, "out")

    def _mid_site(self) -> str | None:
        depth = self.depths.current
        return None if depth is None else site_name(depth, "mid")


@contextmanager
def site_hooks(model: nn.Module, callback: SiteCallback, adapter: Adapter | None = None,
               mid: bool = False) -> Iterator[tuple[str, ...]]:
    """``SiteLayer(model, adapter, mid).hooks(callback)``: call ``callback(site, hidden (B, T, H))``
    at every site of every forward inside the block; yield the site names."""
    with SiteLayer(model, adapter, mid).hooks(callback) as names:
        yield names


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


__all__ = [
    "EMBEDDINGS_SITE", "POINTS", "DepthStack", "ForwardHook", "PassCallback", "SiteCallback", "SiteLayer",
    "block_group_name",
    "depth_occurrences", "depth_of", "distinct_blocks", "hidden_state", "layer_of", "layer_site", "model_device",
    "parse_block_group", "parse_site", "point_of", "replace_hidden_state", "site_hooks", "site_name", "site_names",
]
