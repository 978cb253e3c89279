"""`gradflow record --shard fsdp2`'s per-batch work against a bare FSDP2 forward and backward, side by side.

Run under torchrun (2 CPU ranks by default, gloo)::

    torchrun --nproc-per-node 2 benchmarks/bench_fsdp2_record.py [--rounds 5] [--steps 3] [--layers 4]
        [--hidden 256] [--batch 8] [--length 128]

A random BertForMaskedLM (``--layers``, ``--hidden``, 4 x hidden FFN; gradflow-mini-en's tokenizer and masking of
the committed sample) is sharded as ``record --shard fsdp2`` shards it (:func:`gradflow.runs.sharding.shard_model`:
each block a unit, the root the rest). Per round, in turn (order reversed every other round):

- ``bare``:   ``model(**inputs)``, the MLM loss at the labels (sequence reduction), ``loss.backward()`` (FSDP2's
  gathers and reduce-scatters), gradients dropped;
- ``record``: ``GradFlowRecorder.record(batch)`` on the same sharded model: the whole model's forward, the loss,
  ``autograd.grad`` towards the embeddings, every site's norms and the per-role sublayer split;
- ``norms``:  the same with ``RecorderConfig(sublayers=False)``.

Each sample is the mean of ``--steps`` batches after an untimed one; rank 0 prints per mode the median seconds per
batch and the median of the per-round ratios to ``bare``. Target (issue 62): ``record`` <= 1.15x ``bare``. Not a
test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import BertConfig, BertForMaskedLM

from gradflow.hooks.recorder import GradFlowRecorder, RecorderConfig
from gradflow.inputs.masking import BertMasking
from gradflow.losses import get_loss
from gradflow.models import load_model
from gradflow.models.loading import LoadedModel
from gradflow.runs.job import open_job
from gradflow.runs.sharding import shard_model

MODES = ("bare", "record", "norms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    mini = load_model("gradflow-mini-en", "cpu", "float32")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(mini.tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden,
                        max_position_embeddings=max(512, args.length), pad_token_id=mini.tokenizer.pad_token_id,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(config).eval()
    loaded = LoadedModel(model, mini.tokenizer, "random-bert", "random-bert", mini.adapter, "random")
    loaded, _ = shard_model(loaded, "cpu", world)
    job = open_job(loaded, None, BertMasking(seed=0), args.length, args.batch, rank=rank, world=world)
    batches = [b for _, b in zip(range(args.steps + 1), job.batches())]
    loss_fn = get_loss("mlm", "sequence")
    recorders = {"record": GradFlowRecorder(loaded.model, RecorderConfig(sublayers=True), loaded.adapter),
                 "norms": GradFlowRecorder(loaded.model, RecorderConfig(sublayers=False), loaded.adapter)}

    def bare(batch) -> None:
        loss_fn(loaded.model(**batch.model_inputs()).logits, batch).backward()
        loaded.model.zero_grad(set_to_none=True)

    def sample(mode: str) -> float:
        def one(batch) -> None:
            if mode == "bare":
                bare(batch)
            else:
                recorders[mode].record(batch, reduction="sequence")

        def run() -> float:
            one(batches[0])  # untimed
            torch.distributed.barrier()
            start = time.perf_counter()
            for batch in batches[1:]:
                one(batch)
            torch.distributed.barrier()
            return (time.perf_counter() - start) / (len(batches) - 1)

        if mode == "bare":
            return run()
        with recorders[mode]:
            return run()

    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else tuple(reversed(MODES))):
            times[mode].append(sample(mode))
    if rank == 0:
        load = os.getloadavg()[0]
        print(f"ranks={world} backend=gloo threads={torch.get_num_threads()} layers={args.layers} "
              f"hidden={args.hidden} B={args.batch} T={args.length} torch={torch.__version__} load={load:.1f}")
        summary = {}
        for mode in MODES:
            ratios = [t / b for t, b in zip(times[mode], times["bare"])]
            summary[mode] = {"s_per_batch": statistics.median(times[mode]), "ratio_median": statistics.median(ratios),
                             "ratio_min": min(ratios), "ratio_max": max(ratios)}
            print(f"{mode:7s} {summary[mode]['s_per_batch']:.4f} s/batch  x{summary[mode]['ratio_median']:.3f} "
                  f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
        print(json.dumps(summary))
    torch.distributed.barrier()  # no rank tears gloo down while rank 0 still prints
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
