"""Training-time gradient accounting that stays correct under data parallelism, accumulation and sharding.

At a logging step (opt-in: every ``every`` steps; nothing at all runs at the others) :class:`GradAccounting` measures,
over the step's *global* batch (every micro-batch of every rank):

- per parameter group (``embeddings``, each block, ``other``): the norm of the gradient the optimizer gets, read from
  ``.grad`` after backward, i.e. after DDP's all-reduce or FSDP2's reduce-scatter. A sharded gradient (a DTensor) is
  reduced as the sum of its shards' sums of squares: a local shard's norm is not the norm. ``.grad`` is read, never
  ``param.register_hook``, which never fires on an FSDP2 parameter; a rank whose shard is empty adds zero;
- per position role (:mod:`gradflow.roles`; ``prompt`` and ``pad`` are roles of their own) and per bin of the
  diffusion ratio t, at the embeddings and every block's output: ``sqrt(sum_t ||dL/dh_t||^2)``, the mean of
  ``||dL/dh_t||`` and the positions, from activation hooks local to each rank (:class:`GradFlowRecorder` in capture
  mode), scaled to the gradient the optimizer applies (DDP and FSDP2 average the ranks' gradients: ``1 / world``);
- per block and role, with ``sublayers``: ``sum_t ||g_t|| ||x_t||`` over the block's sublayers;
- the gradient's scale relative to the global-token normaliser the objective defines (:mod:`gradflow.interventions.
  normalisation`), and a one-sentence warning when the loss normalisation makes it scale with accumulation or world.

Every sum is additive, so the ranks' sums are exact: one all-reduce of one float64 tensor at the end of a logging
step is the only synchronisation (no ``.item()`` at other steps). Two ranks give what one rank gives on the same
global batch, to float32 rounding.

Plain loop::

    accounting = GradAccounting(model, AccountingConfig(every=50, t_bins=(0, .25, .5, .75, 1)))
    for step in range(1, steps + 1):
        with accounting.step(step):                       # a logging step arms it, others pass through
            for batch in micro_batches:
                with accounting.micro_batch(roles, labels=batch["labels"], t=batch.get("t")):
                    loss_fn(model(**inputs), batch).backward()
        optimizer.step(); optimizer.zero_grad()            # after the block: .grad was read at its end
    frame = accounting.frame()
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch import nn

from gradflow.adapters import adapter_for, block_modules, get_module
from gradflow.adapters.norms import norm_like
from gradflow.hooks.recorder import BatchRecord, GradFlowRecorder, RecorderConfig
from gradflow.hooks.sites import block_group_name, depth_occurrences, distinct_blocks
from gradflow.interventions.normalisation import LossWeights, normalisation_warning, token_weights
from gradflow.roles import LOSS_ROLES, NUM_ROLES, Role, role_name

ACCOUNTING_FILE = "gradflow_accounting.csv"
ACCOUNTING_COLUMNS: tuple[str, ...] = ("step", "group", "role", "t_bin", "quantity", "value")
"""The log's columns: one row per (step, group, role, t_bin, quantity); ``t_bin`` ``[a, b)`` on t rows (role
``all``), empty otherwise. Quantities: ``grad_norm`` (role ``all``), ``hidden_grad_norm``, ``hidden_grad_mean``,
``n_positions``, ``magnitude_sum``, and for group ``model``: ``gradient_scale``, ``loss_tokens``."""
REDUCTIONS = ("mean", "sum")
"""How the ranks' gradients are combined after backward: DDP and FSDP2 average (``mean``, the default)."""


@dataclass(frozen=True)
class AccountingConfig:
    """``every``: log at steps ``s % every == 0`` (and step 1 with ``first``); ``t_bins``: edges of the t bins
    (ascending; none: no t rows); ``sublayers``: also the per-role magnitude sums (costlier); ``grad_reduction``: how
    the ranks' gradients combine (:data:`REDUCTIONS`); ``tolerance``: the scale's distance from 1 that warns."""

    every: int = 50
    t_bins: tuple[float, ...] = ()
    sublayers: bool = False
    grad_reduction: str = "mean"
    first: bool = True
    tolerance: float = 1e-3

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"every must be >= 1, got {self.every}")
        if self.grad_reduction not in REDUCTIONS:
            raise ValueError(f"grad_reduction must be 'mean' or 'sum', got {self.grad_reduction!r}")
        if list(self.t_bins) != sorted(self.t_bins) or len(self.t_bins) == 1:
            raise ValueError(f"t_bins must be at least two ascending edges, got {self.t_bins}")


