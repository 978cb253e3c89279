"""training_snapshot: each measurement equals a direct computation; no trace is left; errors say what to do."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from gradflow.errors import UsageError
from gradflow.hooks.recorder import GradFlowRecorder, RecorderConfig
from gradflow.interventions.snapshot import (
    EMBEDDING_KEYS,
    TrainingSnapshot,
    embedding_role_gradients,
    training_snapshot,
)
from gradflow.roles import LOSS_ROLES, TOKEN_ROLES, Role, role_code
from gradflow.schema import CALLBACK_COLUMNS
from rounding import assert_within_rounding, gamma, unit_roundoff
from tiny import tiny_batch, tiny_model

TOKENIZER = SimpleNamespace(mask_token_id=4, all_special_ids=[2, 3, 4])  # tiny_batch's ids: [CLS] 2, [SEP] 3, [MASK] 4
HIDDEN = 32


def _model(family: str = "bert", **overrides) -> torch.nn.Module:
    model = tiny_model(family, **overrides)
    model.set_attn_implementation("eager")
    return model


def _snapshot(model, batch, **kwargs) -> TrainingSnapshot:
    return training_snapshot(model, batch.input_ids, batch.labels, batch.attention_mask, tokenizer=TOKENIZER, **kwargs)


def _forward(model, batch, **kwargs):
    return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels, **kwargs)


def _hook_counts(model) -> list[int]:
    return [len(getattr(m, name)) for m in model.modules()
            for name in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")]


def _untied_clone(model) -> torch.nn.Module:
    untied = _model("bert", tie_word_embeddings=False)
    untied.load_state_dict(model.state_dict(), strict=False)
    with torch.no_grad():
        untied.get_output_embeddings().weight.copy_(model.get_output_embeddings().weight)
    assert untied.get_output_embeddings().weight is not untied.get_input_embeddings().weight
    return untied


def _lookup_grads(model, batch):
    """(gradient w.r.t. the word-embedding lookups (B, T, E), autograd's input-matrix gradient, output weight's)."""
    looked_up = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, a, out: looked_up.append(out))
    try:
        loss = _forward(model, batch).loss
    finally:
        handle.remove()
    w_in, w_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    grads = torch.autograd.grad(loss, [looked_up[0], w_in, *([w_out] if w_out is not w_in else [])])
    return grads[0], grads[1], grads[2] if len(grads) > 2 else None


def _lookup_bound(g: torch.Tensor, batch, vocab: int) -> torch.Tensor:
    """Elementwise bound on two float32 orders of the lookups' index_add: 2 gamma_n sum |terms| per row."""
    magnitudes = embedding_role_gradients(g.abs().double(), batch.input_ids, None, vocab, 0)["input"].double()
    return 2 * gamma(batch.input_ids.numel()) * magnitudes


# ---------------------------------------------------------------------------------------- hidden-state gradients
@pytest.mark.parametrize("family", ["bert", "roformer"])
def test_hidden_grad_means_and_ratios_equal_autograd_of_the_loss_wrt_the_hidden_states(family):
    model, batch = _model(family), tiny_batch()
    snap = _snapshot(model, batch)
    out = _forward(model, batch, output_hidden_states=True)
    grads = torch.autograd.grad(out.loss, out.hidden_states)
    assert snap.layers == tuple(range(len(grads))) == (0, 1, 2, 3)
    assert snap.loss == float(out.loss.detach())
    roles = batch.roles.long()
    for layer, grad in enumerate(grads):
        norms = torch.linalg.vector_norm(grad.double(), dim=-1)
        for role in TOKEN_ROLES:
            sel = roles == role_code(role)
            got = torch.tensor(snap.hidden_grad_mean[role][layer], dtype=torch.float64)
            if not bool(sel.any()):
                assert math.isnan(got), role
                continue
            expected = norms[sel].mean()  # float32 norms (H terms each) of the same gradients: relative rounding
            assert_within_rounding(got, expected, 2 * gamma(HIDDEN + 1) * expected, f"{role} at layer {layer}")
        ratio = norms[roles == role_code("context")].mean() / norms[roles <= Role.KEPT].mean()
        got = torch.tensor(snap.context_loss_ratio[layer], dtype=torch.float64)
        assert_within_rounding(got, ratio, 5 * gamma(HIDDEN + 1) * ratio, f"ratio at layer {layer}")


