"""Ship the objectives' members of the 6-block family (issue 52) into the companion, with cards and curves.

    python -m analyses.pretraining.ship_objectives [--build build] [--figures figures/objectives]

For ``gradflow-mini-en-mask40`` and ``gradflow-mini-en-diffusion`` (``pretrain.py --loss mask40 | diffusion``):

1. ``packages/gradflow-models/src/gradflow_models/<name>/``: ``build/<name>/``'s float16 safetensors, tokenizer,
   ``training_log.csv`` and ``recipe.json``, the card added to the latter under ``held_out``: the committed
   sample's top-1 at the selected positions (:func:`gradflow.runs.evaluation.mlm_accuracy`, seed 0) under BERT
   15% (every member's yardstick) and under the model's own objective (BERT 40%; masked diffusion, t ~ U(0.001, 1)),
   of the float16 weights as gradflow loads them; and the CPU seconds of the training process (``cpu_s`` when the
   recipe logged it, else the last reading of ``--cpu-log``, a file of ``HH:MM:SS seconds`` lines sampled while it
   ran every 5 s, so up to 5 s short);
2. ``<figures>/pretraining_curves.{csv,pdf,png}``: training and BERT-15% validation loss and top-1 against tokens,
   the four 6-block members (mini-en and its twin from the core package);
3. ``<figures>/cards.md``: per member its objective, steps, tokens, wall and CPU time, validation top-1 (BERT 15%
   and its own objective) and committed-sample top-1 (both).

``--only NAME`` ships the named members and keeps the others' shipped cards (read from the companion). The card's
objective comes from the run's recipe (:func:`objective_label`): the second diffusion member (issue 60, the MDLM recipe)
is labelled with its recipe, not the first member's.

A run without its final model (``build/<name>/model.safetensors``) is refused with what is missing; nothing is
written then.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pandas as pd

from analyses.pretraining.ship import FILES, training_logs

ROOT = Path(__file__).resolve().parents[2]
NEW = {"gradflow-mini-en-mask40": "BERT 40% (80/10/10)",
       "gradflow-mini-en-diffusion": "masked diffusion (t ~ U(0.001, 1), 1/t weights)"}
CORE = {"gradflow-mini-en": "BERT 15% (80/10/10)", "gradflow-mini-en-alltoken": "all-token (BERT 15% corruption)"}
COMPANION = ROOT / "packages/gradflow-models/src/gradflow_models"
COLOURS = ("#4477AA", "#EE6677", "#228833", "#CCBB44")  # Paul Tol's bright scheme: colour-blind safe
HISTORY = ROOT / "figures/objectives/diffusion-v1"  # the first diffusion member (issue 52): its card and training log
HISTORY_NAME = "gradflow-mini-en-diffusion (first member)"  # its rows' model name in the curves and the cards
HISTORY_COLOUR = "#BBBBBB"  # Paul Tol's grey, dashed: a member no longer shipped


RECIPES = {"mdlm": "masked diffusion, MDLM recipe (t ~ U(0.001, 1) antithetic, 1/t weights; untied embeddings, "
                   "zero-initialised output, lr 3e-4 constant)"}
"""The objective label of a member trained with ``pretrain.py --recipe NAME``."""


def objective_label(name: str, recipe: dict) -> str:
    """The card's objective: the named recipe's label when the run used one, else the member's objective."""
    return RECIPES.get(recipe.get("recipe"), NEW[name])


def own_policy(name: str):
    """The masking of the model's own objective on the committed sample (seed 0)."""
    from gradflow import BertMasking, MaskedDiffusion

    if name.endswith("-diffusion"):
        return MaskedDiffusion(seed=0)
    if name.endswith("-mask40"):
        return BertMasking(rate=0.4, seed=0)
    return BertMasking(seed=0)


def last_cpu_reading(path: Path | None) -> float | None:
    """The last ``seconds`` of a ``HH:MM:SS seconds`` sampling file (None without one)."""
    if path is None or not path.is_file():
        return None
    lines = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return float(lines[-1][1]) if lines else None


def ship_one(run: Path, dest: Path, cpu_log: Path | None) -> dict:
    """Copy ``run`` into ``dest`` and write its card into ``dest/recipe.json``; returns the card."""
    from gradflow import BertMasking
    from gradflow.models import load_model
    from gradflow.runs.evaluation import mlm_accuracy
    from gradflow.runs.record import default_texts

    dest.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        shutil.copy(run / f, dest / f)
    recipe = json.loads((dest / "recipe.json").read_text())
    if recipe.get("cpu_s") is None:
        recipe["cpu_s"] = last_cpu_reading(cpu_log)
        recipe["cpu_s_source"] = "sampled every 5 s from /proc while the process ran (up to 5 s short)"
    loaded = load_model(str(dest))
    held_out = {}
    for key, policy in (("bert15", BertMasking(seed=0)), ("own", own_policy(dest.name))):
        acc = mlm_accuracy(loaded, default_texts(), policy)
        held_out[key] = {"sample_top1": acc.top1, "sample_loss": acc.loss, "positions": acc.positions}
    recipe["held_out"] = {"sample_top1": held_out["bert15"]["sample_top1"], **held_out}
    recipe["objective"] = objective_label(dest.name, recipe)
    (dest / "recipe.json").write_text(json.dumps(recipe, indent=2) + "\n")
    return recipe