@dataclass
class _Sums:
    """One logging step's additive sums on this rank (float64): sites x (roles + t bins) x (sum, sum of squares,
    count); depths x roles magnitudes; the audit's measured and objective weight sums and loss-token count."""

    hidden: torch.Tensor
    magnitude: torch.Tensor
    audit: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    micro_batches: int = 0


class GradAccounting:
    """Gradient accounting of ``model`` (a bare module, or the DDP wrapper: its ``module`` is hooked) every
    ``config.every`` steps; rows accumulate in :attr:`rows` (every rank gets the same rows)."""

    def __init__(self, model: nn.Module, config: AccountingConfig | None = None):
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        self.model = model.module if ddp else model
        self.config = config or AccountingConfig()
        self.groups = parameter_groups(self.model)
        probe_sharded_norms(self.model)
        self.rows: list[dict] = []
        self.warned: str | None = None
        self._recorder: GradFlowRecorder | None = None
        self._sums: _Sums | None = None
        self._step: int | None = None

    def is_logged(self, step: int) -> bool:
        """Whether ``step`` is a logging step."""
        return step % self.config.every == 0 or (self.config.first and step == 1)

    @property
    def armed(self) -> bool:
        """A logging step is open: micro-batches are captured."""
        return self._sums is not None

    @contextmanager
    def step(self, step: int) -> Iterator["GradAccounting"]:
        """One optimizer step's micro-batches inside; at a logging step the parameter gradients are read and the
        rows made when the block ends (the one synchronisation). Hooks are removed on leaving, errors included."""
        if not self.is_logged(step):
            yield self
            return
        with self.open_step(step):
            yield self

    @contextmanager
    def open_step(self, step: int) -> Iterator[None]:
        """:meth:`step` at a step known to be logged (the callback's entry point)."""
        recorder = GradFlowRecorder(self.model, RecorderConfig(sublayers=self.config.sublayers))
        with recorder:
            self._recorder, self._step = recorder, step
            sites = len(recorder.site_names)
            self._sums = _Sums(torch.zeros(sites, NUM_ROLES + self._bins(), 3, dtype=torch.float64),
                               torch.zeros(recorder.num_blocks, NUM_ROLES, dtype=torch.float64))
            try:
                yield
                self.rows += self._finish()
            finally:
                self._recorder = self._sums = self._step = None

    @contextmanager
    def micro_batch(self, roles: torch.Tensor, labels: torch.Tensor | None = None, t: torch.Tensor | None = None,
                    weights: torch.Tensor | None = None) -> Iterator[None]:
        """Capture the one forward and backward inside (no-op outside a logging step). ``roles``: (B, T) role codes;
        ``labels``: (B, T) targets, -100 elsewhere (for the audit; None: no audit); ``t``: (B,) each sequence's
        ratio (for the t bins); ``weights``: (B, T) the objective's weight of each loss token (default 1; ``1 / t``
        for a masked-diffusion ELBO)."""
        if not self.armed:
            yield
            return
        recorder, sums = self._recorder, self._sums
        with ExitStack() as stack:
            loss_weights = LossWeights(labels, weights)
            if labels is not None:
                stack.enter_context(token_weights(self.model, loss_weights))
            stack.enter_context(recorder.capture(roles.to(torch.int8)))
            yield
        record = recorder.result()
        self._fold(sums, record, t)
        if labels is not None:
            sums.audit += loss_weights.sums()
        sums.micro_batches += 1

    # ------------------------------------------------------------------ folding and reducing
    def _bins(self) -> int:
        return max(len(self.config.t_bins) - 1, 0)

    def _fold(self, sums: _Sums, record: BatchRecord, t: torch.Tensor | None) -> None:
        """Add one micro-batch's per-position norms (S, B, T) by role and t bin, and its magnitudes."""
        grad = record.grad_norm.double()
        roles = record.roles.long()
        onehot = torch.nn.functional.one_hot(roles, NUM_ROLES).double()  # (B, T, R)
        sums.hidden[:, :NUM_ROLES, 0] += torch.einsum("sbt,btr->sr", grad, onehot)
        sums.hidden[:, :NUM_ROLES, 1] += torch.einsum("sbt,btr->sr", grad * grad, onehot)
        sums.hidden[:, :NUM_ROLES, 2] += onehot.sum((0, 1))
        if t is not None and self._bins():
            edges = torch.tensor(self.config.t_bins, dtype=torch.float64)
            index = torch.bucketize(t.detach().double().cpu(), edges, right=True) - 1  # (B,)
            real = (roles != int(Role.PAD)).double()
            for b in range(self._bins()):
                rows = (index == b).double()[:, None] * real  # (B, T): the bin's sequences, padding left out
                column = NUM_ROLES + b
                sums.hidden[:, column, 0] += torch.einsum("sbt,bt->s", grad, rows)
                sums.hidden[:, column, 1] += torch.einsum("sbt,bt->s", grad * grad, rows)
                sums.hidden[:, column, 2] += rows.sum()
        for sub in record.sublayers:
            sums.magnitude[sub.depth] += sub.magnitude_sum.double()

    def _finish(self) -> list[dict]:
        """Read the parameter gradients, reduce everything across ranks in one all-reduce, make the rows."""
        sums, world = self._sums, _world()
        sharded, replicated = grad_square_sums(self.groups)
        packed = torch.cat([sums.hidden.flatten(), sums.magnitude.flatten(), sums.audit, sharded, replicated])
        if world > 1:
            device = _reduce_device(self.model)
            packed = packed.to(device)
            torch.distributed.all_reduce(packed)
            packed = packed.cpu()
        sizes = [sums.hidden.numel(), sums.magnitude.numel(), 3, len(self.groups), len(self.groups)]
        hidden, magnitude, audit, sharded, replicated = torch.split(packed, sizes)
        factor = 1.0 / world if self.config.grad_reduction == "mean" else 1.0
        rows = [self._row(g.name, "all", "", "grad_norm", math.sqrt(float(s + r / world)))
                for g, s, r in zip(self.groups, sharded, replicated)]
        rows += self._hidden_rows(hidden.reshape(sums.hidden.shape), factor)
        for depth, values in enumerate(magnitude.reshape(sums.magnitude.shape)):
            rows += [self._row(block_group_name(depth), role_name(r), "", "magnitude_sum", float(v) * factor)
                     for r, v in enumerate(values) if self.config.sublayers and v > 0]
        rows += self._audit_rows(audit, factor, world)
        return rows

    def _hidden_rows(self, hidden: torch.Tensor, factor: float) -> list[dict]:
        rows = []
        edges = self.config.t_bins
        for site, name in enumerate(self._recorder.site_names):
            if not (name.endswith(".out")):
                continue
            layer = self._recorder.site_layers[site]
            group = "embeddings" if layer == 0 else block_group_name(layer - 1)
            for column in range(hidden.shape[1]):
                total, squares, count = (float(v) for v in hidden[site, column])
                if count == 0:
                    continue
                role, t_bin = ((role_name(column), "") if column < NUM_ROLES
                               else ("all", f"[{edges[column - NUM_ROLES]:g}, {edges[column - NUM_ROLES + 1]:g})"))
                rows += [self._row(group, role, t_bin, "hidden_grad_norm", math.sqrt(squares) * factor),
                         self._row(group, role, t_bin, "hidden_grad_mean", total * factor / count),
                         self._row(group, role, t_bin, "n_positions", count)]
        return rows

    def _audit_rows(self, audit: torch.Tensor, factor: float, world: int) -> list[dict]:
        measured, tokens = float(audit[0]), float(audit[1])
        if tokens == 0:
            return []
        scale = measured * factor  # the ideal weights w_t / sum_global(w) sum to 1 over the global batch
        message = normalisation_warning(scale, self.config.tolerance, self._sums.micro_batches, world)
        if message is not None and self.warned is None:
            self.warned = message
            warnings.warn(message, stacklevel=4)
        return [self._row("model", "all", "", "gradient_scale", scale),
                self._row("model", "all", "", "loss_tokens", tokens)]

    def _row(self, group: str, role: str, t_bin: str, quantity: str, value: float) -> dict:
        return {"step": self._step, "group": group, "role": role, "t_bin": t_bin, "quantity": quantity,
                "value": value}

    def frame(self) -> pd.DataFrame:
        """Every row logged so far, columns :data:`ACCOUNTING_COLUMNS`."""
        return pd.DataFrame(self.rows, columns=list(ACCOUNTING_COLUMNS))