def test_the_last_block_gives_context_exactly_no_gradient_under_a_selected_positions_loss():
    snap = _snapshot(_model(), tiny_batch())
    assert snap.hidden_grad_mean["context"][-1] == 0.0
    assert snap.context_loss_ratio[-1] == 0.0
    assert snap.hidden_grad_mean["context"][-2] > 0.0 and snap.context_loss_ratio[-2] > 0.0  # mixing before it
    assert all(snap.hidden_grad_mean["masked"][layer] > 0.0 for layer in snap.layers)


# ---------------------------------------------------------------------------------------- forward measurements
@pytest.mark.parametrize("family", ["bert", "roformer"])
def test_collapse_equals_a_double_loop_over_pairs(family):
    model, batch = _model(family), tiny_batch()
    snap = _snapshot(model, batch)
    with torch.no_grad():
        hidden = _forward(model, batch, output_hidden_states=True).hidden_states
    ids, real = batch.input_ids, (batch.roles != Role.SPECIAL) & (batch.roles != Role.PAD)
    for layer, states in enumerate(hidden):
        cosines = []
        for b in range(ids.shape[0]):
            for i in range(ids.shape[1]):
                for j in range(i + 1, ids.shape[1]):
                    if real[b, i] and real[b, j] and ids[b, i] != ids[b, j]:
                        cosines.append(torch.cosine_similarity(states[b, i].double(), states[b, j].double(), dim=0))
        expected = torch.stack(cosines).mean()
        bound = torch.tensor(4 * gamma(HIDDEN + len(cosines) + 3, torch.float64))  # |cosine| <= 1
        assert_within_rounding(torch.tensor(snap.collapse[layer], dtype=torch.float64), expected, bound, str(layer))


def test_the_hidden_states_line_up_with_the_recorders_layers():
    model, batch = _model(), tiny_batch()
    with GradFlowRecorder(model, RecorderConfig(sublayers=False)) as rec:
        record = rec.record(batch)
    with torch.no_grad():
        hidden = _forward(model, batch, output_hidden_states=True).hidden_states
    outs = {layer: s for s, (layer, point) in enumerate(zip(record.site_layers, record.site_points)) if point == "out"}
    assert sorted(outs) == list(range(len(hidden)))
    for layer, states in enumerate(hidden):
        expected = torch.linalg.vector_norm(states.double(), dim=-1)
        assert_within_rounding(record.act_norm[outs[layer]], expected, 2 * gamma(HIDDEN + 1) * expected, str(layer))


def test_attention_entropy_equals_a_manual_computation_from_the_attentions():
    model, batch = _model(), tiny_batch()
    snap = _snapshot(model, batch)
    with torch.no_grad():
        attentions = _forward(model, batch, output_attentions=True).attentions
    assert len(snap.attention_entropy) == len(snap.attention_entropy_max) == len(attentions) == 3
    real = batch.attention_mask.bool()
    for block, probs in enumerate(attentions):
        entropies, uniform = [], []
        for b in range(probs.shape[0]):
            n_keys = int(real[b].sum())
            for h in range(probs.shape[1]):
                for q in range(probs.shape[2]):
                    if real[b, q]:
                        p = probs[b, h, q].double()
                        p = p[p > 0]
                        entropies.append(-(p * p.log()).sum())
                        uniform.append(math.log(n_keys))
        expected = torch.stack(entropies).mean()
        bound = 4 * gamma(probs.shape[-1] + len(entropies), torch.float64) * torch.tensor(max(uniform))
        got = torch.tensor(snap.attention_entropy[block], dtype=torch.float64)
        assert_within_rounding(got, expected, bound, str(block))
        assert 0 < snap.attention_entropy[block] <= snap.attention_entropy_max[block] * (1 + 1e-12)
        assert snap.attention_entropy_max[block] == pytest.approx(sum(uniform) / len(uniform), rel=1e-15)


# ---------------------------------------------------------------------------------------- embedding gradient
def test_the_per_role_embedding_gradients_sum_to_the_lookups_part():
    model, batch = _model(), tiny_batch()
    g, _, _ = _lookup_grads(model, batch)
    vocab = model.get_input_embeddings().weight.shape[0]
    per_role = embedding_role_gradients(g, batch.input_ids, batch.roles, vocab, 0)
    total = embedding_role_gradients(g, batch.input_ids, None, vocab, 0)["input"]
    assert set(per_role) == set(TOKEN_ROLES) and float(total.abs().sum()) > 0
    assert_within_rounding(torch.stack(list(per_role.values())).sum(0), total, _lookup_bound(g, batch, vocab))
    assert float(per_role["pad"].abs().sum()) == 0.0  # padding_idx 0: nn.Embedding gives its row no gradient
    snap = _snapshot(model, batch)
    for role, matrix in per_role.items():  # the same index_add of the same gradient
        assert snap.embedding_grad[role] == float(torch.linalg.vector_norm(matrix)), role
    assert snap.embedding_grad["input"] == float(torch.linalg.vector_norm(total))


