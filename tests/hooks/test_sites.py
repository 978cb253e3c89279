"""The site layer: names and their parsing, depths of shared blocks, mid points, hidden states in
module outputs, replacement, and hooks that are always removed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput

from gradflow.adapters import adapter_for, block_modules, get_module
from gradflow.errors import AttributionError, RecorderError, SiteError
from gradflow.hooks.sites import (
    EMBEDDINGS_SITE,
    DepthStack,
    SiteLayer,
    block_group_name,
    depth_occurrences,
    depth_of,
    distinct_blocks,
    hidden_state,
    layer_of,
    layer_site,
    parse_block_group,
    parse_site,
    point_of,
    replace_hidden_state,
    site_name,
    site_names,
)
from tiny import tiny_batch, tiny_model


def _hook_counts(model: nn.Module) -> list[tuple[int, int]]:
    return [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]


# ----------------------------------------------------------------------------------------------
# Names
# ----------------------------------------------------------------------------------------------

def test_names_and_order():
    assert site_names(2) == ("embeddings.out", "blocks.0.out", "blocks.1.out")
    assert site_names(2, mid=True) == ("embeddings.out", "blocks.0.mid", "blocks.0.out", "blocks.1.mid",
                                       "blocks.1.out")
    assert site_name(3, "mid") == "blocks.3.mid" and site_name(3) == "blocks.3.out"
    assert EMBEDDINGS_SITE == "embeddings.out"
    assert [layer_site(layer) for layer in range(3)] == ["embeddings.out", "blocks.0.out", "blocks.1.out"]
    with pytest.raises(ValueError, match="unknown site point"):
        site_name(0, "in")


def test_parse_round_trip():
    for name in site_names(12, mid=True):
        depth, point = parse_site(name)
        assert (depth, point) == (depth_of(name), point_of(name))
        if depth is None:
            assert name == EMBEDDINGS_SITE and layer_of(name) == 0 and point == "out"
        else:
            assert site_name(depth, point) == name and layer_of(name) == depth + 1
    for layer in range(5):
        assert layer_of(layer_site(layer)) == layer and point_of(layer_site(layer)) == "out"
    for bad in ("blocks.x.out", "blocks.1", "block.1.out", "blocks.1.in", "embeddings.mid", ""):
        with pytest.raises(ValueError, match="not a site name"):
            parse_site(bad)


def test_block_group_names():
    assert block_group_name(4) == "blocks.4" == block_group_name([4])
    assert block_group_name(range(12)) == "blocks.0-11"
    for depths in ([0], [3], [0, 1, 2], list(range(2, 9))):
        assert parse_block_group(block_group_name(depths)) == (depths[0], depths[-1])
    for bad in ("blocks.", "blocks.a", "embeddings", "blocks.1-x"):
        with pytest.raises(ValueError, match="not a block group"):
            parse_block_group(bad)


# ----------------------------------------------------------------------------------------------
# Depths
# ----------------------------------------------------------------------------------------------

def test_depth_stack_reports_each_depth_of_a_shared_block():
    shared, other = nn.Linear(2, 2), nn.Linear(2, 2)
    blocks = [shared, other, shared, shared]
    occurrences = depth_occurrences(blocks)
    assert occurrences == {id(shared): [0, 2, 3], id(other): [1]}
    assert distinct_blocks(blocks) == [shared, other]
    stack = DepthStack(occurrences)
    seen = []
    for block in blocks:
        seen.append(stack.enter(block))
        assert stack.current == seen[-1]
        assert stack.leave() == seen[-1]
    assert seen == [0, 1, 2, 3] and stack.current is None and stack.leave() is None
    stack.reset()
    assert stack.enter(shared) == 0  # a new forward starts again at the first depth


def test_shared_albert_layer_reports_every_depth_once_in_order():
    model = tiny_model("albert")
    adapter = adapter_for(model)
    blocks = block_modules(adapter, model.base_model)
    assert len(distinct_blocks(blocks)) == 1 and len(blocks) == 3
    seen: list[str] = []
    sites = SiteLayer(model, adapter, mid=True)
    with sites.hooks(lambda site, hidden: seen.append(site)) as names:
        assert names == site_names(3, mid=True)
        model(**tiny_batch().model_inputs())
        assert seen == list(names)
        model(**tiny_batch().model_inputs())  # every forward reports the sites again
    assert seen == [*names, *names]


def test_sites_hold_the_models_hidden_states():
    """Block outputs are transformers' hidden states; the embeddings site is hidden_states[0]."""
    for family in ("bert", "albert", "distilbert"):
        model = tiny_model(family)
        store: dict[str, torch.Tensor] = {}
        with torch.no_grad(), SiteLayer(model, mid=False).hooks(lambda s, h: store.setdefault(s, h.clone())):
            hidden = model(**tiny_batch().model_inputs(), output_hidden_states=True).hidden_states
        if family == "albert":
            hidden = hidden[1:]  # ALBERT's hidden_states[0] is the projected embeddings
            store.pop(EMBEDDINGS_SITE)
        else:
            torch.testing.assert_close(store.pop(EMBEDDINGS_SITE), hidden[0], rtol=0, atol=0)
            hidden = hidden[1:]
        for depth, expected in enumerate(hidden):
            torch.testing.assert_close(store[site_name(depth)], expected, rtol=0, atol=0, msg=f"{family} {depth}")


