"""``gradflow repair``: continue training only the last block on every position (all-positions objective)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import fields

from gradflow.cli.options import (
    AT_LEAST_ONE,
    POSITIVE,
    Bound,
    add_device,
    add_max_length,
    add_model,
    add_number,
    add_seed,
)
from gradflow.interventions.repair import OBJECTIVES, RepairConfig

DEFAULTS = {f.name: f.default for f in fields(RepairConfig)}


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``repair``."""
    p = subparsers.add_parser("repair", help="train only the last block (and optionally the head's transform) on "
                                             "every position, everything below frozen; save the checkpoint")
    add_model(p, required=True)
    p.add_argument("--out", dest="out_dir", required=True, help="output directory (model/, repair.json, "
                                                                 "gradflow_callback.csv)")
    p.add_argument("--texts", default=None, help="training corpus: a text file, .jsonl or directory "
                                                 "(default: the committed SOTU sample)")
    add_number(p, "--steps", int, AT_LEAST_ONE, "optimiser steps", DEFAULTS["steps"])
    add_number(p, "--batch-size", int, AT_LEAST_ONE, "windows per step", DEFAULTS["batch_size"])
    add_number(p, "--lr", float, POSITIVE, "peak learning rate", DEFAULTS["lr"])
    add_number(p, "--warmup", float, Bound(0, 1, high_open=True), "fraction of the steps with a rising learning rate",
               DEFAULTS["warmup"])
    add_number(p, "--weight-decay", float, Bound(0), "AdamW weight decay", DEFAULTS["weight_decay"])
    add_max_length(p, DEFAULTS["max_length"])
    add_seed(p, DEFAULTS["seed"], "random seed of the masking and the data order")
    add_number(p, "--eval-windows", int, AT_LEAST_ONE, "held-out windows (the corpus' first) for top-1 before/after",
               unset="a fifth of the corpus, at most 256")
    add_number(p, "--log-every", int, AT_LEAST_ONE, "steps between gradient-flow log rows", DEFAULTS["log_every"])
    p.add_argument("--train-head", action="store_true",
                   help="also train the MLM head's transform and bias (never the output-embedding matrix)")
    p.add_argument("--objective", choices=OBJECTIVES, default=DEFAULTS["objective"],
                   help="loss backpropagated (default %(default)s; mlm only for comparison)")
    add_device(p, DEFAULTS["device"])
    p.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Repair and print the summary as JSON."""
    from gradflow.interventions.repair import repair

    options = {k: v for k, v in vars(args).items() if k in DEFAULTS and k != "command"}
    result = repair(RepairConfig(**options, command=["gradflow", *argv]))
    keys = ("top1_before", "top1_after", "top1_change", "top1_drop_ok", "trained_parameter_count", "tied_embeddings",
            "wall_s")
    summary = {k: result.meta[k] for k in keys}
    summary["context_share"] = result.meta["context_share"][-1] if result.meta["context_share"] else None
    summary["model_dir"] = str(result.model_dir)
    print(json.dumps(summary, indent=2))
    return 0