def test_tied_input_and_output_sides_add_up_to_autograd_and_match_an_untied_clone():
    tied, batch = _model(), tiny_batch()
    untied = _untied_clone(tied)
    vocab = tied.get_input_embeddings().weight.shape[0]
    g, all_tied, _ = _lookup_grads(tied, batch)
    g_untied, all_untied, output_untied = _lookup_grads(untied, batch)
    lookups = embedding_role_gradients(g, batch.input_ids, None, vocab, 0)["input"]
    bound = _lookup_bound(g, batch, vocab)
    assert_within_rounding(lookups, all_untied, bound, "untied: the input matrix's gradient is the lookups' part")
    assert_within_rounding(lookups + output_untied, all_tied, bound + 2 * unit_roundoff() * all_tied.abs(),
                           "tied: lookups + output side = autograd's total")
    s_tied, s_untied = _snapshot(tied, batch), _snapshot(untied, batch)
    assert (s_tied.embedding_grad["tied"], s_untied.embedding_grad["tied"]) == (1.0, 0.0)
    assert list(s_tied.embedding_grad) == list(EMBEDDING_KEYS)
    assert s_tied.embedding_grad["all"] == float(torch.linalg.vector_norm(all_tied))
    assert s_untied.embedding_grad["all"] == float(torch.linalg.vector_norm(all_untied))
    assert s_untied.embedding_grad["output"] == float(torch.linalg.vector_norm(output_untied))
    norm_bound = float(torch.linalg.vector_norm(bound + 2 * unit_roundoff() * all_tied.abs()))
    assert abs(s_tied.embedding_grad["output"] - s_untied.embedding_grad["output"]) <= norm_bound  # |a|-|b| <= |a-b|
    assert s_tied.embedding_grad["output"] > s_tied.embedding_grad["input"] > 0


def test_a_real_position_holding_the_padding_id_adds_nothing_as_in_nn_embedding():
    model, batch = _model(tie_word_embeddings=False), tiny_batch()
    batch.input_ids[0, 6] = 0  # a loss position (role random) holding padding_idx 0
    g, all_input, _ = _lookup_grads(model, batch)
    assert float(g[0, 6].abs().sum()) > 0  # it does get a gradient, which nn.Embedding drops
    vocab = model.get_input_embeddings().weight.shape[0]
    snap = _snapshot(model, batch)
    bound = float(torch.linalg.vector_norm(_lookup_bound(g, batch, vocab)))
    lookups, total = snap.embedding_grad["input"], snap.embedding_grad["all"]
    dropped = float(g[0, 6].double().pow(2).sum())  # what counting it would add to input^2 (row 0 holds nothing else)
    assert abs(lookups**2 - total**2) <= (lookups + total) * bound < dropped
    assert snap.embedding_grad["all"] == float(torch.linalg.vector_norm(all_input))


# ---------------------------------------------------------------------------------------- no trace
def test_the_probe_leaves_grads_modes_and_hooks_as_they_were():
    model, batch = _model(), tiny_batch()
    model.train()
    model.bert.encoder.layer[1].eval()  # a mixed state: restored module by module
    _snapshot(model, batch)  # transformers installs its own permanent hooks on first output_hidden_states use
    params = list(model.parameters())
    torch.manual_seed(1)
    for p in params[::2]:
        p.grad = torch.randn_like(p)
    before = {id(p): (p.grad, None if p.grad is None else p.grad.clone()) for p in params}
    modes = [m.training for m in model.modules()]
    hooks = _hook_counts(model)
    first, second = _snapshot(model, batch), _snapshot(model, batch)
    assert repr(first) == repr(second)  # no dropout, no tensor hook left to change the second call
    assert [m.training for m in model.modules()] == modes
    assert _hook_counts(model) == hooks
    assert all(not p._backward_hooks and not getattr(p, "_post_accumulate_grad_hooks", None) for p in params)
    for p in params:
        grad, copy_ = before[id(p)]
        assert p.grad is grad
        assert (grad is None) or torch.equal(grad, copy_)


def test_an_error_inside_the_probe_leaves_no_trace_either():
    model, batch = _model(), tiny_batch()
    _snapshot(model, batch)
    model.train()
    hooks, grads = _hook_counts(model), [p.grad for p in model.parameters()]

    def failing(model, input_ids, attention_mask, labels):
        model(input_ids=input_ids, attention_mask=attention_mask)
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        _snapshot(model, batch, loss_fn=failing)
    assert model.training and all(m.training for m in model.modules())
    assert _hook_counts(model) == hooks and [p.grad for p in model.parameters()] == grads
    assert repr(_snapshot(model, batch)) == repr(_snapshot(model, batch))


