"""Check that the pretraining recipe reproduces a shipped model's training log.

Re-runs ``pretrain.py`` with the shipped model's recorded arguments (``recipe.json``) and its
shipped tokenizer (WordPiece training in HF ``tokenizers`` breaks ties between equally frequent
merges in no fixed order, so a re-trained vocabulary can differ in a few ids), stops after
``--steps`` steps of the same schedule, and compares the per-step training loss with the shipped
``training_log.csv``. Prints the largest absolute and relative difference; exits 1 if they are
above ``--rtol``. Bit-identical losses are expected on the same CPU type, torch version and thread
count; other CPUs round bfloat16 matrix products differently.

    python -m analyses.pretraining.check_reproduce --model gradflow-mini-en --steps 40
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gradflow-mini-en")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rtol", type=float, default=1e-3)
    parser.add_argument("--corpus", default=str(ROOT / "data" / "corpus"))
    args = parser.parse_args()
    shipped = ROOT / "src" / "gradflow" / "models" / args.model
    recipe = json.loads((shipped / "recipe.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        command = [sys.executable, "-m", "analyses.pretraining.pretrain", "--corpus", args.corpus,
                   "--tokenizer", str(shipped), "--out", str(out), "--stop-after", str(args.steps)]
        for key in ("loss", "steps", "batch_size", "lr", "warmup", "seed", "threads", "eval_every", "valid_windows",
                    "dropout", "position_init", "position_scale", "arch", "short_fraction", "short_length",
                    "vocab_size"):
            if key in recipe:
                command += [f"--{key.replace('_', '-')}", str(recipe[key])]
        subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        again = pd.read_csv(out / "training_log.csv")
    log = pd.read_csv(shipped / "training_log.csv").set_index("step").loc[again.step]
    a, b = again.set_index("step").train_loss, log.train_loss
    abs_diff = float((a - b).abs().max())
    rel_diff = float(((a - b).abs() / b.abs()).max())
    identical = bool((a.to_numpy() == b.to_numpy()).all())
    print(json.dumps({"model": args.model, "steps_compared": len(a), "bit_identical": identical,
                      "max_abs_diff": abs_diff, "max_rel_diff": rel_diff}))
    return 0 if rel_diff <= args.rtol else 1


if __name__ == "__main__":
    raise SystemExit(main())
