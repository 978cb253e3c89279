"""Ship models trained with the resumable recipe (``pretrain_base``) into the package, with cards and curves.

    python -m analyses.pretraining.ship_base --run build/gradflow-mini12-en \\
        --run build/gradflow-mini12-en-alltoken --figures figures/twelve-blocks

For each finished run (``<run>/model`` and ``<run>/meta.json`` with ``final``; the model's name is the run
folder's name):

1. ``packages/gradflow-models/src/gradflow_models/<name>/`` (the companion distribution gradflow-models, issue 52;
   ``--package`` for elsewhere): ``config.json`` and ``model.safetensors`` in float16 (safetensors only),
   the tokenizer files, ``training_log.csv`` (the run's curve) and ``recipe.json`` (the card below);
2. held-out top-1 at the selected positions, of the float16 weights as gradflow loads them: on the corpus's
   test split (``test.txt``, the recipe's fixed BERT masking, ``--test-windows`` windows, seed 0) and on the
   committed sample (:func:`gradflow.runs.evaluation.mlm_accuracy`, gradflow's own masking, seed 0);
3. ``<figures>/pretraining_curves.{pdf,png,csv}`` (:mod:`analyses.pretraining.ship`'s figure) and
   ``<figures>/cards.md``: per model shape, data, tokens seen, wall time, validation and held-out top-1.

A run that has not finished is refused with what is missing; nothing is written for any model then.
``--shipped NAME`` adds a model shipped earlier (its ``recipe.json`` and ``training_log.csv`` in the package) to
the cards and the curves without re-shipping it: its run folder may be gone (a machine that did not keep
``build/``), and its weights, card and scores stay byte for byte what they were. With ``--shipped`` only (no
``--run``) the cards and curves are redrawn from the package alone.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM, BertTokenizerFast

from analyses.pretraining.recipe.config import RunConfig
from analyses.pretraining.recipe.data import SpecialIds, load_windows, validation_batches
from analyses.pretraining.recipe.train import evaluate
from analyses.pretraining.ship import curves, draw
from analyses.twelve_blocks.snapshot import read_run
from gradflow.errors import UsageError
from gradflow.provenance import portable_command, portable_path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_MODELS = ROOT / "packages" / "gradflow-models" / "src" / "gradflow_models"  # the companion's models (issue 52)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")


@dataclass(frozen=True)
class HeldOut:
    """Top-1 at the selected positions: the corpus's test split and the committed sample (counts of positions)."""

    test_top1: float
    test_loss: float
    test_positions: int
    sample_top1: float
    sample_positions: int


def finished_run(run: Path) -> dict:
    """The run's ``meta.json``, checked to describe a finished run with its final model folder."""
    meta_file = run / "meta.json"
    if not meta_file.is_file():
        raise UsageError(f"{run} has no meta.json: pass a folder written by analyses.pretraining.pretrain_base")
    meta = json.loads(meta_file.read_text())
    if not meta.get("final") or not (run / "model" / "config.json").is_file():
        raise UsageError(f"{run} has not finished training (no final model in {run / 'model'}): rerun its "
                         "pretrain_base command until it prints 'done'")
    return meta


