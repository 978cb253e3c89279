"""Tiny remote-code checkpoints of LLaDA and Dream, built offline into a directory (no hub, no network).

Each directory holds what the hub checkpoint holds, at tiny size: the model's own ``configuration_*.py`` and
``modeling_*.py`` (copied from ``llada_tiny/`` or ``dream_tiny/`` beside this file: imitations of the real files'
module names and call patterns), ``config.json`` whose ``auto_map`` names them for ``AutoConfig`` and ``AutoModel``
only (no ``AutoModelForMaskedLM``), the weights as ``model.safetensors`` and a byte-level BPE tokenizer trained on
the shared sample lines:

- LLaDA: special tokens ``<|endoftext|>``, ``<|startoftext|>`` and the mask ``<|mdm_mask|>`` appended last (as
  126336 sits near the end of LLaDA's vocabulary); the tokenizer declares no mask token (as some LLaDA tokenizer
  configs), ``config.json`` has ``mask_token_id``;
- Dream: ``<|endoftext|>`` (pad, eos), ``<|beginoftext|>`` (bos) and ``<|mask|>``, declared as the mask token;
- a model type gradflow has no adapter for (:func:`build_unknown_type_tiny`): Dream's code under another ``model_type``;
- a mixture-of-experts masked diffusion LM gradflow has no adapter for (:func:`build_moe_tiny`, ``moe_tiny/``: LLaDA-MoE's
  shape, its experts fused, a ModuleList, or routed inside their own forward).

Building one runs the checkpoint's code (``trust_remote_code=True``): it is how the weights are made.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from conftest import SAMPLE_LINES

HERE = Path(__file__).resolve().parent
AUTO_MAPS = {
    "llada": {"AutoConfig": "configuration_llada.LLaDAConfig", "AutoModel": "modeling_llada.LLaDAModelLM"},
    "dream": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    "moe": {"AutoConfig": "configuration_tinymoe.TinyMoeConfig", "AutoModel": "modeling_tinymoe.TinyMoeModel"},
}


def _tokenizer(specials: list[str], mask: str, declare_mask: bool, **roles: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(SAMPLE_LINES * 4, trainer=trainer)
    bpe.add_special_tokens([mask])  # the mask token last, as in LLaDA's and Dream's vocabularies
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, model_max_length=64, **roles)
    if declare_mask:
        tokenizer.mask_token = mask
    return tokenizer


def _save(path: Path, family: str, config: dict, tokenizer, seed: int) -> Path:
    from transformers import AutoConfig, AutoModel

    path.mkdir(parents=True, exist_ok=True)
    for source in (HERE / f"{family}_tiny").glob("*.py"):
        shutil.copy(source, path / source.name)
    config = {**config, "auto_map": AUTO_MAPS[family]}
    (path / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    loaded = AutoConfig.from_pretrained(path, trust_remote_code=True)
    torch.manual_seed(seed)
    model = AutoModel.from_config(loaded, trust_remote_code=True)
    with torch.no_grad():  # gains away from 1, so a wrong norm split cannot pass by symmetry
        for name, param in model.named_parameters():
            if "norm" in name or "ln_f" in name:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path)  # safetensors
    tokenizer.save_pretrained(path)
    saved = json.loads((path / "config.json").read_text(encoding="utf-8"))
    saved["auto_map"] = AUTO_MAPS[family]  # exactly AutoConfig and AutoModel, as the hub checkpoints
    (path / "config.json").write_text(json.dumps(saved, indent=2), encoding="utf-8")
    return path


def build_llada_tiny(path: Path, seed: int = 0) -> Path:
    """A tiny LLaDA checkpoint (model_type ``llada``): 2 blocks, d_model 32, 2 heads."""
    tokenizer = _tokenizer(["<|endoftext|>", "<|startoftext|>"], "<|mdm_mask|>", declare_mask=False,
                           bos_token="<|startoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    config = {"model_type": "llada", "architectures": ["LLaDAModelLM"], "d_model": 32, "n_heads": 2, "n_kv_heads": 2,
              "n_layers": 2, "mlp_hidden_size": 48, "vocab_size": len(tokenizer), "embedding_size": len(tokenizer),
              "max_sequence_length": 64, "weight_tying": False, "include_bias": False, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "init_std": 0.02, "mask_token_id": tokenizer.convert_tokens_to_ids("<|mdm_mask|>"),
              "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
              "bos_token_id": tokenizer.bos_token_id}
    return _save(path, "llada", config, tokenizer, seed)


def build_dream_tiny(path: Path, seed: int = 0) -> Path:
    """A tiny Dream checkpoint (model_type ``Dream``): 2 blocks, hidden 32, 2 query heads sharing 1 key/value head."""
    tokenizer = _tokenizer(["<|endoftext|>", "<|beginoftext|>"], "<|mask|>", declare_mask=True,
                           bos_token="<|beginoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    config = {"model_type": "Dream", "architectures": ["DreamModel"], "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_act": "silu",
              "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "vocab_size": len(tokenizer), "initializer_range": 0.02, "mask_token_id": tokenizer.mask_token_id,
              "pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
              "eos_token_id": tokenizer.eos_token_id}
    return _save(path, "dream", config, tokenizer, seed)


def build_unknown_type_tiny(path: Path, model_type: str = "tinydiff", seed: int = 0) -> Path:
    """A Dream-shaped remote-code checkpoint whose ``model_type`` has no gradflow adapter (its config class and its
    ``config.json`` both say ``model_type``): recorded with ``--adapter auto`` only; 64 positions (the tokenizer's
    ``model_max_length`` and the config's ``max_position_embeddings``), fewer than ``--max-length``'s default 128."""
    base = build_dream_tiny(path.with_name(f"{path.name}-dream"), seed)
    shutil.copytree(base, path)
    code = path / "configuration_dream.py"
    text = code.read_text(encoding="utf-8")
    assert 'model_type = "Dream"' in text
    code.write_text(text.replace('model_type = "Dream"', f'model_type = "{model_type}"'), encoding="utf-8")
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    (path / "config.json").write_text(json.dumps({**config, "model_type": model_type}, indent=2), encoding="utf-8")
    return path


def build_moe_tiny(path: Path, experts_layout: str = "fused", seed: int = 0) -> Path:
    """A tiny remote-code MoE checkpoint (model_type ``tinymoe``, no gradflow adapter: ``--adapter auto``): 2 blocks,
    hidden 32, 4 experts, top-2, bidirectional attention; Dream's tokenizer (``<|mask|>`` declared)."""
    tokenizer = _tokenizer(["<|endoftext|>", "<|beginoftext|>"], "<|mask|>", declare_mask=True,
                           bos_token="<|beginoftext|>", eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    config = {"model_type": "tinymoe", "architectures": ["TinyMoeModel"], "hidden_size": 32, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
              "experts_layout": experts_layout, "max_position_embeddings": 64, "vocab_size": len(tokenizer),
              "mask_token_id": tokenizer.mask_token_id, "pad_token_id": tokenizer.pad_token_id,
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}
    return _save(path, "moe", config, tokenizer, seed)
