"""Why gradflow-mini-en-diffusion stayed at the unigram stage: short runs of mini-en's recipe, one change each.

Each variant trains a fresh mini-en-shaped model for ``--steps`` steps of ``pretrain.train_step`` (mini-en's
windows and order, its optimiser and the diffusion member's schedule: warm-up 212 of 3,059 steps, ``--lr``), then
prints its BERT-15% validation loss and top-1 on 256 validation windows (``pretrain.evaluate``):

- ``diffusion``: the member's objective as trained (t ~ U(0.001, 1), every selected token masked, 1/t weights);
- ``unweighted``: the same corruption without the 1/t weights (t set to 1 in the loss);
- ``allmask15``: BERT 15% selection with every selected token masked (no random or kept tokens), mean loss;
- ``mlm15``: mini-en's corruption (BERT 15%, 80/10/10) through the same loss code;
- ``maskkept15``: mlm15 with its random tokens masked (90% [MASK], 10% kept);
- ``maskrandom15``: mlm15 with its kept tokens masked (90% [MASK], 10% random).

The last two tell which of mlm15's 10% random and 10% kept tokens lets the recipe leave the unigram stage.
``--seed`` (default 0, the committed runs') seeds the model, the windows' order and the masking.

    python -m analyses.pretraining.diagnose_diffusion --variant allmask15 --steps 450 [--lr 3e-4] [--seed 1] [--out D]
    python -m analyses.pretraining.diagnose_diffusion --summary D  # D/summary.md from the runs' D/*.json

With ``--out D`` a run also writes ``D/<variant>-lr<lr>-s<seed>.json``; ``--summary D`` tabulates every such file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from analyses.pretraining import objectives, pretrain

VARIANTS = ("diffusion", "unweighted", "allmask15", "mlm15", "maskkept15", "maskrandom15")


def corruption(variant: str):
    """The corruption of ``variant``, with the signature of :func:`objectives.corrupt`."""
    diffusion = objectives.corrupt  # read now: run() puts the variant in its place while it trains

    def unweighted(objective, ids, tokenizer, gen, ratio_gen=None):
        return dataclasses.replace(diffusion("diffusion", ids, tokenizer, gen, ratio_gen),
                                   ratio=torch.ones(ids.shape[0]))

    def allmask15(objective, ids, tokenizer, gen, ratio_gen=None):
        bert = objectives.corrupt_bert(ids, tokenizer, gen, 0.15)
        inputs = torch.where(bert.selected, torch.full_like(ids, tokenizer.mask_token_id), ids)
        return objectives.Corrupted(inputs, bert.labels, bert.selected)

    def mlm15(objective, ids, tokenizer, gen, ratio_gen=None):
        return objectives.corrupt_bert(ids, tokenizer, gen, 0.15)

    def masked_except(keep_unchanged: bool):
        """mlm15 with its random tokens (``keep_unchanged``) or its unchanged ones masked as well."""
        def corrupt(objective, ids, tokenizer, gen, ratio_gen=None):
            bert = objectives.corrupt_bert(ids, tokenizer, gen, 0.15)
            unchanged = bert.selected & (bert.inputs == ids)
            changed = bert.selected & (bert.inputs != tokenizer.mask_token_id) & ~unchanged
            to_mask = changed if keep_unchanged else unchanged
            inputs = torch.where(to_mask, torch.full_like(ids, tokenizer.mask_token_id), bert.inputs)
            return objectives.Corrupted(inputs, bert.labels, bert.selected)
        return corrupt

    return {"diffusion": objectives.corrupt, "unweighted": unweighted, "allmask15": allmask15, "mlm15": mlm15,
            "maskkept15": masked_except(True), "maskrandom15": masked_except(False)}[variant]


def run(variant: str, steps: int, lr: float, corpus: Path, tokenizer_dir: Path, seed: int = 0) -> dict:
    """Train ``steps`` steps of ``variant`` from ``seed``; its BERT-15% validation metrics."""
    tokenizer = pretrain.train_tokenizer(corpus, tokenizer_dir, 8192)
    train = pretrain.windows(tokenizer, corpus / "train.txt")
    valid_all = pretrain.windows(tokenizer, corpus / "valid.txt")
    valid = valid_all[torch.randperm(len(valid_all), generator=torch.Generator().manual_seed(7))[:256]]
    args = argparse.Namespace(loss="diffusion", sparse=False, arch="roformer", dropout=0.0, position_init="sinusoidal",
                              position_scale=1.0, lr=lr, warmup=212, steps=3059)
    torch.manual_seed(seed)
    model = pretrain.build_model(args, len(tokenizer), tokenizer.pad_token_id).train()
    opt, schedule = pretrain.make_optimizer(model, args)
    gen, ratio_gen = torch.Generator().manual_seed(2 * seed), torch.Generator().manual_seed(2 * seed + 1)
    original, start = objectives.corrupt, time.perf_counter()
    objectives.corrupt = corruption(variant) if variant != "diffusion" else original
    try:
        for _ in range(steps):
            ids = train[torch.randint(len(train), (16,), generator=gen)]
            pretrain.train_step(model, opt, schedule, ids, tokenizer, gen, args, 512, ratio_gen)
    finally:
        objectives.corrupt = original
    return {"variant": variant, "steps": steps, "lr": lr, "seed": seed, "train_s": round(time.perf_counter() - start, 1),
            **pretrain.evaluate(model, tokenizer, valid, 0)}


def run_path(out: Path, result: dict) -> Path:
    """Where ``--out`` puts one run's result: ``<variant>-lr<lr>-s<seed>.json``."""
    return out / f"{result['variant']}-lr{result['lr']:g}-s{result['seed']}.json"