# ----------------------------------------------------------------------------------------------
# Mid points
# ----------------------------------------------------------------------------------------------

def _mid_reference(model: nn.Module, kind: str) -> list[torch.Tensor]:
    """The mid tensor of each depth, read by plain hooks on the adapter's mid module."""
    adapter = adapter_for(model)
    assert adapter.mid[1] == kind
    found: list[torch.Tensor] = []
    handles = []
    for block in block_modules(adapter, model.base_model):
        module = get_module(block, adapter.mid[0])
        if kind == "output":
            handles.append(module.register_forward_hook(lambda m, a, out: found.append(hidden_state(out).clone())))
        else:
            handles.append(module.register_forward_pre_hook(lambda m, a: found.append(a[0].clone())))
    with torch.no_grad():
        model(**tiny_batch().model_inputs())
    for handle in handles:
        handle.remove()
    return found


@pytest.mark.parametrize("family, kind", [("bert", "output"), ("modernbert", "input")])
def test_mid_point_from_output_hook_and_input_pre_hook(family, kind):
    model = tiny_model(family)
    expected = _mid_reference(model, kind)
    store: dict[str, torch.Tensor] = {}
    with torch.no_grad(), SiteLayer(model, mid=True).hooks(lambda s, h: store.setdefault(s, h.clone())):
        model(**tiny_batch().model_inputs())
    assert len(expected) == 3
    for depth, tensor in enumerate(expected):
        torch.testing.assert_close(store[site_name(depth, "mid")], tensor, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["bert", "modernbert"])
def test_replacing_the_mid_point_changes_the_output(family):
    model = tiny_model(family)
    inputs = tiny_batch().model_inputs()
    with torch.no_grad():
        plain = model(**inputs).logits
        with SiteLayer(model, mid=True).hooks(lambda s, h: h * 0 if s == "blocks.2.mid" else None):
            changed = model(**inputs).logits
    assert not torch.allclose(plain, changed)


# ----------------------------------------------------------------------------------------------
# Hidden states in module outputs
# ----------------------------------------------------------------------------------------------

