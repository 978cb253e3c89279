"""Non-persistent buffers of remote-code models, rebuilt after loading.

transformers 5 builds a model on the meta device and then materialises every non-persistent buffer (a rotary
``inv_freq``, say) as uninitialised memory; its own model classes restore them in ``_init_weights``, remote code
written for transformers 4 does not (huggingface/transformers#48892). Such a model then computes with whatever
the allocator held: NaN or, worse, finite and wrong outputs. :func:`rebuild_non_persistent_buffers` recomputes
each of them the way the module's ``__init__`` does, on a copy of the model whose parameters live on the meta
device (no weight memory).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def parameters_on_meta() -> contextlib.AbstractContextManager:
    """Inside the block every parameter a module registers lives on the meta device; buffers are computed as usual
    (accelerate's ``init_empty_weights(include_buffers=False)``, which restores ``register_parameter`` on exit)."""
    from accelerate import init_empty_weights

    return init_empty_weights(include_buffers=False)


def non_persistent_buffers(model: nn.Module) -> list[str]:
    """The qualified names of ``model``'s non-persistent buffers (absent from every checkpoint)."""
    return [f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
            for name in sorted(module._non_persistent_buffers_set) if module._buffers.get(name) is not None]


def rebuild_non_persistent_buffers(model: nn.Module) -> list[str]:
    """Overwrite each non-persistent buffer of ``model`` (a ``PreTrainedModel``) with the value its module's
    ``__init__`` computes from ``model.config``, in the buffer's own dtype and device; returns the names rebuilt.
    Raises whatever building the class from its config raises (the caller words it)."""
    names = non_persistent_buffers(model)
    if not names:
        return []
    with parameters_on_meta(), torch.device("cpu"):
        reference = type(model)(model.config)
    fresh = dict(reference.named_buffers())
    rebuilt = []
    with torch.no_grad():
        for name in names:
            target, value = model.get_buffer(name), fresh.get(name)
            if value is None or value.shape != target.shape or value.is_meta:
                continue
            target.copy_(value.to(dtype=target.dtype))
            rebuilt.append(name)
    return rebuilt


__all__ = ["non_persistent_buffers", "parameters_on_meta", "rebuild_non_persistent_buffers"]
