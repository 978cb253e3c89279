"""A tiny native DiffusionGemma for the tests, built offline: the model, a checkpoint directory with a tokenizer, and
hand-made batches of prompt and canvas.

3 tied blocks (sliding, sliding, full attention), hidden 32, a gated MLP beside 4 experts (top 2), vocabulary 64 (the
model alone) or the tiny WordPiece tokenizer's (the directory), canvas length 8.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

from gradflow.inputs.batch import MaskedBatch
from gradflow.roles import Role

VOCAB, PROMPT, CANVAS, BATCH = 64, 6, 8, 2
MASK_ID = 63
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, global_head_dim=16, num_global_key_value_heads=1, num_experts=4,
            top_k_experts=2, moe_intermediate_size=16, sliding_window=64, max_position_embeddings=128,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"])
VISION = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=24, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, head_dim=8, patch_size=4, position_embedding_size=64)


def tiny_diffusion_gemma(seed: int = 0, vocab: int = VOCAB, pad_token_id: int = 0) -> DiffusionGemmaForBlockDiffusion:
    """A random tiny DiffusionGemmaForBlockDiffusion in eval mode (torch seed ``seed``)."""
    config = DiffusionGemmaConfig(text_config=dict(TEXT, vocab_size=vocab, pad_token_id=pad_token_id),
                                  vision_config=dict(VISION), canvas_length=CANVAS, boi_token_id=vocab - 4,
                                  eoi_token_id=vocab - 3, image_token_id=vocab - 2)
    torch.manual_seed(seed)
    return DiffusionGemmaForBlockDiffusion(config).eval()


def build_tiny_diffusion_gemma_dir(path: Path) -> Path:
    """Save a tiny DiffusionGemma with the tests' tiny WordPiece tokenizer (its vocabulary the model's)."""
    from transformers import AutoTokenizer

    from conftest import build_tiny_mlm_dir

    build_tiny_mlm_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    for name in ("model.safetensors", "config.json"):
        (path / name).unlink()
    tiny_diffusion_gemma(vocab=len(tokenizer), pad_token_id=tokenizer.pad_token_id).save_pretrained(path)
    return path


def two_pass_batch(whole_canvas: bool = False, prompt_pad: bool = False, seed: int = 1) -> MaskedBatch:
    """A (BATCH, PROMPT + CANVAS) batch of prompt and canvas over the model's vocabulary.

    Masked diffusion (default): canvas positions 1 and 4 of row 0 and 2 of row 1 masked (``MASK_ID``), the others
    ``context``; ``whole_canvas``: the published recipe, canvas positions 1, 4 (row 0) and 2 (row 1) replaced by
    random tokens (``random``), every other canvas position ``kept``, the loss on all of them. ``prompt_pad``: row 1's
    prompt is two tokens shorter (right-padded: role ``pad``, attention mask 0). Loss weights 1, normaliser the
    canvas length, mean over sequences (the layout :func:`gradflow.inputs.canvas.canvas_batch` makes)."""
    gen = torch.Generator().manual_seed(seed)
    width = PROMPT + CANVAS
    original = torch.randint(3, 60, (BATCH, width), generator=gen)
    roles = torch.full((BATCH, width), int(Role.KEPT if whole_canvas else Role.CONTEXT), dtype=torch.int8)
    roles[:, :PROMPT] = Role.PROMPT
    selected = torch.zeros(BATCH, width, dtype=torch.bool)
    selected[0, PROMPT + 1] = selected[0, PROMPT + 4] = selected[1, PROMPT + 2] = True
    roles[selected] = Role.RANDOM if whole_canvas else Role.MASKED
    ids = original.clone()
    ids[selected] = (torch.randint(3, 60, (int(selected.sum()),), generator=gen) if whole_canvas else MASK_ID)
    attention = torch.ones(BATCH, width, dtype=torch.long)
    if prompt_pad:
        attention[1, PROMPT - 2:PROMPT] = 0
        roles[1, PROMPT - 2:PROMPT] = Role.PAD
        ids[1, PROMPT - 2:PROMPT] = original[1, PROMPT - 2:PROMPT] = 0
    loss_at = roles <= Role.KEPT
    labels = torch.where(loss_at, original, torch.full_like(original, -100))
    return MaskedBatch(ids, original, labels, roles, attention, torch.arange(BATCH),
                       loss_weights=loss_at.float(), loss_norm=torch.full((BATCH,), float(CANVAS)),
                       mean_over_sequences=True, mask_ratio=torch.full((BATCH,), 0.25, dtype=torch.float64),
                       prompt_width=PROMPT)
