"""Training throughput of the pretraining recipe (analyses/pretraining/recipe): tokens per second.

Times ``recipe.train.train_step`` (forward, MLM loss at the loss rows, backward, clipping, AdamW,
schedule) on synthetic token ids (no corpus needed), batch B x T, after warm-up steps; the batch
is built by the recipe's own ``TokenStream`` (BERT corruption included, outside the timed step).
Prints one line per (arch, loss, threads): median seconds per step and tokens/s (B*T / step time),
with the load average before the run. Not a test: numbers are printed, never asserted.

    python -m benchmarks.bench_pretrain --arch base tiny --threads 1 2
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


def bench(arch: str, loss: str, threads: int, args: argparse.Namespace) -> dict[str, object]:
    """Median step time over ``args.steps`` timed steps after ``args.warmup_steps``."""
    torch.set_num_threads(threads)
    cfg = RunConfig.from_arch(arch, corpus="", out="", loss=loss, batch_size=args.batch_size, device=args.device,
                              dtype=args.dtype, steps=10_000, warmup=100)
    capacity = cfg.batch_size * cfg.max_len if loss == "alltoken" else cfg.batch_size * cfg.max_len // 4
    stream = TokenStream(synthetic_windows(4 * cfg.batch_size, cfg.max_len), cfg.batch_size, 0, SPECIAL,
                         loss == "alltoken", capacity)
    model = build_model(cfg, VOCAB, SPECIAL.pad).to(args.device)
    opt, schedule = make_optimizer(model, cfg)
    times = []
    for step in range(args.warmup_steps + args.steps):
        batch = stream.batch(step).to(args.device)
        sync(args.device)
        start = time.perf_counter()
        train_step(model, opt, schedule, batch, cfg)
        sync(args.device)
        if step >= args.warmup_steps:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    tokens = cfg.batch_size * cfg.max_len
    return {"arch": arch, "layers": cfg.layers, "hidden": cfg.hidden, "loss": loss, "device": args.device,
            "dtype": args.dtype, "threads": threads if args.device == "cpu" else None,
            "batch": f"{cfg.batch_size}x{cfg.max_len}", "params_M": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
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
    args = p.parse_args()
    threads = args.threads if args.device == "cpu" else [torch.get_num_threads()]
    print(json.dumps({"torch": torch.__version__, "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(),
                      "cuda": torch.cuda.get_device_name() if args.device.startswith("cuda") else None}), flush=True)
    for arch in args.arch:
        for loss in args.loss:
            for n in threads:
                print(json.dumps(bench(arch, loss, n, args)), flush=True)
    print(json.dumps({"loadavg_after": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
