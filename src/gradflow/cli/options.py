"""Shared options of the ``gradflow`` commands and the validators that check them at the edge.

An option several commands take is written once, here, and every command adds it through its
helper: ``--device`` (:func:`add_device`), ``--dtype`` (:func:`add_dtype`, the choices of
:data:`gradflow.models.DTYPES`), ``--trust-remote-code`` (:func:`add_trust_remote_code`), ``--seed``
(:func:`add_seed`), ``--limit`` (:func:`add_limit`), ``--model``, ``--max-length``, the corpus and
figure-output options; a command keeps its own default and says what the option means for it
through the helper's parameters. Numeric options go through :func:`add_number`: the value is
converted and range-checked while parsing, and a bad one raises :class:`~gradflow.errors.UsageError`
naming the option, its accepted range and its meaning (``main`` prints it as one line and exits 2).
Choices come from the registries that define them (:class:`RegistryChoices` imports a heavy one
only when it is used). Pieces that several command modules share (:func:`probe_dirs`,
:func:`command_line`, :func:`formats`) live here too, and the training objective's options
(:func:`add_objective`, :func:`objective_from_args`): ``--objective bert`` (``--mask-rate``,
``--mask-split``, ``--whole-word``), ``span`` (``--mask-rate``, ``--mask-split``, ``--span-p``,
``--span-max-words``) or ``diffusion`` (``--eps``, ``--mask-ratio``, ``--mask-ratios``), and
``--shift``; an option of another objective is refused with one sentence.
"""

from __future__ import annotations

import argparse
import importlib
import math
import shlex
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from gradflow.adapters import ADAPTER_CHOICES
from gradflow.errors import UsageError
from gradflow.formatting import format_number
from gradflow.models import DEFAULT_MODEL, DTYPES, EMBEDDED_MODELS

FORMATS_DEFAULT = "pdf,png"


@dataclass(frozen=True)
class Bound:
    """A numeric range: ``low``/``high`` (``None``: unbounded), each end open or closed."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        """``in [0, 1)``, ``>= 1``, ...: the ends written exactly (``format_number(x, digits=None)``)."""
        low, high = format_number(self.low, None), format_number(self.high, None)
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {low}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {high}"
        return "a finite number"


POSITIVE = Bound(0, low_open=True)
AT_LEAST_ONE = Bound(1)
NON_NEGATIVE = Bound(0)
FRACTION = Bound(0, 1, low_open=True)  # (0, 1]


class CheckedAction(argparse.Action):
    """Store ``check(value)`` (of each value when ``nargs`` makes a list); a bad one raises :class:`UsageError`."""

    def __init__(self, option_strings: list[str], dest: str, check: Callable[[str], object] = str, **kwargs) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.check = check

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[str] | None, option_string: str | None = None) -> None:
        checked = [self.check(v) for v in values] if isinstance(values, list) else self.check(values)
        setattr(namespace, self.dest, checked)


def number(flag: str, kind: type, bound: Bound, meaning: str) -> Callable[[str], int | float]:
    """A check converting ``text`` to ``kind`` in ``bound``; the error names ``flag``, range and meaning."""

    def check(text: str) -> int | float:
        try:
            value = kind(text)
        except (TypeError, ValueError):
            article = "an integer" if kind is int else "a number"
            raise UsageError(f"{flag} must be {article} {bound} ({meaning}), got {text!r}") from None
        if value not in bound:
            raise UsageError(f"{flag} must be {bound} ({meaning}), got {text}")
        return value

    return check


def add_number(parser: argparse.ArgumentParser, flag: str, kind: type, bound: Bound, meaning: str,
               default: int | float | None = None, unset: str = "", **kwargs) -> None:
    """A numeric option checked against ``bound``; its help states the meaning, range and default
    (``unset`` says what happens when a ``None`` default is left)."""
    shown = f"; default {default}" if default is not None else (f"; default: {unset}" if unset else "")
    parser.add_argument(flag, action=CheckedAction, check=number(flag, kind, bound, meaning), default=default,
                        help=f"{meaning}; {bound}{shown}", **kwargs)


class RegistryChoices(Sequence[str]):
    """The keys of a registry ``module.NAME``, imported on first use (help, an error, a given value)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def _keys(self) -> list[str]:
        return list(getattr(importlib.import_module(self.module), self.name))

    def __getitem__(self, index):  # type: ignore[override]
        return self._keys()[index]

    def __len__(self) -> int:
        return len(self._keys())

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __contains__(self, value: object) -> bool:
        return value in self._keys()


