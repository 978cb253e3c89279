"""Check that the pretraining recipe reproduces a shipped model's training log.

Re-runs ``pretrain.py`` with the shipped model's recorded arguments (``recipe.json``) and its
shipped tokenizer (WordPiece training in HF ``tokenizers`` breaks ties between equally frequent
merges in no fixed order, so a re-trained vocabulary can differ in a few ids), stops after
``--steps`` steps of the same schedule, and compares the per-step training loss with the shipped
``training_log.csv``. Prints the largest absolute and relative difference; exits 1 if they are
above ``--rtol``. Bit-identical losses are expected on the same CPU type, torch version and thread
count; other CPUs round bfloat16 matrix products differently.

    python -m analyses.pretraining.check_reproduce --model gradflow-mini-en --steps 40
    python -m analyses.pretraining.check_reproduce --model gradflow-mini12-en --steps 20

A model shipped by :mod:`analyses.pretraining.ship_base` is re-trained with ``pretrain_base`` and the
arguments its card records (``recipe.json``'s ``config``), ``--sparse`` included.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

from analyses.pretraining.recipe.train import EXIT_STOPPED
from gradflow.models import embedded_model_dir

ROOT = Path(__file__).resolve().parents[2]


BASE_KEYS = ("loss", "arch", "layers", "hidden", "heads", "ffn", "max_len", "vocab_size", "steps", "batch_size", "lr",
             "warmup", "weight_decay", "clip", "seed", "threads", "valid_windows", "eval_every", "log_every")
"""The resumable recipe's arguments a ``pretrain_base`` card (``recipe.json`` with ``config``) carries."""


def rerun_command(recipe: dict, shipped: Path, out: Path, steps: int, corpus: str | None) -> list[str]:
    """The command that re-trains a shipped model's first ``steps`` steps with its recorded arguments: the
    resumable recipe for a card written by :mod:`analyses.pretraining.ship_base`, else ``pretrain.py``."""
    if "config" in recipe:
        cfg = recipe["config"]
        command = [sys.executable, "-m", "analyses.pretraining.pretrain_base", "--corpus", corpus or cfg["corpus"],
                   "--tokenizer", str(shipped), "--out", str(out), "--stop-after", str(steps)]
        command += [arg for key in BASE_KEYS for arg in (f"--{key.replace('_', '-')}", str(cfg[key]))]
        return command + (["--sparse"] if cfg.get("sparse") else [])
    corpus = corpus or str(ROOT / "data" / "corpus")
    command = [sys.executable, "-m", "analyses.pretraining.pretrain", "--corpus", corpus, "--tokenizer", str(shipped),
               "--out", str(out), "--stop-after", str(steps)]
    for key in ("loss", "steps", "batch_size", "lr", "warmup", "seed", "threads", "eval_every", "valid_windows",
                "dropout", "position_init", "position_scale", "arch", "short_fraction", "short_length",
                "vocab_size"):
        if key in recipe:
            command += [f"--{key.replace('_', '-')}", str(recipe[key])]
    return command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gradflow-mini-en")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rtol", type=float, default=1e-3)
    parser.add_argument("--corpus", default=None, help="the corpus folder (default: the one the model was trained on)")
    parser.add_argument("--package", type=Path, default=None,
                        help="the folder the model was shipped to (default: where the embedded model is installed: "
                             "src/gradflow/models or the companion gradflow-models)")
    args = parser.parse_args(argv)
    shipped = args.package / args.model if args.package else embedded_model_dir(args.model)
    recipe = json.loads((shipped / "recipe.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        command = rerun_command(recipe, shipped, out, args.steps, args.corpus)
        done = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL)
        if done.returncode not in (0, EXIT_STOPPED):  # pretrain_base stops at --stop-after with a checkpoint
            raise SystemExit(f"the re-run failed (exit code {done.returncode}): {' '.join(command)}")
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
