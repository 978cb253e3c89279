"""The model sharded by FSDP2 under torchrun (``gradflow record --shard fsdp2``), and the ranks kept in step.

Every transformer block whose parameters are its own becomes one FSDP2 unit
(``torch.distributed.fsdp.fully_shard``), and the whole model the root unit: the embeddings, the MLM head and
any parameter shared between them (tied input and output embeddings) live in the root's group, so tying
survives sharding. A rank holds ``1 / world`` of each parameter (dim 0; a parameter with fewer rows than ranks
leaves some ranks an empty shard); each forward gathers a unit's parameters just before it runs and frees them
after, and the backward gathers them again.

What is recorded reads no parameter gradient: per-position norms come from activation hooks, and the per-role
split of a weight gradient from each call's input rows and output gradients (:mod:`gradflow.hooks.sublayer_stats`),
all local to the rank, which holds whole batches. Where a parameter gradient *is* read (training-time accounting)
its norm is reduced across ranks by :func:`gradflow.interventions.grad_norms.global_sq_sums`; a local shard's
norm is not the norm.

FSDP2's gathers are collectives, so every rank must run every step: batches are dealt whole (the one-process
run's batch k goes to rank ``k % world``) and :func:`lockstep` lets a rank whose batches have run out repeat a
filler batch, recorded and dropped, until every rank's have.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from gradflow.adapters import block_modules
from gradflow.adapters.norms import norm_like
from gradflow.errors import UsageError
from gradflow.inputs.masking import MaskedBatch
from gradflow.models import LoadedModel
from gradflow.runs.interrupts import StopRequest

SHARDINGS: tuple[str, ...] = ("none", "fsdp2")
"""The values of ``--shard``: ``none`` (each rank a whole model copy) or ``fsdp2`` (parameters sharded)."""

WHOLE_MODEL = "under FSDP2 the root's parameters (embeddings, head) are gathered by the whole model's forward"
"""Why a sharded model is called whole (logits at every position; the loss and its gradients are the same)."""


@dataclass(frozen=True)
class ShardPlan:
    """How a model was sharded: ``kind`` (``fsdp2``), ``world`` ranks, ``units`` FSDP2 units (blocks, plus the
    root) and ``blocks_left`` blocks left to the root because a parameter of theirs is shared outside them."""

    kind: str
    world: int
    units: int
    blocks_left: int

    def describe(self) -> dict:
        """meta.json's ``sharding``."""
        return {"kind": self.kind, "world_size": self.world, "units": self.units, "blocks_in_root": self.blocks_left}


def check_sharding(shard: str, world: int, router_aux_loss: float | str | None) -> None:
    """Refuse, in one sentence, a sharding this process cannot run: an unknown kind, FSDP2 outside torchrun,
    or FSDP2 with the router's auxiliary loss (measured by gradients of parameters FSDP2 holds in shards)."""
    if shard not in SHARDINGS:
        raise UsageError(f"unknown sharding {shard!r}: pass --shard {' or --shard '.join(SHARDINGS)}.")
    if shard == "none":
        return
    if world < 2:
        raise UsageError("--shard fsdp2 shards the model across torchrun's processes: launch with torchrun "
                         "--nproc-per-node N (N >= 2), or drop --shard.")
    if router_aux_loss is not None:
        raise UsageError("--router-aux-loss measures parameter gradients that FSDP2 holds in shards: record it "
                         "with --shard none (each rank a whole model).")


def shard_model(loaded: LoadedModel, device: str, world: int) -> tuple[LoadedModel, ShardPlan]:
    """Shard ``loaded``'s model in place with FSDP2 over ``world`` ranks on ``device``'s type; returns the loaded
    model with an adapter that calls the model whole (see :data:`WHOLE_MODEL`) and the plan for meta.json."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (world,))
    model = loaded.model
    for module in model.modules():  # norms are probed (y = xhat * w + b?) while their weights are whole
        norm_like(module)
    blocks = _distinct(block_modules(loaded.adapter, model.base_model))
    own = [block for block in blocks if _owns_parameters(model, block)]
    for block in own:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    adapter = loaded.adapter if loaded.adapter.run_whole_model else replace(loaded.adapter, run_whole_model=WHOLE_MODEL)
    return replace(loaded, adapter=adapter), ShardPlan("fsdp2", world, len(own) + 1, len(blocks) - len(own))


def _distinct(modules: list[nn.Module]) -> list[nn.Module]:
    """Each module once, in first-call order (a block applied at several depths is one unit)."""
    return list({id(m): m for m in modules}.values())


def _owns_parameters(model: nn.Module, block: nn.Module) -> bool:
    """Whether every parameter of ``block`` is used nowhere else in ``model`` (it can be its own FSDP2 unit)."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    inside = Counter(id(p) for _, p in block.named_parameters(remove_duplicate=False))
    return bool(inside) and all(uses[key] == count for key, count in inside.items())


def lockstep(stream: Iterator[MaskedBatch], idle: Callable[[MaskedBatch], None],
             filler: Callable[[], MaskedBatch | None], stop: StopRequest, device: str) -> Iterator[MaskedBatch]:
    """This rank's batches from ``stream``, one per step of all ranks: before each step the ranks agree (one
    all-reduce of two flags) whether any still has a batch and whether any was asked to stop. A rank out of
    batches while others are not runs ``idle`` on its last batch (or ``filler()``, one the corpus gives) and
    drops the result; any rank's stop (Ctrl-C, an error reading the corpus) stops all at the same step, the
    others' ``stop`` then set as if asked."""
    last: MaskedBatch | None = None
    done = False
    while True:
        batch, failure = None, None
        if not done:
            try:
                batch = next(stream, None)
            except Exception as err:  # noqa: BLE001 - the peers are told to stop first, then it is raised
                failure = err
            done = batch is None
        flags = torch.tensor([0 if done else 1, int(stop.requested or failure is not None)], device=device)
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
        if failure is not None:
            raise failure
        if int(flags[1]):
            stop.requested = True
            return
        if not int(flags[0]):
            return
        if batch is None:
            spare = last if last is not None else filler()
            if spare is None:  # nothing to run at all: the corpus has no window (every rank ends at the next step)
                raise UsageError("this rank has no batch to keep in step with the others: the corpus has no window.")
            idle(spare)
            continue
        last = batch
        yield batch


__all__ = ["SHARDINGS", "WHOLE_MODEL", "ShardPlan", "check_sharding", "lockstep", "shard_model"]