def describe(registry: Mapping[str, object]) -> str:
    """``"name: what it is; ..."`` from a registry of descriptions or documented functions (``%`` escaped for help)."""

    def text(value: object) -> str:
        doc = value if isinstance(value, str) else (getattr(value, "__doc__", None) or "")
        return doc.strip().splitlines()[0].rstrip(".") if doc.strip() else ""

    joined = "; ".join(f"{name}: {text(value)}" if text(value) else name for name, value in registry.items())
    return joined.replace("%", "%%")


def model_help(default: str | None = DEFAULT_MODEL) -> str:
    """Help of a ``--model`` option: the embedded names from the registry and the other forms."""
    names = ", ".join(EMBEDDED_MODELS)
    tail = f" (default {default})" if default else ""
    return f"embedded model ({names}), zoo:NAME (see `gradflow zoo list`), a local directory or a hub name{tail}"


def add_model(parser: argparse.ArgumentParser, required: bool = False) -> None:
    """``--model``: required, or defaulting to the default embedded model."""
    default = None if required else DEFAULT_MODEL
    parser.add_argument("--model", required=required, default=default, help=model_help(default))


def add_adapter(parser: argparse.ArgumentParser) -> None:
    """``--adapter``: the registered adapter of the model type, or the generic one (opt-in)."""
    parser.add_argument("--adapter", choices=ADAPTER_CHOICES, default="registered",
                        help="registered: the adapter of the model's model_type (default); auto: the generic adapter, "
                             "which discovers the block stack from the module tree (for custom or unregistered "
                             "architectures; prints what it found; block outputs and per-module-path splits only)")


def add_corpus(parser: argparse.ArgumentParser, seed_meaning: str = "random seed of the masking") -> None:
    """The corpus options of ``record`` and ``diagnose``: texts, window length, batch, limit, seed."""
    parser.add_argument("--texts", default=None,
                        help="UTF-8 text file (one document per line), .jsonl with a 'text' field, a directory of "
                             ".txt files, or - for stdin (default: the committed SOTU sample)")
    add_max_length(parser, 128)
    add_number(parser, "--batch-size", int, AT_LEAST_ONE, "sequences per forward and backward pass", 8)
    add_limit(parser, "sequences (windows) to read before stopping")
    add_seed(parser, meaning=seed_meaning)


def add_max_length(parser: argparse.ArgumentParser, default: int) -> None:
    """``--max-length``: tokens per sequence, special tokens included."""
    add_number(parser, "--max-length", int, AT_LEAST_ONE, "tokens per sequence, special tokens included", default)


def add_limit(parser: argparse.ArgumentParser, meaning: str, flag: str = "--limit", unset: str = "no limit",
              default: int | None = None) -> None:
    """``--limit`` (or ``flag``): a count limit, an integer >= 1; ``meaning`` says what it counts, ``unset``
    what happens when it is left out (``default`` None), or ``default`` gives a value."""
    add_number(parser, flag, int, AT_LEAST_ONE, meaning, default, unset=unset)


def add_seed(parser: argparse.ArgumentParser, default: int = 0, meaning: str = "random seed") -> None:
    """``--seed``: the random seed, an integer >= 0; ``meaning`` says what it seeds."""
    add_number(parser, "--seed", int, NON_NEGATIVE, meaning, default)


