"""Seed 004's remaining row: where new vocabulary rows get their gradient during continued MLM.

The 40 most frequent words of the Brown training text that gradflow-mini-en's tokenizer splits into
two or more pieces become whole tokens (``extend_vocabulary``: each new row the mean of its old
pieces); then continued MLM on the Brown training sentences that contain at least one of them (the
"domain text" of the new words; ``continue_mlm``, BERT masking) logs, every 5 steps,
the gradient the new rows receive, split into the **input side** by the role of the position that
reads the token and the **output side** (the tied decoder) by the role of the loss position
(:class:`gradflow.interventions.new_rows.NewRowGradients`, exact: the two sides sum to autograd).

Writes ``figures/finetune/last-block-finetuning/new_vocabulary/``: ``words.txt``, ``new_rows.csv``,
``continued.json``, ``mlm_log.csv``, ``summary.csv`` (per side and role: mean gradient norm over
the logged steps, positions per logged batch) and ``new_vocabulary.{pdf,png}``. The trained model
goes to ``build/new-vocabulary/`` (not committed).

    python -m analyses.vocabulary.new_rows        # 655 s measured (continued.json), one thread
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "figures/finetune/last-block-finetuning/new_vocabulary"  # default --out
WORK = ROOT / "build/new-vocabulary"  # default --work
SIDES = {("input", "kept"): "#228833", ("input", "random"): "#CCBB44", ("input", "context"): "#66CCEE",
         ("output", "masked"): "#4477AA", ("output", "random"): "#AA3377", ("output", "kept"): "#EE6677"}


def brown_texts(data_root: Path) -> list[str]:
    rows = [json.loads(line) for line in (data_root / "brown-pos" / "train.jsonl").read_text().splitlines()]
    return [" ".join(r["tokens"]) for r in rows]


def pick_words(texts: list[str], model: str, count: int) -> list[str]:
    """The ``count`` most frequent (lower-cased, alphabetic) words that the tokenizer splits into >= 2 pieces."""
    from gradflow.models import load_model

    tokenizer = load_model(model).tokenizer
    frequency = Counter(w.lower() for t in texts for w in t.split() if w.isalpha() and len(w) > 3)
    words = []
    for word, _ in frequency.most_common():
        if len(tokenizer(word, add_special_tokens=False)["input_ids"]) >= 2:
            words.append(word)
        if len(words) == count:
            break
    return words


def summarise(rows: pd.DataFrame) -> pd.DataFrame:
    rows = rows[rows.role != "all"]
    return (rows.groupby(["side", "role"], sort=False)
            .agg(mean_grad_norm=("grad_norm", "mean"), positions_per_batch=("n_positions", "mean"),
                 logged_steps=("step", "nunique")).reset_index())


def draw(rows: pd.DataFrame, summary: pd.DataFrame, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradflow.figures import save_figure
    from gradflow.figures.style import gradflow_style

    with gradflow_style("double"):
        fig, axes = plt.subplots(1, 2, figsize=(7.0, 2.6), gridspec_kw={"width_ratios": [1.4, 1]})
        ax = axes[0]
        for (side, role), colour in SIDES.items():
            sub = rows[(rows.side == side) & (rows.role == role)].sort_values("step")
            values = sub.grad_norm.where(sub.n_positions > 0)  # no such position in the batch: no point
            if values.notna().any():
                ax.plot(sub.step, values, marker="o" if side == "output" else "s", ms=2.5, color=colour,
                        ls="-" if side == "output" else "--", lw=0.8, label=f"{side}, {role}")
        ax.set_yscale("log")
        ax.set_xlabel("continued-MLM step")
        ax.set_ylabel("gradient norm of the new rows")
        ax.set_title("gradient of the 40 new rows, per logged batch")
        ax.set_ylim(1e-4, 30)
        ax.legend(frameon=False, fontsize="x-small", ncol=3, loc="upper center")
        ax = axes[1]
        labels, values, colours, counts = [], [], [], []
        for (side, role), colour in SIDES.items():
            hit = summary[(summary.side == side) & (summary.role == role)]
            labels.append(f"{side}\n{role}")
            values.append(float(hit.mean_grad_norm.iloc[0]) if len(hit) else 0.0)
            counts.append(float(hit.positions_per_batch.iloc[0]) if len(hit) else 0.0)
            colours.append(colour)
        labels.append("input\nmasked")
        values.append(0.0)
        colours.append("#BBBBBB")
        bars = ax.bar(range(len(values)), values, color=colours)
        bars[-1].set_hatch("///")
        for x, (value, count) in enumerate(zip(values, counts)):
            ax.annotate(f"{count:.1f}", (x, value), textcoords="offset points", xytext=(0, 2), ha="center",
                        fontsize="x-small")
        ax.annotate("0: never read", (len(values) - 1, 0), textcoords="offset points", xytext=(0, 4),
                    ha="center", fontsize="x-small", rotation=90)
        ax.set_xticks(range(len(values)), labels, fontsize="x-small")
        ax.set_ylabel("mean gradient norm")
        ax.set_title("mean over 25 logged batches\n(number: positions per batch)")
        save_figure(fig, out / "new_vocabulary")
        plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gradflow-mini-en")
    parser.add_argument("--words", type=int, default=40)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--data-root", type=Path, default=ROOT / "data/tasks")
    parser.add_argument("--figure-only", action="store_true")
    parser.add_argument("--out", type=Path, default=OUT, help="tables and figure (default %(default)s)")
    parser.add_argument("--work", type=Path, default=WORK, help="the trained model (not committed)")
    args = parser.parse_args()
    out, work = args.out, args.work
    out.mkdir(parents=True, exist_ok=True)
    if not args.figure_only:
        import torch

        torch.set_num_threads(1)
        from gradflow.interventions.finetune import continue_mlm

        texts = brown_texts(args.data_root)
        words = pick_words(texts, args.model, args.words)
        (out / "words.txt").write_text("\n".join(words) + "\n", encoding="utf-8")
        wanted = set(words)
        domain = [t for t in texts if wanted & {w.lower() for w in t.split()}]
        print(f"{len(words)} new words; {len(domain)} of {len(texts)} training sentences contain one", flush=True)
        continue_mlm(args.model, domain, work, steps=args.steps, batch_size=16, lr=1e-4, seed=0, log_every=5,
                     max_length=128, new_words=words)
        for name in ("new_rows.csv", "continued.json", "mlm_log.csv"):
            shutil.copy(work / name, out / name)
    rows = pd.read_csv(out / "new_rows.csv")
    summary = summarise(rows)
    summary.to_csv(out / "summary.csv", index=False, float_format="%.6g")
    print(summary.to_string(index=False))
    draw(rows, summary, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
