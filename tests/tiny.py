"""Tiny random models of every supported family, built from configs (no downloads)."""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForMaskedLM

from gradflow.inputs.masking import MaskedBatch
from gradflow.roles import Role

VOCAB = 64
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
              intermediate_size=48, max_position_embeddings=64)

FAMILY_CONFIGS: dict[str, dict] = {
    "bert": {},
    "roberta": dict(pad_token_id=1),
    "xlm-roberta": dict(pad_token_id=1),
    "camembert": dict(pad_token_id=1),
    "electra": dict(embedding_size=24),
    "ernie": {},
    "roformer": dict(embedding_size=32),
    "data2vec-text": dict(pad_token_id=1),
    "distilbert": dict(dim=32, n_layers=3, n_heads=2, hidden_dim=48),
    "albert": dict(embedding_size=16, num_hidden_groups=1, inner_group_num=1),
    "deberta-v2": dict(relative_attention=True, pos_att_type=["p2c", "c2p"], share_att_key=True,
                       position_buckets=8, max_relative_positions=16, position_biased_input=False,
                       norm_rel_ebd="layer_norm"),
    "modernbert": dict(pad_token_id=0, bos_token_id=2, eos_token_id=3, cls_token_id=2, sep_token_id=3,
                       mask_token_id=4, global_attn_every_n_layers=2, local_attention=8),
    "esm": dict(pad_token_id=1, mask_token_id=4, token_dropout=False, position_embedding_type="rotary"),
    "mpnet": dict(pad_token_id=1),
    "roberta-prelayernorm": dict(pad_token_id=1),
    "megatron-bert": {},
    "xlm-roberta-xl": dict(pad_token_id=1),
    "rembert": dict(input_embedding_size=16, output_embedding_size=24),
    "yoso": dict(pad_token_id=1),
    "big_bird": dict(attention_type="original_full"),  # block_sparse: tests/adapters/test_mlm_coverage.py
    "luke": dict(pad_token_id=1, entity_vocab_size=10, entity_emb_size=16),
    "convbert": dict(embedding_size=24),
    "gte": {},
    "nomic_bert": dict(head_dim=16),
    "jina_embeddings_v3": {},
    "esmc": dict(head_dim=16, num_key_value_heads=2),
    "eurobert": dict(pad_token_id=0, bos_token_id=2, eos_token_id=3, mask_token_id=4, head_dim=16,
                     num_key_value_heads=1),  # grouped-query attention: 2 query heads share 1 key/value head
    # radius-4 windows in blocks 0 and 2: the last block's window is narrower than the batch (row 0's
    # final special token is outside every loss position's window; tests/adapters/test_mlm_coverage.py)
    "ultrabert": dict(pad_token_id=0, bos_token_id=2, eos_token_id=3, head_dim=16, num_key_value_heads=1,
                      sliding_window=4, prediction_head_size=24,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # no block module: parallel lists attentions/layer_norm1/ffns/layer_norm2 (padding id 0 as in tiny_batch)
    "xlm": dict(pad_token_id=0),
    "flaubert": dict(pad_token_id=0),
    # output.LayerNorm runs twice per block; no lang_ids are passed, so the default language is used
    "xmod": dict(pad_token_id=1, default_language="en_XX"),
    # the published block layout (bottlenecks, 3 stacked FFNs + the block's own, NoNorm) with the bottleneck as
    # wide as the hidden state, so the generic adapter (which splits norms of the hidden width only) agrees;
    # tests/adapters/test_families_special_blocks.py also runs the narrow bottleneck of the real checkpoints
    "mobilebert": dict(embedding_size=16, intra_bottleneck_size=32, true_hidden_size=32),
    "longformer": dict(pad_token_id=1, attention_window=[8, 8, 8]),  # tiny_batch's 12 positions padded to 16
    "fnet": {},
    # in_proj rows interleaved per head; c2p and p2c relative-position terms (pos_proj, pos_q_proj: role relpos)
    "deberta": dict(relative_attention=True, pos_att_type=["c2p", "p2c"], max_relative_positions=16),
    # (B, C, T) blocks of pointwise Conv1d: groups 4 in q/k/v, the FFN input and output (post_attention: 1)
    "squeezebert": dict(embedding_size=32, q_groups=4, k_groups=4, v_groups=4, intermediate_groups=4,
                        output_groups=4),
    "ibert": dict(pad_token_id=1, quant_mode=False),  # QuantLinear/IntLayerNorm computing float Linear/LayerNorm
    "tapas": {},  # text only: the 7 token-type channels 0, as TapasTokenizer sets them for the text segment
    "roc_bert": dict(shape_vocab_size=16, pronunciation_vocab_size=16, shape_embed_dim=8, pronunciation_embed_dim=8),
    # exact attention (as many landmarks as segment_means_seq_len, the published setting) + a width-3 value conv
    "nystromformer": dict(segment_means_seq_len=64, num_landmarks=64, conv_kernel_size=3),
}


def _sub_config(model_type: str, **values) -> object:
    config = AutoConfig.for_model(model_type)
    for key, value in values.items():
        setattr(config, key, value)
    if isinstance(getattr(config, "layer_types", None), list):  # derived for the default depth: cut to the tiny one
        config.layer_types = config.layer_types[:config.num_hidden_layers]
    return config


# vision-language encoders recorded on text: their text_config is the tiny text family's, a 1-layer SigLIP tower
_VISION = _sub_config("siglip_vision_model", hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, image_size=16, patch_size=8)
for _family, _text in (("modernvbert", "modernbert"), ("ultravbert", "ultrabert")):
    FAMILY_CONFIGS[_family] = dict(text_config=_sub_config(_text, **COMMON, **FAMILY_CONFIGS[_text]),
                                   vision_config=_VISION)
FAMILIES = tuple(FAMILY_CONFIGS)
PRE_LN = {"modernbert", "esm", "roberta-prelayernorm", "megatron-bert", "xlm-roberta-xl", "esmc", "eurobert",
          "ultrabert", "modernvbert", "ultravbert"}


def tiny_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random-init ForMaskedLM of ``family`` with 3 blocks, hidden 32, in eval mode, float32."""
    config = AutoConfig.for_model(family)
    for key, value in {**COMMON, **FAMILY_CONFIGS[family], **overrides}.items():
        setattr(config, key, copy.deepcopy(value))  # sub-configs: a fresh one per model
    torch.manual_seed(seed)
    return AutoModelForMaskedLM.from_config(config).eval()


def tiny_batch(seed: int = 0, b: int = 3, t: int = 12) -> MaskedBatch:
    """A batch with every role: specials at both ends, padding in the last row, few loss positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (b, t), generator=gen)
    roles = torch.full((b, t), int(Role.CONTEXT), dtype=torch.int8)
    roles[:, 0] = Role.SPECIAL
    roles[:, -1] = Role.SPECIAL
    roles[:, 3] = Role.MASKED
    roles[0, 6] = Role.RANDOM
    roles[1, 5] = Role.KEPT
    roles[1, 8] = Role.MASKED
    attention = torch.ones(b, t, dtype=torch.long)
    attention[-1, -4:] = 0
    roles[-1, -4:] = Role.PAD
    roles[-1, -5] = Role.SPECIAL
    original = ids.clone()
    original[:, 0] = 2
    original[roles == Role.SPECIAL] = 3
    original[:, 0] = 2
    original[roles == Role.PAD] = 0
    inputs = original.clone()
    inputs[roles == Role.MASKED] = 4
    inputs[roles == Role.RANDOM] = 7
    labels = torch.where(roles <= Role.KEPT, original, torch.full_like(original, -100))
    return MaskedBatch(inputs, original, labels, roles, attention, torch.arange(b))


