"""X-MOD: RoBERTa's post-LN block with a language adapter after the FFN, and one LayerNorm called twice.

With the default config (``adapter_reuse_layer_norm=True``, ``adapter_layer_norm=False``,
``pre_norm=False``) ``XmodOutput`` runs ``output.dense``, adds the residual, normalises with
``output.LayerNorm`` (first call), applies the language's bottleneck adapter
(``output.adapter_modules.<lang>.dense1``/``dense2``) with a residual, and ``XmodLayer`` normalises
the result with ``output.LayerNorm`` again (second call): the block's output. Each call gets its
own name and its own role split (:class:`~gradflow.adapters.SublayerSpec` ``call``):
``adapter.norm`` is the first call (the norm before the adapter, the place of
``adapter_layer_norm`` in configs that have one) and ``ffn.norm`` the second (the norm that forms
the block's output, as BERT's ``output.LayerNorm`` does). The two names' contributions sum to the
LayerNorm's gradient. Both calls, the adapter Linears and the FFN act on one position after the
attention, so in the last block all of them get exactly zero gradient from context positions.

Language: gradflow passes no ``lang_ids``, so XmodModel uses ``config.default_language`` for every
sequence (``model.set_default_language("en_XX")``, or ``default_language`` in config.json); a
config without one is refused.
"""

from __future__ import annotations

from dataclasses import replace

from gradflow.adapters.base import LM_HEAD, SublayerSpec
from gradflow.adapters.bert import BERT, BERT_SUBLAYERS
from gradflow.adapters.subset_variants import xmod_subset


def xmod_refusal(config: object) -> str | None:
    """Why an X-MOD config cannot be recorded, or None (also for a stand-in without X-MOD's attributes)."""
    if not hasattr(config, "languages"):
        return None  # e.g. the coverage table's config with only a model_type: nothing to judge
    if getattr(config, "default_language", None) is None:
        languages = ", ".join(map(str, getattr(config, "languages", ())))
        return ("X-MOD picks a language adapter per input and gradflow passes no lang_ids, so it needs "
                "config.default_language, which is unset: call model.set_default_language(...) and save the model, "
                f"or set default_language in its config.json (one of: {languages})")
    if str(config.default_language) not in map(str, getattr(config, "languages", ())):
        return (f"its default_language {config.default_language!r} has no language adapter (languages: "
                f"{', '.join(map(str, getattr(config, 'languages', ())))})")
    if getattr(config, "pre_norm", False):
        return ("pre_norm=True applies each LayerNorm before its sublayer and output.LayerNorm before the FFN and "
                "again before the adapter; gradflow's X-MOD adapter describes the post-norm block only")
    if getattr(config, "adapter_layer_norm", False) or not getattr(config, "adapter_reuse_layer_norm", True):
        return ("gradflow's X-MOD adapter describes adapter_reuse_layer_norm=True without adapter_layer_norm (the "
                "default): output.LayerNorm called before the adapter and after it")
    return None


XMOD = replace(
    BERT, family="xmod", model_types=("xmod",), head=LM_HEAD, positions_after_padding=True,
    sublayers={**BERT_SUBLAYERS,
               "ffn.norm": SublayerSpec("output.LayerNorm", call=1),
               "adapter.norm": SublayerSpec("output.LayerNorm", call=0)},
    after_mixing_extra=("adapter.norm",),
    refuse=xmod_refusal,
    subset_block=xmod_subset,
    notes="post-LN (RoBERTa layout) with a language adapter after the FFN; output.LayerNorm runs twice per block: "
          "its first call (before the adapter) is the sublayer adapter.norm, its second (the block's output) ffn.norm, "
          "each with its own role split (their contributions sum to the LayerNorm's gradient); the adapter's Linears "
          "(output.adapter_modules.<lang>.dense1/dense2) are no standard sublayers (gradflow check measures them); "
          "in the last block attn.q, attn.out, attn.norm, ffn.in, ffn.out, adapter.norm, ffn.norm and the adapter "
          "get exactly zero gradient from context positions; no lang_ids are passed: every sequence uses "
          "config.default_language (a config without one is refused)",
)
