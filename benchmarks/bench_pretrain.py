"""Training throughput of the pretraining recipe (analyses/pretraining/recipe): tokens per second.

Times ``recipe.train.train_step`` (forward, MLM loss at the loss rows, backward, clipping, AdamW,
schedule) on synthetic token ids (no corpus needed), batch B x T, after warm-up steps; the batch
is built by the recipe's own ``TokenStream`` (BERT corruption included, outside the timed step).
Prints one line per (arch, loss, threads): median seconds per step and tokens/s (B*T / step time),
with the load average before the run. Not a test: numbers are printed, never asserted.
``--sparse`` times the MLM loss as the recipe's ``--sparse`` runs it (the last block's query side and the
head at the loss rows only); ``--rounds R`` interleaves: each round times every (arch, loss, threads) once,
in order, and the median is over all rounds' steps (a slow spell of the machine hits every configuration).

    python -m benchmarks.bench_pretrain --arch base tiny --threads 1 2
    python -m benchmarks.bench_pretrain --arch mini12 --loss mlm alltoken --sparse --threads 2 --rounds 5
    python -m benchmarks.bench_pretrain --arch base --device cuda --dtype bfloat16 --batch-size 64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
from analyses.pretraining.recipe.config import RunConfig
from analyses.pretraining.recipe.data import SpecialIds, TokenStream
from analyses.pretraining.recipe.model import build_model
from analyses.pretraining.recipe.train import make_optimizer, train_step

VOCAB = 8192
SPECIAL = SpecialIds(cls=2, sep=3, pad=0, mask=4, vocab=VOCAB)  # BertWordPiece's order: PAD UNK CLS SEP MASK


def synthetic_windows(n: int, length: int, seed: int = 0) -> np.ndarray:
    """(n, length) int32 windows of uniform random non-special ids between [CLS] and [SEP], no padding."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, VOCAB, size=(n, length), dtype=np.int32)
    ids[:, 0], ids[:, -1] = SPECIAL.cls, SPECIAL.sep
    return ids


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Arm:
    """One (arch, loss, threads) configuration: its model, optimiser and batches, timed in ``time_steps`` calls."""

    def __init__(self, arch: str, loss: str, threads: int, args: argparse.Namespace) -> None:
        self.threads, self.device, self.step, self.times = threads, args.device, 0, []
        sparse = args.sparse and loss == "mlm"
        self.cfg = RunConfig.from_arch(arch, corpus="", out="", loss=loss, batch_size=args.batch_size,
                                       device=args.device, dtype=args.dtype, steps=10_000, warmup=100, sparse=sparse)
        capacity = self.cfg.batch_size * self.cfg.max_len
        capacity = capacity if loss == "alltoken" else capacity // 4
        self.stream = TokenStream(synthetic_windows(4 * self.cfg.batch_size, self.cfg.max_len), self.cfg.batch_size,
                                  0, SPECIAL, loss == "alltoken", capacity)
        torch.set_num_threads(threads)
        self.model = build_model(self.cfg, VOCAB, SPECIAL.pad).to(args.device)
        self.opt, self.schedule = make_optimizer(self.model, self.cfg)

    def time_steps(self, n: int, warmup: int = 0) -> None:
        """Run ``warmup`` untimed then ``n`` timed training steps (seconds appended to ``times``)."""
        torch.set_num_threads(self.threads)
        for k in range(warmup + n):
            batch = self.stream.batch(self.step).to(self.device)
            self.step += 1
            sync(self.device)
            start = time.perf_counter()
            train_step(self.model, self.opt, self.schedule, batch, self.cfg)
            sync(self.device)
            if k >= warmup:
                self.times.append(time.perf_counter() - start)

    def row(self, arch: str) -> dict[str, object]:
        cfg, times = self.cfg, self.times
        median = statistics.median(times)
        tokens = cfg.batch_size * cfg.max_len
        return {"arch": arch, "layers": cfg.layers, "hidden": cfg.hidden, "loss": cfg.loss, "sparse": cfg.sparse,
                "device": self.device, "dtype": cfg.dtype, "threads": self.threads if self.device == "cpu" else None,
                "batch": f"{cfg.batch_size}x{cfg.max_len}",
                "params_M": round(sum(p.numel() for p in self.model.parameters()) / 1e6, 2),
                "s_per_step": round(median, 4), "tokens_per_s": round(tokens / median, 1),
                "steps_timed": len(times), "spread_s": [round(min(times), 4), round(max(times), 4)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", nargs="+", default=["base", "tiny"])
    p.add_argument("--loss", nargs="+", default=["mlm"], choices=["mlm", "alltoken"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--sparse", action="store_true", help="the MLM arms train as the recipe's --sparse does")
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of --steps timed steps per arm")
    args = p.parse_args()
    threads = args.threads if args.device == "cpu" else [torch.get_num_threads()]
    print(json.dumps({"torch": torch.__version__, "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(),
                      "cuda": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}), flush=True)
    arms = {(arch, loss, n): Arm(arch, loss, n, args) for arch in args.arch for loss in args.loss for n in threads}
    for arm in arms.values():
        arm.time_steps(0, warmup=args.warmup_steps)
    for _ in range(args.rounds):
        for arm in arms.values():
            arm.time_steps(args.steps)
    for (arch, _, _), arm in arms.items():
        print(json.dumps(arm.row(arch)), flush=True)
    if len(args.loss) == 2 and len(args.arch) == 1 and len(threads) == 1:
        arch, n = args.arch[0], threads[0]
        mlm, alltoken = (statistics.median(arms[(arch, loss, n)].times) for loss in ("mlm", "alltoken"))
        print(json.dumps({"t_mlm_over_t_alltoken": round(mlm / alltoken, 4)}), flush=True)
    print(json.dumps({"loadavg_after": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
