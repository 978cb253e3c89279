"""A remote-code model's non-persistent buffers are rebuilt after loading (transformers 5 materialises them as
uninitialised memory: huggingface/transformers#48892). The tiny Dream's rotary ``inv_freq`` is the regression: left
as the allocator's garbage it made the sparse-objective tests NaN in a full run and pass alone."""

from __future__ import annotations

import torch
from models.remote_code.tiny_remote import build_dream_tiny
from torch import nn

from gradflow.models import load_model
from gradflow.models.buffers import non_persistent_buffers, parameters_on_meta, rebuild_non_persistent_buffers


def test_dream_inv_freq_is_its_analytic_value_whatever_the_allocator_held(tmp_path) -> None:
    path = build_dream_tiny(tmp_path / "dream")
    for _ in range(3):  # freed NaN blocks: what an uninitialised buffer would read
        junk = [torch.full((4096,), float("nan")) for _ in range(64)]
        del junk
        lm = load_model(str(path), trust_remote_code=True)
        dim = lm.model.config.hidden_size // lm.model.config.num_attention_heads
        expected = 1.0 / (lm.model.config.rope_theta ** (torch.arange(0, dim, 2).float() / dim))
        assert non_persistent_buffers(lm.model) == ["model.rotary_emb.inv_freq"]
        assert torch.equal(lm.model.get_buffer("model.rotary_emb.inv_freq"), expected)


class Rotary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.5]), persistent=False)
        self.register_buffer("kept", torch.tensor([3.0]))  # persistent: the checkpoint's, never touched


class Toy(nn.Module):
    def __init__(self, config: object = None) -> None:
        super().__init__()
        self.config = config
        self.rotary = Rotary()


def test_rebuild_overwrites_only_non_persistent_buffers_in_their_dtype() -> None:
    model = Toy().to(torch.float64)
    model.rotary.inv_freq.fill_(float("nan"))
    model.rotary.kept.fill_(7.0)
    assert rebuild_non_persistent_buffers(model) == ["rotary.inv_freq"]
    assert model.rotary.inv_freq.dtype == torch.float64
    assert model.rotary.inv_freq.tolist() == [1.0, 0.5] and model.rotary.kept.tolist() == [7.0]


def test_parameters_on_meta_takes_no_weight_memory_and_restores_register_parameter() -> None:
    original = nn.Module.register_parameter
    with parameters_on_meta():
        module = Rotary()
    assert module.proj.weight.is_meta and module.proj.weight.requires_grad and not module.inv_freq.is_meta
    assert nn.Module.register_parameter is original and not nn.Linear(2, 2).weight.is_meta


class Unbuildable(Toy):
    def __init__(self, config: object = None) -> None:
        super().__init__(config)
        if config is not None:
            raise RuntimeError("needs flash-attn")


def test_a_class_that_cannot_be_rebuilt_is_refused_in_one_sentence() -> None:
    import pytest

    from gradflow.errors import ModelLoadError
    from gradflow.models.loading import _rebuild_buffers

    model = Unbuildable()
    model.config = {"hidden": 4}
    with pytest.raises(ModelLoadError, match=r"'toy': .*\(rotary.inv_freq\).*RuntimeError: needs flash-attn.*#48892"):
        _rebuild_buffers(model, "toy")
