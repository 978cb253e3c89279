"""Pretrain a 12-layer English MLM (``--arch base``) resumably, for gradflow's Part B pair (issue 18).

Same model family and data recipe as ``pretrain.py`` (RoFormerForMaskedLM, post-LN, rotary positions,
lower-cased WordPiece trained with HF ``tokenizers``, BERT 15% / 80-10-10 masking; ``--loss mlm``
or ``--loss alltoken``), but every run can stop and resume bit-identically: checkpoints every
``--checkpoint-every`` steps, on SIGTERM / SIGINT and after ``--max-minutes`` of wall time, and
rerunning the same command resumes from ``<out>/checkpoint.pt``. Exit codes: 0 done, 75 stopped
with a checkpoint (rerun to resume), 2 refused (config differs from the checkpoint's, or no corpus).

    python -m analyses.pretraining.pretrain_base --loss mlm --out build/gradflow-base-en
    # GPU lent in <= 10 minute slots: each command trains 9 minutes and checkpoints
    python -m analyses.pretraining.pretrain_base --loss mlm --out build/gradflow-base-en \\
        --device cuda --dtype bfloat16 --max-minutes 9

See ``docs/pretraining-recipe.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analyses.pretraining.recipe.config import ARCHS, RunConfig
from analyses.pretraining.recipe.train import EXIT_CONFIG, main_guard

DEFAULT_CORPUS = Path("data/corpus-large")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="folder with train.txt and valid.txt")
    p.add_argument("--out", type=Path, required=True, help="run folder: checkpoint, tokenizer, curve, final model")
    p.add_argument("--tokenizer", type=Path, default=None,
                   help="tokenizer folder, trained there on the corpus if absent (default: <out>/tokenizer); share "
                        "one between the two models of a pair (WordPiece training is not deterministic)")
    p.add_argument("--loss", choices=["mlm", "alltoken"], default="mlm")
    p.add_argument("--arch", choices=sorted(ARCHS), default="base",
                   help="base: 12 layers, hidden 512, 8 heads, FFN 2048, 128 positions; mini: the shipped 6-layer "
                        "sizes; mini12: mini's width at 12 layers; tiny: 2 layers, hidden 32 (tests)")
    for name in ("layers", "hidden", "heads", "ffn", "max_len"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None, help="override the preset")
    p.add_argument("--vocab-size", type=int, default=8192, help="WordPiece vocabulary to train")
    p.add_argument("--steps", type=int, default=40_000)
    p.add_argument("--batch-size", type=int, default=64, help="windows of max_len tokens per step")
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=2_000)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="bfloat16: autocast of the forward pass (weights and optimiser stay float32)")
    p.add_argument("--valid-windows", type=int, default=1024)
    p.add_argument("--eval-every", type=int, default=1_000)
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop with a checkpoint (exit 75) after this much wall time since the command started")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--sparse", action="store_true",
                   help="compute the last block's query side at the loss positions only "
                        "(gradflow.training.sparse_mlm): the same loss and gradients, less compute; not with "
                        "--loss alltoken")
    p.add_argument("--snapshots", type=int, default=0,
                   help="keep the weights at this many log-spaced steps in <out>/snapshots (0: none)")
    p.add_argument("--stop-after", type=int, default=None, help=argparse.SUPPRESS)  # test hook
    p.add_argument("--throttle-s", type=float, default=0.0, help=argparse.SUPPRESS)  # test hook
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Parse, check the corpus, train; returns the exit code (0 done, 75 stopped, 2 refused)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    missing = [n for n in ("train.txt", "valid.txt") if not (args.corpus / n).exists()]
    if missing:
        hint = ("run `make -C analyses corpus-large` to build it" if args.corpus == DEFAULT_CORPUS else
                "give --corpus a folder with train.txt and valid.txt (one document per line)")
        print(f"error: corpus {args.corpus} has no {' / '.join(missing)}: {hint}, or pass --corpus data/corpus "
              "for the small corpus (`make -C analyses corpus`).", file=sys.stderr)
        return EXIT_CONFIG
    if args.sparse and args.loss == "alltoken":
        print("error: --sparse skips the positions outside the loss; with --loss alltoken there are none. Drop "
              "--sparse for the all-token model.", file=sys.stderr)
        return EXIT_CONFIG
    fields = {k: v for k, v in vars(args).items() if k not in ("corpus", "out", "arch", "tokenizer")}
    cfg = RunConfig.from_arch(args.arch, corpus=str(args.corpus), out=str(args.out),
                               tokenizer=str(args.tokenizer or ""), **fields)
    return main_guard(cfg, [sys.executable, "-m", "analyses.pretraining.pretrain_base", *argv])


if __name__ == "__main__":
    sys.exit(main())
