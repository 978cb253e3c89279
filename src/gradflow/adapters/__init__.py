"""Architecture adapters and their registry.

To support a new family, describe it with an :class:`Adapter` and register it::

    from gradflow.adapters import Adapter, SublayerSpec, register_adapter
    register_adapter(Adapter(family="mybert", model_types=("mybert",), embeddings="embeddings",
                             blocks="encoder.layer", mid=("attention", "output"),
                             sublayers={"attn.q": SublayerSpec("attention.self.query"), ...}))
"""

from __future__ import annotations

from torch import nn

from gradflow.adapters.albert import ALBERT
from gradflow.adapters.base import SUBLAYER_NAMES, Adapter, SublayerSpec, block_modules, get_module
from gradflow.adapters.bert import BERT
from gradflow.adapters.others import DEBERTA_V2, DISTILBERT, ESM, MODERNBERT, MPNET
from gradflow.adapters.prenorm import MEGATRON_BERT, ROBERTA_PRELAYERNORM, XLM_ROBERTA_XL
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


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter of a model, from ``model.config.model_type``."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in _REGISTRY:
        raise UnsupportedArchitectureError(
            f"gradflow has no adapter for model_type {model_type!r}. Supported: "
            f"{', '.join(supported_model_types())}. To add one, describe where its embeddings, "
            "blocks and sublayers are with gradflow.adapters.Adapter and call "
            "gradflow.adapters.register_adapter() (see the README section 'Adding an architecture')."
        )
    return _REGISTRY[model_type]


for _adapter in (BERT, DISTILBERT, ALBERT, DEBERTA_V2, MODERNBERT, ESM, MPNET, ROBERTA_PRELAYERNORM,
                 MEGATRON_BERT, XLM_ROBERTA_XL):
    register_adapter(_adapter)

__all__ = [
    "SUBLAYER_NAMES", "Adapter", "SublayerSpec", "UnsupportedArchitectureError", "adapter_for",
    "block_modules", "get_module", "register_adapter", "supported_model_types",
]