@dataclass
class ParamGroup:
    """A named set of parameters (tied weights once, in the first group that holds them)."""

    name: str
    params: list[nn.Parameter]


def parameter_groups(model: nn.Module) -> list[ParamGroup]:
    """``embeddings``, one group per distinct block (in call order), ``other``; empty groups left out."""
    adapter = adapter_for(model)
    base = model.base_model
    seen: set[int] = set()

    def take(module: nn.Module) -> list[nn.Parameter]:
        out = [p for p in module.parameters() if id(p) not in seen]
        seen.update(id(p) for p in out)
        return out

    groups = [ParamGroup("embeddings", take(get_module(base, adapter.embeddings)))]
    blocks = block_modules(adapter, base)
    depths = depth_occurrences(blocks)
    groups += [ParamGroup(block_group_name(depths[id(b)]), take(b)) for b in distinct_blocks(blocks)]
    groups.append(ParamGroup("other", take(model)))
    return [g for g in groups if g.params]


def grad_square_sums(groups: list[ParamGroup]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group (float64, CPU): the sums of squares of this rank's *shards* of sharded gradients (DTensors with a
    Shard placement: the ranks' sums add up to the norm's square; an empty shard adds 0), and of whole gradients
    (plain tensors, or replicated DTensors: every rank holds the same after DDP's all-reduce; averaged over ranks).
    A parameter without a gradient adds nothing."""
    from torch.distributed.tensor import DTensor, Shard

    sharded = torch.zeros(len(groups), dtype=torch.float64)
    whole = torch.zeros(len(groups), dtype=torch.float64)
    for i, group in enumerate(groups):
        parts_sharded, parts_whole = [], []
        for p in group.params:
            grad = p.grad
            if grad is None:
                continue
            if isinstance(grad, DTensor):
                local = grad.to_local().detach()
                target = parts_sharded if any(isinstance(x, Shard) for x in grad.placements) else parts_whole
                target.append(local.double().pow(2).sum())
            else:
                parts_whole.append(grad.detach().double().pow(2).sum())
        sharded[i] = torch.stack(parts_sharded).sum().cpu() if parts_sharded else 0.0
        whole[i] = torch.stack(parts_whole).sum().cpu() if parts_whole else 0.0
    return sharded, whole


def probe_sharded_norms(model: nn.Module) -> None:
    """Let the recorder's norm probe (is it ``y = xhat * w + b``?) see whole weights under FSDP2: each leaf with a
    1-D sharded ``weight`` (and ``bias``) gets its gathered parameters for the probe (cached per module), then its
    shards back. A collective (``full_tensor``): every rank calls it, in the same module order, at construction."""
    from torch.distributed.tensor import DTensor

    for module in model.modules():
        params = dict(module.named_parameters(recurse=False))
        weight = params.get("weight")
        if (next(module.children(), None) is not None or not isinstance(weight, DTensor) or weight.dim() != 1
                or set(params) - {"weight", "bias"}):
            continue
        whole = {name: nn.Parameter(p.full_tensor().detach(), requires_grad=p.requires_grad)
                 for name, p in params.items()}
        module._parameters.update(whole)
        try:
            norm_like(module)
        finally:
            module._parameters.update(params)


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _reduce_device(model: nn.Module) -> torch.device:
    """Where the one all-reduce runs: the model's device under NCCL, the CPU under gloo."""
    backend = torch.distributed.get_backend()
    param = next(model.parameters(), None)
    return param.device if backend == "nccl" and param is not None else torch.device("cpu")


__all__ = ["ACCOUNTING_COLUMNS", "ACCOUNTING_FILE", "REDUCTIONS", "AccountingConfig", "GradAccounting", "ParamGroup",
           "grad_square_sums", "parameter_groups",
           "probe_sharded_norms"]
