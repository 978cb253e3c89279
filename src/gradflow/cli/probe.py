"""``gradflow probe``: layer-wise linear probes (accuracy with CIs, control task, online code length)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from gradflow.cli.options import (
    AT_LEAST_ONE,
    POSITIVE,
    add_device,
    add_figure_output,
    add_limit,
    add_max_length,
    add_model,
    add_number,
    add_seed,
    formats,
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``probe``."""
    from gradflow.inputs.labelled import BUILTIN_PROBE_TASKS

    tasks = "; ".join(f"{k}: {v}" for k, v in BUILTIN_PROBE_TASKS.items())
    p = subparsers.add_parser("probe", help="layer-wise linear probes of word features (accuracy, selectivity, "
                                            "online code length; last-layer drop with a CI)")
    add_model(p)
    p.add_argument("--task", required=True,
                   help=f"{tasks}; or a file of 'word<TAB>label' lines (blank line between sentences), a .jsonl "
                        "file with 'tokens' and 'labels', or a directory with train/validation/test files")
    add_figure_output(p, width=True)
    add_limit(p, "sentences read from each split (train, validation, test)", default=2000)
    p.add_argument("--train-limit", type=_train_limit, default=None, metavar="N",
                   help="sentences of the training split instead of --limit (a count, or 'all' for the whole split); "
                        "validation and test stay the first --limit sentences, so the test words do not change")
    p.add_argument("--probe", choices=("logistic", "mlp"), default="logistic",
                   help="probe family: standardised logistic regression (default), or an MLP with one hidden layer "
                        "of 256 ReLU units, early-stopped on validation; C chosen on validation for both")
    p.add_argument("--masked", action="store_true",
                   help="also probe with the probed word masked (one forward per word: slower)")
    p.add_argument("--pooling", choices=("first", "mean"), default="first",
                   help="a word's feature: its first sub-word (default) or the mean of its sub-words")
    p.add_argument("--mid", action="store_true", help="also probe the FFN inputs (blocks.{i}.mid)")
    p.add_argument("--no-code-length", dest="code_length", action="store_false",
                   help="skip the online code length (faster)")
    add_number(p, "--code-c", float, POSITIVE, "inverse L2 strength of the online-code probe, the same at every "
               "site", 0.01)
    add_max_length(p, 128)
    add_number(p, "--batch-size", int, AT_LEAST_ONE, "sequences per forward pass", 32)
    add_number(p, "--resamples", int, AT_LEAST_ONE, "bootstrap resamples for the CIs", 1000)
    add_seed(p, meaning="random seed of the split, the control task and the bootstraps")
    p.add_argument("--feature-dtype", choices=("float16", "float32"), default="float16",
                   help="dtype of the features streamed to disk (default %(default)s)")
    p.add_argument("--feature-cache", default=None, metavar="DIR",
                   help="reuse word features extracted earlier for the same weights, sentences and settings (a sweep "
                        "over training sizes, probe families or tasks re-reads the same validation and test "
                        "sentences); missing ones are written there. Safe to delete")
    add_device(p)
    p.add_argument("--data-root", default=None, help="where the built-in tasks live (default $GRADFLOW_TASKS, else "
                                                     "./data/tasks, else the user cache; see `gradflow tasks list`, "
                                                     "built by `gradflow tasks fetch`)")
    p.add_argument("--overwrite", action="store_true", help="replace the probe files in a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=run)


def _train_limit(text: str) -> int | str:
    """``--train-limit``: an integer >= 1 or ``all``."""
    if text == "all":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a count >= 1 or 'all', got {text!r}")
    return value


def _progress(quiet: bool) -> Callable[[str, int], Callable[[int], None]] | None:
    """tqdm bars (one per stage) that close themselves when full."""
    if quiet:
        return None
    from gradflow.progress import progress_bar

    def start(label: str, total: int) -> Callable[[int], None]:
        bar = progress_bar(total=total, desc=label, unit="word" if "features" in label else "site", leave=False)

        def tick(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()

        return tick

    return start


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Probe, write the figure, print the last-layer drops."""
    from gradflow.figures.probes import write_probe_figures
    from gradflow.runs.probe import ProbeConfig, run_probes

    config = ProbeConfig(model=args.model, task=args.task, out=args.out,
                         regimes=("unmasked", "masked") if args.masked else ("unmasked",), pooling=args.pooling,
                         mid=args.mid, limit=args.limit, train_limit=args.train_limit, probe=args.probe,
                         max_length=args.max_length, batch_size=args.batch_size,
                         seed=args.seed, n_resamples=args.resamples, code_length=args.code_length, code_c=args.code_c,
                         feature_dtype=args.feature_dtype, feature_cache=args.feature_cache, device=args.device, data_root=args.data_root,
                         overwrite=args.overwrite, command=["gradflow", *argv])
    result = run_probes(config, progress=_progress(args.quiet))
    write_probe_figures([result.out], None, result.out, formats=formats(args.format), width=args.width)
    for row in result.drops.itertuples():
        print(f"{row.regime:9s} {row.metric:17s} last_layer_drop {row.last_layer_drop:+.4f} "
              f"[{row.ci_low:+.4f}, {row.ci_high:+.4f}] (last {row.last_score:.4f}, best earlier layer "
              f"{row.best_earlier_layer}: {row.best_earlier_score:.4f})")
    print(f"wrote {result.out}")
    return 0
