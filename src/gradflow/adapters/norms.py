"""Norm modules whose gain and bias the recorder can split by role exactly: LayerNorm and RMSNorm-like.

A norm is *affine-diagonal* when ``y = xhat(x) * weight + bias`` elementwise, with ``xhat`` not
depending on the parameters (``nn.LayerNorm``, ``nn.RMSNorm``, the RMSNorm classes of transformers
models). Then the gain's per-position gradient contribution is ``g * xhat`` and the bias's is
``g``, so the per-role sums add up to autograd's gradient exactly. ``xhat`` is the module's own
forward with ``weight = 1`` and ``bias = 0`` (:func:`unit_affine`), so no formula is assumed.

A module other than ``nn.LayerNorm`` counts as norm-like (:func:`norm_like`) only if it is a leaf
whose parameters are a 1-D ``weight`` (and a ``bias`` of the same shape) and a random probe confirms
the affine-diagonal form; a gain applied as ``(1 + weight)`` fails the probe and is not split.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _forward_with(module: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``module.forward(x)`` with some parameters replaced, without running (or touching) its hooks."""
    clone = object.__new__(type(module))
    clone.__dict__.update(module.__dict__)
    clone.__dict__["_parameters"] = {**module._parameters, **params}
    return clone.forward(x)


def unit_affine(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The module's output on ``x`` with ``weight = 1`` and ``bias = 0``: ``xhat``, in the module's dtype."""
    params = {"weight": torch.ones_like(module.weight)}
    if getattr(module, "bias", None) is not None:
        params["bias"] = torch.zeros_like(module.bias)
    with torch.no_grad():
        return _forward_with(module, params, x)


def _shaped_like_norm(module: nn.Module) -> bool:
    """A leaf whose parameters are a 1-D ``weight`` and optionally a ``bias`` of its shape."""
    if next(module.children(), None) is not None:
        return False
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if weight is None or weight.dim() != 1 or set(params) - {"weight", "bias"}:
        return False
    return "bias" not in params or params["bias"].shape == weight.shape


def _affine_diagonal(module: nn.Module) -> bool:
    """A random probe: ``forward`` with random (weight, bias) equals ``unit_affine * weight + bias``."""
    weight = module.weight
    gen = torch.Generator(device="cpu").manual_seed(0)
    d = weight.numel()
    x, w, b = (torch.randn(shape, generator=gen).to(weight.device, weight.dtype) for shape in ((2, 3, d), (d,), (d,)))
    params = {"weight": w}
    has_bias = getattr(module, "bias", None) is not None
    if has_bias:
        params["bias"] = b
    try:
        with torch.no_grad():
            y = _forward_with(module, params, x).float()
            expected = unit_affine(module, x).float() * w.float() + (b.float() if has_bias else 0)
    except Exception:  # noqa: BLE001 - a module that cannot run on (B, T, D) alone is not a norm we can split
        return False
    tol = 1e-4 if weight.dtype == torch.float32 else 2e-2
    return y.shape == expected.shape and bool(torch.allclose(y, expected, rtol=tol, atol=tol))


def norm_like(module: nn.Module, width: int | None = None) -> bool:
    """Whether the recorder can split this norm's parameters by role exactly.

    ``nn.LayerNorm`` with a gain always; another module if :func:`_shaped_like_norm` and the probe
    confirms ``y = xhat * weight + bias``. ``width``: also require a gain of that size.
    """
    if isinstance(module, nn.LayerNorm):
        ok = module.weight is not None
    elif _shaped_like_norm(module):
        if module not in _CHECKED:
            _CHECKED[module] = _affine_diagonal(module)
        ok = _CHECKED[module]
    else:
        return False
    return ok and (width is None or module.weight.numel() == width)


def splittable(module: nn.Module) -> bool:
    """A module whose weight gradient the recorder splits by role: Linear, LayerNorm, RMSNorm-like."""
    return isinstance(module, (nn.Linear, nn.LayerNorm)) or norm_like(module)


__all__ = ["norm_like", "splittable", "unit_affine"]
