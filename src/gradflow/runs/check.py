"""The structural-zero lint behind ``gradflow check``: which roles send exactly zero gradient, measured.

For one masked batch (BERT masking, fixed seed) the recorder splits the weight gradient of every
standard sublayer, and of the block's other ``nn.Linear``/``nn.LayerNorm`` modules (ESMC's
``q_norm``, ConvBERT's span-kernel Linears), by position role (:mod:`gradflow.hooks.sublayer_stats`:
the role contributions sum to autograd's gradient). A role *sends exactly zero gradient* to a
parameter when its contribution ``G_r`` is exactly 0.0 in this batch: measured, never assumed. A
parameter (and a sublayer, when all its parameters are) is *flagged* as structurally untrained on
context channels when the context contribution is exactly 0.0 while a loss role's is not.

Weight sharing (ALBERT: one block module applied at several depths): the recorder splits each
*application* (depth) on its own, so a flag is per application. When the last depth's module is
also applied at earlier depths, its parameters' gradient is the sum over all applications and the
earlier ones do send context gradient: the check then says so in ``notes`` and gives, per flagged
parameter of the last block, the shared parameter's *total* context share: the context part of the
per-position gradient magnitudes ``sum_t ||g_t|| ||x_t||`` summed over every application, over all
roles' (the measure of ``sublayers.csv``'s ``share``).

Theory (the adapter's :meth:`~gradflow.adapters.Adapter.after_mixing`): in the last block the
sublayers after the last attention (``attn.q``, ``attn.out``, ``ffn.*``, and ``attn.norm`` in post-LN
blocks) get exactly zero gradient from context positions; no other (block, sublayer) does. The
check lists every (block, standard sublayer) where measurement and theory agree and where they do
not. The block's parameters the recorder cannot split (convolutions, modules not called) are listed
with the reason.

It also states the share of the batch's forward + backward matmul FLOPs that the last block spends
on its zero-context Linear sublayers at unselected positions (:mod:`gradflow.runs.check_flops`
has the formula): compute an implementation can skip, as flash-attention's BERT
(``last_layer_subset``) and MosaicBERT (``subset_mask``) do by running the last layer's queries,
output projection and FFN only at the loss positions.

``CheckResult.to_dict()`` (``gradflow check --json``): its keys (``model``, ``batch``, ``params``, ``sublayers``,
``unsplit``, ``theory``, ``flops``, ``skippable_share``, ``notes``, ``shared_parameters`` and theirs), each with
its meaning, are :data:`gradflow.schema_reports.CHECK_JSON_KEYS` (listed in ``docs/reference/run-directory.md``;
a test fails when the object gains a key that is not declared there).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from torch import nn

from gradflow.adapters import Adapter, SublayerSpec, adapter_for, block_modules, get_module
from gradflow.adapters.norms import splittable
from gradflow.errors import CorpusError, UsageError
from gradflow.formatting import format_number
from gradflow.hooks.recorder import GradFlowRecorder, RecorderConfig
from gradflow.hooks.records import BatchRecord
from gradflow.hooks.sites import depth_occurrences
from gradflow.inputs.corpus import check_corpus_path, default_texts
from gradflow.inputs.masking import BertMasking, MaskedBatch, MaskingPolicy
from gradflow.losses import get_loss
from gradflow.models import LoadedModel, load_model
from gradflow.models.zoo import example_inputs_path
from gradflow.provenance import portable_path
from gradflow.roles import ALL_ROLES, LOSS_ROLES, ROLE_ORDER, Role, role_code, role_counts
from gradflow.runs.check_flops import FlopCount, count_flops, count_linear_calls
from gradflow.runs.job import open_job

OTHER = "other:"
"""Prefix of the recorder's names for a block's non-standard modules (stripped in the result)."""


@dataclass(frozen=True)
class ParamCheck:
    """One parameter of one block: per present role its positions, nonzero positions and ``||G_r||_F``."""

    layer: int
    sublayer: str
    param: str
    standard: bool
    n_positions: dict[str, int]
    positions_nonzero: dict[str, int]
    contribution: dict[str, float]
    zero_roles: tuple[str, ...]
    context_zero: bool | None
    loss_nonzero: bool
    flagged: bool


@dataclass(frozen=True)
class SublayerCheck:
    """One (layer, sublayer): flagged when every parameter is; ``expected_zero`` None outside the theory."""

    layer: int
    sublayer: str
    params: tuple[str, ...]
    standard: bool
    flagged: bool
    expected_zero: bool | None
    agrees: bool | None
    shared_layers: tuple[int, ...] = ()


@dataclass
class CheckResult:
    """What ``gradflow check`` measured on one batch (``to_dict``: the JSON keys of the module docstring)."""

    model: str
    model_type: str
    family: str
    attn_norm: str
    num_blocks: int
    batch: dict
    params: list[ParamCheck]
    sublayers: list[SublayerCheck]
    unsplit: list[dict]
    expected_last_block: tuple[str, ...]
    flops: FlopCount
    notes: list[str] = field(default_factory=list)
    shared_parameters: list[dict] = field(default_factory=list)

    @property
    def agreements(self) -> list[SublayerCheck]:
        return [s for s in self.sublayers if s.agrees]

    @property
    def disagreements(self) -> list[SublayerCheck]:
        return [s for s in self.sublayers if s.agrees is False]

    @property
    def skippable_share(self) -> float:
        return self.flops.share

    def flagged(self, layer: int | None = None) -> list[SublayerCheck]:
        """Flagged sublayers (of ``layer``, 1..L, when given)."""
        return [s for s in self.sublayers if s.flagged and (layer is None or s.layer == layer)]

    def to_dict(self) -> dict:
        def theory_row(s: SublayerCheck) -> dict:
            return {"layer": s.layer, "sublayer": s.sublayer, "expected_zero": s.expected_zero,
                    "measured_zero": s.flagged}

        return {
            "model": self.model, "model_type": self.model_type, "family": self.family, "attn_norm": self.attn_norm,
            "num_blocks": self.num_blocks, "batch": self.batch,
            "params": [{**vars(p), "zero_roles": list(p.zero_roles)} for p in self.params],
            "sublayers": [{**vars(s), "params": list(s.params), "shared_layers": list(s.shared_layers)}
                          for s in self.sublayers],
            "unsplit": self.unsplit,
            "theory": {"last_block_expected_zero": list(self.expected_last_block),
                       "agreements": [theory_row(s) for s in self.agreements],
                       "disagreements": [theory_row(s) for s in self.disagreements],
                       "agree": not self.disagreements},
            "flops": self.flops.to_dict(), "skippable_share": self.skippable_share, "notes": self.notes,
            "shared_parameters": self.shared_parameters,
        }


def check_model(model: str | LoadedModel = "gradflow-mini-en", texts: str | None = None, *, seed: int = 0,
                batch_size: int = 8, max_length: int = 128, device: str = "cpu",
                trust_remote_code: bool = False, objective: MaskingPolicy | None = None) -> CheckResult:
    """Load ``model`` (a spec as ``gradflow record`` takes, or a :class:`LoadedModel`, used as it is), mask
    the first ``batch_size`` windows of ``texts`` (default: a zoo model's shipped example sequences, else
    the committed SOTU sample, as ``gradflow record`` uses) with BERT masking, or ``objective`` (masked
    diffusion, span masking, a shift: :mod:`gradflow.inputs.objectives`), seeded by ``seed``, and check
    that batch under the objective's loss."""

    for flag, value in (("--batch-size", batch_size), ("--max-length", max_length)):
        if int(value) < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if int(seed) < 0:
        raise UsageError(f"--seed must be >= 0, got {seed}")
    if texts is None and isinstance(model, str) and model.startswith("zoo:"):
        texts = example_inputs_path(model[len("zoo:"):])
    source = texts if texts is not None else default_texts()
    check_corpus_path(source)
    loaded = model if isinstance(model, LoadedModel) else load_model(model, device, "float32", trust_remote_code)
    name = loaded.name
    policy = BertMasking(seed=seed) if objective is None else replace(objective, seed=seed)
    job = open_job(loaded, source, policy, max_length, batch_size, limit=batch_size, model=name,
                   one_pass="gradflow check")
    batch = next(job.batches(), None)
    if batch is None:
        raise CorpusError(f"the corpus {source} has no document with a maskable token: pass real text in the "
                          "model's language.")
    result = check_batch(loaded.model, batch, loaded.adapter, model_name=name)
    result.batch.update(texts=portable_path(source, "."), seed=seed, batch_size=batch_size, max_length=max_length,
                        masking=policy.describe())
    return result