def add_checkpointing(parser: argparse.ArgumentParser, resume: bool = True) -> None:
    """``--resume`` (with ``resume``), ``--checkpoint-every`` and ``--checkpoint-minutes`` of the resumable jobs."""
    if resume:
        parser.add_argument("--resume", action="store_true",
                            help="continue the unfinished run in --out from its last checkpoint (same options; the "
                                 "finished tables are those of an uninterrupted run)")
    add_number(parser, "--checkpoint-every", int, AT_LEAST_ONE, "checkpoint every this many sequences (or every "
               "--checkpoint-minutes, whichever comes first); a kill loses at most the work since the last", 1024)
    add_number(parser, "--checkpoint-minutes", float, POSITIVE, "checkpoint every this many minutes (or every "
               "--checkpoint-every sequences, whichever comes first)", 10.0)


def add_device(parser: argparse.ArgumentParser, default: str = "cpu") -> None:
    """``--device``: the torch device the model runs on (any name torch accepts; checked when it is used)."""
    parser.add_argument("--device", default=default,
                        help="torch device: cpu, cuda, cuda:1, mps, ... (default %(default)s)")


def add_dtype(parser: argparse.ArgumentParser, default: str = "float32") -> None:
    """``--dtype``: the dtype the model's weights are loaded in, one of :data:`gradflow.models.DTYPES`."""
    parser.add_argument("--dtype", choices=list(DTYPES), default=default,
                        help="dtype the model's weights are loaded in: %(choices)s (default %(default)s)")


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    """``--trust-remote-code``: let a hub checkpoint run its own Python code (off unless given)."""
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow a hub checkpoint to run its own Python code (off by default; review the code "
                             "first)")


def add_blocks(parser: argparse.ArgumentParser, default: int | None = 0) -> None:
    """``--drop-last`` / ``--reinit-last``: block surgery on the last k blocks."""
    add_number(parser, "--drop-last", int, NON_NEGATIVE, "number of last blocks to remove", default)
    add_number(parser, "--reinit-last", int, NON_NEGATIVE, "number of last blocks to re-initialise", default)


DEFAULT_FIGURE_WIDTH = "single"
"""``--width``'s default for every figure command: :data:`gradflow.figures.style.DEFAULT_WIDTH` (a test keeps them
equal; spelled here so that building the parser does not import matplotlib)."""


def add_figure_output(parser: argparse.ArgumentParser, width: bool = False) -> None:
    """``--out`` (required), ``--format`` and, with ``width``, ``--width`` (one default for every command)."""
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--format", default=FORMATS_DEFAULT, help="comma-separated figure formats (default %(default)s)")
    if width:
        parser.add_argument("--width", choices=RegistryChoices("gradflow.figures.style", "WIDTHS"),
                            default=DEFAULT_FIGURE_WIDTH,
                            metavar="WIDTH", help="figure width preset: %(choices)s (default %(default)s)")


class _Default(str):
    """An option's default, kept by argparse as given, so that :func:`latex_layout` tells it from the same value
    typed."""


LAYOUT_RULE = ("The LaTeX tables' layout is --latex-layout when given; else a --width given picks it (single: column, "
               "one column of a two-column paper; double: wide); else page.")
"""How :func:`latex_layout` chooses, for a command's description."""


def add_latex_layout(parser: argparse.ArgumentParser) -> None:
    """``--latex-layout``: how ``tables.tex`` and ``latex/<name>.tex`` are laid out (:mod:`gradflow.figures.tables`);
    with ``--width`` (:func:`add_figure_output`), :func:`latex_layout` tells a layout or width given from a default."""
    parser.add_argument("--latex-layout", choices=RegistryChoices("gradflow.figures.tables", "LATEX_LAYOUTS"),
                        default="page", metavar="LAYOUT",
                        help="LaTeX tables: page (a one-column paper), wide (table*, across both columns of a "
                             "two-column paper) or column (one column of a two-column paper: intervals under their "
                             "estimates); default %(default)s, or what --width suggests")
    parser.set_defaults(latex_layout=_Default("page"))
    if any(action.dest == "width" for action in parser._actions):
        parser.set_defaults(width=_Default(parser.get_default("width")))


def latex_layout(args: argparse.Namespace) -> str:
    """``--latex-layout`` when given; else the layout a ``--width`` given suggests (``single``: ``column``,
    ``double``: ``wide``); else ``page``."""
    from gradflow.figures.report_tables import layout_for_width

    if not isinstance(args.latex_layout, _Default):
        return str(args.latex_layout)
    width = getattr(args, "width", None)  # commands without --width keep the default layout
    return layout_for_width(width) if width is not None and not isinstance(width, _Default) else str(args.latex_layout)


