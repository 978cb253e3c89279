"""Block surgery: drop, re-initialise or freeze blocks of a masked LM, keeping it saveable.

In the last block the non-selected (context) channels receive exactly zero MLM gradient, so the
last block is trained only through the few loss positions. These operations let fine-tuning test
what that costs: drop the last ``k`` blocks, re-initialise them with the architecture's own
initialiser, or freeze parts of the encoder.

Every operation works in place, returns ``(model, SurgeryRecord)`` and keeps ``model.config``
consistent (``num_hidden_layers`` and, for ModernBERT, ``layer_types``), so the result saves with
``save_pretrained`` and reloads with ``from_pretrained`` to the same outputs.

ALBERT applies one shared layer group ``num_hidden_layers`` times. Here:

- *dropping* the last ``k`` blocks means ``k`` fewer applications (``num_hidden_layers -= k``); the
  weights are unchanged. With several groups the group of each depth depends on
  ``num_hidden_layers``, so only one group (the usual case) or fully unshared groups (one group per
  depth, see :func:`unshare_albert`) can be dropped from;
- *re-initialising* the last application is impossible while the layer is shared (it would
  re-initialise every depth): it raises :class:`SurgeryError` unless the model was first unshared
  with :func:`unshare_albert` (explicit: the parameter count grows ``num_hidden_layers``-fold);
- *freezing* the first ``k`` applications likewise needs an unshared model (``k`` equal to the
  number of applications freezes the one shared layer).
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from gradflow.adapters import Adapter, adapter_for, block_modules, get_module
from gradflow.errors import OutputDirError, SurgeryError

SURGERY_FILE = "surgery.json"



@dataclass(frozen=True)
class SurgeryRecord:
    """What one operation did, for meta files. ``blocks``: depths (0-based, before) affected."""

    operation: str
    family: str
    k: int
    blocks_before: int
    blocks_after: int
    blocks: tuple[int, ...]
    parameters: int
    seed: int | None = None
    notes: str = ""

    def to_dict(self) -> dict:
        """JSON-ready form."""
        out = asdict(self)
        out["blocks"] = list(self.blocks)
        return out


@dataclass(frozen=True)
class SurgeryPlan:
    """The operations :func:`apply_surgery` applies, in this order: drop, then re-initialise."""

    drop_last: int = 0
    reinit_last: int = 0
    seed: int = 0

    def is_noop(self) -> bool:
        return self.drop_last == 0 and self.reinit_last == 0


@dataclass
class SurgeryResult:
    """The records of every operation applied."""

    records: list[SurgeryRecord] = field(default_factory=list)

    def to_dict(self) -> list[dict]:
        return [r.to_dict() for r in self.records]


# ---------------------------------------------------------------------------------------- helpers
def _num_blocks(model: nn.Module, adapter: Adapter) -> int:
    return len(block_modules(adapter, model.base_model))


def _check_k(k: int, num_blocks: int, what: str, keep_one: bool) -> None:
    upper = num_blocks - 1 if keep_one else num_blocks
    if not isinstance(k, int) or k < 0 or k > upper:
        raise SurgeryError(f"cannot {what} {k} block(s) of a model with {num_blocks}: choose k in 0..{upper}"
                           + (" (at least one block must remain)" if keep_one else ""))


def _count(modules: list[nn.Module]) -> int:
    seen: set[int] = set()
    total = 0
    for module in modules:
        for p in module.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def _albert_groups(model: nn.Module) -> tuple[int, int]:
    config = model.config
    return int(config.num_hidden_layers), int(config.num_hidden_groups)


def _albert_shared(model: nn.Module, adapter: Adapter) -> bool:
    """True when some layer module runs at more than one depth."""
    blocks = block_modules(adapter, model.base_model)
    return len({id(b) for b in blocks}) < len(blocks)


# ---------------------------------------------------------------------------------------- drop
def drop_last_blocks(model: nn.Module, k: int) -> tuple[nn.Module, SurgeryRecord]:
    """Remove the last ``k`` blocks (ALBERT: ``k`` fewer applications of the shared layer)."""
    adapter = adapter_for(model)
    before = _num_blocks(model, adapter)
    _check_k(k, before, "drop", keep_one=True)
    dropped = tuple(range(before - k, before))
    if k == 0:
        return model, SurgeryRecord("drop_last_blocks", adapter.family, 0, before, before, (), 0)
    if adapter.family == "albert":
        removed, notes = _drop_albert(model, adapter, k)
    else:
        layers = get_module(model.base_model, adapter.blocks)
        if not isinstance(layers, nn.ModuleList) or len(layers) != before:
            raise SurgeryError(f"{adapter.family}: expected a ModuleList of {before} blocks at {adapter.blocks!r}")
        removed = _count(list(layers[before - k:]))
        del layers[before - k:]
        notes = ""
    fix = _DROP_FIXES.get(adapter.family)
    if fix is not None:
        notes = fix(model, before, before - k)
    _set_num_layers(model.config, before - k)
    return model, SurgeryRecord("drop_last_blocks", adapter.family, k, before, before - k, dropped, removed,
                                notes=notes)


def _drop_albert(model: nn.Module, adapter: Adapter, k: int) -> tuple[int, str]:
    layers, groups = _albert_groups(model)
    if groups == 1:
        return 0, f"ALBERT: {k} fewer application(s) of the shared layer; no weights removed"
    if groups == layers:
        group_list = get_module(model.base_model, adapter.blocks)
        removed = _count(list(group_list[layers - k:]))
        del group_list[layers - k:]
        model.config.num_hidden_groups = layers - k
        return removed, "ALBERT (unshared): last group(s) removed"
    raise SurgeryError(f"ALBERT with {groups} layer groups over {layers} layers: the group of each depth depends "
                       "on num_hidden_layers, so dropping depths would reassign groups. Unshare the model first "
                       "(gradflow.interventions.surgery.unshare_albert) or use a single-group model.")


def _trim_esm_contact_head(model: nn.Module, before: int, after: int) -> str:
    """ESM's contact head regresses on every layer's attention maps (layer-major): keep the kept layers'."""
    head = getattr(model.base_model, "contact_head", None)
    if head is None:
        return ""
    old = head.regression
    heads = old.in_features // before
    new = nn.Linear(after * heads, 1, bias=old.bias is not None).to(old.weight.device, old.weight.dtype)
    with torch.no_grad():
        new.weight.copy_(old.weight[:, : after * heads])
        if old.bias is not None:
            new.bias.copy_(old.bias)
    head.regression = new
    head.in_features = after * heads
    return "ESM contact head: regression columns of the dropped layers' attention maps removed"


