"""The adapter registry: ``config.model_type`` -> :class:`Adapter`, with every built-in family registered."""

from __future__ import annotations

from gradflow.adapters.albert import ALBERT
from gradflow.adapters.base import Adapter
from gradflow.adapters.bert import BERT, ELECTRA, ROBERTA
from gradflow.adapters.bertlike import BIG_BIRD, CONVBERT, LUKE, REMBERT, YOSO
from gradflow.adapters.diffusion_gemma import DIFFUSION_GEMMA
from gradflow.adapters.dream import DREAM
from gradflow.adapters.esm import ESM, ESMC
from gradflow.adapters.extra_inputs import NYSTROMFORMER, ROC_BERT, TAPAS
from gradflow.adapters.gte import GTE, JINA_EMBEDDINGS_V3, NOMIC_BERT
from gradflow.adapters.llada import LLADA
from gradflow.adapters.llamalike import EUROBERT, ULTRABERT
from gradflow.adapters.moe import MIXTRAL, OLMOE, QWEN2_MOE, QWEN3_MOE
from gradflow.adapters.multimodal import MODERNVBERT, ULTRAVBERT
from gradflow.adapters.others import DEBERTA_V2, DISTILBERT, MODERNBERT, MPNET
from gradflow.adapters.prenorm import MEGATRON_BERT, ROBERTA_PRELAYERNORM, XLM_ROBERTA_XL
from gradflow.adapters.refusals import refusal
from gradflow.adapters.special_blocks import FNET, LONGFORMER, MOBILEBERT
from gradflow.adapters.unusual_projections import DEBERTA, IBERT, SQUEEZEBERT
from gradflow.adapters.xlm import XLM
from gradflow.adapters.xmod import XMOD
from gradflow.errors import UnsupportedArchitectureError

_REGISTRY: dict[str, Adapter] = {}


def register_adapter(adapter: Adapter, *, replace: bool = False) -> None:
    """Make ``adapter`` the one used for each of its ``model_types``."""
    for model_type in adapter.model_types:
        if model_type in _REGISTRY and not replace:
            raise ValueError(f"model_type {model_type!r} already has adapter {_REGISTRY[model_type].family!r}; "
                             "pass replace=True to override it")
        _REGISTRY[model_type] = adapter


def supported_model_types() -> tuple[str, ...]:
    """Every ``config.model_type`` that has an adapter, sorted."""
    return tuple(sorted(_REGISTRY))


def adapter_for(model_or_config: object) -> Adapter:
    """The adapter of a model or a config, from ``config.model_type``.

    Takes anything with a ``model_type`` (a transformers config) or with a ``config`` that has one
    (a model), so a config can be checked before its model is built.
    """
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in _REGISTRY and refusal(model_type) is not None:
        raise UnsupportedArchitectureError(
            f"gradflow does not support model_type {model_type!r}: {refusal(model_type)} "
            "(see docs/mlm-coverage.md)."
        )
    if model_type not in _REGISTRY:
        raise UnsupportedArchitectureError(
            f"gradflow has no adapter for model_type {model_type!r}. Supported: "
            f"{', '.join(supported_model_types())}. To add one, describe where its embeddings, "
            "blocks and sublayers are with gradflow.adapters.Adapter and call "
            "gradflow.adapters.register_adapter() (see docs/reference/architectures.md, 'Adding an architecture')."
        )
    adapter = _REGISTRY[model_type]
    reason = adapter.refuse(config) if adapter.refuse is not None else None
    if reason is not None:
        raise UnsupportedArchitectureError(f"gradflow does not support this {model_type!r} model: {reason}.")
    return adapter


def registered_family(model_type: str | None) -> str | None:
    """The family of the adapter registered for ``model_type``, or None."""
    adapter = _REGISTRY.get(model_type) if model_type is not None else None
    return adapter.family if adapter is not None else None


for _adapter in (BERT, ROBERTA, ELECTRA, DISTILBERT, ALBERT, DEBERTA_V2, MODERNBERT, ESM, MPNET,
                 ROBERTA_PRELAYERNORM, MEGATRON_BERT, XLM_ROBERTA_XL, REMBERT, YOSO, BIG_BIRD, LUKE, CONVBERT,
                 GTE, NOMIC_BERT, JINA_EMBEDDINGS_V3, ESMC, EUROBERT, ULTRABERT,
                 MOBILEBERT, LONGFORMER, FNET, XLM, XMOD, DEBERTA, SQUEEZEBERT, IBERT,
                 TAPAS, ROC_BERT, NYSTROMFORMER, MODERNVBERT, ULTRAVBERT,
                 LLADA, DREAM,  # masked diffusion LMs (remote code)
                 OLMOE, MIXTRAL, QWEN3_MOE, QWEN2_MOE,  # mixtures of experts (causal LMs recorded as they are)
                 DIFFUSION_GEMMA):  # block diffusion: two passes through tied blocks
    register_adapter(_adapter)