def test_a_weighted_loss_fn_is_used_as_given():
    model, batch = _model(), tiny_batch()

    def doubled(model, input_ids, attention_mask, labels):
        return 2 * model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss

    plain, weighted = _snapshot(model, batch), _snapshot(model, batch, loss_fn=doubled)
    assert weighted.loss == 2 * plain.loss  # a power of two scales every rounded result exactly
    for role in TOKEN_ROLES:
        for a, b in zip(plain.hidden_grad_mean[role], weighted.hidden_grad_mean[role]):
            assert (math.isnan(a) and math.isnan(b)) or b == 2 * a, role
    assert repr(weighted.context_loss_ratio) == repr(plain.context_loss_ratio)
    for key in EMBEDDING_KEYS[:-1]:
        assert weighted.embedding_grad[key] == 2 * plain.embedding_grad[key], key
    assert weighted.collapse == plain.collapse and weighted.attention_entropy == plain.attention_entropy


# ---------------------------------------------------------------------------------------- errors
def test_unusable_inputs_raise_value_errors_that_say_what_to_do():
    model, batch = _model(), tiny_batch()
    with pytest.raises(ValueError, match="labels have shape .* pass MLM labels shaped like input_ids"):
        training_snapshot(model, batch.input_ids, batch.labels[:, :-1])
    with pytest.raises(ValueError, match="no loss position .* keep at least one label"):
        training_snapshot(model, batch.input_ids, torch.full_like(batch.labels, -100))
    with pytest.raises(ValueError, match=r"no input embeddings .* pass a transformers masked LM"):
        training_snapshot(torch.nn.Linear(3, 3), batch.input_ids, batch.labels)


def test_a_model_without_attention_probabilities_is_told_to_use_eager_or_attention_false():
    model, batch = tiny_model("bert"), tiny_batch()
    model.set_attn_implementation("sdpa")
    with pytest.raises(UsageError, match='attn_implementation="eager".*attention=False'):
        _snapshot(model, batch)
    snap = _snapshot(model, batch, attention=False)
    assert snap.attention_entropy == snap.attention_entropy_max == ()
    assert len(snap.collapse) == 4 and snap.loss > 0


# ---------------------------------------------------------------------------------------- rows and CSV
def test_rows_have_the_callback_columns_groups_and_quantities():
    snap = _snapshot(_model(), tiny_batch(), step=7)
    frame = pd.DataFrame(snap.rows())
    assert tuple(frame.columns) == CALLBACK_COLUMNS and set(frame["step"]) == {7}
    by_quantity = frame.groupby("quantity")["group"].agg(set).to_dict()
    layers = {"embeddings", "blocks.0", "blocks.1", "blocks.2"}
    assert by_quantity == {"loss": {"model"}, "hidden_grad_mean": layers, "context_loss_ratio": layers,
                           "collapse": layers, "attention_entropy": layers - {"embeddings"},
                           "attention_entropy_max": layers - {"embeddings"}, "embedding_grad_norm": {"embeddings.word"}}
    assert set(frame.loc[frame.quantity == "hidden_grad_mean", "role"]) == {"masked", "random", "kept", "context",
                                                                             "special", "pad"}
    assert list(frame.loc[frame.quantity == "embedding_grad_norm", "role"]) == list(EMBEDDING_KEYS)
    assert set(frame.loc[~frame.quantity.isin(["hidden_grad_mean", "embedding_grad_norm"]), "role"]) == {"all"}
    last = frame[(frame.group == "blocks.2") & (frame.quantity == "attention_entropy")]["value"]
    assert list(last) == [snap.attention_entropy[2]]
    assert set(LOSS_ROLES) <= set(snap.hidden_grad_mean)


def test_append_csv_round_trips_and_writes_the_header_once(tmp_path):
    model, batch = _model(), tiny_batch()
    first, second = _snapshot(model, batch, step=1), _snapshot(model, batch, step=2)
    path = tmp_path / "probe" / "snapshots.csv"
    first.append_csv(path)
    second.append_csv(path)
    frame = pd.read_csv(path, float_precision="round_trip")
    expected = pd.DataFrame(first.rows() + second.rows())
    assert tuple(frame.columns) == CALLBACK_COLUMNS
    pd.testing.assert_frame_equal(frame, expected, check_exact=True)
    assert path.read_text().count("step,group,role,quantity,value") == 1
