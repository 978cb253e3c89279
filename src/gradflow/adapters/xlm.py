"""XLM and FlauBERT: blocks that are no module, gathered per depth from parallel ModuleLists.

``XLMModel`` and ``FlaubertModel`` keep their blocks' parts in four parallel lists (``attentions``,
``layer_norm1``, ``ffns``, ``layer_norm2``) and apply depth i's parts in a loop of their ``forward``.
:func:`parallel_blocks` gathers each depth's parts into a :class:`DepthParts` module (never called;
its children are the model's own modules under their list names), so every consumer of blocks
(recorder, check, surgery, Trainer callback) reads paths such as ``attentions.q_lin`` inside it.
The site layer finds where a depth starts from the adapter's ``block_entry`` (``attentions``: its
first input is the block's input); a block's output is the next block's input, the last one's the
base model's output (after the model's padding mask: padded positions are 0 there, as in its own
``hidden_states``).

Post-LN (the default, and FlauBERT's ``pre_norm=False``): attention, residual, ``layer_norm1``,
FFN, residual, ``layer_norm2``; so, as in BERT, the last block's ``attn.q``, ``attn.out``,
``attn.norm`` and FFN get exactly zero gradient from context positions.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from gradflow.adapters.base import Adapter, HeadSpec, SublayerSpec, count_parameters, get_module
from gradflow.adapters.subset_blocks import xlm_subset

PARTS = ("attentions", "layer_norm1", "ffns", "layer_norm2")
"""The parallel lists of XLMModel and FlaubertModel, in call order within a depth."""


class DepthParts(nn.Module):
    """The modules one depth applies, as children under their list names (a view: it is never called)."""

    def __init__(self, parts: dict[str, nn.Module]):
        super().__init__()
        for name, module in parts.items():
            self.add_module(name, module)


def parallel_blocks(lists: tuple[str, ...]) -> Callable[[nn.Module], list[nn.Module]]:
    """``expand_blocks`` for parallel ModuleLists at ``lists`` (paths in the base model): depth i's entries."""
    def blocks(base: nn.Module) -> list[nn.Module]:
        modules = [get_module(base, path) for path in lists]
        depths = {len(m) for m in modules}
        if len(depths) != 1:
            raise LookupError(f"the parallel block lists {', '.join(lists)} differ in length in {type(base).__name__}")
        return [DepthParts({path: m[i] for path, m in zip(lists, modules)}) for i in range(depths.pop())]

    return blocks


def drop_parallel_blocks(model: nn.Module, k: int) -> tuple[int, str]:
    """Remove the last ``k`` entries of every parallel list and the model's own ``n_layers``."""
    base = model.base_model
    lists = [get_module(base, path) for path in PARTS]
    n = len(lists[0])
    removed = count_parameters(m for lst in lists for m in lst[n - k:])
    for lst in lists:
        del lst[n - k:]
    base.n_layers = n - k  # forward loops over range(self.n_layers)
    return removed, f"the last {k} entries of {', '.join(PARTS)} removed"


def language_refusal(config: object) -> str | None:
    """Why an XLM/FlauBERT config cannot be recorded, or None."""
    if getattr(config, "use_lang_emb", False) and int(getattr(config, "n_langs", 1)) > 1:
        return (f"it adds a language embedding per token (n_langs={config.n_langs}, use_lang_emb=True) from the "
                "langs input, which gradflow's masked batches do not carry; without it the model embeds no language "
                "at all, so a recording would not be of the input the model was trained on")
    if getattr(config, "asm", False):
        return "its head is an adaptive softmax (asm=True), not a module chain from hidden states to logits"
    if getattr(config, "pre_norm", False):
        return ("FlaubertModel's pre_norm=True branch fails in the installed transformers (it indexes the "
                "EncoderDecoderCache: TypeError); supporting it needs an adapter variant with layer_norm1 as "
                "attn.norm before attention, attn_norm='pre' and the mid point at layer_norm2's input")
    return None


XLM = Adapter(
    family="xlm",
    model_types=("xlm", "flaubert"),
    embeddings="embeddings",
    embeddings_at="blocks",
    blocks="attentions",
    expand_blocks=parallel_blocks(PARTS),
    block_entry="attentions",
    subset_call="attentions",
    subset_block=xlm_subset,
    mid=("layer_norm1", "output"),
    sublayers={
        "attn.q": SublayerSpec("attentions.q_lin"),
        "attn.k": SublayerSpec("attentions.k_lin"),
        "attn.v": SublayerSpec("attentions.v_lin"),
        "attn.out": SublayerSpec("attentions.out_lin"),
        "attn.norm": SublayerSpec("layer_norm1"),
        "ffn.in": SublayerSpec("ffns.lin1"),
        "ffn.out": SublayerSpec("ffns.lin2"),
        "ffn.norm": SublayerSpec("layer_norm2"),
    },
    attn_norm="post",
    head=HeadSpec(("pred_layer.proj",)),
    drop_blocks=drop_parallel_blocks,
    refuse=language_refusal,
    notes="post-LN; no block module: depth i is attentions[i], layer_norm1[i], ffns[i], layer_norm2[i] of parallel "
          "ModuleLists (sublayer paths name the list, e.g. attentions.q_lin is attentions.{i}.q_lin); embeddings.out "
          "is the first block's input (token + position embeddings after layer_norm_emb and the padding mask), and "
          "the embeddings module is the token embedding alone (freezing it leaves position_embeddings and "
          "layer_norm_emb trainable); blocks.{i}.out is after the model's padding mask; FlauBERT's layerdrop skips "
          "blocks in training mode only (gradflow records in eval mode); refused: pre_norm=True, asm=True, and "
          "language embeddings with n_langs > 1 (they need the langs input)",
)