def test_hidden_state_in_tensor_tuple_list_and_model_output():
    h, extra = torch.randn(2, 3, 4), torch.randn(2)
    new = torch.zeros(2, 3, 4)
    assert hidden_state(h) is h and replace_hidden_state(h, new) is new
    assert hidden_state((h, None)) is h
    replaced = replace_hidden_state((h, None), new)
    assert isinstance(replaced, tuple) and replaced[0] is new and replaced[1] is None
    replaced = replace_hidden_state([h, extra], new)
    assert isinstance(replaced, list) and replaced[0] is new and replaced[1] is extra
    output = BaseModelOutput(last_hidden_state=h, hidden_states=(extra,))
    assert hidden_state(output) is h
    replaced = replace_hidden_state(output, new)
    assert type(replaced) is BaseModelOutput and replaced.last_hidden_state is new
    assert replaced.hidden_states == (extra,) and output.last_hidden_state is h  # the original is untouched
    for bad in ({"x": h}, (None, h), ()):
        with pytest.raises(SiteError, match="cannot find"):
            hidden_state(bad)
        with pytest.raises(SiteError, match="cannot replace"):
            replace_hidden_state(bad, new)
    assert issubclass(SiteError, RecorderError) and issubclass(SiteError, AttributionError)


def test_replacing_a_block_output_changes_the_model_output_only_at_that_depth():
    model = tiny_model("albert")  # one module at three depths: only depth 1 is replaced
    inputs = tiny_batch().model_inputs()
    seen: dict[str, torch.Tensor] = {}
    store: dict[str, torch.Tensor] = {}

    def identity(site: str, hidden: torch.Tensor) -> torch.Tensor:
        seen[site] = hidden.clone()
        return hidden.clone()

    def zero_depth_one(site: str, hidden: torch.Tensor) -> torch.Tensor | None:
        store[site] = hidden.clone()
        return torch.zeros_like(hidden) if site == "blocks.1.out" else None

    with torch.no_grad():
        plain = model(**inputs).logits
        with SiteLayer(model).hooks(identity):
            same = model(**inputs).logits
        with SiteLayer(model).hooks(zero_depth_one):
            changed = model(**inputs).logits
    torch.testing.assert_close(same, plain, rtol=0, atol=0)
    assert not torch.allclose(changed, plain)
    for site in ("embeddings.out", "blocks.0.mid", "blocks.0.out", "blocks.1.mid", "blocks.1.out"):
        torch.testing.assert_close(store[site], seen[site], rtol=0, atol=0)  # up to the replaced site: as before
    for site in ("blocks.2.mid", "blocks.2.out"):
        assert not torch.allclose(store[site], seen[site])  # depth 2 ran on the zeroed stream


# ----------------------------------------------------------------------------------------------
# Hooks are always removed
# ----------------------------------------------------------------------------------------------

def test_hook_counts_restored_after_the_context_and_on_exceptions():
    model = tiny_model("modernbert")
    model(**tiny_batch().model_inputs(), output_hidden_states=True)  # transformers may add its own hooks first
    before = _hook_counts(model)
    extra_module = get_module(block_modules(adapter_for(model), model.base_model)[1], "mlp.Wo")
    extra = [(extra_module, lambda m, a, out: None)]
    with SiteLayer(model, mid=True).hooks(lambda s, h: None, extra=extra):
        inside = _hook_counts(model)
        model(**tiny_batch().model_inputs())
    assert inside != before and sum(map(sum, inside)) > sum(map(sum, before))
    assert _hook_counts(model) == before
    with pytest.raises(RuntimeError, match="boom"):
        with SiteLayer(model, mid=True).hooks(lambda s, h: None, extra=extra):
            model(**tiny_batch().model_inputs())
            raise RuntimeError("boom")
    assert _hook_counts(model) == before

    def fail(site: str, hidden: torch.Tensor) -> None:
        if site == "blocks.1.mid":
            raise ValueError("inside a hook")

    with pytest.raises(ValueError, match="inside a hook"):
        with SiteLayer(model, mid=True).hooks(fail):
            model(**tiny_batch().model_inputs())
    assert _hook_counts(model) == before


def test_hooks_removed_when_installation_fails():
    model = tiny_model("bert")
    before = _hook_counts(model)
    broken = dataclasses.replace(adapter_for(model), mid=("no.such.module", "output"))
    with pytest.raises(LookupError, match="no.such.module"):
        with SiteLayer(model, broken, mid=True).hooks(lambda s, h: None):
            pass  # pragma: no cover
    assert _hook_counts(model) == before
