"""Families with BERT's block layout whose inputs or attention need a word more: TAPAS, RoCBert, Nystromformer.

- **TAPAS** reads ``token_type_ids`` of shape (B, T, 7) (segment, column, row, previous answer, column
  rank, inverse rank, numeric relation). gradflow records text alone: ``TapasTokenizer`` gives every
  token of the text segment ([CLS] text [SEP], the part before the table) the value 0 in all seven
  channels, which is exactly what ``TapasModel`` uses when no ``token_type_ids`` are passed, and
  with column and row 0 everywhere the per-cell position reset leaves absolute positions. So a
  text-only batch is the input TAPAS gets for a text with an empty table; tables are not carried.
- **RoCBert** reads ``input_shape_ids`` and ``input_pronunciation_ids`` (glyph and pinyin ids). Its
  tokenizer derives them from each token alone (the ``word_shape`` and ``word_pronunciation`` tables,
  unknown tokens -> the [UNK] entry, the added [CLS] and [SEP] -> the [UNK] entry, padding -> the pad
  id), so :func:`token_inputs` derives them from the batch's (corrupted) input ids with the
  tokenizer's own tables, and :func:`gradflow.inputs.masking.mask_batch` puts them in
  ``MaskedBatch.extra_inputs``. A batch built without the tokenizer carries none and the model then
  embeds shape and pronunciation id 0 (its padding rows) at every position. Both tokenizers are slow
  only, and corpus jobs window documents with a fast tokenizer's overflow: TAPAS's BertTokenizerFast
  on the same vocabulary gives the same ids; RoCBert is recorded through the Python API.
- **Nystromformer** computes exact softmax attention when ``num_landmarks == segment_means_seq_len``
  (the published uw-madison configurations: 64 and 64, whatever the input length), and adds
  ``attention.self.conv``, a depthwise convolution of the values over ``conv_kernel_size``
  neighbouring positions. The Nystrom branch (fewer landmarks) is refused: its landmark queries are
  segment means of every position's query, so the last block's ``attn.q`` gets context gradient
  (measured in tests/adapters/test_families_extra_inputs.py).

Their last blocks have BERT's zero pattern: ``attn.q``, ``attn.out``, ``attn.norm`` and the FFN get
exactly zero gradient from context positions.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gradflow.adapters.bert import BERT
from gradflow.adapters.subset_variants import nystromformer_subset

TAPAS = replace(
    BERT, family="tapas", model_types=("tapas",),
    notes="post-LN; text only: token_type_ids are not passed, so all 7 table channels are 0 at every position, "
          "as TapasTokenizer sets them for the text segment ([CLS] text [SEP]) of a text with an empty table; "
          "table cells (segment 1, column/row ids, ranks, numeric relations) are not carried. TapasTokenizer (slow "
          "only; its first argument is a table) cannot feed corpus jobs, which need a fast tokenizer: save the "
          "checkpoint with BertTokenizerFast on its vocab.txt, which gives a text without table TapasTokenizer's ids",
)

ROC_BERT = replace(
    BERT, family="roc_bert", model_types=("roc_bert",),
    notes="post-LN; input_shape_ids and input_pronunciation_ids are derived from the batch's input ids with the "
          "tokenizer's word_shape and word_pronunciation tables, as RoCBertTokenizer derives them (a masked "
          "position gets the [MASK] token's ids, a random replacement its token's); a batch built without the "
          "tokenizer carries none and the model embeds id 0 (the padding row) instead. RoCBertTokenizer is slow "
          "only and corpus jobs (record, check) window documents with a fast tokenizer's overflow, so RoCBert is "
          "recorded through the Python API (mask_batch on texts of at most max_length tokens)",
)


def _nystrom_refusal(config: object) -> str | None:
    landmarks = getattr(config, "num_landmarks", None)
    segment = getattr(config, "segment_means_seq_len", None)
    if landmarks == segment:
        return None
    return (f"does not hold: with num_landmarks={landmarks} < segment_means_seq_len={segment} Nystrom attention "
            "forms landmark queries as segment means of every position's query, so each loss position's output "
            "reads the context positions' queries and the last block's attn.q gets context gradient (measured "
            "non-zero in tests/adapters/test_families_extra_inputs.py); the installed model also needs exactly "
            "segment_means_seq_len positions and fails on padded batches in that branch. Configurations with "
            "num_landmarks == segment_means_seq_len (exact attention, the published checkpoints) are supported")


NYSTROMFORMER = replace(
    BERT, family="nystromformer", model_types=("nystromformer",), refuse=_nystrom_refusal,
    subset_block=nystromformer_subset,
    notes="post-LN; exact softmax attention (num_landmarks == segment_means_seq_len; otherwise refused). "
          "attention.self.conv (a depthwise Conv2d over conv_kernel_size neighbouring positions of the values, "
          "added to the attention output) is outside the standard sublayers and, like attn.v, gets context "
          "gradient in the last block; position ids start at 2 (max_position_embeddings + 2 rows)",
)

TOKEN_TABLES: dict[str, str] = {"input_shape_ids": "word_shape", "input_pronunciation_ids": "word_pronunciation"}
"""Model input -> the tokenizer attribute (a dict token -> id) it is derived from (RoCBert's tokenizer)."""


def token_inputs(tokenizer: object, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token model inputs beyond ``input_ids`` that the tokenizer derives from each token alone.

    ``input_ids`` and ``attention_mask`` are (B, T); returns ``{name: (B, T) long}`` for every table of
    :data:`TOKEN_TABLES` the tokenizer has (none: ``{}``). A token's id is its table entry (unknown
    tokens: the unknown token's entry); the tokenizer's [CLS] and [SEP] ids get the unknown token's
    entry and padding (attention 0) the pad id, as RoCBertTokenizer builds its inputs.
    """
    tables = {name: getattr(tokenizer, attr, None) for name, attr in TOKEN_TABLES.items()}
    tables = {name: table for name, table in tables.items() if isinstance(table, dict)}
    if not tables:
        return {}
    unk = getattr(tokenizer, "unk_token", None)
    added = {getattr(tokenizer, "cls_token_id", None), getattr(tokenizer, "sep_token_id", None)} - {None}
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    present = torch.unique(input_ids)  # sorted
    ids = present.tolist()
    tokens = tokenizer.convert_ids_to_tokens(ids)
    where = torch.searchsorted(present, input_ids)
    real = attention_mask.bool()
    out: dict[str, torch.Tensor] = {}
    for name, table in tables.items():
        fallback = int(table.get(unk, pad))
        values = [fallback if i in added else int(table.get(tok, fallback)) for i, tok in zip(ids, tokens)]
        derived = torch.tensor(values, dtype=torch.long, device=input_ids.device)[where]
        out[name] = torch.where(real, derived, torch.full_like(derived, pad))
    return out