def curves(figures: Path) -> pd.DataFrame:
    """The four members' training logs as one table (``model`` first): ``<figures>/pretraining_curves.csv``."""
    folders = {name: (ROOT / "src/gradflow/models" / name) if name in CORE else COMPANION / name for name in (*CORE, *NEW)}
    if shipped_second_member():
        folders[HISTORY_NAME] = HISTORY
    return training_logs(folders, figures)


def shipped_second_member() -> bool:
    """Whether the companion holds the second diffusion member (a recipe-trained one), the first kept as history."""
    recipe = json.loads((COMPANION / "gradflow-mini-en-diffusion" / "recipe.json").read_text())
    return recipe.get("recipe") in RECIPES


def draw(table: pd.DataFrame, figures: Path) -> None:
    """BERT-15% validation loss and top-1 against training tokens, one colour per member."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradflow.figures import save_figure
    from gradflow.figures.style import gradflow_style

    with gradflow_style("double"):
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(7.0, 2.6))
        styles = [(name, colour, "o-") for name, colour in zip((*CORE, *NEW), COLOURS)]
        for name, colour, style in styles + [(HISTORY_NAME, HISTORY_COLOUR, "s--")]:
            ev = table[table.model == name].dropna(subset=["valid_top1"])
            if ev.empty:
                continue
            label = name.replace("gradflow-", "")
            ax_loss.plot(ev.tokens / 1e6, ev.valid_loss, style, color=colour, ms=3, label=label)
            ax_acc.plot(ev.tokens / 1e6, ev.valid_top1, style, color=colour, ms=3, label=label)
        for ax in (ax_loss, ax_acc):
            ax.set_xlabel("training tokens (millions)")
        ax_loss.set_ylabel("validation cross-entropy (nats)")
        ax_acc.set_ylabel("validation top-1")
        ax_loss.set_title("Held-out loss at BERT 15% masking", fontsize=8)
        ax_acc.set_title("Held-out top-1 at BERT 15% masking", fontsize=8)
        ax_acc.legend(fontsize=6, frameon=False)
        save_figure(fig, figures / "pretraining_curves")
        plt.close(fig)


def cards_markdown(cards: dict[str, dict]) -> str:
    """The members' cards as one markdown table."""
    lines = ["| model | objective | steps | tokens | wall | CPU | validation top-1, BERT 15% | validation top-1, own "
             "objective | sample top-1, BERT 15% | sample top-1, own objective |", "|" + "---|" * 10]
    for name, card in cards.items():
        cpu = f"{card['cpu_s'] / 60:.1f} min" if card.get("cpu_s") else "not logged"
        own_valid = card["final"].get("own_top1", card["final"]["valid_top1"])
        held = card["held_out"]
        label = f"`{name}`" if name != HISTORY_NAME else "`gradflow-mini-en-diffusion`, first member (history)"
        lines.append(f"| {label} | {card['objective']} | {card['steps']:,} | {card['tokens_seen'] / 1e6:.2f} M | "
                     f"{card['wall_s'] / 60:.1f} min | {cpu} | {card['final']['valid_top1']:.4f} | {own_valid:.4f} | "
                     f"{held['bert15']['sample_top1']:.4f} | {held['own']['sample_top1']:.4f} |")
    return "\n".join(lines) + "\n"


def core_card(name: str) -> dict:
    """mini-en's or the twin's card in the same shape (their committed-sample top-1: figures/pretraining_accuracy.json;
    their own objective's is BERT 15% masking, the twin's loss aside)."""
    card = json.loads((ROOT / "src/gradflow/models" / name / "recipe.json").read_text())
    sample = json.loads((ROOT / "figures/pretraining_accuracy.json").read_text())[name]["sample_top1"]
    card["held_out"] = {"bert15": {"sample_top1": sample}, "own": {"sample_top1": sample}}
    card["objective"] = CORE[name]
    return card


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build", type=Path, default=ROOT / "build")
    p.add_argument("--figures", type=Path, default=ROOT / "figures/objectives")
    p.add_argument("--cpu-log", nargs="*", default=[], help="NAME=FILE: the CPU sampling file of NAME's training")
    p.add_argument("--only", nargs="+", choices=sorted(NEW), default=list(NEW),
                   help="ship these members; the others keep their shipped card (default: both)")
    args = p.parse_args(argv)
    logs = dict(item.split("=", 1) for item in args.cpu_log)
    missing = [str(args.build / n / "model.safetensors") for n in args.only
               if not (args.build / n / "model.safetensors").is_file()]
    if missing:
        print(f"error: not finished: {', '.join(missing)} missing; let pretrain.py finish (or rerun it), then ship.",
              file=sys.stderr)
        return 2
    cards = {name: core_card(name) for name in CORE}
    for name in NEW:
        if name in args.only:
            cards[name] = ship_one(args.build / name, COMPANION / name, Path(logs[name]) if name in logs else None)
        else:
            cards[name] = json.loads((COMPANION / name / "recipe.json").read_text())
    if shipped_second_member():
        cards[HISTORY_NAME] = json.loads((HISTORY / "card.json").read_text())
    draw(curves(args.figures), args.figures)
    (args.figures / "cards.md").write_text(cards_markdown(cards))
    print(cards_markdown(cards))
    return 0


if __name__ == "__main__":
    sys.exit(main())
