"""``gradflow finetune``: fine-tune a masked LM on a token or sequence classification task."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import fields

from gradflow.cli.options import (
    AT_LEAST_ONE,
    NON_NEGATIVE,
    POSITIVE,
    Bound,
    CheckedAction,
    add_blocks,
    add_device,
    add_limit,
    add_max_length,
    add_model,
    add_number,
    add_seed,
    describe,
    number_list,
)
from gradflow.inputs.tasks import BUILTIN_TASKS
from gradflow.interventions.finetune.data import CLASS_WEIGHT_SCHEMES
from gradflow.interventions.finetune.train import FinetuneConfig

DEFAULTS = {f.name: f.default for f in fields(FinetuneConfig)}
AUTOCAST = ("bfloat16",)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``finetune``."""
    p = subparsers.add_parser("finetune", help="fine-tune a masked LM on a classification task (optionally after surgery)")
    add_model(p, required=True)
    p.add_argument("--task", required=True,
                   help=f"a built-in task under --data-root ({describe(BUILTIN_TASKS)}) or a task directory "
                        "with task.json")
    p.add_argument("--out", dest="out_dir", required=True, help="output directory (eval.csv, result.json)")
    p.add_argument("--data-root", default=None, help="where the built-in tasks are (default $GRADFLOW_TASKS, else "
                                                     "./data/tasks, else the user cache; see `gradflow tasks list`, "
                                                     "built by `gradflow tasks fetch`)")
    _add_schedule(p)
    add_limit(p, "training examples (a seeded sample)", "--train-limit", "all")
    add_limit(p, "evaluation examples per split (a seeded sample)", "--eval-limit", "all")
    add_limit(p, "examples of the splits scored only at the end, e.g. test (a seeded sample)", "--test-limit",
              "as --eval-limit")
    p.add_argument("--class-weights", action=CheckedAction, check=class_weights, default=None,
                   help=f"training-loss weights: {', '.join(CLASS_WEIGHT_SCHEMES)} or one non-negative number per "
                        "label, comma-separated (default: unweighted)")
    p.add_argument("--head-only", action="store_true", help="train only the newly initialised head")
    p.add_argument("--extend-vocabulary", metavar="WORDS_FILE", default=None,
                   help="add these words (one per line) to the vocabulary first, each new embedding the mean of its "
                        "old sub-word pieces; the prepared checkpoint is saved under OUT/encoder/")
    add_number(p, "--continue-mlm", int, NON_NEGATIVE, "steps of continued MLM on the training text before "
               "fine-tuning (gradient flow logged; with --extend-vocabulary also new_rows.csv: where the new rows get "
               "their gradient)", 0)
    add_number(p, "--continue-mlm-lr", float, POSITIVE, "learning rate of the continued MLM", DEFAULTS["continue_mlm_lr"])
    add_device(p, DEFAULTS["device"])
    p.add_argument("--autocast", choices=AUTOCAST, default=None,
                   help="mixed-precision forward passes (fast on GPUs and on CPUs with AVX512-BF16)")
    p.add_argument("--save-model", action="store_true", help="save the fine-tuned model and tokenizer under --out")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.set_defaults(run=run)


def _add_schedule(p: argparse.ArgumentParser) -> None:
    add_number(p, "--lr", float, POSITIVE, "peak learning rate", DEFAULTS["lr"])
    add_number(p, "--steps", int, AT_LEAST_ONE, "optimiser steps", DEFAULTS["steps"])
    add_number(p, "--batch-size", int, AT_LEAST_ONE, "training examples per step", DEFAULTS["batch_size"])
    add_number(p, "--warmup", float, Bound(0, 1, high_open=True), "fraction of the steps with a rising learning rate",
               DEFAULTS["warmup"])
    add_number(p, "--weight-decay", float, NON_NEGATIVE, "AdamW weight decay", DEFAULTS["weight_decay"])
    add_number(p, "--eval-every", int, AT_LEAST_ONE, "steps between evaluations", DEFAULTS["eval_every"])
    add_max_length(p, DEFAULTS["max_length"])
    add_seed(p, DEFAULTS["seed"], "random seed of the new head, the surgery, the samples and the data order")
    add_blocks(p, DEFAULTS["drop_last"])


def class_weights(text: str) -> str | tuple[float, ...]:
    """``--class-weights``: a scheme name or comma-separated non-negative numbers."""
    if text in CLASS_WEIGHT_SCHEMES:
        return text
    expected = f"{' or '.join(CLASS_WEIGHT_SCHEMES)} or comma-separated non-negative numbers, one per label"
    return number_list("--class-weights", expected, text, NON_NEGATIVE)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Fine-tune and print the final metrics per split as JSON."""
    from gradflow.interventions.finetune.train import finetune
    from gradflow.interventions.vocabulary import read_word_list

    options = {k: v for k, v in vars(args).items() if k in DEFAULTS}
    options["continue_mlm_steps"] = args.continue_mlm
    if args.extend_vocabulary:
        options["extend_vocabulary"] = tuple(read_word_list(args.extend_vocabulary))
    result = finetune(FinetuneConfig(**options))
    print(json.dumps(result.final, indent=2))
    return 0
