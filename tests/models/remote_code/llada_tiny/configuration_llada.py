"""A tiny imitation of LLaDA's remote-code config (GSAI-ML/LLaDA-8B-Base, configuration_llada.py), for gradflow's tests.

The real ``LLaDAConfig`` (model_type ``llada``) copies an OLMo-style ``ModelConfig`` dataclass into a
``PretrainedConfig``: ``d_model``, ``n_heads``, ``n_kv_heads``, ``n_layers``, ``mlp_hidden_size``, ``vocab_size``,
``embedding_size``, ``rms_norm_eps``, ``rope_theta``, ``weight_tying``, ``include_bias``, ``mask_token_id`` ...,
with the standard names (``hidden_size``, ``num_attention_heads``, ``num_hidden_layers``) as read-only properties.
This keeps those names and defaults the tiny sizes; it is test code, not LLaDA's.

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


mark_ran("configuration_llada imported")


class LLaDAConfig(PretrainedConfig):
    model_type = "llada"
    keys_to_ignore_at_inference: ClassVar[list[str]] = ["past_key_values"]

    def __init__(self, d_model: int = 32, n_heads: int = 2, n_kv_heads: int | None = None, n_layers: int = 2,
                 mlp_hidden_size: int = 48, vocab_size: int = 300, embedding_size: int | None = None,
                 rms_norm_eps: float = 1e-5, rope: bool = True, rope_theta: float = 500000.0,
                 max_sequence_length: int = 64, weight_tying: bool = False, include_bias: bool = False,
                 include_qkv_bias: bool = False, block_type: str = "llama", activation_type: str = "silu",
                 layer_norm_type: str = "rms", scale_logits: bool = False, input_emb_norm: bool = False,
                 init_std: float = 0.02, mask_token_id: int | None = None, use_cache: bool = False, **kwargs):
        mark_ran("LLaDAConfig.__init__")
        kwargs.setdefault("architectures", ["LLaDAModelLM"])
        super().__init__(**kwargs)
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.n_layers = n_layers
        self.mlp_hidden_size = mlp_hidden_size
        self.vocab_size = vocab_size
        self.embedding_size = embedding_size
        self.rms_norm_eps = rms_norm_eps
        self.rope = rope
        self.rope_theta = rope_theta
        self.max_sequence_length = max_sequence_length
        self.weight_tying = weight_tying
        self.include_bias = include_bias
        self.include_qkv_bias = include_qkv_bias
        self.block_type = block_type
        self.activation_type = activation_type
        self.layer_norm_type = layer_norm_type
        self.scale_logits = scale_logits
        self.input_emb_norm = input_emb_norm
        self.init_std = init_std
        self.mask_token_id = mask_token_id
        self.use_cache = use_cache

    @property
    def num_attention_heads(self) -> int:
        return self.n_heads

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layers

    @property
    def hidden_size(self) -> int:
        return self.d_model

    @property
    def effective_n_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads
