"""Checkpoint overhead of ``gradflow record`` on the committed sample, measured side by side.

Records the committed SOTU sample (``--limit`` windows, the embedded ``gradflow-mini-en`` by default)
in three modes, interleaved over ``--rounds`` rounds (after one untimed warm-up run):

- ``off``:     no periodic checkpoint (``checkpoint_every`` and ``checkpoint_minutes`` out of reach);
- ``default``: the defaults (every 1024 sequences or 10 minutes, whichever comes first);
- ``dense``:   a checkpoint every ``--dense`` sequences, to price one checkpoint.

and prints per mode the median wall time, its ratio to ``off``, the checkpoints written and the
time spent in them (timed inside the run, so robust to a loaded machine). From ``dense`` it derives
the cost of one checkpoint and the overhead at the default interval: that cost over the time of
1024 sequences (the median time per sequence outside checkpoints, over every run). A kill loses at most the work since the last checkpoint: 1024 sequences or 10
minutes with the defaults. Not a test: numbers are printed, never asserted.

    python benchmarks/checkpoint_overhead.py [--limit 256] [--rounds 3] [--dense 32] [--model gradflow-mini-en]
        [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

from gradflow.models import load_model
from gradflow.runs.record import RecordConfig, record_corpus
from gradflow.runs.resume import DEFAULT_EVERY, DEFAULT_MINUTES

FAR = 10**12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gradflow-mini-en")
    parser.add_argument("--limit", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dense", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu", help="torch device for the recordings (default cpu)")
    a = parser.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    loaded = load_model(a.model, device=a.device)
    modes = {"off": (FAR, FAR), "default": (DEFAULT_EVERY, DEFAULT_MINUTES), "dense": (a.dense, FAR)}
    results: dict[str, list] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        record_corpus(RecordConfig(out=str(Path(tmp) / "warm-up"), model=a.model, limit=8, quiet=True,
                                   device=a.device), loaded)
        names = list(modes)
        for r in range(a.rounds):  # the order rotates each round, so a load that drifts hits every mode
            for mode in names[r % len(names):] + names[: r % len(names)]:
                every, minutes = modes[mode]
                out = Path(tmp) / f"{mode}{r}"
                s = record_corpus(RecordConfig(out=str(out), model=a.model, limit=a.limit, quiet=True,
                                               checkpoint_every=every, checkpoint_minutes=minutes,
                                               device=a.device), loaded)
                results[mode].append((s.wall_s, s.checkpoint_s, s.sequences))
    base = statistics.median(w for w, _, _ in results["off"])
    print(f"{a.model}, committed sample, --limit {a.limit}, {a.rounds} rounds, device {a.device}, "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'mode':8} {'checkpoints':>11} {'wall_s':>8} {'ratio':>7} {'in_ckpt_s':>9} {'in_ckpt%':>8}")
    for mode, (every, _) in modes.items():
        wall = statistics.median(w for w, _, _ in results[mode])
        ckpt = statistics.median(c for _, c, _ in results[mode])
        count = results[mode][0][2] // every if every < FAR else 0
        each = " ".join(f"{w:.2f}" for w, _, _ in results[mode])
        print(f"{mode:8} {count:>11} {wall:>8.2f} {wall / base:>7.3f} {ckpt:>9.3f} {100 * ckpt / wall:>7.2f}%  ({each})")
    dense_count = max(results["dense"][0][2] // a.dense, 1)
    per_ckpt = statistics.median(c for _, c, _ in results["dense"]) / dense_count
    per_seq = statistics.median((w - c) / max(n, 1) for runs in results.values() for w, c, n in runs)
    print(f"one checkpoint: {per_ckpt * 1000:.1f} ms; {DEFAULT_EVERY} sequences: {per_seq * DEFAULT_EVERY:.1f} s; "
          f"overhead at the default interval: {100 * per_ckpt / (per_seq * DEFAULT_EVERY):.3f}% "
          f"(a kill loses at most {DEFAULT_EVERY} sequences or {DEFAULT_MINUTES:g} minutes of work)")


if __name__ == "__main__":
    main()
