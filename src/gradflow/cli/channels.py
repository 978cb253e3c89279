"""``gradflow channels``: the channel view of one sentence (tokens x layers), as figures and optionally HTML."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from gradflow.cli.options import (
    RegistryChoices,
    add_figure_output,
    add_model,
    add_objective,
    add_seed,
    command_line,
    formats,
    objective_from_args,
)
from gradflow.errors import UsageError


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``channels``."""
    channels = subparsers.add_parser("channels", help="tokens x layers channel-view figure for one sentence")
    add_model(channels)
    channels.add_argument("--text", required=True, help="the sentence to show")
    # range-checked against the sentence's length by the library ("out of range ... positions 0..n-1")
    channels.add_argument("--mask-positions", type=int, nargs="+", default=None,
                          help="token positions to mask, special tokens included in the count (0 is the first); "
                               "default: BERT's masking seeded by --seed")
    add_seed(channels, meaning="random seed of BERT's masking when --mask-positions is not given (each token is "
                               "selected on its own with probability 0.15, so one sentence's share varies around 15 "
                               "percent)")
    add_objective(channels)
    channels.add_argument("--quantity", default="grad_norm", metavar="QUANTITY",
                          choices=RegistryChoices("gradflow.runs.channels", "QUANTITIES"),
                          help="what each cell shows: %(choices)s (default %(default)s)")
    channels.add_argument("--html", default=None, metavar="FILE",
                          help="also write the view as one self-contained HTML page (opens offline, no server; "
                               "grad_norm only; needs the explore extra)")
    add_figure_output(channels)
    channels.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Draw the channel view (and write the HTML page)."""
    from gradflow.models import load_model
    from gradflow.runs.channels import channel_batch, selection_text, write_channel_view

    loaded = load_model(args.model)
    objective = objective_from_args(args)
    if args.html and args.quantity != "grad_norm":
        raise UsageError(f"--html shows the gradient norms only; drop --html or use --quantity grad_norm "
                         f"(got {args.quantity})")
    paths = write_channel_view(loaded, args.text, args.out, mask_positions=args.mask_positions,
                               quantity=args.quantity, formats=formats(args.format), seed=args.seed,
                               command=command_line(argv), objective=objective)
    batch = channel_batch(loaded, args.text, args.mask_positions, seed=args.seed, objective=objective)
    print(selection_text(batch, args.seed if args.mask_positions is None else None, objective))
    print(f"wrote {len(paths) + 1} files to {args.out} (the figure, channel_view.csv and meta.json)")
    if args.html:
        from gradflow.explore.view import channel_view

        mask = "random" if args.mask_positions is None else args.mask_positions
        channel_view(loaded, args.text, mask=mask, seed=args.seed, objective=objective).to_html(args.html)
        print(f"wrote the self-contained page {args.html}")
    return 0
