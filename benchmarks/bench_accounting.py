"""GradAccounting's overhead in a plain MLM training loop, logging every 50 steps, measured side by side.

    python benchmarks/bench_accounting.py [--steps 100] [--every 50] [--rounds 3] [--layers 4] [--hidden 256]
        [--batch 8] [--length 128] [--accumulation 2]
    torchrun --nproc-per-node 2 benchmarks/bench_accounting.py ...   # DDP over gloo ranks

Trains a random BertForMaskedLM (AdamW, BERT 80/10/10 masking from a fixed generator, ``--accumulation``
micro-batches a step, the loss over the global batch's loss tokens) for ``--steps`` steps in each mode, interleaved
over ``--rounds`` rounds: ``off`` (no accounting), ``accounting`` (``GradAccounting(every)``: group norms, per-role and
per-t-bin hidden-state gradient norms, the audit) and ``sublayers`` (also the per-role magnitudes). Prints per mode
the median over rounds of the wall time and its overhead over ``off``, and, from per-step timers in the same run, the
median unlogged step, the mean extra time of a logged step and the implied overhead
``extra * logged steps / (median step * steps)``. Target (issue 62): <= 1% at ``--every 50``. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import nullcontext

import torch
from transformers import BertConfig, BertForMaskedLM

from gradflow.interventions.accounting import AccountingConfig, GradAccounting
from gradflow.roles import Role

MODES = ("off", "accounting", "sublayers")
MASK = 103


def batch_of(gen: torch.Generator, args: argparse.Namespace, vocab: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1000, vocab, (args.batch, args.length), generator=gen)
    selected = torch.rand(ids.shape, generator=gen) < 0.15
    labels = torch.where(selected, ids, torch.full_like(ids, -100))
    action = torch.rand(ids.shape, generator=gen)
    inputs = ids.clone()
    inputs[selected & (action < 0.8)] = MASK
    roles = torch.full_like(ids, int(Role.CONTEXT))
    roles[selected] = int(Role.KEPT)
    roles[selected & (action < 0.9)] = int(Role.RANDOM)
    roles[selected & (action < 0.8)] = int(Role.MASKED)
    return {"input_ids": inputs, "labels": labels, "roles": roles, "t": torch.rand(args.batch, generator=gen)}


def train(mode: str, args: argparse.Namespace, world: int, rank: int) -> tuple[float, dict[int, float]]:
    torch.manual_seed(0)
    vocab = 8000
    config = BertConfig(vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden,
                        max_position_embeddings=max(512, args.length))
    model = BertForMaskedLM(config).train()
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    accounting = (GradAccounting(wrapped, AccountingConfig(every=args.every, t_bins=(0, .25, .5, .75, 1),
                                                           sublayers=mode == "sublayers")) if mode != "off" else None)
    gen = torch.Generator().manual_seed(1 + rank)
    durations = {}
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        micro = [batch_of(gen, args, vocab) for _ in range(args.accumulation)]
        tokens = sum(int((b["labels"] != -100).sum()) for b in micro) * world
        with accounting.step(step) if accounting else nullcontext():
            for i, b in enumerate(micro):
                sync = wrapped.no_sync() if world > 1 and i < len(micro) - 1 else nullcontext()
                capture = (accounting.micro_batch(b["roles"], labels=b["labels"], t=b["t"]) if accounting
                           else nullcontext())
                with sync, capture:
                    logits = wrapped(input_ids=b["input_ids"]).logits
                    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), b["labels"], reduction="sum")
                    (loss * world / tokens).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        durations[step] = time.perf_counter() - t0
    return time.perf_counter() - start, durations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("steps", 100), ("every", 50), ("rounds", 3), ("layers", 4), ("hidden", 256),
                          ("batch", 8), ("length", 128), ("accumulation", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if world > 1 else 0
    logged = {s for s in range(1, args.steps + 1) if s % args.every == 0 or s == 1}
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    implied: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else tuple(reversed(MODES))):
            wall, durations = train(mode, args, world, rank)
            plain = statistics.median(d for s, d in durations.items() if s not in logged)
            extra = statistics.mean(durations[s] - plain for s in logged if s > 1)
            walls[mode].append(wall)
            implied[mode].append(100 * extra * (len(logged) - 1) / (plain * args.steps))
            if rank == 0:
                print(f"round {r} {mode:10s} wall {wall:.2f} s  step {plain * 1000:.1f} ms  logged extra "
                      f"{extra * 1000:.1f} ms", flush=True)
    if rank == 0:
        off = statistics.median(walls["off"])
        summary = {m: {"wall_s": statistics.median(walls[m]),
                       "wall_overhead_pct": 100 * (statistics.median(walls[m]) / off - 1),
                       "implied_overhead_pct": statistics.median(implied[m])} for m in MODES if m != "off"}
        print(f"ranks={world} steps={args.steps} every={args.every} accumulation={args.accumulation} "
              f"layers={args.layers} hidden={args.hidden} B={args.batch} T={args.length} load={os.getloadavg()[0]:.1f}")
        print(json.dumps(summary))
    if world > 1:
        torch.distributed.barrier()  # no rank tears gloo down while rank 0 still prints
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
