"""The batched arithmetic of the experts split (hooks/grouped_experts.py): grouped products equal the per-expert
loop (torch's kernel and the fallback), the split runs every expert in one grouped call while capturing, and its
cheap path (the largest role's product, the rest as one more, the other roles' norms from Gram matrices) gives the
per-role products' norms, autograd's gradient and the exact zeros."""

from __future__ import annotations

import pytest
import torch

from gradflow import GradFlowRecorder, RecorderConfig
from gradflow.hooks import grouped_experts
from gradflow.hooks.batch_state import BatchState
from gradflow.hooks.experts import ExpertSums
from gradflow.hooks.grouped_experts import add_by_role, grouped, offsets
from gradflow.losses import get_loss
from gradflow.roles import NUM_ROLES, Role
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


def _rows(dtype: torch.dtype, wide: int):
    """Rows of 4 experts (expert 2 gets none), sorted by expert then role: context many, masked some, random and
    special few, kept ``wide`` per expert (enough that its norm is its own product, not its Gram); kept's rows of
    expert 3 and every ``x`` row of special zero (special: no contribution)."""
    gen = torch.Generator().manual_seed(1)
    per = {Role.MASKED: 3, Role.RANDOM: 1, Role.KEPT: wide, Role.CONTEXT: 20, Role.SPECIAL: 2}
    expert, codes = [], []
    for e in (0, 1, 3):
        for role in sorted(per):
            expert += [e] * per[role]
            codes += [int(role)] * per[role]
    expert, codes = torch.tensor(expert), torch.tensor(codes)
    g = torch.randn(len(codes), 12, generator=gen, dtype=torch.float64).to(dtype)
    x = torch.randn(len(codes), 8, generator=gen, dtype=torch.float64).to(dtype)
    x[codes == Role.SPECIAL] = 0
    g[(codes == Role.KEPT) & (expert == 3)] = 0
    table = torch.bincount(expert * NUM_ROLES + codes, minlength=4 * NUM_ROLES).view(4, NUM_ROLES)
    return g, x, codes, expert, table