def check_batch(model: nn.Module, batch: MaskedBatch, adapter: Adapter | None = None, *,
                model_name: str = "") -> CheckResult:
    """Record ``batch`` under the MLM loss (mean over the batch's loss positions) and check the zeros."""
    adapter = adapter or adapter_for(model)
    if not bool((batch.roles <= Role.KEPT).any()):
        raise CorpusError("the batch has no loss position (masked, random or kept): nothing to check.")
    blocks = block_modules(adapter, model.base_model)
    extra, skipped = _other_modules(adapter, blocks)
    recording = replace(adapter, sublayers={**adapter.sublayers, **{OTHER + p: SublayerSpec(p) for p in extra}})
    with count_linear_calls(model) as calls, GradFlowRecorder(model, RecorderConfig(), recording) as rec:
        # a callable loss: the whole model runs (the dense head's calls at unselected positions are counted)
        record = rec.record(batch, loss=get_loss("mlm", "batch"))
    params = [_param_check(rec_) for rec_ in record.sublayers]
    last = len(blocks)
    shared = {layer: tuple(group) for group in weight_sharing(blocks) for layer in group}
    sublayers = _sublayer_checks(params, adapter, last, shared)
    zero_last = [s.sublayer for s in sublayers if s.layer == last and s.standard and s.flagged]
    flops = count_flops(model, adapter, blocks, calls, batch.roles, batch.attention_mask, zero_last)
    counts = role_counts(batch.roles)
    notes = []
    if counts["context"] == 0:
        notes.append("the batch has no context position: no zero from context can be measured")
    shared_parameters = _shared_parameters(record, params, shared.get(last, ()))
    if shared_parameters:
        notes.append(sharing_note(shared_parameters))
    config = model.config
    return CheckResult(
        model=model_name or getattr(config, "name_or_path", "") or type(model).__name__,
        model_type=str(getattr(config, "model_type", "")), family=adapter.family, attn_norm=adapter.attn_norm,
        num_blocks=last, batch={"sequences": int(batch.roles.shape[0]), "tokens": counts, "loss": record.loss},
        params=params, sublayers=sublayers, unsplit=_unsplit(record, adapter, blocks, extra, skipped),
        expected_last_block=adapter.after_mixing(), flops=flops, notes=notes,
        shared_parameters=shared_parameters,
    )


