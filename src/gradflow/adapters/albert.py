"""ALBERT: one (or a few) shared layer(s) applied at every depth.

Each application is its own depth (``blocks.{i}``); the shared weights' gradient is the sum of
the per-depth contributions. ``expand_blocks`` lists the layer modules in call order, following
``AlbertTransformer``: depth i uses group ``int(i / (num_hidden_layers / num_hidden_groups))``,
and a group applies its ``inner_group_num`` layers in turn.

What surgery means here:

- *dropping* the last ``k`` depths means ``k`` fewer applications (``num_hidden_layers -= k``); the
  weights are unchanged. With several groups the group of each depth depends on
  ``num_hidden_layers``, so only one group (the usual case) or fully unshared groups (one group per
  depth, see :func:`albert_unshare`) can be dropped from;
- *re-initialising* or *freezing* some applications of a shared layer is impossible without
  touching the others: the model must be unshared first (one copy of its group per depth).
"""

from __future__ import annotations

import copy

from torch import nn

from gradflow.adapters.base import Adapter, HeadSpec, SublayerSpec, count_parameters
from gradflow.adapters.subset import albert_subset
from gradflow.errors import SurgeryError


def _group_of(depth: int, config) -> int:
    """Index of the layer group applied at ``depth``."""
    return int(depth / (config.num_hidden_layers / config.num_hidden_groups))


def albert_blocks(base: nn.Module) -> list[nn.Module]:
    """The layer modules in call order (depth-major, then the group's inner layers)."""
    groups = base.encoder.albert_layer_groups
    order: list[nn.Module] = []
    for depth in range(base.config.num_hidden_layers):
        order.extend(groups[_group_of(depth, base.config)].albert_layers)
    return order


def albert_drop(model: nn.Module, k: int) -> tuple[int, str]:
    """Drop the last ``k`` depths: fewer applications, or (unshared) the last groups themselves."""
    config = model.config
    layers, groups = int(config.num_hidden_layers), int(config.num_hidden_groups)
    if groups == 1:
        return 0, f"ALBERT: {k} fewer application(s) of the shared layer; no weights removed"
    if groups == layers:
        group_list = model.base_model.encoder.albert_layer_groups
        removed = count_parameters(group_list[layers - k:])
        del group_list[layers - k:]
        config.num_hidden_groups = layers - k
        return removed, "ALBERT (unshared): last group(s) removed"
    raise SurgeryError(f"ALBERT with {groups} layer groups over {layers} layers: the group of each depth depends "
                       "on num_hidden_layers, so dropping depths would reassign groups. Unshare the model first "
                       "(gradflow.interventions.surgery.unshare_albert) or use a single-group model.")


def albert_unshare(model: nn.Module) -> None:
    """One copy of its layer group per depth (``num_hidden_groups = num_hidden_layers``); same outputs."""
    config = model.config
    encoder = model.base_model.encoder
    groups = encoder.albert_layer_groups
    encoder.albert_layer_groups = nn.ModuleList(copy.deepcopy(groups[_group_of(depth, config)])
                                                for depth in range(config.num_hidden_layers))
    config.num_hidden_groups = config.num_hidden_layers


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
    head=HeadSpec(("predictions",)),
    drop_blocks=albert_drop,
    unshare=albert_unshare,
    subset_block=albert_subset,
)
