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

    python -m analyses.pretraining.diagnose_diffusion --variant allmask15 --steps 450 [--lr 3e-4] [--seed 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from analyses.pretraining import objectives, pretrain

VARIANTS = ("diffusion", "unweighted", "allmask15", "mlm15", "maskkept15", "maskrandom15")


def corruption(variant: str):
    """The corruption of ``variant``, with the signature of :func:`objectives.corrupt`."""
    def unweighted(objective, ids, tokenizer, gen, ratio_gen=None):
        return dataclasses.replace(objectives.corrupt("diffusion", ids, tokenizer, gen, ratio_gen),
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
    original = objectives.corrupt
    objectives.corrupt = corruption(variant) if variant != "diffusion" else original
    try:
        for _ in range(steps):
            ids = train[torch.randint(len(train), (16,), generator=gen)]
            pretrain.train_step(model, opt, schedule, ids, tokenizer, gen, args, 512, ratio_gen)
    finally:
        objectives.corrupt = original
    return {"variant": variant, "steps": steps, "lr": lr, "seed": seed, **pretrain.evaluate(model, tokenizer, valid, 0)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", choices=VARIANTS, required=True)
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--tokenizer", type=Path, default=Path("src/gradflow/models/gradflow-mini-en"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0, help="seeds the model, the windows' order and the masking")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(run(args.variant, args.steps, args.lr, args.corpus, args.tokenizer, args.seed)), flush=True)


if __name__ == "__main__":
    main()
