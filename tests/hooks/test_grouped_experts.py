"""The batched arithmetic of the experts split (hooks/grouped_experts.py): grouped products equal the per-expert
loop (torch's kernel and the fallback), and the split runs every expert in one grouped call while capturing."""

from __future__ import annotations

import pytest
import torch

from gradflow import GradFlowRecorder
from gradflow.hooks import grouped_experts
from gradflow.hooks.grouped_experts import grouped, offsets
from tests.tiny import tiny_batch, tiny_moe_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("width", [16, 6])  # 6: strides not 16-byte aligned in float32 (the loop)
def test_grouped_equals_the_per_expert_loop(dtype, width):
    gen = torch.Generator().manual_seed(0)
    sizes = [3, 0, 5, 8]
    a = torch.randn(16, width, generator=gen, dtype=dtype)
    w = torch.randn(4, width, 8, generator=gen, dtype=dtype)
    g = torch.randn(16, 8, generator=gen, dtype=dtype)
    ends = offsets(torch.tensor(sizes))
    rows = torch.cat([a[s - n:s] @ w[e] for e, (n, s) in enumerate(zip(sizes, ends.tolist()))])
    slabs = torch.stack([g[s - n:s].T @ a[s - n:s] for n, s in zip(sizes, ends.tolist())])
    torch.testing.assert_close(grouped(a, w, ends, sizes), rows)
    torch.testing.assert_close(grouped(g.T, a, ends, sizes), slabs)
    assert torch.count_nonzero(grouped(g.T, a, ends, sizes)[1]) == 0  # an expert without rows: an exact zero slab


def test_split_runs_the_experts_in_grouped_calls(monkeypatch):
    """While capturing, each block's experts take 4 grouped calls for the forward and backward products and at most
    one per role and parameter for the weight gradients, not one per expert."""
    calls = []
    kernel = torch._grouped_mm

    def spy(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(grouped_experts.torch, "_grouped_mm", spy)
    model = tiny_moe_model("olmoe", experts_implementation="grouped_mm")
    with GradFlowRecorder(model) as rec:
        rec.record(tiny_batch())
    roles = len(tiny_batch().roles.unique())
    assert 2 * 4 + 2 * 2 <= len(calls) <= 2 * (4 + 2 * roles)
