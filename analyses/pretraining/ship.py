"""Ship trained models into the package and draw their pretraining curves.

Copies ``build/<name>/`` (float16 safetensors, tokenizer, recipe.json, training_log.csv) into
``src/gradflow/models/<name>/``, measures each model's masked-token accuracy on the committed
held-out sample, and writes ``figures/pretraining_curves.{pdf,png}`` with the table it was drawn
from (``figures/pretraining_curves.csv``).

    python -m analyses.pretraining.ship [--build build] [--out figures]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pandas as pd

NAMES = ("gradflow-mini-en", "gradflow-mini-en-alltoken")
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "recipe.json",
         "training_log.csv")


def ship(build: Path, dest: Path) -> None:
    for name in NAMES:
        src, out = build / name, dest / name
        out.mkdir(parents=True, exist_ok=True)
        for f in FILES:
            shutil.copy(src / f, out / f)


def curves(dest: Path, figures: Path, names: tuple[str, ...] = NAMES) -> pd.DataFrame:
    """The shipped models' training logs as one table (``model`` first), also written to
    ``figures/pretraining_curves.csv``."""
    return training_logs({name: dest / name for name in names}, figures)


def training_logs(folders: dict[str, Path], figures: Path) -> pd.DataFrame:
    """The ``training_log.csv`` of each model's folder as one table (``model`` first), in ``folders``' order; also
    written to ``<figures>/pretraining_curves.csv``."""
    frames = []
    for name, folder in folders.items():
        log = pd.read_csv(folder / "training_log.csv")
        log.insert(0, "model", name)
        frames.append(log)
    table = pd.concat(frames, ignore_index=True)
    figures.mkdir(parents=True, exist_ok=True)
    table.to_csv(figures / "pretraining_curves.csv", index=False, float_format="%.6g")
    return table


def draw(table: pd.DataFrame, figures: Path, names: tuple[str, ...] = NAMES) -> None:
    """Loss and held-out top-1 against training tokens, one colour per model: ``figures/pretraining_curves``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradflow.figures import save_figure
    from gradflow.figures.style import gradflow_style as figure_style

    with figure_style("double"):
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(7.0, 2.4))
        for name, colour in zip(names, ("#4477AA", "#EE6677")):
            rows = table[table.model == name]
            smooth = rows.train_loss.rolling(25, min_periods=1).mean()
            ax_loss.plot(rows.tokens / 1e6, smooth, color=colour, label=f"{name} (train, 25-step mean)")
            ev = rows.dropna(subset=["valid_top1"])
            ax_loss.plot(ev.tokens / 1e6, ev.valid_loss, "o--", color=colour, ms=3, label=f"{name} (validation MLM)")
            ax_acc.plot(ev.tokens / 1e6, ev.valid_top1, "o-", color=colour, ms=3, label=name)
        ax_loss.set_xlabel("training tokens (millions)")
        ax_loss.set_ylabel("cross-entropy (nats)")
        ax_loss.legend(fontsize=6, frameon=False)
        ax_acc.set_xlabel("training tokens (millions)")
        ax_acc.set_ylabel("validation top-1 at selected positions")
        ax_acc.legend(fontsize=6, frameon=False)
        ax_loss.set_title("Pretraining loss", fontsize=8)
        ax_acc.set_title("Held-out masked-token accuracy", fontsize=8)
        save_figure(fig, figures / "pretraining_curves")
        plt.close(fig)


def main() -> None:
    root = Path(__file__).resolve().parents[2]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build", type=Path, default=root / "build", help="where pretrain wrote the models")
    parser.add_argument("--out", type=Path, default=root / "figures", help="where the curves and accuracy go")
    args = parser.parse_args()
    dest = root / "src" / "gradflow" / "models"
    ship(args.build, dest)
    table = curves(dest, args.out)
    draw(table, args.out)
    from gradflow.models import load_model
    from gradflow.runs.evaluation import mlm_accuracy
    from gradflow.runs.record import default_texts

    results = {}
    for name in NAMES:
        acc = mlm_accuracy(load_model(name), default_texts())
        results[name] = {"sample_top1": acc.top1, "sample_top1_masked": acc.top1_masked, "sample_loss": acc.loss,
                         "positions": acc.positions,
                         "valid_top1": json.loads((dest / name / "recipe.json").read_text())["final"]["valid_top1"]}
    (args.out / "pretraining_accuracy.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
