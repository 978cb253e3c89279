"""GradFlowCallback overhead, measured side by side in ``transformers.Trainer`` MLM training.

Trains a random BertForMaskedLM (default 4 layers, hidden 256, 4 heads, FFN 1024; B=16, T=128)
for ``--steps`` optimizer steps in each of these modes, interleaved over ``--rounds`` rounds:

- ``off``:   no callback;
- ``norms``: ``GradFlowCallback(every, sublayers=False)``: block gradient norms, drift, per-role
  hidden-state gradient norms;
- ``full``:  ``GradFlowCallback(every)``: also the per-role split of every block's weight gradient.

and prints, per mode, the median over rounds of (a) the wall time of ``trainer.train()`` and its
overhead over ``off``, and (b) from per-step timers in the same run (robust to a loaded machine):
the median time of an unlogged step, the mean extra time of a logged step, and the implied
overhead ``(extra * logged steps) / (median step * steps)``. Target: <= 5% at ``--every 50``.
Not a test: numbers are printed, never asserted.

    python benchmarks/bench_callback.py [--steps 200] [--every 50] [--rounds 3] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainerCallback, TrainingArguments

from gradflow.interventions.callback import GradFlowCallback

MODES = ("off", "norms", "full")
SPECIAL = (0, 100, 101, 102, 103)
MASK_ID = 103


class MaskingCollator:
    """BERT 80/10/10 masking of random token rows (own generator: identical across modes)."""

    def __init__(self, vocab: int, rate: float = 0.15, seed: int = 0):
        self.vocab, self.rate = vocab, rate
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        ids = torch.stack([r["input_ids"] for r in rows])
        selected = torch.rand(ids.shape, generator=self.gen) < self.rate
        selected[:, 0] = selected[:, -1] = False
        labels = torch.where(selected, ids, torch.full_like(ids, -100))
        action = torch.rand(ids.shape, generator=self.gen)
        inputs = ids.clone()
        inputs[selected & (action < 0.8)] = MASK_ID
        rand = selected & (action >= 0.8) & (action < 0.9)
        inputs[rand] = torch.randint(1000, self.vocab, (int(rand.sum()),), generator=self.gen)
        return {"input_ids": inputs, "attention_mask": torch.ones_like(ids), "labels": labels}


def dataset(n: int, t: int, vocab: int) -> list[dict]:
    gen = torch.Generator().manual_seed(1)
    body = torch.randint(1000, vocab, (n, t - 2), generator=gen)
    return [{"input_ids": torch.cat([torch.tensor([101]), row, torch.tensor([102])])} for row in body]


class StepTimer:
    """Two callbacks around every other one: ``start`` (add first) and ``stop`` (add last)."""

    def __init__(self, device: str):
        self.device = device
        self.durations: dict[int, float] = {}
        self._t0 = 0.0
        timer = self

        class Start(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer._sync()
                timer._t0 = time.perf_counter()

        class Stop(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                timer._sync()
                timer.durations[state.global_step] = time.perf_counter() - timer._t0

        self.start, self.stop = Start(), Stop()

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


def logged_steps(steps: int, every: int) -> list[int]:
    return [s for s in range(1, steps + 1) if s % every == 0 or s == 1]


def run(mode: str, args: argparse.Namespace) -> tuple[float, dict[int, float]]:
    """Wall seconds of ``trainer.train()`` in one mode, and each step's duration."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=args.hidden // 64, intermediate_size=4 * args.hidden,
                        max_position_embeddings=max(512, args.seq))
    model = BertForMaskedLM(config)
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch,
                                  learning_rate=1e-4, report_to=[], use_cpu=args.device == "cpu",
                                  save_strategy="no", logging_strategy="no", disable_tqdm=True,
                                  dataloader_num_workers=0, seed=0)
        trainer = Trainer(model=model, args=targs, train_dataset=dataset(args.steps * args.batch, args.seq, args.vocab),
                          data_collator=MaskingCollator(args.vocab))
        timer = StepTimer(args.device)
        trainer.add_callback(timer.start)
        if mode != "off":
            tok = SimpleNamespace(mask_token_id=MASK_ID, all_special_ids=list(SPECIAL))
            trainer.add_callback(GradFlowCallback(args.every, sublayers=mode == "full", tokenizer=tok))
        trainer.add_callback(timer.stop)
        start = time.perf_counter()
        trainer.train()
        return time.perf_counter() - start, timer.durations


def step_stats(durations: dict[int, float], args: argparse.Namespace) -> dict[str, float]:
    """Median unlogged step, mean extra of a logged step, implied overhead (step 1 excluded: warm-up)."""
    logged = set(logged_steps(args.steps, args.every))
    plain = statistics.median(d for s, d in durations.items() if s not in logged and s > 1)
    extra = statistics.mean(durations[s] - plain for s in logged if s > 1)
    return {"step_s": plain, "logged_extra_s": extra,
            "implied_overhead_pct": 100 * extra * len(logged) / (plain * args.steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    stats: dict[str, list[dict]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in MODES:
            wall, durations = run(mode, args)
            times[mode].append(wall)
            stats[mode].append(step_stats(durations, args))
            print(f"round {r + 1} {mode:5s} {wall:.2f}s  {json.dumps(stats[mode][-1])}", flush=True)
    base = statistics.median(times["off"])
    summary = {}
    for m in MODES:
        med = {k: statistics.median(s[k] for s in stats[m]) for k in stats[m][0]}
        summary[m] = {"wall_median_s": round(statistics.median(times[m]), 3),
                      "wall_overhead_pct": round(100 * (statistics.median(times[m]) / base - 1), 2),
                      **{k: round(v, 4) for k, v in med.items()}}
    print(json.dumps({"config": vars(args), "logged_steps": len(logged_steps(args.steps, args.every)),
                      "modes": summary}, indent=2))


if __name__ == "__main__":
    main()
