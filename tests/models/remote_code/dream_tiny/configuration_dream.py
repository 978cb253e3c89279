"""A tiny imitation of Dream's remote-code config (Dream-org/Dream-v0-Base-7B, configuration_dream.py), for gradflow's
tests.

The real ``DreamConfig`` (model_type ``Dream``) is Qwen2's config: ``hidden_size``, ``intermediate_size``,
``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``hidden_act``, ``rms_norm_eps``,
``rope_theta``, ``tie_word_embeddings`` and the token ids, ``mask_token_id`` among them. This keeps those names and
defaults the tiny sizes; it is test code, not Dream's.

Every construction appends a line to the file named by ``GRADFLOW_TEST_REMOTE_CODE_LOG`` (when set), so a test
can prove that loading without ``trust_remote_code`` never ran it.
"""

from __future__ import annotations

import os
from typing import ClassVar

from transformers import PretrainedConfig


def mark_ran(what: str) -> None:
    """Note that checkpoint code ran (tests/models/test_loading_messages.py reads the log)."""
    log = os.environ.get("GRADFLOW_TEST_REMOTE_CODE_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as handle:
            handle.write(f"{what}\n")


mark_ran("configuration_dream imported")


class DreamConfig(PretrainedConfig):
    model_type = "Dream"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    def __init__(self, vocab_size: int = 300, hidden_size: int = 32, intermediate_size: int = 48,
                 num_hidden_layers: int = 2, num_attention_heads: int = 2, num_key_value_heads: int = 1,
                 hidden_act: str = "silu", max_position_embeddings: int = 64, initializer_range: float = 0.02,
                 rms_norm_eps: float = 1e-6, use_cache: bool = False, tie_word_embeddings: bool = False,
                 rope_theta: float = 10000.0, attention_dropout: float = 0.0, mask_token_id: int | None = None,
                 pad_token_id: int | None = None, bos_token_id: int | None = None, eos_token_id: int | None = None,
                 **kwargs):
        mark_ran("DreamConfig.__init__")
        kwargs.setdefault("architectures", ["DreamModel"])
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.rope_theta = rope_theta
        self.attention_dropout = attention_dropout
        self.mask_token_id = mask_token_id
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
