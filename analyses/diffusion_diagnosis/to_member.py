"""The member that rule 5 ships, laid out as ``pretrain.py`` lays out a trained member, for ``ship_objectives.py``.

Rule 5 (``member.py``) names the recipe's cell and the budget it ships at; the runner saved that model in float32
(``<runs>/<cell>-s0[-<step>].model/``). This writes ``<out>/`` (default ``build/gradflow-mini-en-diffusion``) with what
``pretrain.py`` writes: the float16 weights, the tokenizer, ``training_log.csv`` (pretrain's columns: one row per
checkpoint the runner measured up to the shipped step, its logged train loss and learning rate; the tokens replayed
from the run's own generators; the BERT-15% validation loss and top-1, ``pretrain.evaluate``'s, and the own
objective's, at every saved budget up to the shipped one) and ``recipe.json`` (pretrain's keys for the cell's recipe,
``final`` from the float32 model as ``pretrain.py`` measures its last step, the budget and the runner's times).

    python -m analyses.diffusion_diagnosis.to_member [--runs figures/diffusion-diagnosis/full] [--out build/gradflow-mini-en-diffusion]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from analyses.diffusion_diagnosis import cells as cells_mod
from analyses.diffusion_diagnosis import member
from analyses.diffusion_diagnosis.cells import WARMUP
from analyses.diffusion_diagnosis.train import load_data
from analyses.pretraining import pretrain

FIELDS = ("step", "tokens", "train_loss", "lr", "elapsed_s", "valid_loss", "valid_top1", "valid_positions",
          "own_loss", "own_top1", "own_positions")
"""``pretrain.py``'s training-log columns for the diffusion objective."""
VALID_WINDOWS = 1024
"""``pretrain.py``'s validation windows (``--valid-windows``, the first member's): the first of the seed-7 order."""


def replay_tokens(c: cells_mod.Cell, seed: int, steps: int, train: torch.Tensor, tokenizer) -> list[int]:
    """The cumulative non-padding tokens after each of ``steps`` training steps of the run of ``c`` from ``seed``,
    from its own generators (the windows drawn and corrupted in the runner's order), length ``steps + 1``."""
    gen, ratio_gen = torch.Generator().manual_seed(2 * seed), torch.Generator().manual_seed(2 * seed + 1)
    seen = [0]
    for _ in range(steps):
        ids = train[torch.randint(len(train), (16,), generator=gen)]
        cells_mod.corrupt(c, ids, tokenizer, gen, ratio_gen)  # advances the generators as training did
        seen.append(seen[-1] + int((ids != tokenizer.pad_token_id).sum()))
    return seen


def model_dir(runs: Path, cell: str, step: int, last: int, seed: int = 0) -> Path:
    """Where the runner saved the model of ``cell`` at ``step`` (``last``: the run's final step)."""
    return runs / (f"{cell}-s{seed}.model" if step == last else f"{cell}-s{seed}-{step}.model")


def validation(model, tokenizer, valid: torch.Tensor) -> dict:
    """``pretrain.py``'s last-step measures: BERT-15% and own-objective (masked diffusion) loss and top-1."""
    row = pretrain.evaluate(model, tokenizer, valid, 0)
    row.update(pretrain.evaluate_own(model, tokenizer, valid, 0, "diffusion"))
    return row


def build_member(runs: Path, out: Path, corpus: Path, tokenizer_dir: Path) -> dict:
    """Write the shipped budget's model as a ``pretrain.py`` member into ``out``; returns its recipe."""
    from transformers import AutoModelForMaskedLM

    budgets = member.load_budgets(runs)
    recipe_cell = member.choose(budgets)
    shipped = member.shipped(budgets[recipe_cell]) if recipe_cell else None
    if shipped is None:
        raise SystemExit(f"nothing ships yet: {member.verdict(budgets)}")
    record_path = next(p for p in (runs / f"{shipped.cell}-s0.json", runs / f"{shipped.cell}-s0.partial.json")
                       if p.exists())
    record = json.loads(record_path.read_text())
    c = cells_mod.cell(shipped.cell)
    tokenizer, train, valid_all = load_data(corpus, tokenizer_dir)
    valid = valid_all[:VALID_WINDOWS]
    saved = [b for b in budgets[shipped.cell] if b.step <= shipped.step and b.measures is not None]
    evaluations = {}
    for b in saved:
        evaluations[b.step] = validation(
            AutoModelForMaskedLM.from_pretrained(model_dir(runs, b.cell, b.step, record["steps"])).eval(),
            tokenizer, valid)
    tokens = replay_tokens(c, 0, shipped.step, train, tokenizer)
    rows = [{"step": r["step"], "tokens": tokens[r["step"]], "train_loss": r["train_loss"], "lr": r["lr"],
             **evaluations.get(r["step"], {})} for r in record["checkpoints"] if 0 < r["step"] <= shipped.step]
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForMaskedLM.from_pretrained(model_dir(runs, shipped.cell, shipped.step, record["steps"]))
    model.half().save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    with (out / "training_log.csv").open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    share = shipped.step / cells_mod.SCHEDULE_STEPS
    recipe = {"corpus": str(corpus), "tokenizer": str(tokenizer_dir), "out": str(out), "loss": "diffusion",
              "recipe": c.name, "vocab_size": len(tokenizer), "steps": shipped.step, "batch_size": 16, "lr": c.lr,
              "warmup": WARMUP, "schedule": "constant after the warm-up" if c.constant else "linear decay",
              "seed": 0, "arch": "roformer", "dropout": 0.0, "position_init": "sinusoidal",
              "tie_embeddings": c.tied, "zero_output": c.zero_output, "t_sampler": c.sampler, "threads": 1,
              "valid_windows": len(valid), "precision": record["precision"],
              "budget": {"share_of_member_compute": round(share, 3), "label": shipped.share,
                         "rule": "figures/diffusion-diagnosis/plan.md rule 5 (decision 3)"},
              "final": evaluations[shipped.step], "acceptance": shipped.measures,
              "train_windows": len(train), "tokens_seen": tokens[shipped.step],
              "trained_by": "python -m analyses.diffusion_diagnosis.train (" + record["command"] + ")",
              "torch": torch.__version__}
    at = next(r for r in record["checkpoints"] if r["step"] == shipped.step)
    recipe.update(wall_s=at.get("wall_s"), cpu_s=at.get("cpu_s"),
                  cpu_s_source="the runner's process time at the shipped step, its measurements included")
    (out / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    return recipe


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=Path, default=member.DEFAULT_RUNS)
    p.add_argument("--out", type=Path, default=Path("build/gradflow-mini-en-diffusion"))
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--tokenizer", type=Path, default=Path("src/gradflow/models/gradflow-mini-en"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    print(json.dumps(build_member(args.runs, args.out, args.corpus, args.tokenizer)["final"]))


if __name__ == "__main__":
    sys.exit(main())
