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
from gradflow.adapters.generic import discover_adapter
from gradflow.adapters.registry import adapter_for, register_adapter, registered_family, supported_model_types
from gradflow.errors import UnsupportedArchitectureError, UsageError

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


__all__ = [
    "ADAPTER_CHOICES", "LM_HEAD", "SUBLAYER_NAMES", "Adapter", "HeadSpec", "SublayerSpec",
    "UnsupportedArchitectureError", "adapter_for", "block_modules", "count_parameters", "discover_adapter",
    "get_module", "register_adapter", "registered_family", "resolve_adapter", "supported_model_types",
]