# mixtures of experts (causal LMs of transformers 5.x, recorded as they are): 4 experts, 2 per position, 2 blocks
MOE_COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=64, pad_token_id=0, num_experts_per_tok=2)
MOE_CONFIGS: dict[str, dict] = {
    "olmoe": dict(num_experts=4, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4),
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=24, norm_topk_prob=True),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=24, shared_expert_intermediate_size=40),
}
MOE_FAMILIES = tuple(MOE_CONFIGS)
EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")


def tiny_moe_model(family: str, seed: int = 0, experts_implementation: str = "eager",
                   dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A random-init ForCausalLM of an MoE ``family`` (2 blocks, hidden 32, 4 experts, top-2), in eval mode, whose
    experts run ``experts_implementation`` (transformers' eager loop, ``batched_mm`` or ``grouped_mm``)."""
    from transformers import AutoModelForCausalLM

    config = AutoConfig.for_model(family)
    for key, value in {**MOE_COMMON, **MOE_CONFIGS[family]}.items():
        setattr(config, key, value)
    config._experts_implementation = experts_implementation
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # routers and gains away from their zero/one initialisation
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("gate.weight"):
                param.add_(0.1 * torch.randn_like(param))
    return model.to(dtype)


class ListExpert(torch.nn.Module):
    """One expert of :class:`ListMoe`: w2(silu(w1 x) * w3 x), from a fused slab pair."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        inner = down.shape[1]
        self.w1 = torch.nn.Linear(gate_up.shape[1], inner, bias=False)
        self.w3 = torch.nn.Linear(gate_up.shape[1], inner, bias=False)
        self.w2 = torch.nn.Linear(inner, down.shape[0], bias=True)
        with torch.no_grad():
            self.w1.weight.copy_(gate_up[:inner])
            self.w3.weight.copy_(gate_up[inner:])
            self.w2.weight.copy_(down)
            self.w2.bias.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class ListMoe(torch.nn.Module):
    """Mixtral's pre-5.x layout: a Linear router, a ModuleList of experts each called on the rows routed to it."""

    def __init__(self, fused: torch.nn.Module, k: int = 2):
        super().__init__()
        experts, hidden = fused.experts.gate_up_proj.shape[0], fused.experts.gate_up_proj.shape[2]
        self.k = k
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        with torch.no_grad():
            self.gate.weight.copy_(fused.gate.weight)
        self.experts = torch.nn.ModuleList(
            ListExpert(fused.experts.gate_up_proj[e].detach(), fused.experts.down_proj[e].detach())
            for e in range(experts))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        b, t, h = hidden.shape
        x = hidden.view(-1, h)
        weights, index = torch.topk(torch.nn.functional.softmax(self.gate(x), dim=-1), self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(index == e)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * weights[token, slot, None])
        return out.view(b, t, h)


def list_moe_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The tiny OLMoE with each block's MoE replaced by :class:`ListMoe` holding the same weights (a bias on w2)."""
    model = tiny_moe_model("olmoe", dtype=torch.float64)
    for layer in model.model.layers:
        layer.mlp = ListMoe(layer.mlp).double()
    return model.to(dtype)