def formats(text: str) -> tuple[str, ...]:
    """``"pdf,png"`` -> ``("pdf", "png")``."""
    return tuple(f.strip() for f in text.split(",") if f.strip())


def probe_dirs(run_dirs: Sequence[str]) -> bool:
    """True when every directory is a probe directory (``report`` and ``compare`` redraw its figure); a mix of
    probe and record runs is refused."""
    from gradflow.analysis.probe_tables import is_probe_dir

    kinds = [is_probe_dir(d) for d in run_dirs]
    if any(kinds) and not all(kinds):
        probes = [d for d, k in zip(run_dirs, kinds) if k]
        raise UsageError(f"cannot compare probe directories ({', '.join(probes)}) with record runs; compare each kind "
                         "on its own")
    return all(kinds)


def command_line(argv: Sequence[str]) -> str:
    """The command as typed, for provenance in meta.json."""
    return "gradflow " + shlex.join(argv)


# ----------------------------------------------------------------------------------------------
# The training objective (``record``, ``check``, ``channels``, ``explore``)
# ----------------------------------------------------------------------------------------------

OBJECTIVES: dict[str, str] = {
    "bert": "BERT masking: --mask-rate of the tokens (0.15), 80/10/10 --mask-split",
    "span": "SpanBERT span masking: whole-word spans of geometric length (--span-p, --span-max-words) until "
            "--mask-rate of the tokens",
    "diffusion": "masked diffusion (LLaDA, MDLM): a ratio t per sequence from U(--eps, 1), or --mask-ratio, or "
                 "--mask-ratios; every selected token masked; loss weights 1/t",
    "random-canvas": "DiffusionGemma's published recipe: a ratio t per sequence as diffusion's; every selected "
                     "token replaced by a random token; the loss on every token outside the prompt, unweighted",
}
OPEN_FRACTION = Bound(0, 1, low_open=True, high_open=True)
_T = ("diffusion", "random-canvas")  # the objectives with a ratio t per sequence
_ONLY: dict[str, tuple[str, ...]] = {  # option (its argparse dest) -> the objectives that read it
    "mask_rate": ("bert", "span"), "mask_split": ("bert", "span"), "whole_word": ("bert",),
    "eps": _T, "mask_ratio": _T, "mask_ratios": _T,
    "span_p": ("span",), "span_max_words": ("span",),
}


def add_objective(parser: argparse.ArgumentParser) -> None:
    """``--objective`` and its parameters (defaults None: an option given to another objective is refused)."""
    parser.add_argument("--objective", choices=list(OBJECTIVES), default="bert",
                        help="the training objective whose loss is backpropagated: "
                             + "; ".join(f"{k}: {v}" for k, v in OBJECTIVES.items()) + " (default %(default)s)")
    add_number(parser, "--mask-rate", float, FRACTION, "bert and span: the fraction of maskable tokens selected "
               "for the loss", None, unset="0.15")
    parser.add_argument("--mask-split", action=CheckedAction, check=mask_split, default=None,
                        help="bert and span: mask,random,kept: fractions of the selected tokens replaced by [MASK], "
                             "by a random token or kept, summing to 1 (default 0.8,0.1,0.1)")
    parser.add_argument("--whole-word", action="store_true", default=None, help="bert: select whole words")
    add_number(parser, "--eps", float, OPEN_FRACTION,
               "diffusion, random-canvas: each sequence's ratio t is drawn from U(eps, 1)",
               None, unset="0.001, as LLaDA")
    add_number(parser, "--mask-ratio", float, FRACTION,
               "diffusion, random-canvas: one fixed ratio t for every sequence", None,
               unset="drawn per sequence")
    parser.add_argument("--mask-ratios", action=CheckedAction, check=ratio_grid, default=None,
                        help="diffusion, random-canvas: a grid of ratios t, comma-separated (0.1,0.5,0.9): "
                             "sequence i gets the "
                             "(i mod n)-th, so one run measures every ratio")
    add_number(parser, "--span-p", float, FRACTION, "span: the geometric parameter of span lengths in words", None,
               unset="0.2, as SpanBERT")
    add_number(parser, "--span-max-words", int, AT_LEAST_ONE, "span: the longest span in words", None,
               unset="10, as SpanBERT")
    parser.add_argument("--shift", action="store_true",
                        help="a shifted head (Dream, DiffuLLaMA, LLM2Vec's MNTP): the logits at position p predict "
                             "the token at p + 1, so p carries that token's loss")


