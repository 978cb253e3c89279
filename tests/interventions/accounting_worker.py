"""One global batch of a tiny BERT trained one step under GradAccounting: in one process (imported by
test_accounting.py) or as one of torchrun's ranks (``python -m torch.distributed.run --nproc-per-node 2
accounting_worker.py OUT.json``: DDP, DDP with accumulation and FSDP2 with accumulation, rank 0 writing the rows)."""

from __future__ import annotations

import json
import sys

import torch
from transformers import BertConfig, BertForMaskedLM

from gradflow.interventions.accounting import AccountingConfig, GradAccounting
from gradflow.roles import Role

ROWS, LENGTH, VOCAB, MASK, PAD = 8, 12, 40, 3, 0
T_BINS = (0.0, 0.5, 1.0)


def tiny_model() -> BertForMaskedLM:
    """2 blocks, tied embeddings, a 1-row token-type table (an empty shard on rank 1 under FSDP2), no dropout."""
    torch.manual_seed(0)
    config = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=24, max_position_embeddings=32, type_vocab_size=1, pad_token_id=PAD,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(config).train()


def global_batch() -> dict[str, torch.Tensor]:
    """(8, 12): a prompt of 2 tokens on rows 0-3, padding at the end of rows 5 and 7, 3 loss positions a row
    (masked, random, kept), t per row in (0, 1)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, VOCAB, (ROWS, LENGTH), generator=g)
    attention = torch.ones(ROWS, LENGTH, dtype=torch.long)
    attention[5, 9:] = 0
    attention[7, 6:] = 0
    ids[attention == 0] = PAD
    labels = torch.full_like(ids, -100)
    roles = torch.full_like(ids, int(Role.CONTEXT))
    roles[attention == 0] = int(Role.PAD)
    roles[:4, :2] = int(Role.PROMPT)
    for row in range(ROWS):
        for k, role in enumerate((Role.MASKED, Role.RANDOM, Role.KEPT)):
            pos = 2 + k + (row % 3)
            labels[row, pos] = ids[row, pos]
            roles[row, pos] = int(role)
            if role == Role.MASKED:
                ids[row, pos] = MASK
            elif role == Role.RANDOM:
                ids[row, pos] = 4
    t = torch.linspace(0.1, 0.9, ROWS)
    return {"input_ids": ids, "attention_mask": attention, "labels": labels, "roles": roles, "t": t}


def train_step(model, accounting: GradAccounting, micro: list[slice], world: int, normaliser: str,
               sync=None) -> None:
    """One logged step over this rank's ``micro`` row slices. ``normaliser``: ``global`` (each token loss over the
    global batch's loss tokens, times ``world`` against DDP's average) or ``local`` (each micro-batch's mean)."""
    batch = global_batch()
    total = int((batch["labels"] != -100).sum())
    with accounting.step(1):
        for i, rows in enumerate(micro):
            last = i == len(micro) - 1
            labels = batch["labels"][rows]
            context = sync() if (sync is not None and not last) else _nothing()
            with context, accounting.micro_batch(batch["roles"][rows], labels=labels, t=batch["t"][rows]):
                logits = model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows]).logits
                losses = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
                if normaliser == "global":
                    loss = losses.sum() * world / total
                else:
                    loss = losses.sum() / (labels != -100).sum()
                loss.backward()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def one_process(micro: list[slice], normaliser: str = "global") -> GradAccounting:
    """The reference: one process, the whole global batch."""
    model = tiny_model()
    accounting = GradAccounting(model, AccountingConfig(every=50, t_bins=T_BINS, sublayers=True))
    train_step(model, accounting, micro, 1, normaliser)
    return accounting


def _ranked(rank: int, world: int, accumulation: int) -> list[slice]:
    share = ROWS // world
    step = share // accumulation
    return [slice(rank * share + k * step, rank * share + (k + 1) * step) for k in range(accumulation)]


def main(out: str) -> None:
    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {}
    for name, accumulation in (("ddp", 1), ("ddp_accumulation", 2), ("fsdp2_accumulation", 2)):
        model = tiny_model()
        if name.startswith("ddp"):
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
            sync = wrapped.no_sync
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in model.bert.encoder.layer:
                fully_shard(layer)
            wrapped, sync = fully_shard(model), None
        accounting = GradAccounting(wrapped, AccountingConfig(every=50, t_bins=T_BINS, sublayers=True))
        train_step(wrapped, accounting, _ranked(rank, world, accumulation), world, "global", sync)
        results[name] = accounting.rows
    if rank == 0:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump(results, fh)
    torch.distributed.barrier()  # no rank tears gloo down while rank 0 still writes (aborts "terminate called")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