def summary(out: Path) -> str:
    """A markdown table of every run under ``out``: per variant and learning rate, top-1 and loss at each seed."""
    runs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(out.glob("*-lr*-s*.json"))]
    if not runs:
        raise SystemExit(f"no diagnostic runs under {out}")
    lines = ["BERT-15% validation top-1 (loss) on 256 held-out windows after the steps given, one row per variant and "
             "learning rate, one value per seed (`python -m analyses.pretraining.diagnose_diffusion`; the unigram "
             "stage is top-1 0.05-0.07).", "",
             "| variant | lr | steps | seed: top-1 (loss) | train s |", "|---|---|---|---|---|"]
    key = {v: i for i, v in enumerate(VARIANTS)}
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((key[r["variant"]], r["variant"], -r["lr"], r["steps"]), []).append(r)
    for (_, variant, minus_lr, steps), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["seed"])
        cells = "; ".join(f"{r['seed']}: {r['valid_top1']:.3f} ({r['valid_loss']:.2f})" for r in rs)
        lines.append(f"| {variant} | {-minus_lr:g} | {steps} | {cells} | "
                     f"{', '.join(str(r.get('train_s', '-')) for r in rs)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", choices=VARIANTS)
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--tokenizer", type=Path, default=Path("src/gradflow/models/gradflow-mini-en"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="seeds the model, the windows' order and the masking")
    p.add_argument("--out", type=Path, help="also write the result to OUT/<variant>-lr<lr>-s<seed>.json")
    p.add_argument("--summary", type=Path, metavar="DIR", help="write DIR/summary.md from DIR's runs and stop")
    args = p.parse_args(argv)
    if args.summary:
        (args.summary / "summary.md").write_text(summary(args.summary), encoding="utf-8")
        print((args.summary / "summary.md").read_text(encoding="utf-8"))
        return
    if args.variant is None:
        p.error("--variant is needed (or --summary DIR)")
    torch.set_num_threads(args.threads)
    result = run(args.variant, args.steps, args.lr, args.corpus, args.tokenizer, args.seed)
    print(json.dumps(result), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        run_path(args.out, result).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
