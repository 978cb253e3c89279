"""Block surgery: drop, re-initialise or freeze blocks of a masked LM, keeping it saveable.

In the last block the non-selected (context) channels receive exactly zero MLM gradient, so the
last block is trained only through the few loss positions. These operations let fine-tuning test
what that costs: drop the last ``k`` blocks, re-initialise them with the architecture's own
initialiser, or freeze parts of the encoder.

Every operation works in place, returns ``(model, SurgeryRecord)`` and keeps ``model.config``
consistent (``num_hidden_layers`` and the adapter's ``per_layer_config`` lists, e.g. ModernBERT's
``layer_types``), so the result saves with ``save_pretrained`` and reloads with ``from_pretrained``
to the same outputs. Every architecture fact comes from the model's adapter (``drop_blocks``,
``drop_extras``, ``init_block``, ``unshare``; see :class:`gradflow.adapters.Adapter`).

Shared blocks (ALBERT applies one layer group ``num_hidden_layers`` times):

- *dropping* the last ``k`` blocks follows the adapter's ``drop_blocks`` (ALBERT: ``k`` fewer
  applications; see :mod:`gradflow.adapters.albert`);
- *re-initialising* the last application is impossible while the layer is shared (it would
  re-initialise every depth): it raises :class:`SurgeryError` unless the model was first unshared
  with :func:`unshare_albert` (explicit: the parameter count grows ``num_hidden_layers``-fold);
- *freezing* the first ``k`` applications likewise needs an unshared model (``k`` equal to the
  number of applications freezes the one shared layer).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from gradflow.adapters import Adapter, adapter_for, block_modules, count_parameters, get_module
from gradflow.errors import OutputDirError, SurgeryError
from gradflow.models import load_model
from gradflow.provenance import portable_path, source_revision
from gradflow.version import __version__

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


def _shared(blocks: list[nn.Module]) -> bool:
    """True when some block module runs at more than one depth."""
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
    if adapter.drop_blocks is not None:
        removed, notes = adapter.drop_blocks(model, k)
    else:
        removed, notes = _drop_from_list(model, adapter, before, k), ""
    if adapter.drop_extras is not None:
        notes = adapter.drop_extras(model, before, before - k)
    _set_num_layers(model.config, adapter, before - k)
    return model, SurgeryRecord("drop_last_blocks", adapter.family, k, before, before - k, dropped, removed,
                                notes=notes)


def _drop_from_list(model: nn.Module, adapter: Adapter, before: int, k: int) -> int:
    """Delete the last ``k`` entries of the blocks ModuleList; returns the parameters removed."""
    layers = get_module(model.base_model, adapter.blocks)
    if not isinstance(layers, nn.ModuleList) or len(layers) != before:
        raise SurgeryError(f"{adapter.family}: expected a ModuleList of {before} blocks at {adapter.blocks!r}")
    removed = count_parameters(layers[before - k:])
    del layers[before - k:]
    return removed


def _set_num_layers(config, adapter: Adapter, n: int) -> None:
    """Set ``num_hidden_layers`` and cut the adapter's per-layer config lists to the first ``n``."""
    config.num_hidden_layers = n
    for name in adapter.per_layer_config:
        values = getattr(config, name, None)
        if isinstance(values, (list, tuple)):
            setattr(config, name, list(values[:n]))


# ---------------------------------------------------------------------------------------- re-init
def reinit_last_blocks(model: nn.Module, k: int, seed: int = 0) -> tuple[nn.Module, SurgeryRecord]:
    """Re-initialise the last ``k`` blocks with the model's own ``_init_weights`` (seeded).

    The global RNG state is left unchanged. ALBERT must be unshared first (see module docstring).
    """
    adapter = adapter_for(model)
    blocks = block_modules(adapter, model.base_model)
    _check_k(k, len(blocks), "re-initialise", keep_one=False)
    targets = blocks[len(blocks) - k:]
    if k and _shared(blocks):
        raise SurgeryError(f"{adapter.family} shares one layer across depths: re-initialising the last application "
                           "would re-initialise every depth. Call gradflow.interventions.surgery.unshare_albert(model) "
                           "first (explicit: one copy of the layer per depth) and re-initialise then.")
    init_block, notes = adapter.init_block, "adapter.init_block applied to each block"
    if init_block is None:
        init_block, notes = _hf_init_block, "model._init_weights applied to each submodule"
        if getattr(model, "_init_weights", None) is None:
            raise SurgeryError(f"{type(model).__name__} has no _init_weights: it is not a transformers PreTrainedModel")
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for block in targets:
            init_block(model, block)
    depths = tuple(range(len(blocks) - k, len(blocks)))
    return model, SurgeryRecord("reinit_last_blocks", adapter.family, k, len(blocks), len(blocks), depths,
                                count_parameters(targets), seed=seed, notes=notes)


