"""``gradflow check``: lint a checkpoint for the structural zero (measured on one masked batch).

Prints, per block and parameter, the roles that send exactly zero gradient, the sublayers flagged
as structurally untrained on context channels, where this agrees or disagrees with the theory, and
the share of the batch's matmul FLOPs the last block spends where it gets no gradient. For a last
block whose module is applied at earlier depths too (ALBERT's shared layer) a flag is per
application: its row and a note give the shared weight's context share over all applications. Exit
0 whenever the check ran, whatever it found; 2 for bad input. ``--json``: one JSON object (keys in
:mod:`gradflow.runs.check`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from gradflow.cli.options import (
    AT_LEAST_ONE,
    add_device,
    add_max_length,
    add_model,
    add_number,
    add_objective,
    add_seed,
    add_trust_remote_code,
    objective_from_args,
)
from gradflow.formatting import format_number, masking_label

MARK = "*"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``check``."""
    p = subparsers.add_parser("check", help="lint a checkpoint for the structural zero: which roles send exactly "
                                            "zero gradient per block and parameter, measured on one masked batch")
    add_model(p)
    p.add_argument("--texts", default=None,
                   help="UTF-8 text file (one document per line), .jsonl with a 'text' field, a directory of .txt "
                        "files, or - for stdin; the batch is its first windows (default: a zoo model's shipped example "
                        "sequences, else the committed SOTU sample)")
    add_seed(p, meaning="random seed of the masking")
    add_objective(p)
    add_number(p, "--batch-size", int, AT_LEAST_ONE, "sequences (windows) in the checked batch", 8)
    add_max_length(p, 128)
    add_device(p)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text table")
    add_trust_remote_code(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Check and print; 0 whenever the check ran."""
    from gradflow.runs.check import check_model

    result = check_model(args.model, args.texts, seed=args.seed, batch_size=args.batch_size,
                         max_length=args.max_length, device=args.device, trust_remote_code=args.trust_remote_code,
                         objective=objective_from_args(args))
    print(json.dumps(result.to_dict(), indent=1) if args.json else render(result))
    return 0


def _roles(names: Sequence[str]) -> str:
    return ",".join(names) if names else "-"


def render(result) -> str:
    """The readable report of a :class:`~gradflow.runs.check.CheckResult`."""
    b, f = result.batch, result.flops
    tokens = ", ".join(f"{role} {n}" for role, n in b["tokens"].items())
    lines = [f"gradflow check: {result.model} (model_type {result.model_type}, adapter {result.family}, "
             f"{result.attn_norm}-LN), {result.num_blocks} blocks",
             f"batch: {b['sequences']} sequences from {b.get('texts', 'the given batch')}, {masking_label(b.get('masking', {'policy': 'bert', 'rate': 0.15}))}, seed "
             f"{b.get('seed', '-')}, max length {b.get('max_length', '-')}; positions: {tokens}; loss "
             f"{b['loss']:.4f}", "",
             "Roles that send exactly zero gradient (measured: the role's contribution to the parameter's gradient "
             f"is 0.0); {MARK} = structurally untrained on context (context exactly 0, loss roles nonzero)",
             f"{'layer':>5}  {'sublayer':<34} {'params':<12} zero roles"]
    shared = {row["sublayer"]: row for row in result.shared_parameters if row["param"] == "weight"}
    if result.shared_parameters:
        n = len(result.shared_parameters[0]["layers"])
        lines.insert(-1, f"  weight sharing: layer {result.num_blocks}'s block is one module applied {n} times, so "
                         f"its {MARK} is per application; the share after it is the shared weight's context share "
                         f"over all {n} applications (see the note)")
    for layers, rows in _layer_groups(result):
        for name, params, zero, flagged in rows:
            mark = f"  {MARK}" if flagged else ""
            if flagged and name in shared:
                mark += (f" per application; shared weight: {format_number(100 * shared[name]['total_context_share'])}"
                         f"% context over all {len(shared[name]['layers'])} applications")
            lines.append(f"{layers:>5}  {name:<34} {params:<12} {_roles(zero)}{mark}")
    for row in result.unsplit:
        lines.append(f"{row['layer']:>5}  {row['parameter']:<34} {'(not split)':<12} {row['reason']}")
    last = result.num_blocks
    expected = [s for s in result.sublayers if s.layer == last and s.expected_zero]
    nonzero = [s for s in result.sublayers if s.layer == last and s.standard and not s.expected_zero]
    earlier = [s for s in result.sublayers if s.layer < last and s.standard]
    lines += ["", f"Theory ({result.attn_norm}-LN): in the last block {_names(result.expected_last_block)} get exactly "
              "zero gradient from context positions; no other (block, sublayer) does."]
    lines.append(f"  agree, last block zero: {_names(s.sublayer for s in expected if s.agrees)}")
    lines.append(f"  agree, last block nonzero: {_names(s.sublayer for s in nonzero if s.agrees)}")
    lines.append(f"  agree, blocks 1-{last - 1} nonzero: {sum(bool(s.agrees) for s in earlier)} of {len(earlier)} "
                 "(block, sublayer) pairs")
    if result.disagreements:
        for s in result.disagreements:
            lines.append(f"  DISAGREE: layer {s.layer} {s.sublayer}: theory "
                         f"{'zero' if s.expected_zero else 'nonzero'}, measured {'zero' if s.flagged else 'nonzero'}")
    else:
        lines.append("  disagreements: none")
    others = [s for s in result.sublayers if not s.standard and s.flagged]
    if others:
        lines.append("  also flagged (outside the standard sublayers, no theory entry): "
                     + ", ".join(f"layer {s.layer} {s.sublayer}" for s in others))
    lines += ["", f"Skippable compute: {100 * f.share:.2f}% of the batch's forward+backward matmul FLOPs "
              f"({_names(f.skippable_sublayers)} of the last block at the {f.unselected_tokens} unselected of "
              f"{f.tokens} positions: {f.skippable / 1e9:.4g} of {f.total / 1e9:.4g} GFLOP); "
              f"{100 * f.share_with_attention:.2f}% with the last block's attention rows of those queries.",
              "  FLOPs = 3 (forward+backward) x 2*in*out per token per Linear, + 3 x 2*n^2*(d_q+d_v) attention "
              "scores and values per block and sequence; head at the loss positions only; padding not counted."]
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def _layer_groups(result) -> list[tuple[str, list[tuple]]]:
    """(layer label, rows) with consecutive layers whose rows are identical merged ("1-5")."""
    per_layer: dict[int, dict[tuple, list[str]]] = {}
    for p in result.params:
        per_layer.setdefault(p.layer, {}).setdefault((p.sublayer, p.zero_roles, p.flagged), []).append(p.param)
    groups: list[tuple[list[int], list[tuple]]] = []
    for layer, rows in per_layer.items():
        table = [(name, ",".join(params), zero, flagged) for (name, zero, flagged), params in rows.items()]
        if groups and groups[-1][1] == table and groups[-1][0][-1] == layer - 1:
            groups[-1][0].append(layer)
        else:
            groups.append(([layer], table))
    return [(str(ls[0]) if len(ls) == 1 else f"{ls[0]}-{ls[-1]}", table) for ls, table in groups]


def _names(names) -> str:
    names = list(names)
    return ", ".join(names) if names else "none"