def weight_sharing(blocks: Sequence[nn.Module]) -> list[list[int]]:
    """The layers (1..L, layer = depth + 1) applying one block module, for each module applied at several
    depths (ALBERT's shared layer), in order of first application; [] when no block is shared."""
    return [[depth + 1 for depth in depths] for depths in depth_occurrences(blocks).values() if len(depths) > 1]


def layers_text(layers: Sequence[int], noun: str = "layer") -> str:
    """``layers 1-12`` for consecutive layers, ``layers 2, 4, 6`` otherwise, ``layer 1`` for one."""
    layers = list(layers)
    if len(layers) == 1:
        return f"{noun} {layers[0]}"
    if layers == list(range(layers[0], layers[-1] + 1)):
        return f"{noun}s {layers[0]}-{layers[-1]}"
    return f"{noun}s " + ", ".join(map(str, layers))


def _shared_parameters(record: BatchRecord, params: list[ParamCheck], group: tuple[int, ...]) -> list[dict]:
    """Per flagged parameter of the last block when its module is shared: the context share of the per-position
    magnitudes summed over every application (layer of ``group``)."""
    if not group:
        return []
    last = max(group)
    flagged = {(p.sublayer, p.param) for p in params if p.layer == last and p.flagged}
    sums: dict[tuple[str, str], list[float]] = {}  # (sublayer, param) -> [context, all roles]
    for rec in record.sublayers:
        key = (rec.sublayer.removeprefix(OTHER), rec.param)
        if rec.depth + 1 in group and key in flagged:
            mag = rec.magnitude_sum.double()
            acc = sums.setdefault(key, [0.0, 0.0])
            acc[0] += float(mag[Role.CONTEXT])
            acc[1] += float(mag.sum())
    rows = []
    for p in params:
        if p.layer == last and (p.sublayer, p.param) in sums:
            context, total = sums[(p.sublayer, p.param)]
            rows.append({"sublayer": p.sublayer, "param": p.param, "layers": list(group),
                         "total_context_share": context / total if total > 0 else 0.0})
    return rows


def sharing_note(shared: list[dict]) -> str:
    """The note on a weight-shared last block: zeros per application, the shared weights' total context share."""
    group = shared[0]["layers"]
    last, n = group[-1], len(group)
    weights = [row for row in shared if row["param"] == "weight"] or shared
    shares = ", ".join(f"{row['sublayer']}{'' if row['param'] == 'weight' else '.' + row['param']} "
                       f"{format_number(100 * row['total_context_share'])}%" for row in weights)
    return (f"weight sharing: layer {last}'s block is one module applied at {layers_text(group)} ({n} "
            f"applications), so its exact zeros are per application: the last application (layer {last}) gets "
            f"exactly 0 from context, but the shared parameters are trained on context through "
            f"{layers_text(group[:-1])}. Context share of the shared weights' gradient summed over all {n} "
            f"applications: {shares} (summed per-position magnitudes; shared_parameters in --json).")


