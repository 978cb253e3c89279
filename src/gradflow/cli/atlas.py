"""``gradflow atlas``: record, check, diagnose and probe several checkpoints; merge them into one atlas.

``gradflow atlas MODEL... --out DIR [--shard I/N]`` runs each model into ``DIR/<slug>/`` (resumable:
finished models are skipped, interrupted ones resume their record and diagnostics steps) and,
unsharded, writes ``DIR/atlas.csv`` and the figures; ``gradflow atlas --merge DIR... --out OUT``
merges finished directories (e.g. the shards of a cluster array job). See :mod:`gradflow.runs.atlas`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradflow.cli.options import (
    AT_LEAST_ONE,
    FORMATS_DEFAULT,
    CheckedAction,
    add_checkpointing,
    add_device,
    add_dtype,
    add_latex_layout,
    add_limit,
    add_number,
    add_seed,
    add_trust_remote_code,
    command_line,
    formats,
    model_help,
)
from gradflow.errors import UsageError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``atlas``."""
    from gradflow.runs.atlas import parse_shard

    p = subparsers.add_parser("atlas", help="record, check, diagnose and probe several checkpoints into one atlas "
                                            "(resumable, shardable), or --merge finished atlas directories")
    p.add_argument("models", nargs="*", metavar="MODEL", help=model_help(None) + "; one or more")
    p.add_argument("--out", required=True, help="atlas directory (one subdirectory per model), or the merge's output")
    p.add_argument("--merge", nargs="+", metavar="DIR", default=None,
                   help="merge the finished models of these atlas directories into --out (no MODEL)")
    p.add_argument("--shard", action=CheckedAction, check=parse_shard, default=(1, 1), metavar="I/N",
                   help="run only the I-th of N slices of the model list (models I, I+N, I+2N, ...; 1-based); "
                        "merge the shards' directories afterwards with --merge (default 1/1: all, then merge)")
    p.add_argument("--texts", action="append", default=[], metavar="[MODEL=]FILE",
                   help="corpus of one model (MODEL=FILE, repeatable) or of every model without its own (FILE); "
                        "default: the committed SOTU sample, a zoo model's shipped example inputs")
    add_limit(p, "windows recorded and diagnosed per model", unset="all of the model's inputs")
    add_number(p, "--max-length", int, AT_LEAST_ONE, "tokens per window, special tokens included",
               unset="256 for zoo models, 128 otherwise, at most what the model accepts")
    add_number(p, "--batch-size", int, AT_LEAST_ONE, "sequences per forward and backward pass", 8)
    add_seed(p, meaning="random seed of the masking, the probe splits and the bootstraps")
    add_device(p)
    add_dtype(p)
    p.add_argument("--pressure", action="store_true",
                   help="also record under the all-positions loss (counterfactual context pressure; twice the "
                        "recording time)")
    p.add_argument("--probe-task", default="brown-pos",
                   help="probe task for models whose vocabulary fits its words (default %(default)s; or a "
                        "'word<TAB>label' file, see gradflow probe)")
    p.add_argument("--no-probes", dest="probes", action="store_false", help="skip the probes")
    add_number(p, "--probe-limit", int, AT_LEAST_ONE, "probe sentences per split", 600)
    p.add_argument("--data-root", default=None, help="where the built-in probe tasks live (default $GRADFLOW_TASKS, "
                                                     "else ./data/tasks, else the user cache; see `gradflow tasks "
                                                     "list`, built by `gradflow tasks fetch`)")
    add_number(p, "--resamples", int, AT_LEAST_ONE, "bootstrap resamples of the CIs", 2000)
    p.add_argument("--format", default=FORMATS_DEFAULT, help="comma-separated figure formats (default %(default)s)")
    add_latex_layout(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_trust_remote_code(p)
    add_checkpointing(p, resume=False)  # an interrupted model's record and diagnostics steps always resume
    p.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run the atlas, or merge; 0 on success."""
    if args.merge is not None:
        return _merge(args, argv)
    from gradflow.runs.atlas import AtlasConfig, run_atlas

    if not args.models:
        raise UsageError("gradflow atlas needs at least one MODEL, or --merge DIR... to merge finished atlases")
    config = AtlasConfig(
        models=tuple(args.models), out=args.out, texts=tuple(args.texts), shard=args.shard, limit=args.limit,
        max_length=args.max_length, batch_size=args.batch_size, seed=args.seed, device=args.device,
        dtype=args.dtype, pressure=args.pressure, probes=args.probes, probe_task=args.probe_task,
        probe_limit=args.probe_limit, data_root=args.data_root, resamples=args.resamples,
        formats=formats(args.format), latex_layout=args.latex_layout, quiet=args.quiet,
        trust_remote_code=args.trust_remote_code,
        command=command_line(argv), checkpoint_every=args.checkpoint_every,
        checkpoint_minutes=args.checkpoint_minutes)
    summary = run_atlas(config)
    print(f"atlas {args.out}: {len(summary.ran)} model(s) run, {len(summary.skipped)} finished before"
          + (f" (shard {args.shard[0]}/{args.shard[1]}: merge with gradflow atlas --merge)" if args.shard[1] > 1
             else "; atlas.csv and figures written"))
    return 0


def _merge(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from gradflow.runs.atlas_merge import merge_atlas

    if args.models:
        raise UsageError(f"--merge takes atlas directories, not models; drop {' '.join(args.models)} or --merge")
    path = merge_atlas(args.merge, args.out, formats=formats(args.format), resamples=args.resamples, seed=args.seed,
                       command=command_line(argv), latex_layout=args.latex_layout)
    print(f"wrote {path}")
    return 0