def _hf_init_block(model: nn.Module, block: nn.Module) -> None:
    """transformers' own initialiser (``model._init_weights``) on every submodule of ``block``."""
    _clear_init_flags(block)
    block.apply(model._init_weights)


def _clear_init_flags(module: nn.Module) -> None:
    """Drop transformers' ``_is_hf_initialized`` marks so its init functions act again."""
    for sub in module.modules():
        if hasattr(sub, "_is_hf_initialized"):
            del sub._is_hf_initialized
        for tensor in [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]:
            if hasattr(tensor, "_is_hf_initialized"):
                del tensor._is_hf_initialized


def unshare_albert(model: nn.Module) -> tuple[nn.Module, SurgeryRecord]:
    """Give every depth its own copy of its shared block (ALBERT: of its layer group); same outputs.

    Uses the adapter's ``unshare`` (ALBERT: ``num_hidden_groups = num_hidden_layers``); the result
    saves and reloads as a plain model of the same family.
    """
    adapter = adapter_for(model)
    if adapter.unshare is None:
        raise SurgeryError(f"unshare_albert needs a model with shared blocks (ALBERT), got {adapter.family}")
    layers = int(model.config.num_hidden_layers)
    before = count_parameters(block_modules(adapter, model.base_model))
    adapter.unshare(model)
    added = count_parameters(block_modules(adapter, model.base_model)) - before
    return model, SurgeryRecord("unshare_albert", adapter.family, 0, layers, layers, tuple(range(layers)), added,
                                notes="parameters column: parameters added")


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
                                tuple(range(k)), count_parameters(frozen))


def freeze_embeddings(model: nn.Module) -> tuple[nn.Module, SurgeryRecord]:
    """Freeze the embeddings module (token, position and type embeddings and their norm).

    The MLM decoder is usually tied to the token embeddings, so it is frozen too.
    """
    adapter = adapter_for(model)
    emb = get_module(model.base_model, adapter.embeddings)
    emb.requires_grad_(False)
    n = _num_blocks(model, adapter)
    return model, SurgeryRecord("freeze_embeddings", adapter.family, 0, n, n, (), count_parameters([emb]),
                                notes="tied output embeddings are frozen with the input embeddings")


def freeze_encoder(model: nn.Module) -> tuple[nn.Module, SurgeryRecord]:
    """Freeze the whole base model (``model.base_model``): only task heads stay trainable."""
    base = model.base_model
    base.requires_grad_(False)
    adapter = adapter_for(model)
    n = _num_blocks(model, adapter)
    return model, SurgeryRecord("freeze_encoder", adapter.family, n, n, n, tuple(range(n)), count_parameters([base]))


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
    meta = {"source": portable_path(model_spec, out), "source_path": portable_path(loaded.path, out),
            "source_config_hash": loaded.config_hash,
            "plan": asdict(plan), "operations": result.to_dict(), "num_hidden_layers": model.config.num_hidden_layers,
            "gradflow_version": __version__, "gradflow_revision": source_revision()}
    (out / SURGERY_FILE).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out


__all__ = [
    "SURGERY_FILE", "SurgeryError", "SurgeryPlan", "SurgeryRecord", "SurgeryResult", "apply_surgery",
    "drop_last_blocks", "freeze_embeddings", "freeze_encoder", "freeze_first_blocks", "reinit_last_blocks",
    "surgery_to_dir", "unshare_albert",
]