def _other_modules(adapter: Adapter, blocks: list[nn.Module]) -> tuple[list[str], dict[str, str]]:
    """(paths of non-standard Linear/LayerNorm modules with parameters, present in every block;
    path -> why the others cannot be split)."""
    distinct = list({id(b): b for b in blocks}.values())
    paths: dict[str, list[nn.Module]] = {}
    for block in distinct:
        standard = {id(get_module(block, spec.path)) for spec in adapter.sublayers.values()}
        for path, module in block.named_modules():
            if path and id(module) not in standard and any(True for _ in module.parameters(recurse=False)):
                paths.setdefault(path, []).append(module)
    extra, skipped = [], {}
    for path, modules in paths.items():
        if len(modules) == len(distinct) and all(splittable(m) for m in modules):
            extra.append(path)
        elif len(modules) != len(distinct):
            skipped[path] = "not in every block"
        else:
            skipped[path] = f"{type(modules[0]).__name__}: the recorder splits nn.Linear, LayerNorm and RMSNorm-like norms only"
    return extra, skipped


def _param_check(rec) -> ParamCheck:
    present = [code for code in map(role_code, ROLE_ORDER) if int(rec.n_positions[code]) > 0]  # display order
    norm = {ALL_ROLES[c]: float(rec.contribution_norm[c]) for c in present}
    context = norm.get("context")
    loss_nonzero = any(norm.get(role, 0.0) > 0 for role in LOSS_ROLES)
    context_zero = None if context is None else context == 0.0
    name = rec.sublayer
    return ParamCheck(
        layer=rec.depth + 1, sublayer=name.removeprefix(OTHER), param=rec.param, standard=not name.startswith(OTHER),
        n_positions={ALL_ROLES[c]: int(rec.n_positions[c]) for c in present},
        positions_nonzero={ALL_ROLES[c]: int(rec.n_nonzero[c]) for c in present},
        contribution=norm, zero_roles=tuple(r for r, v in norm.items() if v == 0.0),
        context_zero=context_zero, loss_nonzero=loss_nonzero, flagged=bool(context_zero) and loss_nonzero,
    )


def _sublayer_checks(params: list[ParamCheck], adapter: Adapter, last: int,
                     shared: dict[int, tuple[int, ...]]) -> list[SublayerCheck]:
    expected_last = set(adapter.after_mixing())
    groups: dict[tuple[int, str], list[ParamCheck]] = {}
    for p in params:
        groups.setdefault((p.layer, p.sublayer), []).append(p)
    checks = []
    for (layer, name), group in groups.items():
        standard = group[0].standard
        flagged = all(p.flagged for p in group)
        expected = (name in expected_last if layer == last else False) if standard else None
        checks.append(SublayerCheck(layer, name, tuple(p.param for p in group), standard, flagged, expected,
                                    None if expected is None else expected == flagged, shared.get(layer, ())))
    return checks


def _unsplit(record: BatchRecord, adapter: Adapter, blocks: list[nn.Module], extra: list[str],
             skipped: dict[str, str]) -> list[dict]:
    """Per depth, the block parameters the check has no per-role measurement for, with the reason."""
    recorded = {(r.depth, r.sublayer, r.param) for r in record.sublayers}
    standard_paths = {spec.path: name for name, spec in adapter.sublayers.items()}
    outside_biases = {spec.bias for spec in adapter.sublayers.values() if spec.bias is not None}  # DeBERTa v1
    rows = []
    for depth, block in enumerate(blocks):
        for full, _ in block.named_parameters():
            path, param = full.rpartition(".")[::2]
            if path in standard_paths or full in outside_biases or (depth, OTHER + path, param) in recorded:
                continue
            if path in extra:
                reason = "not called on the batch's positions in this forward (no per-position gradient)"
            else:
                reason = skipped.get(path, "inside a module the recorder does not split")
            rows.append({"layer": depth + 1, "parameter": full, "reason": reason})
    return rows


__all__ = ["CheckResult", "ParamCheck", "SublayerCheck", "check_batch", "check_model", "layers_text", "sharing_note",
           "weight_sharing"]
