"""Pretrain the embedded English MLMs ``gradflow-mini-en`` and ``gradflow-mini-en-alltoken``.

One recipe, four losses (``--loss``):
- ``--loss mlm``: standard BERT masking (15% of tokens selected; 80% [MASK], 10% random, 10% kept)
  and the cross-entropy at the selected positions only.
- ``--loss alltoken``: the same corruption, but the original token is predicted at *every*
  non-special position (ELECTRA's "All-Tokens MLM" ablation), so the last block is trained on
  context channels too.
- ``--loss mask40`` and ``--loss diffusion`` (issue 52, :mod:`analyses.pretraining.objectives`): BERT masking
  at 40%, and masked diffusion as LLaDA pretrains (t ~ U(1e-3, 1) per window, every selected token masked,
  1/t weights, divided by the batch's real tokens), on mini-en's windows in mini-en's order.

Architecture (RoFormerForMaskedLM: BERT's post-LN block with rotary position embeddings instead of
a learned position table): 6 layers, hidden 256, 4 heads, FFN 1024, 128 positions, lower-cased
WordPiece vocabulary of 8,192 (trained here with HF ``tokenizers``): the attention and FFN shapes
of BERT-base scaled by 1/3, 6 of its 12 blocks, small enough to train in under an hour of one core.

Why rotary positions (recipe version 3): with BERT's learned absolute positions the models never
left the bag-of-words stage inside this budget. Recipe version 1 (BertForMaskedLM, batch 32 x 1,300
steps, dropout 0.1) ended at 0.137 validation top-1; version 2 (no dropout, batch 16, sinusoidal
initial positions) was at 0.141 after 2,000 steps, and a sequence-length warm-up (32-token windows
for the first half) at 0.120 after 900 steps. In all of them every head's attention to the previous
and the next token stayed at 1/T (0.008 of the mass for T = 128, measured on validation windows):
no head had learned to look at its neighbours. RoFormer, identical otherwise, had five heads with
0.05 to 0.16 of their mass on the neighbouring token after 300 steps and 0.150 validation top-1
(BERT: 0.11 after 500). Pre-LN (``--arch prenorm``) learned no faster over its first 200 steps;
position tables initialised 5x larger diverged.

Recipe: batch 16 x 128 tokens, AdamW (betas 0.9/0.98, weight decay 0.01) at peak 1e-3 after 250
warm-up steps then linear decay to 0 at 3,600 steps, gradient clipping at 1.0, no dropout (the
shipped config keeps dropout 0, as trained). The all-token twin gets the same *time* budget: its
MLM head runs at every position (16 x 128 rows of 8,192 logits per step instead of 16 x 32), so
it trains for 2,700 steps (190 warm-up), with 6.7x more loss positions per token.
Training tricks that change speed, not the model: bfloat16 autocast, logits computed only at the
loss positions (a fixed number of rows per step). ``--sparse`` (not used for the shipped models) also
computes the last block's query, attention output and FFN at the loss positions only, with
:func:`gradflow.training.sparse_mlm`: the same loss and gradients with less compute (docs/guides/sparse-training.md).
Every random draw comes from ``--seed``.

    python -m analyses.corpus.fetch_corpus --out data/corpus
    python -m analyses.pretraining.pretrain --loss mlm --out build/gradflow-mini-en
    python -m analyses.pretraining.pretrain --loss alltoken --out build/gradflow-mini-en-alltoken
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import BertWordPieceTokenizer
from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

from analyses.pretraining import objectives, pretrain_state
from gradflow.training import sparse_mlm

MAX_LEN = 128


def train_tokenizer(corpus: Path, out: Path, vocab_size: int) -> BertTokenizerFast:
    """Train (once) a lower-cased WordPiece tokenizer on the training split; reuse it after."""
    if not (out / "tokenizer.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        wp = BertWordPieceTokenizer(lowercase=True)
        wp.train([str(corpus / "train.txt")], vocab_size=vocab_size, min_frequency=2)
        # BertTokenizerFast(vocab_file=...) silently keeps only the special tokens in transformers 5:
        # wrap the trained tokenizer object instead, then check the size after reloading.
        BertTokenizerFast(
            tokenizer_object=wp._tokenizer, do_lower_case=True, unk_token="[UNK]", sep_token="[SEP]",
            pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]",
        ).save_pretrained(out)
    tokenizer = BertTokenizerFast.from_pretrained(out)
    if len(tokenizer) < vocab_size // 2:
        raise RuntimeError(f"tokenizer in {out} has only {len(tokenizer)} tokens")
    return tokenizer


def window_rows(tokenizer: BertTokenizerFast, ids: list[int], length: int) -> list[list[int]]:
    """One document's token ids -> rows of ``length``: [CLS] up to length-2 pieces [SEP], padded;
    pieces shorter than min(16, (length-2)//2) are dropped."""
    body = length - 2
    rows = []
    for start in range(0, len(ids), body):
        piece = ids[start : start + body]
        if len(piece) < min(16, body // 2):
            continue
        row = [tokenizer.cls_token_id, *piece, tokenizer.sep_token_id]
        rows.append(row + [tokenizer.pad_token_id] * (length - len(row)))
    return rows


def windows(tokenizer: BertTokenizerFast, path: Path, length: int = MAX_LEN) -> torch.Tensor:
    """Documents -> (N, length) int64 windows: [CLS] up to length-2 pieces [SEP], padded with 0."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        rows += window_rows(tokenizer, tokenizer(line, add_special_tokens=False)["input_ids"], length)
    return torch.tensor(rows, dtype=torch.long)


def corrupt(ids: torch.Tensor, tokenizer: BertTokenizerFast, gen: torch.Generator, alltoken: bool):
    """BERT 15% / 80-10-10 corruption (:func:`objectives.corrupt_bert`). Returns (inputs, labels, selected), labels
    -100 outside the loss."""
    corrupted = objectives.corrupt_bert(ids, tokenizer, gen, 0.15, alltoken=alltoken)
    return corrupted.inputs, corrupted.labels, corrupted.selected


def loss_positions(labels: torch.Tensor, capacity: int) -> torch.Tensor:
    """Flat indices of the label positions, padded (with -1) or cut to a fixed ``capacity``.

    A fixed number of head rows per step keeps every tensor shape constant: with varying shapes
    the CPU kernels' caches grew by gigabytes over a run.
    """
    flat = torch.nonzero(labels.reshape(-1) != -100).squeeze(1)[:capacity]
    pad = torch.full((capacity - flat.numel(),), -1, dtype=torch.long)
    return torch.cat([flat, pad])


def mlm_loss(model: BertForMaskedLM, inputs, labels, attention_mask, capacity: int):
    """Cross-entropy at label positions; the MLM head runs on ``capacity`` gathered rows only."""
    hidden = model.base_model(input_ids=inputs, attention_mask=attention_mask).last_hidden_state
    rows = loss_positions(labels, capacity)
    gathered = hidden.reshape(-1, hidden.shape[-1])[rows.clamp_min(0)]
    targets = torch.where(rows >= 0, labels.reshape(-1)[rows.clamp_min(0)], torch.full_like(rows, -100))
    logits = (model.cls if hasattr(model, "cls") else model.lm_head)(gathered)
    where = targets != -100
    return F.cross_entropy(logits.float(), targets, ignore_index=-100), logits[where], targets[where]


def sparse_loss(model: torch.nn.Module, inputs, labels, attention_mask) -> torch.Tensor:
    """The MLM loss with the head and the last block's query side at the loss positions only (``--sparse``).

    Each row computes a multiple of 8 positions (the batch's largest count rounded up), so a run sees
    a handful of shapes, not one per step.
    """
    width = 8 * math.ceil(int((labels != -100).sum(dim=1).max()) / 8)
    return sparse_mlm(model, rows_per_sequence=min(width, labels.shape[1])).loss(inputs, attention_mask, labels)


@torch.no_grad()
def evaluate(model, tokenizer, valid: torch.Tensor, seed: int, batch: int = 128) -> dict:
    """Loss and top-1 accuracy at the *selected* positions of a fixed masking of ``valid``."""
    model.eval()
    gen = torch.Generator().manual_seed(seed + 1)
    total_loss = total_correct = total = 0.0
    for start in range(0, len(valid), batch):
        ids = valid[start : start + batch]
        inputs, _, selected = corrupt(ids, tokenizer, gen, alltoken=False)
        labels = torch.where(selected, ids, torch.full_like(ids, -100))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, logits, targets = mlm_loss(model, inputs, labels, (ids != tokenizer.pad_token_id).long(), ids.numel())
        n = targets.numel()
        total_loss += float(loss) * n
        total_correct += float((logits.argmax(-1) == targets).sum())
        total += n
    model.train()
    return {"valid_loss": total_loss / total, "valid_top1": total_correct / total, "valid_positions": int(total)}


@torch.no_grad()
def evaluate_own(model, tokenizer, valid: torch.Tensor, seed: int, objective: str, batch: int = 128,
                 recipe: str | None = None) -> dict:
    """The objective's own loss (diffusion: the 1/t-weighted loss per real token) and top-1 at its loss positions,
    on a fixed corruption of ``valid`` (seeds ``seed + 1``, and ``seed + 2`` for the ratios)."""
    model.eval()
    gen, ratio_gen = torch.Generator().manual_seed(seed + 1), torch.Generator().manual_seed(seed + 2)
    total_loss = total_norm = total_correct = total = 0.0
    for start in range(0, len(valid), batch):
        ids = valid[start : start + batch]
        corrupted = corruption(argparse.Namespace(loss=objective, recipe=recipe))(ids, tokenizer, gen, ratio_gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss, logits, targets = objectives.objective_loss(model, corrupted, (ids != tokenizer.pad_token_id).long())
        # the loss's own normaliser: real tokens (diffusion), loss positions (BERT masking)
        norm = int((ids != tokenizer.pad_token_id).sum()) if objective == "diffusion" else targets.numel()
        total_loss += float(loss) * norm
        total_norm += norm
        total_correct += float((logits.argmax(-1) == targets).sum())
        total += targets.numel()
    model.train()
    return {"own_loss": total_loss / total_norm, "own_top1": total_correct / total, "own_positions": int(total)}


def sinusoids(n_positions: int, dim: int) -> torch.Tensor:
    """(n_positions, dim) sinusoidal position table of Vaswani et al. (2017), sin and cos halves."""
    pos = torch.arange(n_positions, dtype=torch.float32)[:, None]
    freq = torch.exp(-math.log(10000.0) * torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return torch.cat([torch.sin(pos * freq), torch.cos(pos * freq)], dim=1)


def build_model(args: argparse.Namespace, vocab_size: int, pad_token_id: int) -> torch.nn.Module:
    """The seeded-by-caller model of ``args.arch`` at mini-en's sizes (6 x 256, 4 heads, FFN 1024); the output layer
    shares the word embeddings unless ``args.tie_embeddings`` is False."""
    sizes = dict(vocab_size=vocab_size, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                 intermediate_size=1024, type_vocab_size=2, pad_token_id=pad_token_id,
                 hidden_dropout_prob=args.dropout, attention_probs_dropout_prob=args.dropout,
                 tie_word_embeddings=getattr(args, "tie_embeddings", True))  # untied: issue 60's diagnosis
    if args.arch == "bert":
        model = BertForMaskedLM(BertConfig(**sizes, max_position_embeddings=MAX_LEN))
    elif args.arch == "roformer":  # rotary positions in every attention, no position embedding table
        from transformers import RoFormerConfig, RoFormerForMaskedLM

        model = RoFormerForMaskedLM(RoFormerConfig(**sizes, embedding_size=256, max_position_embeddings=MAX_LEN))
    else:  # RoBERTa-style positions start after the padding index: two more rows
        from transformers import RobertaPreLayerNormConfig, RobertaPreLayerNormForMaskedLM

        model = RobertaPreLayerNormForMaskedLM(RobertaPreLayerNormConfig(**sizes, max_position_embeddings=MAX_LEN + 2))
    config = model.config
    if args.position_init == "sinusoidal" and args.arch != "roformer":
        with torch.no_grad():
            table = model.base_model.embeddings.position_embeddings.weight
            waves = sinusoids(table.shape[0], config.hidden_size)
            table.copy_(waves * args.position_scale * table.std() / waves.std())
    return model


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace):
    """AdamW (0.9, 0.98), weight decay 0.01 on matrices, and the warm-up then linear-decay schedule (constant after
    the warm-up with ``args.constant_lr``)."""
    decay = [p_ for n, p_ in model.named_parameters() if p_.ndim >= 2]
    no_decay = [p_ for n, p_ in model.named_parameters() if p_.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-6,
    )
    if getattr(args, "constant_lr", False):  # MDLM: constant after the warm-up
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / args.warmup, 1.0))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / args.warmup, max(0.0, (args.steps - s) / (args.steps - args.warmup)))
    )
    return opt, schedule


def corruption(args: argparse.Namespace):
    """``(ids, tokenizer, gen, ratio_gen) -> Corrupted`` of ``args.loss``, or of the diagnosis cell ``args.recipe``
    (``analyses.diffusion_diagnosis.cells``: its t sampler and kept tokens) when one is given."""
    recipe = getattr(args, "recipe", None)
    if recipe:
        from analyses.diffusion_diagnosis import cells

        return functools.partial(cells.corrupt, cells.cell(recipe))
    return functools.partial(objectives.corrupt, args.loss)


def train_step(model, opt, schedule, ids: torch.Tensor, tokenizer, gen: torch.Generator, args: argparse.Namespace,
               capacity: int, ratio_gen: torch.Generator | None = None) -> torch.Tensor:
    """One optimiser step on windows ``ids`` (B, T) under ``args.loss``: corruption, bfloat16-autocast forward and
    loss, backward, clipping at 1.0, AdamW, schedule. Returns the detached loss."""
    attention_mask = (ids != tokenizer.pad_token_id).long()
    if args.loss in ("mlm", "alltoken"):  # mini-en's and the twin's path, unchanged (check_reproduce)
        inputs, labels, _ = corrupt(ids, tokenizer, gen, alltoken=args.loss == "alltoken")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if args.sparse:
                loss = sparse_loss(model, inputs, labels, attention_mask)
            else:
                loss, _, _ = mlm_loss(model, inputs, labels, attention_mask, capacity)
    else:
        batch = corruption(args)(ids, tokenizer, gen, ratio_gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not getattr(args, "fp32", False)):
            loss, _, _ = objectives.objective_loss(model, batch, attention_mask)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    schedule.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Pretrain a gradflow-mini-en model.")
    p.add_argument("--corpus", type=Path, default=Path("data/corpus"))
    p.add_argument("--tokenizer", type=Path, default=Path("build/tokenizer-mini-en"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--loss", choices=list(objectives.OBJECTIVES), default="mlm")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=250)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--position-scale", type=float, default=1.0,
                   help="std of the initial position embeddings relative to the word embeddings' (BERT: 1)")
    p.add_argument("--arch", choices=["bert", "prenorm", "roformer"], default="roformer",
                   help="bert: BertForMaskedLM (post-LN); prenorm: RobertaPreLayerNormForMaskedLM, same sizes")
    p.add_argument("--dropout", type=float, default=0.0,
                   help="hidden and attention dropout during pretraining (BERT used 0.1; 0 trains faster on a short budget)")
    p.add_argument("--position-init", choices=["normal", "sinusoidal"], default="sinusoidal",
                   help="initial position embeddings: BERT's N(0, 0.02), or sinusoids (still learned)")
    p.add_argument("--short-fraction", type=float, default=0.0,
                   help="sequence-length warm-up: this fraction of the steps uses windows of --short-length "
                        "tokens (and proportionally more of them, so a step has the same number of tokens)")
    p.add_argument("--short-length", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--valid-windows", type=int, default=1024)
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after N steps (same schedule): for checking that a run reproduces a shipped log")
    p.add_argument("--recipe", metavar="CELL", default=None,
                   help="--loss diffusion with a diagnosis cell's recipe (analyses/diffusion_diagnosis/cells.py: "
                        "embeddings, output init, kept tokens, t sampler, lr and schedule; figures/diffusion-diagnosis)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop after this many minutes with the run's state in OUT/checkpoint.pt; rerun to resume")
    p.add_argument("--state-every", type=int, default=200, help="save the run's state every this many steps")
    p.add_argument("--fp32", action="store_true",
                   help="train in float32 (default: bfloat16 autocast, faster only on CPUs with AMX)")
    p.add_argument("--sparse", action="store_true",
                   help="train with the MLM head and the last block's query, attention output and FFN at the loss "
                        "positions only (gradflow.training.sparse_mlm): the same loss and gradients, less compute")
    args = p.parse_args(argv)
    if args.recipe:
        if args.loss != "diffusion":
            p.error(f"--recipe {args.recipe} is a masked-diffusion recipe: use it with --loss diffusion")
        from analyses.diffusion_diagnosis import cells

        try:
            cell = cells.cell(args.recipe)
        except ValueError as err:
            p.error(str(err))
        if cell.objective != "diffusion":
            p.error(f"--recipe {args.recipe} is not a diffusion cell")
        # the cell's recipe replaces these flags' values (recorded in recipe.json)
        args.tie_embeddings, args.zero_output, args.lr, args.constant_lr = cell.tied, cell.zero_output, cell.lr, cell.constant
    if args.sparse and args.loss == "alltoken":
        p.error("--sparse skips the positions outside the loss; with --loss alltoken every non-special position is "
                "in the loss, so there is nothing to skip: drop --sparse")
    if args.sparse and args.loss not in ("mlm", "alltoken"):
        p.error(f"--sparse is the 15% MLM's speed-up; --loss {args.loss} trains dense, as its budget was measured")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        _train(args)
    finally:  # an in-process caller keeps its own thread count
        torch.set_num_threads(threads)


def _train(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    tokenizer = train_tokenizer(args.corpus, args.tokenizer, args.vocab_size)
    train = windows(tokenizer, args.corpus / "train.txt")
    short_steps = int(round(args.short_fraction * args.steps))
    train_short = windows(tokenizer, args.corpus / "train.txt", args.short_length) if short_steps else None
    valid_all = windows(tokenizer, args.corpus / "valid.txt")
    valid = valid_all[torch.randperm(len(valid_all), generator=torch.Generator().manual_seed(7))[: args.valid_windows]]
    print(f"train windows {len(train)}, valid windows {len(valid)} (of {len(valid_all)})", flush=True)

    model = build_model(args, len(tokenizer), tokenizer.pad_token_id)
    if getattr(args, "zero_output", False):  # MDLM: the (untied) output layer starts at zero
        with torch.no_grad():
            model.get_output_embeddings().weight.zero_()
            model.get_output_embeddings().bias.zero_()
    opt, schedule = make_optimizer(model, args)
    gen = torch.Generator().manual_seed(args.seed)
    ratio_gen = torch.Generator().manual_seed(args.seed + 1)  # diffusion's ratios t (mini-en's draws untouched)
    progress = pretrain_state.resume(args, model, opt, schedule, gen, ratio_gen)
    log_rows, tokens_seen = progress.log_rows, progress.tokens_seen
    start, cpu_start = time.time() - progress.wall_s, time.process_time() - progress.cpu_s
    deadline = None if args.max_minutes is None else time.time() + 60 * args.max_minutes
    # head rows per step: every position for the all-token loss, else 1/4 of them (15% are selected)
    capacity = args.batch_size * MAX_LEN if args.loss == "alltoken" else args.batch_size * MAX_LEN // 4
    model.train()
    for step in range(progress.step, args.steps + 1):
        source, rows_per_step = ((train_short, args.batch_size * MAX_LEN // args.short_length) if step <= short_steps
                                 else (train, args.batch_size))
        ids = source[torch.randint(len(source), (rows_per_step,), generator=gen)]
        loss = train_step(model, opt, schedule, ids, tokenizer, gen, args, capacity, ratio_gen)
        tokens_seen += int((ids != tokenizer.pad_token_id).sum())
        row = {"step": step, "tokens": tokens_seen, "train_loss": float(loss.detach()), "lr": schedule.get_last_lr()[0],
               "elapsed_s": round(time.time() - start, 1)}
        if step % args.eval_every == 0 or step == args.steps:
            row.update(evaluate(model, tokenizer, valid, args.seed))
            if args.loss in ("mask40", "diffusion"):
                row.update(evaluate_own(model, tokenizer, valid, args.seed, args.loss, recipe=args.recipe))
            print(json.dumps(row), flush=True)
            model.save_pretrained(args.out / "checkpoint")
        log_rows.append(row)
        if step % 50 == 0:
            print(f"step {step} loss {row['train_loss']:.4f} elapsed {row['elapsed_s']}s", flush=True)
        if not math.isfinite(float(loss.detach())):
            raise SystemExit(f"non-finite loss at step {step}")
        if args.stop_after is not None and step >= args.stop_after:
            break
        stop = deadline is not None and time.time() > deadline
        if step < args.steps and (stop or step % args.state_every == 0):
            progress = pretrain_state.Progress(step + 1, tokens_seen, log_rows, time.time() - start,
                                               time.process_time() - cpu_start)
            where = pretrain_state.keep(args, progress, model, opt, schedule, gen, ratio_gen)
            if stop:
                print(f"--max-minutes {args.max_minutes:g}: stopped after step {step}; rerun to resume ({where})")
                return
    final = evaluate(model, tokenizer, valid, args.seed)
    if args.loss in ("mask40", "diffusion"):
        final.update(evaluate_own(model, tokenizer, valid, args.seed, args.loss, recipe=args.recipe))
    model.half().save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    fields = ["step", "tokens", "train_loss", "lr", "elapsed_s", "valid_loss", "valid_top1", "valid_positions"]
    if args.loss in ("mask40", "diffusion"):
        fields += ["own_loss", "own_top1", "own_positions"]
    with open(args.out / "training_log.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(log_rows)
    recipe = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    recipe.update(final=final, train_windows=len(train), wall_s=round(time.time() - start, 1),
                  cpu_s=round(time.process_time() - cpu_start, 1),
                  torch=torch.__version__, tokens_seen=tokens_seen)
    (args.out / "recipe.json").write_text(json.dumps(recipe, indent=2))
    pretrain_state.finish(args)
    print(json.dumps(recipe), flush=True)


if __name__ == "__main__":
    main()
