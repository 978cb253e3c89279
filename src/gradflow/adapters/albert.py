"""ALBERT: one (or a few) shared layer(s) applied at every depth.

Each application is its own depth (``blocks.{i}``); the shared weights' gradient is the sum of
the per-depth contributions. ``expand_blocks`` lists the layer modules in call order, following
``AlbertTransformer``: depth i uses group ``int(i / (num_hidden_layers / num_hidden_groups))``,
and a group applies its ``inner_group_num`` layers in turn.
"""

from torch import nn

from gradflow.adapters.base import Adapter, SublayerSpec


def albert_blocks(base: nn.Module) -> list[nn.Module]:
    config = base.config
    groups = base.encoder.albert_layer_groups
    per_group = config.num_hidden_layers / config.num_hidden_groups
    order: list[nn.Module] = []
    for depth in range(config.num_hidden_layers):
        group = groups[int(depth / per_group)]
        order.extend(group.albert_layers)
    return order


ALBERT = Adapter(
    family="albert",
    model_types=("albert",),
    embeddings="embeddings",
    blocks="encoder.albert_layer_groups",
    mid=("attention", "output"),
    sublayers={
        "attn.q": SublayerSpec("attention.query"),
        "attn.k": SublayerSpec("attention.key"),
        "attn.v": SublayerSpec("attention.value"),
        "attn.out": SublayerSpec("attention.dense"),
        "attn.norm": SublayerSpec("attention.LayerNorm"),
        "ffn.in": SublayerSpec("ffn"),
        "ffn.out": SublayerSpec("ffn_output"),
        "ffn.norm": SublayerSpec("full_layer_layer_norm"),
    },
    attn_norm="post",
    expand_blocks=albert_blocks,
    notes="shared layer: one depth per application; weights' gradient = sum over depths",
)