# Family-specific parts sized by the number of layers (outside the blocks themselves).
_DROP_FIXES = {"esm": _trim_esm_contact_head}


def _set_num_layers(config, n: int) -> None:
    """Set ``num_hidden_layers`` (and trim per-layer lists such as ModernBERT's ``layer_types``)."""
    config.num_hidden_layers = n
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)):
        config.layer_types = list(layer_types[:n])


# ---------------------------------------------------------------------------------------- re-init
def reinit_last_blocks(model: nn.Module, k: int, seed: int = 0) -> tuple[nn.Module, SurgeryRecord]:
    """Re-initialise the last ``k`` blocks with the model's own ``_init_weights`` (seeded).

    The global RNG state is left unchanged. ALBERT must be unshared first (see module docstring).
    """
    adapter = adapter_for(model)
    blocks = block_modules(adapter, model.base_model)
    _check_k(k, len(blocks), "re-initialise", keep_one=False)
    targets = blocks[len(blocks) - k:]
    if k and adapter.family == "albert" and _albert_shared(model, adapter):
        raise SurgeryError("ALBERT shares one layer across depths: re-initialising the last application would "
                           "re-initialise every depth. Call gradflow.interventions.surgery.unshare_albert(model) first "
                           "(explicit: one copy of the layer per depth) and re-initialise then.")
    init_fn = getattr(model, "_init_weights", None)
    if init_fn is None:
        raise SurgeryError(f"{type(model).__name__} has no _init_weights: it is not a transformers PreTrainedModel")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for block in targets:
            _clear_init_flags(block)
            block.apply(init_fn)
    depths = tuple(range(len(blocks) - k, len(blocks)))
    return model, SurgeryRecord("reinit_last_blocks", adapter.family, k, len(blocks), len(blocks), depths,
                                _count(targets), seed=seed, notes="model._init_weights applied to each submodule")


def _clear_init_flags(module: nn.Module) -> None:
    """Drop transformers' ``_is_hf_initialized`` marks so its init functions act again."""
    for sub in module.modules():
        if hasattr(sub, "_is_hf_initialized"):
            del sub._is_hf_initialized
        for tensor in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]:
            if hasattr(tensor, "_is_hf_initialized"):
                del tensor._is_hf_initialized


