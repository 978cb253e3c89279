"""The model (RoFormerForMaskedLM: post-LN BERT block, rotary positions) and its MLM loss."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from transformers import RoFormerConfig, RoFormerForMaskedLM

from gradflow.training import sparse_mlm

from .config import RunConfig
from .data import Batch


def build_model(cfg: RunConfig, vocab_size: int, pad_id: int) -> RoFormerForMaskedLM:
    """A freshly initialised model on CPU, float32; the initialisation draws from ``cfg.seed`` only."""
    config = RoFormerConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden, embedding_size=cfg.hidden, num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads, intermediate_size=cfg.ffn, max_position_embeddings=cfg.max_len,
        type_vocab_size=2, pad_token_id=pad_id, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = RoFormerForMaskedLM(config)
    return model


def autocast(cfg: RunConfig) -> contextlib.AbstractContextManager:
    """bfloat16 autocast on the run's device, or nothing for float32."""
    if cfg.dtype == "bfloat16":
        return torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def mlm_loss(model: RoFormerForMaskedLM, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over the batch's loss rows; the MLM head runs on those C rows only.

    Returns (loss scalar, logits (C, V) of the used rows, their targets (C_used,)).
    """
    hidden = model.base_model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
    gathered = hidden.reshape(-1, hidden.shape[-1])[batch.rows.clamp_min(0)]  # (C, H)
    logits = model.cls(gathered)  # (C, V)
    loss = F.cross_entropy(logits.float(), batch.targets, ignore_index=-100)
    used = batch.targets != -100
    return loss, logits[used], batch.targets[used]


def labels_of(batch: Batch) -> torch.Tensor:
    """(B, T) labels: the target id at each loss row of ``batch``, -100 elsewhere."""
    b, t = batch.input_ids.shape
    labels = torch.full((b * t,), -100, dtype=torch.long, device=batch.input_ids.device)
    used = batch.rows >= 0
    labels[batch.rows[used]] = batch.targets[used]
    return labels.view(b, t)


def sparse_mlm_loss(model: RoFormerForMaskedLM, batch: Batch) -> torch.Tensor:
    """``mlm_loss``'s loss with the last block's query side also at the loss positions only (``--sparse``):
    :func:`gradflow.training.sparse_mlm`, the same loss and gradients (tested). Each row computes a multiple
    of 8 positions (the batch's largest count rounded up), so a run sees a handful of shapes."""
    labels = labels_of(batch)
    width = 8 * math.ceil(int((labels != -100).sum(dim=1).max()) / 8)
    return sparse_mlm(model, rows_per_sequence=min(width, labels.shape[1])).loss(
        batch.input_ids, batch.attention_mask, labels)