# bfloat16: each slab element is rounded once (2^-9 relative: a gradient element of a bfloat16 product, or of a
# bare backward that rounds elsewhere, within 2^-6 of the largest) and a slab's norm once (2^-9: a squared norm
# within 2^-8, measured within 2^-9); float32: a reordered sum's rounding
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-5, torch.bfloat16: 2.0 ** -6}
NORM_TOLERANCE = {**TOLERANCE, torch.bfloat16: 2.0 ** -8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("wide", [2, 40], ids=["kept-from-gram", "kept-own-product"])
def test_cheap_split_equals_the_per_role_products(dtype, wide):
    """``add_by_role`` without materialising: each role's squared norm is the sum over experts of its product's
    (rounding-bounded: 1e-5 relative in float32, 2^-8 in bfloat16), the gradient is the sum of every expert's rows,
    and a role without a contributing row (special: zero inputs) gets exactly 0."""
    tol = TOLERANCE[dtype]
    g, x, codes, expert, table = _rows(dtype, wide)
    n = codes.numel()
    state = BatchState.start(RecorderConfig(), torch.zeros(1, n, dtype=torch.int8), None, 1)
    sums = ExpertSums.of(state, (0, "ffn.experts.down_proj", "weight"))
    summed = add_by_role(sums, state, g, x, torch.arange(n), codes, expert, table, False, (4, 12, 8))
    g64, x64 = g.double(), x.double()
    for e in range(4):
        rows = expert == e
        expected = g64[rows].T @ x64[rows]
        torch.testing.assert_close(summed[e].double(), expected, rtol=tol, atol=tol * float(expected.abs().max()))
    for code in range(NUM_ROLES):
        expected = sum(float((g64[(codes == code) & (expert == e)].T @ x64[(codes == code) & (expert == e)])
                             .square().sum()) for e in range(4))
        assert abs(float(sums.squares[code]) - expected) <= NORM_TOLERANCE[dtype] * expected, Role(code)
    assert float(sums.squares[int(Role.SPECIAL)]) == 0.0 and float(sums.squares[int(Role.PAD)]) == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cheap_split_under_backward_is_autograds_gradient(dtype):
    """Under ``rec.capture`` and ``loss.backward()`` without materialising (the cheap path): the experts' ``.grad``
    is a bare backward's (1e-5 of its norm; bfloat16: 2^-6, the bare and the split round differently), each role's
    norm is its materialised product's (1e-5 relative; bfloat16 2^-8), and the last block's roles without a loss get
    exactly 0."""
    tol = TOLERANCE[dtype]
    model = tiny_moe_model("olmoe", dtype=dtype)
    batch = tiny_batch()
    loss = get_loss("mlm", "batch")
    names = ("gate_up_proj", "down_proj")
    model.zero_grad(set_to_none=True)
    loss(model(**batch.model_inputs()).logits, batch).backward()
    bare = {(d, n): getattr(layer.mlp.experts, n).grad.clone() for d, layer in enumerate(model.model.layers)
            for n in names}
    frames = []
    for materialize in (True, False):
        model.zero_grad(set_to_none=True)
        with GradFlowRecorder(model, RecorderConfig(materialize=materialize)) as rec:
            with rec.capture(batch.roles):
                loss(model(**batch.model_inputs()).logits, batch).backward()
            frame = rec.result().sublayer_frame()
        frames.append(frame[frame.sublayer.str.startswith("ffn.experts")].set_index(["layer", "sublayer", "role"]))
    for (depth, name), grad in bare.items():  # the cheap path's gradient (the last loop's)
        error = float((getattr(model.model.layers[depth].mlp.experts, name).grad - grad).norm())
        assert error <= tol * float(grad.norm()), (depth, name, error)
    products, cheap = frames
    assert products.index.equals(cheap.index) and len(cheap)
    torch.testing.assert_close(torch.tensor(cheap.contribution_norm.values),
                               torch.tensor(products.contribution_norm.values), rtol=NORM_TOLERANCE[dtype], atol=0)
    assert ((products.contribution_norm == 0) == (cheap.contribution_norm == 0)).all()
    last = cheap.xs(2, level="layer")
    for role in ("context", "special"):
        assert (last.xs(role, level="role").contribution_norm == 0).all(), role
    assert (last.xs("masked", level="role").contribution_norm > 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_squares_skip_only_the_slabs_of_experts_without_rows(dtype, monkeypatch):
    """An expert without rows has an exactly zero slab and is not looked at again; a slab with rows whose norm is 0
    or outside the safe range goes to safe_norm, which decides it (here: a zero slab stays 0, a tiny one is not
    flushed to 0)."""
    gen = torch.Generator().manual_seed(1)
    slabs = torch.randn(5, 4, 3, generator=gen).to(dtype)
    slabs[1] = 0  # no rows
    slabs[3] = 0  # rows whose products cancel to zero
    slabs[4] = torch.full((4, 3), 1e-30).to(dtype)  # float32's squared norm underflows
    looked_at = []
    real = grouped_experts.safe_norm
    monkeypatch.setattr(grouped_experts, "safe_norm", lambda x, **kw: looked_at.append(x.shape) or real(x, **kw))
    got = grouped_experts._squares(slabs, [2, 0, 5, 1, 3])
    expected = sum(float(torch.linalg.vector_norm(s.double())) ** 2 for s in slabs)
    assert looked_at == [torch.Size([4, 3])] * 2  # slabs 3 and 4 only
    assert float(got) == pytest.approx(expected, rel=2 ** -7 if dtype == torch.bfloat16 else 1e-6)
    tiny = grouped_experts._squares(slabs[4:], [3])
    assert float(tiny) > 0


def test_row_dots_in_chunks_equal_one_pass(monkeypatch):
    """The routing weights' gradient rows, taken a chunk at a time, equal the whole float32 product's row sums within
    the rounding of a float32 sum of 24 terms (the reduction may be vectorised differently for 2 rows and for 50)."""
    from gradflow.hooks import split_experts
    monkeypatch.setattr(split_experts, "CHUNK_ELEMENTS", 64)
    gen = torch.Generator().manual_seed(2)
    a, b = (torch.randn(50, 24, generator=gen).to(torch.bfloat16) for _ in range(2))
    products = a.float() * b.float()  # exact: bfloat16 products fit float32
    bound = 24 * torch.finfo(torch.float32).eps * products.abs().sum(dim=-1)
    difference = (split_experts.row_dots(a, b) - products.sum(dim=-1)).abs()
    assert bool((difference <= bound).all()), (difference / bound).max()
