"""The generic adapter (adapter="auto"): it agrees with every hand-written adapter, and records a custom model.

Agreement, per family of the tiny family table: the same batch is recorded with the registered
adapter and with ``adapter="auto"``; the block-output site norms must be identical (bitwise), and
for every standard sublayer the hand-written adapter names, the auto adapter's split of that very
module (found by identity, since auto names by module path) must give identical per-role matrices
and statistics.

Stated exceptions (not hidden):

- fused modules chunked by the hand-written adapter (ModernBERT's ``attn.Wqkv`` as attn.q/k/v and
  ``mlp.Wi`` as ffn.in/gate, DeBERTa v1's per-head interleaved ``in_proj``): auto splits the whole
  module, so its per-role matrices are compared on the chunk's output rows (identical) and the
  chunk's contribution norm is the norm of those rows; the per-position magnitudes and nonzero
  counts of a chunk are not defined for the whole module, so those are not compared; a bias the
  hand-written adapter adds from outside the module (DeBERTa v1's ``q_bias``) has no auto counterpart;
- families the generic adapter does not discover (``NOT_DISCOVERED``: blocks whose hidden states
  are (B, H, T), blocks holding no ``nn.Linear``): auto must refuse them with its error;
- blocks that are no module (XLM and FlauBERT: the registered adapter's ``block_entry``, depths
  gathered from parallel lists): auto finds one of those lists as its block stack, so it does not apply;
- ``embeddings.out``: auto's is the first block's input, the hand-written one the embeddings
  module's output (they differ where a projection sits in between: ELECTRA, ConvBERT, RemBERT,
  ALBERT), so only block outputs are compared; auto has no ``mid`` sites;
- ALBERT's shared layer agrees fully: auto finds the one layer group applied three times and
  records one depth per application, as the hand-written adapter does (its module paths carry the
  group's ``albert_layers.0.`` prefix).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.modeling_outputs import MaskedLMOutput

from gradflow import GradFlowRecorder, RecorderConfig, mlm_loss
from gradflow.adapters import adapter_for, block_modules, discover_adapter, get_module
from gradflow.adapters.norms import norm_like, splittable
from gradflow.errors import UnsupportedArchitectureError
from gradflow.hooks.sites import EMBEDDINGS_SITE, site_name
from gradflow.losses import get_loss
from gradflow.roles import Role
from tiny import FAMILIES, VOCAB, tiny_batch, tiny_model

CHUNKED = {"modernbert", "deberta", "modernvbert"}  # fused projections split by rows in the hand-written adapter (see the docstring)
NOT_DISCOVERED = {  # the generic adapter finds no block stack (see the docstring)
    "squeezebert": "blocks take and return (B, H, T) hidden states, not one vector per position",
    "ibert": "its blocks hold QuantLinear modules, no nn.Linear",
    "longformer": "it pads the probe's 7 positions to a multiple of attention_window: no block sees 7 positions",
}


def _record(model, batch, adapter=None, **config):
    """A callable loss: the whole model runs for both adapters (a registered adapter's record() would run the
    head at the loss positions only, the generic one cannot), so the two recordings are bit-identical."""
    with GradFlowRecorder(model, RecorderConfig(materialize=True, **config), adapter=adapter) as rec:
        return rec.record(batch, get_loss("mlm")), rec


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request):
    model = tiny_model(request.param)
    batch = tiny_batch()
    if request.param in NOT_DISCOVERED:
        with pytest.raises(UnsupportedArchitectureError, match="found no block stack"):
            _record(model, batch, adapter="auto")
        pytest.skip(f"the generic adapter refuses {request.param}: {NOT_DISCOVERED[request.param]}")
    registered = adapter_for(model)
    if registered.block_entry is not None:  # blocks that are no module, gathered from parallel lists (XLM)
        parts = {name for name, _ in block_modules(registered, model.base_model)[0].named_children()}
        assert discover_adapter(model, notice=False).blocks in parts  # auto takes one of the lists for the blocks
        pytest.skip(f"{request.param}: its blocks are no modules; the generic adapter finds one of its parallel lists")
    hand, hand_rec = _record(model, batch)
    auto, auto_rec = _record(model, batch, adapter="auto")
    return request.param, model, batch, (hand, hand_rec), (auto, auto_rec)


@pytest.mark.slow
def test_block_output_sites_identical(pair):
    family, model, batch, (hand, _), (auto, auto_rec) = pair
    assert auto_rec.adapter.family == "generic" and auto.num_blocks == hand.num_blocks == 3
    assert auto.site_names == (EMBEDDINGS_SITE, *(site_name(d) for d in range(3)))
    for depth in range(hand.num_blocks):
        for i in (0, 1):  # grad norm, act norm: identical at every position, hence per role
            assert torch.equal(hand.site(site_name(depth))[i], auto.site(site_name(depth))[i]), (family, depth, i)
    a, b = hand.site_frame(), auto.site_frame()
    out = [site_name(d) for d in range(3)]
    assert a[a.site.isin(out)].reset_index(drop=True).equals(b[b.site.isin(out)].reset_index(drop=True))


def _auto_name(block: nn.Module, module: nn.Module) -> str:
    names = [name for name, m in block.named_modules() if m is module]
    assert len(names) == 1
    return names[0]


def test_standard_sublayers_identical(pair):
    family, model, batch, (hand, hand_rec), (auto, auto_rec) = pair
    auto_stats = {(r.depth, r.sublayer, r.param): r for r in auto.sublayers}
    compared = 0
    for name, spec in hand_rec.adapter.sublayers.items():
        assert spec.chunk is None or family in CHUNKED, (family, name)
        for depth in range(hand.num_blocks):
            module = get_module(hand_rec.blocks[depth], spec.path)
            if not splittable(module):
                continue  # ModernBERT's first block: nn.Identity as attn.norm, in both
            if spec.call is not None:
                continue  # one name per call of a module run several times per block (X-MOD): auto splits none
            path = _auto_name(auto_rec.blocks[depth], module)
            assert path in auto_rec.adapter.sublayers, (family, name, path)
            for param in ("weight", "bias"):
                keys = [k for k in hand.matrices if k[:3] == (depth, name, param)]
                if getattr(module, param, None) is None:
                    assert not keys or (param == "bias" and spec.bias is not None)  # a bias from outside
                    continue
                assert keys, (family, name, param)
                for key in keys:
                    theirs = auto.matrices[(depth, path, param, key[3])]
                    if spec.chunk is not None:  # contiguous or per-head interleaved rows
                        theirs = theirs[spec.rows(theirs.shape[0], model.config)]
                    assert torch.equal(hand.matrices[key], theirs), (family, name, param, key[3])
                mine = next(r for r in hand.sublayers if (r.depth, r.sublayer, r.param) == (depth, name, param))
                other = auto_stats[(depth, path, param)]
                assert torch.equal(mine.n_positions, other.n_positions)
                if spec.chunk is None:
                    for field in ("n_nonzero", "magnitude_sum", "contribution_norm"):
                        assert torch.equal(getattr(mine, field), getattr(other, field)), (family, name, field)
                compared += 1
    assert compared >= 24, family


@pytest.mark.slow
def test_auto_contributions_sum_to_autograd(pair):
    family, model, batch, _, (auto, auto_rec) = pair
    _check_sums(model, batch, auto, auto_rec)


def _check_sums(model, batch, record, rec, min_checked=12):
    model.zero_grad(set_to_none=True)
    mlm_loss(model(**batch.model_inputs()).logits, batch).backward()
    floor = 1e-3 * max(float(p.grad.norm()) for p in model.parameters() if p.grad is not None)
    checked = 0
    for path in rec.adapter.sublayers:
        modules = {id(get_module(b, path)): get_module(b, path) for b in rec.blocks}
        for module in modules.values():
            if not splittable(module):
                continue
            depths = [d for d, b in enumerate(rec.blocks) if get_module(b, path) is module]
            for param in ("weight", "bias"):
                ref = getattr(module, param, None)
                if ref is None:
                    continue
                total = sum(m for (d, s, p, _), m in record.matrices.items() if s == path and p == param and d in depths)
                scale = max(float(ref.grad.norm()), floor)
                assert float((total - ref.grad).norm()) <= 1e-5 * scale, (path, param)
                checked += 1
    assert checked >= min_checked


# ---------------------------------------------------------------------------------------------- a custom model

class RMSNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    """Pre-norm: RMSNorm -> attention (q, k, v, o) -> residual; LayerNorm -> MLP (up, down) -> residual."""

    def __init__(self, width: int, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm_attn = RMSNorm(width)
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.norm_mlp = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x, attention_mask):
        b, t, w = x.shape
        h = self.norm_attn(x)
        q, k, v = (f(h).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.q, self.k, self.v))
        keep = attention_mask[:, None, None, :].bool()  # torch's fused attention, as modern models call it
        mixed = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = x + self.o(mixed.transpose(1, 2).reshape(b, t, w))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm_mlp(x))))


class CustomMLM(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3, positions: int = 32):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, width), nn.Embedding(positions, width)
        self.tower_of_stages = nn.ModuleList(Block(width) for _ in range(depth))  # an unusual attribute name
        self.final = RMSNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        x = self.tokens(input_ids) + self.positions(torch.arange(input_ids.shape[1]))
        for block in self.tower_of_stages:
            x = block(x, attention_mask)
        return MaskedLMOutput(logits=self.head(self.final(x)))


@pytest.fixture(scope="module")
def custom():
    torch.manual_seed(0)
    model = CustomMLM().eval()
    batch = tiny_batch()
    record, rec = _record(model, batch, adapter="auto")
    return model, batch, record, rec


def test_custom_model_discovery_and_notice(capsys):
    torch.manual_seed(0)
    adapter = discover_adapter(CustomMLM())
    err = capsys.readouterr().err
    assert "generic adapter" in err and "3 blocks of Block under 'tower_of_stages'" in err and "no registered adapter" not in err
    assert "norm_attn" in err and "Not split: nothing" in err
    assert adapter.blocks == "tower_of_stages" and adapter.mid is None
    assert list(adapter.sublayers) == ["norm_attn", "q", "k", "v", "o", "norm_mlp", "up", "down"]


def test_custom_model_exact_zero_and_sums(custom):
    model, batch, record, rec = custom
    last = record.num_blocks - 1
    grad, _ = record.site(site_name(last))
    for role in (Role.CONTEXT, Role.SPECIAL, Role.PAD):
        assert torch.all(grad[batch.roles == role] == 0)
    frame = record.sublayer_frame()
    ctx = frame[(frame.layer == last + 1) & (frame.role == "context")]
    after = {"q", "o", "norm_mlp", "up", "down"}  # see only the position's own post-attention state
    for row in ctx.itertuples():
        if row.sublayer in after:
            assert row.contribution_norm == 0.0 and row.magnitude_sum == 0.0 and row.n_nonzero == 0, row
        else:  # norm_attn, k and v feed other positions' attention
            assert row.contribution_norm > 0, row
    for (depth, name, _, role), matrix in record.matrices.items():
        if depth == last and role == "context" and name in after:
            assert torch.count_nonzero(matrix) == 0
    early = frame[(frame.layer < last + 1) & (frame.role == "context") & (frame.param == "weight")]
    assert (early.contribution_norm > 0).all()
    _check_sums(model, batch, record, rec, min_checked=3 * 14)


def test_config_adapter_auto_is_the_same_recording(custom):
    model, batch, record, _ = custom
    with GradFlowRecorder(model, RecorderConfig(materialize=True, adapter="auto")) as rec:
        again = rec.record(batch)
    assert torch.equal(again.grad_norm, record.grad_norm)
    assert again.matrices.keys() == record.matrices.keys()


def test_no_block_stack_is_refused():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens, self.mix, self.head = nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Linear(8, VOCAB)

        def forward(self, input_ids, attention_mask=None):
            return MaskedLMOutput(logits=self.head(self.mix(self.tokens(input_ids))))

    with pytest.raises(UnsupportedArchitectureError, match="found no block stack.*Adding an architecture"):
        discover_adapter(Flat(), notice=False)
    with pytest.raises(UnsupportedArchitectureError, match="no input embeddings"):
        discover_adapter(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), notice=False)


def test_norm_like_needs_the_affine_diagonal_form():
    class OnePlusGain(RMSNorm):  # Gemma-style (1 + weight): not y = xhat * weight, so not split
        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)

    assert norm_like(RMSNorm(8)) and norm_like(nn.LayerNorm(8)) and norm_like(nn.RMSNorm(8))
    assert not norm_like(OnePlusGain(8)) and not norm_like(nn.LayerNorm(8, elementwise_affine=False))
    assert not norm_like(nn.Linear(8, 8)) and not norm_like(nn.Embedding(4, 8))


def test_cli_record_adapter_auto(tmp_path, capsys, tiny_mlm_dir, tiny_corpus):
    import json

    import pandas as pd

    from gradflow.cli import main

    out = tmp_path / "run"
    code = main(["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--max-length", "24", "--batch-size", "4", "--limit", "8", "--quiet", "--adapter", "auto"])
    assert code == 0
    assert "generic adapter (adapter='auto')" in capsys.readouterr().err
    meta = json.loads((out / "meta.json").read_text())
    assert meta["family"] == "generic" and meta["after_mixing_sublayers"] == []
    channels = pd.read_csv(out / "channels.csv")
    assert set(channels.point) == {"out"}
    last = channels[(channels.layer == meta["num_layers"]) & (channels.role == "context")]
    assert (last.grad_norm_mean == 0.0).all()
    sublayers = pd.read_csv(out / "sublayers.csv")
    assert "attention.self.query" in set(sublayers.sublayer)
    q = sublayers[(sublayers.layer == meta["num_layers"]) & (sublayers.role == "context")
                  & (sublayers.sublayer == "attention.output.dense")]
    assert (q.share == 0.0).all()