def write_float16(run: Path, dest: Path) -> None:
    """``<run>/model`` (float32) as float16 safetensors with its tokenizer files into ``dest``."""
    model = AutoModelForMaskedLM.from_pretrained(run / "model", dtype=torch.float32, trust_remote_code=False)
    dest.mkdir(parents=True, exist_ok=True)
    model.half().save_pretrained(dest, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (run / "model" / name).is_file():
            shutil.copy(run / "model" / name, dest / name)
    shutil.copy(run / "training_log.csv", dest / "training_log.csv")


def held_out(dest: Path, cfg: RunConfig, test_windows: int, cache: Path, sample_limit: int | None = None) -> HeldOut:
    """:class:`HeldOut` of the shipped model in ``dest`` (loaded as gradflow loads it, float32 compute);
    ``sample_limit``: score only that many windows of the committed sample (None: all)."""
    from gradflow.models import load_model
    from gradflow.runs.evaluation import mlm_accuracy
    from gradflow.runs.record import default_texts

    loaded = load_model(str(dest))
    tokenizer = BertTokenizerFast.from_pretrained(dest)
    windows = load_windows(tokenizer, Path(cfg.corpus) / "test.txt", cfg.max_len, cache)
    batches = validation_batches(windows, test_windows, cfg.seed, SpecialIds.of(tokenizer))
    eval_cfg = RunConfig(corpus=cfg.corpus, out=cfg.out, device="cpu", dtype="float32")
    test = evaluate(loaded.model, batches, eval_cfg)
    loaded.model.eval()
    sample = mlm_accuracy(loaded, default_texts(), max_length=min(128, loaded.max_positions()), limit=sample_limit)
    return HeldOut(test["valid_top1"], test["valid_loss"], test["valid_positions"], sample.top1, sample.positions)


def card(run: Path, meta: dict, scores: HeldOut, dest: Path) -> dict:
    """recipe.json (written into ``dest``): the run's settings and provenance, what it saw and took, and its scores;
    command lines without a machine's absolute paths."""
    cfg = {k: portable_path(v, dest) if k in ("corpus", "out", "tokenizer") and v and Path(v).is_absolute() else v
           for k, v in meta["config"].items()}
    wall_s = float(pd.read_csv(run / "training_log.csv")["elapsed_s"].iloc[-1])
    return {"config": cfg, "shape": {k: cfg[k] for k in ("layers", "hidden", "heads", "ffn", "max_len")},
            "vocab_size": meta["vocab_size"], "steps_done": meta["steps_done"], "tokens_seen": meta["tokens_seen"],
            "wall_s": round(wall_s, 1), "threads": cfg.get("threads"), **cpu_time(meta["segments"]),
            "final": meta["final"],
            "held_out": scores.__dict__, "versions": meta["versions"], "tokenizer_sha256": meta["tokenizer_sha256"],
            "command_line": _portable_argv(meta["command_line"], dest),
            "segments": [{**seg, "argv": _portable_argv(seg["argv"], dest)} for seg in meta["segments"]]}


def _portable_argv(argv: list[str], dest: Path) -> str:
    """A recipe command for the card: the interpreter (``sys.executable``) written ``python``, paths portable."""
    return portable_command(["python", *argv[1:]] if argv else [], dest)


def cpu_time(segments: list[dict]) -> dict:
    """CPU seconds summed over the run's commands that logged them (``cpu_s``), and how many commands (with their
    steps) did not: runs resumed from a checkpoint written before the recipe logged CPU time."""
    known = [s for s in segments if "cpu_s" in s]
    return {"cpu_s": round(sum(s["cpu_s"] for s in known), 1), "commands": len(segments),
            "commands_without_cpu_s": len(segments) - len(known)}


def cards_markdown(cards: dict[str, dict]) -> str:
    """One table row per shipped model."""
    lines = ["| model | loss | layers x hidden (heads, FFN) | steps | tokens seen | CPU wall time | validation "
             "top-1 | test-split top-1 | committed-sample top-1 |", "|---|---|---|---|---|---|---|---|---|"]
    for name, c in cards.items():
        s, h = c["shape"], c["held_out"]
        lines.append(f"| `{name}` | {c['config']['loss']} | {s['layers']} x {s['hidden']} ({s['heads']}, {s['ffn']}) "
                     f"| {c['steps_done']:,} | {c['tokens_seen'] / 1e6:.1f} M | {c['wall_s'] / 3600:.2f} h "
                     f"({c['threads']} threads) | {c['final']['valid_top1']:.4f} | {h['test_top1']:.4f} "
                     f"({h['test_positions']:,} positions) | {h['sample_top1']:.4f} ({h['sample_positions']:,}) |")
    return "\n".join(lines) + "\n"


def shipped_card(package: Path, name: str) -> dict:
    """The card (``recipe.json``) of a model shipped earlier into ``package``, checked to have its curve."""
    dest = package / name
    if not (dest / "recipe.json").is_file() or not (dest / "training_log.csv").is_file():
        raise UsageError(f"{name} is not a shipped recipe model (no recipe.json and training_log.csv in {dest}): "
                         "ship its run with --run instead")
    return json.loads((dest / "recipe.json").read_text())


def ship(runs: list[Path], package: Path, figures: Path, test_windows: int, sample_limit: int | None = None,
         shipped: tuple[str, ...] = ()) -> dict[str, dict]:
    """Ship every run (all checked first); the cards and curves also cover ``shipped``, models shipped earlier
    (listed first, untouched). Returns the cards by model name, ``shipped`` first."""
    if not runs and not shipped:
        raise UsageError("nothing to ship: give a finished run folder (--run) or a model shipped earlier (--shipped)")
    metas = {run: finished_run(run) for run in runs}
    clash = sorted(set(shipped) & {run.name for run in runs})
    if clash:
        raise UsageError(f"{', '.join(clash)} given both as --run and --shipped: pass each model once")
    cards = {name: shipped_card(package, name) for name in shipped}
    for run, meta in metas.items():
        dest = package / run.name
        write_float16(run, dest)
        cfg = read_run(run).config
        scores = held_out(dest, cfg, test_windows, run / "cache", sample_limit)
        cards[run.name] = card(run, meta, scores, dest)
        (dest / "recipe.json").write_text(json.dumps(cards[run.name], indent=2) + "\n")
    names = tuple(cards)
    draw(curves(package, figures, names), figures, names)
    (figures / "cards.md").write_text(cards_markdown(cards))
    return cards


def check_float16(dest: Path) -> None:
    """Every tensor of ``dest/model.safetensors`` is float16 (raises AssertionError otherwise)."""
    bad = [k for k, v in load_file(dest / "model.safetensors").items() if v.dtype != torch.float16]
    assert not bad, f"not float16: {bad[:5]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, action="append", default=[], help="a finished pretrain_base run folder")
    parser.add_argument("--shipped", action="append", default=[], metavar="NAME",
                        help="a model shipped earlier into --package: joins the cards and curves, not re-shipped")
    parser.add_argument("--figures", type=Path, default=ROOT / "figures" / "twelve-blocks")
    parser.add_argument("--package", type=Path, default=PACKAGE_MODELS, help="where the models go")
    parser.add_argument("--test-windows", type=int, default=1024, help="test-split windows scored")
    parser.add_argument("--sample-limit", type=int, default=None, help="committed-sample windows scored (all)")
    args = parser.parse_args(argv)
    try:
        cards = ship(args.run, args.package, args.figures, args.test_windows, args.sample_limit,
                     tuple(args.shipped))
    except UsageError as err:
        print(f"error: {err}")
        return 2
    for name, c in cards.items():
        check_float16(args.package / name)  # the shipped ones too
        print(name, json.dumps(c["held_out"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
