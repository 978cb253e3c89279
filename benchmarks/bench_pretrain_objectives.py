"""The embedded 6-block recipe's step time under each pretraining objective, side by side (issue 52's budget).

Times ``analyses.pretraining.pretrain.train_step`` (corruption, bfloat16-autocast forward, loss, backward,
clipping, AdamW, schedule) for each ``--loss``, as ``pretrain.py`` trains it (mini-en's sizes, batch 16 x 128,
one thread by default: mini-en and its twin trained side by side on one core each). Every objective gets its own
model and optimiser, seeded alike, and the windows mini-en saw at the same steps (the corpus and tokenizer
``pretrain.py`` uses; the recipe's generator, so step k is mini-en's step k). Rounds interleave the objectives
(a slow spell of the machine hits all of them); after ``--warmup-steps`` untimed steps each round times
``--steps`` steps per objective. Prints one JSON line per objective (mean and median seconds per step, the 10-90% spread) and
each objective's step count for mini-en's compute: ``round(3600 * t_mlm / t_objective)`` with ``t`` the mean
step time (compute is the sum of the steps' times; a diffusion step's time varies with its ratios, so its
median is not its mean). Not a test: numbers
are printed, never asserted.

    python -m benchmarks.bench_pretrain_objectives --loss mlm mask40 diffusion --rounds 6 --steps 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from analyses.pretraining import pretrain

MINI_EN_STEPS = 3600
"""gradflow-mini-en's training steps (its recipe.json)."""


class Arm:
    """One objective: its model, optimiser, schedule and generators, stepping through mini-en's windows."""

    def __init__(self, loss: str, train: torch.Tensor, tokenizer, args: argparse.Namespace) -> None:
        self.loss, self.train, self.tokenizer, self.times = loss, train, tokenizer, []
        self.args = argparse.Namespace(loss=loss, sparse=False, arch="roformer", dropout=0.0, position_init="sinusoidal",
                                       position_scale=1.0, lr=1e-3, warmup=250, steps=MINI_EN_STEPS)
        torch.manual_seed(0)
        self.model = pretrain.build_model(self.args, len(tokenizer), tokenizer.pad_token_id).train()
        self.opt, self.schedule = pretrain.make_optimizer(self.model, self.args)
        self.gen, self.ratio_gen = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
        batch = args.batch_size
        self.batch = batch
        self.capacity = batch * pretrain.MAX_LEN if loss == "alltoken" else batch * pretrain.MAX_LEN // 4

    def time_steps(self, n: int, record: bool = True) -> None:
        for _ in range(n):
            ids = self.train[torch.randint(len(self.train), (self.batch,), generator=self.gen)]
            t0 = time.perf_counter()
            pretrain.train_step(self.model, self.opt, self.schedule, ids, self.tokenizer, self.gen, self.args,
                                self.capacity, self.ratio_gen)
            if record:
                self.times.append(time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--loss", nargs="+", default=["mlm", "mask40", "diffusion"])
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--tokenizer", type=Path, default=Path("src/gradflow/models/gradflow-mini-en"),
                   help="mini-en's shipped tokenizer (as check_reproduce uses it)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=5, help="timed steps per objective and round")
    p.add_argument("--warmup-steps", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = pretrain.train_tokenizer(args.corpus, args.tokenizer, 8192)
    train = pretrain.windows(tokenizer, args.corpus / "train.txt")
    print(json.dumps({"torch": torch.__version__, "cpu_count": os.cpu_count(), "loadavg": os.getloadavg(),
                      "threads": args.threads, "batch": f"{args.batch_size}x{pretrain.MAX_LEN}",
                      "train_windows": len(train)}), flush=True)
    arms = [Arm(loss, train, tokenizer, args) for loss in args.loss]
    for arm in arms:
        arm.time_steps(args.warmup_steps, record=False)
    for round_ in range(args.rounds):
        for arm in (arms if round_ % 2 == 0 else reversed(arms)):
            arm.time_steps(args.steps)
    means = {arm.loss: statistics.fmean(arm.times) for arm in arms}
    for arm in arms:
        times = sorted(arm.times)
        print(json.dumps({"loss": arm.loss, "s_per_step": round(means[arm.loss], 4),
                          "median_s": round(statistics.median(times), 4), "steps_timed": len(times),
                          "spread_s": [round(times[len(times) // 10], 4), round(times[-1 - len(times) // 10], 4)]}))
    if "mlm" in means:
        for loss, seconds in means.items():
            steps = round(MINI_EN_STEPS * means["mlm"] / seconds)
            print(json.dumps({"loss": loss, "t_mlm_over_t": round(means["mlm"] / seconds, 4),
                              "steps_at_mini_en_compute": steps, "warmup": round(250 * steps / MINI_EN_STEPS)}))
    print(json.dumps({"loadavg_after": os.getloadavg()}), flush=True)


if __name__ == "__main__":
    main()
