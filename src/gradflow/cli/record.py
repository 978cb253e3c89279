"""``gradflow record``: record the gradient flow of one model over one corpus into a run directory."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradflow.cli.options import (
    AT_LEAST_ONE,
    add_adapter,
    add_checkpointing,
    add_corpus,
    add_device,
    add_dtype,
    add_model,
    add_number,
    add_objective,
    add_trust_remote_code,
    command_line,
    describe,
    objective_from_args,
)
from gradflow.errors import UsageError
from gradflow.losses import LOSSES, REDUCTIONS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``record``."""
    record = subparsers.add_parser("record", help="record gradient flow over a corpus")
    _add_record_args(record)
    record.set_defaults(run=run)


def _add_record_args(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument("--out", required=True, help="output run directory")
    add_corpus(p)
    add_objective(p)
    p.add_argument("--prompt-field", default=None, metavar="FIELD",
                   help="--texts is a .jsonl of prompt/response pairs for supervised fine-tuning: this field is the "
                        "prompt, never masked (LLaDA's SFT); default: a plain corpus")
    p.add_argument("--response-field", default=None, metavar="FIELD",
                   help="with --prompt-field: the field holding the response (default response)")
    add_number(p, "--canvas-length", int, AT_LEAST_ONE,
               "two-pass models (DiffusionGemma) only: the canvas length C; a plain corpus's window of n tokens puts "
               "its last min(C, n - 1) tokens on the canvas and the rest in the prompt (a C given here must be below "
               "--max-length); with --prompt-field the response (with the special tokens after it) is the canvas, "
               "cut to its first C tokens", unset="the model config's canvas_length (256 in DiffusionGemma's "
               "default config)", metavar="C")
    add_device(p)
    add_dtype(p)
    p.add_argument("--loss", choices=list(LOSSES), default="mlm",
                   help=f"{describe(LOSSES)} (default %(default)s; mlm: the objective's own loss)")
    p.add_argument("--reduction", choices=REDUCTIONS, default="sequence",
                   help="sequence: each sequence's mean loss, summed (batch-invariant; default); batch: mean over the batch")
    p.add_argument("--norms-only", action="store_true", help="skip the per-role sublayer split")
    p.add_argument("--router-aux-loss", nargs="?", const="model", default=None, type=_aux_coefficient,
                   metavar="COEF",
                   help="mixtures of experts: add the model's auxiliary router (load-balancing) loss to the loss, as "
                        "its training does, times its own router_aux_loss_coef or COEF; its gradient is split by "
                        "role like the loss's, and router_aux.csv gives each router's and experts weight's gradient "
                        "norm from the loss and from the term (default: the loss alone)")
    p.add_argument("--shard", choices=["none", "fsdp2"], default="none",
                   help="under torchrun: none (each rank a whole model copy; default) or fsdp2 (the parameters "
                        "sharded across the ranks by FSDP2, each block a unit; batches dealt whole, the tables "
                        "those of one process)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run files in a non-empty --out (an unfinished run's checkpoints too)")
    add_checkpointing(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_trust_remote_code(p)
    add_adapter(p)


def _aux_coefficient(text: str) -> float | str:
    """``--router-aux-loss``'s value: ``model`` or a finite coefficient >= 0."""
    if text == "model":
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite coefficient >= 0 (or model), got {text!r}")
    return value


def prompted_fields(args: argparse.Namespace):
    """The prompt/response fields of ``--prompt-field``/``--response-field`` (None: a plain corpus)."""
    if args.prompt_field is None:
        if args.response_field is not None:
            raise UsageError("--response-field names the response of a prompt/response corpus: give --prompt-field "
                             "too")
        return None
    from gradflow.inputs.prompted import PromptFields

    if args.prompt_field == (args.response_field or "response"):
        raise UsageError(f"--prompt-field and --response-field must differ, both are {args.prompt_field!r}")
    return PromptFields(args.prompt_field, args.response_field or "response")


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Record and print where the run went."""
    from gradflow.runs.record import RecordConfig, record_corpus

    config = RecordConfig(
        out=args.out, model=args.model, texts=args.texts, objective=objective_from_args(args),
        prompted=prompted_fields(args),
        seed=args.seed, max_length=args.max_length, batch_size=args.batch_size,
        limit=args.limit, device=args.device, dtype=args.dtype, loss=args.loss, reduction=args.reduction,
        sublayers=not args.norms_only, overwrite=args.overwrite, quiet=args.quiet,
        trust_remote_code=args.trust_remote_code, adapter=args.adapter, command=command_line(argv),
        resume=args.resume, checkpoint_every=args.checkpoint_every, checkpoint_minutes=args.checkpoint_minutes,
        router_aux_loss=args.router_aux_loss, shard=args.shard, canvas_length=args.canvas_length,
    )
    summary = record_corpus(config)
    if summary.meta:
        print(f"wrote {summary.out} ({summary.sequences} sequences, {summary.tokens} tokens, {summary.wall_s:.1f} s)")
    return 0
