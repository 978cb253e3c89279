"""Architecture adapters and their registry.

To support a new family, describe it with an :class:`Adapter` and register it::

    from gradflow.adapters import Adapter, SublayerSpec, register_adapter
    register_adapter(Adapter(family="mybert", model_types=("mybert",), embeddings="embeddings",
                             blocks="encoder.layer", mid=("attention", "output"),
                             sublayers={"attn.q": SublayerSpec("attention.self.query"), ...}))

Fields left out take the BERT layout's defaults (``cls`` head, no final norm, ...); see
:class:`Adapter`.
"""

from __future__ import annotations

from gradflow.adapters.albert import ALBERT
from gradflow.adapters.base import (
    LM_HEAD,
    SUBLAYER_NAMES,
    Adapter,
    HeadSpec,
    SublayerSpec,
    block_modules,
    count_parameters,
    get_module,
)
from gradflow.adapters.bert import BERT, ELECTRA, ROBERTA
from gradflow.adapters.bertlike import BIG_BIRD, CONVBERT, LUKE, REMBERT, YOSO
from gradflow.adapters.coverage import refusal
from gradflow.adapters.esm import ESM, ESMC
from gradflow.adapters.generic import discover_adapter
from gradflow.adapters.gte import GTE, JINA_EMBEDDINGS_V3, NOMIC_BERT
from gradflow.adapters.llamalike import EUROBERT, ULTRABERT
from gradflow.adapters.others import DEBERTA_V2, DISTILBERT, MODERNBERT, MPNET
from gradflow.adapters.prenorm import MEGATRON_BERT, ROBERTA_PRELAYERNORM, XLM_ROBERTA_XL
from gradflow.errors import UnsupportedArchitectureError, UsageError

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
            "gradflow.adapters.register_adapter() (see the README section 'Adding an architecture')."
        )
    return _REGISTRY[model_type]


def registered_family(model_type: str | None) -> str | None:
    """The family of the adapter registered for ``model_type``, or None."""
    adapter = _REGISTRY.get(model_type) if model_type is not None else None
    return adapter.family if adapter is not None else None


ADAPTER_CHOICES = ("registered", "auto")
"""``registered``: the adapter registered for ``config.model_type`` (refused without one); ``auto``: the
generic adapter, discovered from the module tree (opt-in; see :mod:`gradflow.adapters.generic`)."""


def resolve_adapter(model: object, adapter: "Adapter | str | None" = None) -> Adapter:
    """An :class:`Adapter` as is; None or ``"registered"``: :func:`adapter_for`; ``"auto"``: discovered."""
    if isinstance(adapter, Adapter):
        return adapter
    if adapter is None or adapter == "registered":
        return adapter_for(model)
    if adapter == "auto":
        return discover_adapter(model)
    raise UsageError(f"adapter must be an Adapter or one of {', '.join(ADAPTER_CHOICES)}, got {adapter!r}")


for _adapter in (BERT, ROBERTA, ELECTRA, DISTILBERT, ALBERT, DEBERTA_V2, MODERNBERT, ESM, MPNET,
                 ROBERTA_PRELAYERNORM, MEGATRON_BERT, XLM_ROBERTA_XL, REMBERT, YOSO, BIG_BIRD, LUKE, CONVBERT,
                 GTE, NOMIC_BERT, JINA_EMBEDDINGS_V3, ESMC, EUROBERT, ULTRABERT):
    register_adapter(_adapter)

__all__ = [
    "ADAPTER_CHOICES", "LM_HEAD", "SUBLAYER_NAMES", "Adapter", "HeadSpec", "SublayerSpec",
    "UnsupportedArchitectureError", "adapter_for", "block_modules", "count_parameters", "discover_adapter",
    "get_module", "register_adapter", "registered_family", "resolve_adapter", "supported_model_types",
]
