"""The generic adapter (``adapter="auto"``, opt-in): the block stack discovered from the module tree.

For a model without a registered adapter (a custom ``nn.Module``, a ``--trust-remote-code``
checkpoint, an unregistered ``model_type``) :func:`discover_adapter` finds:

- candidate stacks: for every module, its direct children grouped by class (a ``ModuleList`` of
  blocks, or repeated sibling modules), each child holding an ``nn.Linear``, none holding the
  input embeddings or the output head;
- one tiny forward (``input_ids`` (2, 7), ``attention_mask`` of ones, no gradient) with forward
  hooks on every candidate: a candidate qualifies when its members are called at least twice,
  one call after another (never nested), each call taking and returning one hidden vector per
  position of the same width, all after the input embeddings ran and before the head ran. The
  stack with the most calls wins (then the most distinct modules, then the outermost); its call
  sequence is the block order, so a module applied at several depths (ALBERT) is one block per
  application;
- the parameters split by role: every ``nn.Linear`` and ``nn.LayerNorm``, and every RMSNorm-like
  module with a gain of the hidden width (:mod:`gradflow.adapters.norms`), inside the blocks, that
  ran on the positions exactly once per block. Sublayers are named by their module path inside the
  block; everything else holding parameters is listed as not split.

Sites: ``embeddings.out`` is the input of the first block (not an embeddings module's output) and
``blocks.{i}.out`` each block's output; there are no ``mid`` sites and no standard sublayer names,
so the after-mixing set is unknown. The recorder checks at every forward that the blocks run in
the discovered order. No stack: :class:`~gradflow.errors.UnsupportedArchitectureError`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from gradflow.adapters.base import Adapter, HeadSpec, SublayerSpec
from gradflow.adapters.experts import ExpertsSpec
from gradflow.adapters.generic_experts import ExpertProbe, computes_linear, find_experts, inside, router_like
from gradflow.adapters.norms import norm_like
from gradflow.adapters.refusals import refusal
from gradflow.adapters.registry import registered_family
from gradflow.errors import SurgeryError, UnsupportedArchitectureError

PROBE_SHAPE = (2, 7)
"""(B, T) of the discovery forward."""


@dataclass
class _Call:
    module: nn.Module
    start: int
    end: int = -1
    width: int | None = None
    token_input: bool = False


@dataclass
class _Group:
    parent: str
    paths: list[str]
    modules: list[nn.Module]
    calls: list[_Call] = field(default_factory=list)
    active: int = 0


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    hidden = kwargs.get("hidden_states")
    if isinstance(hidden, torch.Tensor):
        return hidden
    return next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)


def _output_tensor(output: object) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    hidden = getattr(output, "last_hidden_state", None)
    return hidden if isinstance(hidden, torch.Tensor) else None


def _token_shaped(x: torch.Tensor | None) -> bool:
    return x is not None and x.dim() == 3 and tuple(x.shape[:2]) == PROBE_SHAPE


def _input_embeddings(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_input_embeddings", None)
    try:
        found = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        found = None
    return found or next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _output_head(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        return None


def _groups(base: nn.Module, avoid: list[nn.Module]) -> list[_Group]:
    """Children of every module, grouped by class, that hold a Linear and none of ``avoid``."""
    groups = []
    for parent_path, parent in base.named_modules():
        by_class: dict[type, _Group] = {}
        for name, child in parent.named_children():
            if isinstance(child, (nn.Linear, nn.ModuleList, nn.ModuleDict)):
                continue
            inner = list(child.modules())
            if not any(isinstance(m, nn.Linear) for m in inner) or any(a is m for a in avoid for m in inner):
                continue
            group = by_class.setdefault(type(child), _Group(parent_path, [], []))
            group.paths.append(f"{parent_path}.{name}" if parent_path else name)
            group.modules.append(child)
        groups.extend(by_class.values())
    return groups


class _Probe:
    """Forward hooks for the discovery forward: candidate calls, sublayer inputs, embeddings and head."""

    def __init__(self, groups: list[_Group], leaves: list[nn.Module]):
        self.groups, self.leaves = groups, leaves
        self.tick = 0
        self.embed_end: int | None = None
        self.head_start: int | None = None
        self.leaf_calls: dict[int, list[tuple[int, bool, bool, bool]]] = {id(m): [] for m in leaves}

    def _next(self) -> int:
        self.tick += 1
        return self.tick

    def install(self, embed: nn.Module | None, head: nn.Module | None) -> list:
        handles = []
        for group in self.groups:
            for module in group.modules:
                handles.append(module.register_forward_pre_hook(self._enter(group), with_kwargs=True))
                handles.append(module.register_forward_hook(self._leave(group)))
        for leaf in self.leaves:
            handles.append(leaf.register_forward_hook(self._leaf))
        if embed is not None:
            handles.append(embed.register_forward_hook(self._embedded))
        if head is not None:
            handles.append(head.register_forward_pre_hook(self._head))
        return handles

    def _enter(self, group: _Group):
        def hook(module, args, kwargs):
            group.active += 1
            if group.active == 1:
                group.calls.append(_Call(module, self._next(), token_input=_token_shaped(_first_tensor(args, kwargs))))
        return hook

    def _leave(self, group: _Group):
        def hook(module, args, output):
            group.active -= 1
            if group.active == 0:
                call = group.calls[-1]
                call.end = self._next()
                out = _output_tensor(output)
                call.width = int(out.shape[-1]) if _token_shaped(out) else None
        return hook

    def _leaf(self, module, args, output):
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        lead = x is not None and tuple(x.shape[:2]) == PROBE_SHAPE
        # (B * T, D) rows: an MoE router, a shared expert; a module that is no Linear must compute one of them
        flat = (x is not None and x.dim() == 2 and x.shape[0] == PROBE_SHAPE[0] * PROBE_SHAPE[1]
                and (isinstance(module, nn.Linear) or computes_linear(module, x, output)))
        self.leaf_calls[id(module)].append((self._next(), lead and x.dim() == 3, lead and x.dim() > 3, flat))

    def _embedded(self, module, args, output):
        if self.embed_end is None:
            self.embed_end = self._next()

    def _head(self, module, args):
        self.head_start = self._next()


def _run_probe(model: nn.Module, embed: nn.Module) -> None:
    vocab = int(getattr(embed, "num_embeddings", 8))
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    b, t = PROBE_SHAPE
    ids = (torch.arange(b * t, device=device).reshape(b, t) % max(vocab - 5, 1)) + min(5, vocab - 1)
    mask = torch.ones(b, t, dtype=torch.long, device=device)
    attempts = ((), {"input_ids": ids, "attention_mask": mask}), ((), {"input_ids": ids}), ((ids,), {})
    with torch.no_grad():
        for i, (args, kwargs) in enumerate(attempts):
            try:
                model(*args, **kwargs)
                return
            except TypeError:
                if i == len(attempts) - 1:
                    raise


def _stack(probe: _Probe) -> tuple[_Group, list[_Call]] | None:
    """The qualifying candidate with the most calls (then distinct modules, then the outermost)."""
    best, best_key = None, None
    for group in probe.groups:
        calls = group.calls
        if len(calls) < 2 or any(not c.token_input or c.width is None for c in calls):
            continue
        if len({c.width for c in calls}) != 1 or any(a.end > b.start for a, b in zip(calls, calls[1:])):
            continue
        if probe.embed_end is not None and calls[0].start < probe.embed_end:
            continue
        if probe.head_start is not None and calls[-1].end > probe.head_start:
            continue
        depth = group.parent.count(".") + bool(group.parent)
        key = (len(calls), len({id(c.module) for c in calls}), -depth)
        if best_key is None or key > best_key:
            best, best_key = (group, calls), key
    return best


def _sublayers(probe: _Probe, calls: list[_Call], width: int, experts: dict[str, ExpertsSpec]
               ) -> tuple[dict[str, SublayerSpec], list[str]]:
    """(module path -> its spec, for the paths split by role; 'path (Class)' of the parameter holders not split).

    A path is split when every distinct block has it and, wherever it holds parameters, it is a
    Linear, a LayerNorm or an RMSNorm-like module of the hidden width that ran on the positions
    exactly once per block call (ModernBERT's first block has a parameter-free Identity there), or a Linear or
    router-like module (:func:`~gradflow.adapters.generic_experts.router_like`) that ran once per block call on the
    (B * T, D) rows (``flat``). Modules inside ``experts`` are the experts' (split there).
    """
    blocks = list(dict.fromkeys(c.module for c in calls))
    verdicts: dict[str, list[bool]] = {}
    flat: dict[str, bool] = {}
    kinds: dict[str, str] = {}
    for block in blocks:
        spans = [(c.start, c.end) for c in calls if c.module is block]
        for name, mod in block.named_modules():
            if not name or next(mod.parameters(recurse=False), None) is None or inside(name, experts):
                continue
            kind = isinstance(mod, nn.Linear) or (norm_like(mod) and (isinstance(mod, nn.LayerNorm)
                                                                      or mod.weight.numel() == width))
            seen = probe.leaf_calls.get(id(mod), [])
            per_block = [sum(1 for tick, token, _, _ in seen if token and s < tick < e) for s, e in spans]
            per_flat = [sum(1 for tick, _, _, rows in seen if rows and s < tick < e) for s, e in spans]
            rows = (isinstance(mod, nn.Linear) or router_like(mod)) and all(n == 1 for n in per_flat) \
                and not any(per_block)
            good = (kind and all(n == 1 for n in per_block) or rows) and not any(deep for _, _, deep, _ in seen)
            verdicts.setdefault(name, []).append(good)
            flat[name] = flat.get(name, True) and rows
            kinds.setdefault(name, type(mod).__name__)
    split = {n: SublayerSpec(n, flat=flat[n], acts_as="linear" if flat[n] and not isinstance(
        blocks[0].get_submodule(n), nn.Linear) else None)
        for n, v in verdicts.items() if all(v) and all(_has(b, n) for b in blocks)}
    skipped = [f"{n} ({kinds[n]})" for n in verdicts if n not in split]
    return split, skipped


def _routers(block: nn.Module, split: dict[str, SublayerSpec], experts: dict[str, ExpertsSpec]) -> tuple[str, ...]:
    """The split sublayers that route rows to the experts: called once per block call on the (B * T, D) rows
    (``flat``), with one output per expert of an experts module beside them (the same parent module)."""
    counts = {}
    for name, spec in experts.items():
        module = block.get_submodule(spec.path)
        parent = spec.path.rpartition(".")[0]
        if spec.layout == "fused":
            counts[parent] = next(module.parameters()).shape[0]
        else:
            counts[parent] = len(module)
    found = []
    for name, spec in split.items():
        weight = getattr(block.get_submodule(name), "weight", None)
        parent = name.rpartition(".")[0]
        if spec.flat and isinstance(weight, torch.Tensor) and weight.dim() == 2 and parent in counts \
                and weight.shape[0] == counts[parent]:
            found.append(name)
    return tuple(found)


def _experts(blocks: tuple[nn.Module, ...], probe: ExpertProbe) -> tuple[dict[str, ExpertsSpec], list[str]]:
    """The experts every distinct block holds alike (:func:`~gradflow.adapters.generic_experts.find_experts`), and
    'path (Class: why)' of those not split."""
    distinct = list(dict.fromkeys(blocks))
    found = [find_experts(block, probe, PROBE_SHAPE[0] * PROBE_SHAPE[1]) for block in distinct]
    experts = {name: spec for name, spec in found[0][0].items() if all(f[0].get(name) == spec for f in found)}
    refused = list(dict.fromkeys(r for f in found for r in f[1]))
    return experts, refused


def _has(block: nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True


def _no_head(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    raise UnsupportedArchitectureError("the generic adapter (adapter='auto') records only: it does not know the "
                                       "model's MLM head, so head-based tools need a registered adapter")


def _no_surgery(model: nn.Module, *args) -> tuple[int, str]:
    raise SurgeryError("block surgery needs a registered adapter; the generic adapter (adapter='auto') records only")


def discover_adapter(model: nn.Module, notice: bool = True) -> Adapter:
    """The generic adapter of ``model`` (see the module docstring); prints what it found when ``notice``."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    reason = refusal(model_type) if model_type else None
    if reason is not None and reason.startswith("does not hold"):
        raise UnsupportedArchitectureError(f"gradflow does not record model_type {model_type!r}, with the generic "
                                           f"adapter either: {reason}")
    base = getattr(model, "base_model", model)
    embed, head = _input_embeddings(model), _output_head(model)
    if embed is None:
        raise UnsupportedArchitectureError("the generic adapter (adapter='auto') found no input embeddings "
                                           "(no get_input_embeddings() and no nn.Embedding): it needs a model "
                                           "that embeds input_ids; write an Adapter for it instead")
    groups = _groups(base, [m for m in (embed, head) if m is not None])
    leaves = [m for m in base.modules() if isinstance(m, nn.Linear) or norm_like(m) or router_like(m)]
    probe = _Probe(groups, leaves)
    expert_probe = ExpertProbe()
    handles = probe.install(embed, head) + expert_probe.install(base)
    try:
        _run_probe(model, embed)
    except Exception as err:  # noqa: BLE001 - any failure of the probe forward is reported as a refusal
        raise UnsupportedArchitectureError(f"the generic adapter (adapter='auto') could not run a probe forward "
                                           f"(input_ids and attention_mask of shape {PROBE_SHAPE}): "
                                           f"{type(err).__name__}: {err}") from None
    finally:
        for handle in handles:
            handle.remove()
    found = _stack(probe)
    if found is None:
        raise UnsupportedArchitectureError(
            f"the generic adapter (adapter='auto') found no block stack in {type(model).__name__}: no ModuleList "
            "or repeated sibling modules of one class, holding nn.Linear, called at least twice in turn between "
            "the input embeddings and the head, each taking and returning one hidden vector per position. "
            "Describe the model with gradflow.adapters.Adapter instead (README: 'Adding an architecture').")
    group, calls = found
    width = int(calls[0].width)
    modules = tuple(c.module for c in calls)
    experts, refused = _experts(modules, expert_probe)
    split, skipped = _sublayers(probe, calls, width, experts)
    notes = _describe(model_type, group, modules, [*split, *(n for name, spec in experts.items() if spec.unsplittable
                                                                is None for n in spec.names(name))], skipped + refused)
    if notice and os.environ.get("RANK", "0") == "0":  # under torchrun: once, not once a rank
        print(f"gradflow: {notes}", file=sys.stderr)
    return Adapter(
        family="generic", model_types=(), embeddings="", blocks=group.parent, mid=None, shifted_head=None,
        sublayers=split, experts=experts, routers=_routers(modules[0], split, experts), attn_norm="unknown",
        expand_blocks=lambda _base: list(modules), notes=notes, head=HeadSpec(call=_no_head),
        head_mixes_positions="not known: the generic adapter does not know the model's MLM head",
        embeddings_at="blocks", drop_blocks=_no_surgery,
    )


def _describe(model_type: str | None, group: _Group, modules: tuple[nn.Module, ...], split: list[str],
              skipped: list[str]) -> str:
    family = registered_family(model_type)
    which = (f"model_type {model_type!r} has a registered adapter ({family}), not used because adapter='auto' "
             "was asked for" if family else f"model_type {model_type!r} has no registered adapter"
             if model_type else "the model has no config.model_type")
    paths = {id(m): p for p, m in zip(group.paths, group.modules)}
    order = ", ".join(paths[id(m)] for m in modules) if len(modules) <= 6 else \
        f"{paths[id(modules[0])]} ... {paths[id(modules[-1])]}"
    distinct = len(set(map(id, modules)))
    shared = f" ({distinct} distinct module(s) applied in turn)" if distinct < len(modules) else ""
    return (f"generic adapter (adapter='auto'): {which}. Discovered {len(modules)} blocks of "
            f"{type(modules[0]).__name__} under {group.parent or 'the model root'!r}{shared}, in call order: {order}. "
            f"Sites: embeddings.out = the first block's input, blocks.<i>.out; no mid sites. Split by role, named "
            f"by module path in the block: {', '.join(split) if split else 'nothing'}. Not split: "
            f"{', '.join(skipped) if skipped else 'nothing'}. Standard sublayer names and the exact-zero "
            "(after-mixing) set are unknown to the generic adapter.")


__all__ = ["PROBE_SHAPE", "discover_adapter"]