def _ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, ..., 21st."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def number_list(flag: str, expected: str, text: str, bound: Bound) -> tuple[float, ...]:
    """Comma-separated numbers, each in ``bound``; the error (``flag`` must be ``expected``, got ``text``) names the
    first value that is not a number or not in ``bound``, and its place in the list."""
    values = []
    for place, item in enumerate(text.split(","), 1):
        ordinal = f"the {_ordinal(place)} value"
        try:
            value = float(item)
        except ValueError:
            raise UsageError(f"{flag} must be {expected}, got {text!r}: {item.strip()!r} ({ordinal}) is not a "
                             "number") from None
        if value not in bound:
            raise UsageError(f"{flag} must be {expected}, got {text!r}: {item.strip()} ({ordinal}) is not {bound}")
        values.append(value)
    return tuple(values)


def mask_split(text: str) -> tuple[float, float, float]:
    """``--mask-split``: three non-negative fractions (mask, random, kept) summing to 1."""
    expected = "three comma-separated non-negative fractions (mask,random,kept) summing to 1"
    parts = number_list("--mask-split", expected, text, NON_NEGATIVE)
    if len(parts) != 3:
        raise UsageError(f"--mask-split must be {expected}, got {text!r}: it has {len(parts)} value{'s' * (len(parts) != 1)}")
    if abs(sum(parts) - 1) > 1e-6:
        raise UsageError(f"--mask-split must be {expected}, got {text!r}: they sum to {sum(parts):.6g}")
    return parts  # type: ignore[return-value]


def ratio_grid(text: str) -> tuple[float, ...]:
    """``--mask-ratios``: comma-separated ratios, each in (0, 1]."""
    return number_list("--mask-ratios", "comma-separated numbers in (0, 1] (masking ratios t)", text, FRACTION)


def objective_from_args(args: argparse.Namespace):
    """The masking policy the options name, seeded by ``--seed`` (0 where the command has none).

    Refuses, with one sentence, an option of another objective and ``--mask-ratio`` with ``--mask-ratios``.
    """
    from gradflow.inputs.masking import BertMasking, MaskedDiffusion, SpanMasking

    name = args.objective
    for dest, readers in _ONLY.items():
        if getattr(args, dest, None) not in (None, False) and name not in readers:
            flag = "--" + dest.replace("_", "-")
            raise UsageError(f"{flag} applies to --objective {' or '.join(readers)}, not to --objective {name}: "
                             f"drop it or choose that objective")
    seed = int(getattr(args, "seed", 0) or 0)
    rate = 0.15 if args.mask_rate is None else args.mask_rate
    split = (0.8, 0.1, 0.1) if args.mask_split is None else tuple(args.mask_split)
    if name in _T:
        if args.mask_ratio is not None and args.mask_ratios is not None:
            raise UsageError("--mask-ratio and --mask-ratios both fix the masking ratio: give one of them")
        return MaskedDiffusion(eps=1e-3 if args.eps is None else args.eps, ratio=args.mask_ratio,
                               ratios=tuple(args.mask_ratios or ()), seed=seed, shift=args.shift,
                               corruption="mask" if name == "diffusion" else "random")
    if name == "span":
        return SpanMasking(rate=rate, split=split, geometric_p=0.2 if args.span_p is None else args.span_p,
                           max_words=10 if args.span_max_words is None else args.span_max_words, seed=seed,
                           shift=args.shift)
    return BertMasking(rate=rate, split=split, whole_word=bool(args.whole_word), seed=seed, shift=args.shift)