def unshare_albert(model: nn.Module) -> tuple[nn.Module, SurgeryRecord]:
    """Give every ALBERT depth its own copy of its layer group (same outputs, more parameters).

    Sets ``num_hidden_groups = num_hidden_layers``; saves and reloads as a plain ALBERT.
    """
    adapter = adapter_for(model)
    if adapter.family != "albert":
        raise SurgeryError(f"unshare_albert needs an ALBERT model, got {adapter.family}")
    layers, groups = _albert_groups(model)
    group_list = get_module(model.base_model, adapter.blocks)
    per_group = layers / groups
    new = nn.ModuleList(copy.deepcopy(group_list[int(i / per_group)]) for i in range(layers))
    before = _count(list(group_list))
    parent_path, _, name = adapter.blocks.rpartition(".")
    setattr(get_module(model.base_model, parent_path), name, new)
    model.config.num_hidden_groups = layers
    return model, SurgeryRecord("unshare_albert", "albert", 0, layers, layers, tuple(range(layers)),
                                _count(list(new)) - before, notes="parameters column: parameters added")


# ---------------------------------------------------------------------------------------- freezing
def freeze_first_blocks(model: nn.Module, k: int) -> tuple[nn.Module, SurgeryRecord]:
    """Set ``requires_grad=False`` on the parameters of the first ``k`` blocks."""
    adapter = adapter_for(model)
    blocks = block_modules(adapter, model.base_model)
    _check_k(k, len(blocks), "freeze", keep_one=False)
    frozen = blocks[:k]
    still_trained = {id(b) for b in blocks[k:]}
    if any(id(b) in still_trained for b in frozen):
        raise SurgeryError("a frozen block is the same module as a later, trained one (ALBERT's shared layer): "
                           "unshare the model first (gradflow.interventions.surgery.unshare_albert) or freeze every block.")
    for block in frozen:
        block.requires_grad_(False)
    return model, SurgeryRecord("freeze_first_blocks", adapter.family, k, len(blocks), len(blocks),
                                tuple(range(k)), _count(frozen))


def freeze_embeddings(model: nn.Module) -> tuple[nn.Module, SurgeryRecord]:
    """Freeze the embeddings module (token, position and type embeddings and their norm).

    The MLM decoder is usually tied to the token embeddings, so it is frozen too.
    """
    adapter = adapter_for(model)
    emb = get_module(model.base_model, adapter.embeddings)
    emb.requires_grad_(False)
    n = _num_blocks(model, adapter)
    return model, SurgeryRecord("freeze_embeddings", adapter.family, 0, n, n, (), _count([emb]),
                                notes="tied output embeddings are frozen with the input embeddings")


def freeze_encoder(model: nn.Module) -> tuple[nn.Module, SurgeryRecord]:
    """Freeze the whole base model (``model.base_model``): only task heads stay trainable."""
    base = model.base_model
    base.requires_grad_(False)
    adapter = adapter_for(model)
    n = _num_blocks(model, adapter)
    return model, SurgeryRecord("freeze_encoder", adapter.family, n, n, n, tuple(range(n)), _count([base]))


# ---------------------------------------------------------------------------------------- plans and files
def apply_surgery(model: nn.Module, plan: SurgeryPlan) -> tuple[nn.Module, SurgeryResult]:
    """Drop the last ``plan.drop_last`` blocks, then re-initialise the (new) last ``plan.reinit_last``."""
    result = SurgeryResult()
    if plan.drop_last:
        model, rec = drop_last_blocks(model, plan.drop_last)
        result.records.append(rec)
    if plan.reinit_last:
        model, rec = reinit_last_blocks(model, plan.reinit_last, plan.seed)
        result.records.append(rec)
    return model, result


def surgery_to_dir(model_spec: str, out_dir: str | Path, drop_last: int = 0, reinit_last: int = 0,
                   seed: int = 0, overwrite: bool = False) -> Path:
    """Load ``model_spec``, apply the plan, save model, tokenizer and ``surgery.json`` to ``out_dir``."""
    from gradflow import __version__
    from gradflow.models import load_model

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        raise OutputDirError(f"output directory {out} exists and is not empty (or is a file); "
                             "choose another --out or pass --overwrite.")
    plan = SurgeryPlan(drop_last, reinit_last, seed)
    if plan.is_noop():
        raise SurgeryError("nothing to do: pass --drop-last and/or --reinit-last with k >= 1")
    loaded = load_model(model_spec)
    model, result = apply_surgery(loaded.model, plan)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    meta = {"source": model_spec, "source_path": loaded.path, "source_config_hash": loaded.config_hash,
            "plan": asdict(plan), "operations": result.to_dict(), "num_hidden_layers": model.config.num_hidden_layers,
            "gradflow_version": __version__}
    (out / SURGERY_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out


__all__ = [
    "SURGERY_FILE", "SurgeryError", "SurgeryPlan", "SurgeryRecord", "SurgeryResult", "apply_surgery",
    "drop_last_blocks", "freeze_embeddings", "freeze_encoder", "freeze_first_blocks", "reinit_last_blocks",
    "surgery_to_dir", "unshare_albert",
]
