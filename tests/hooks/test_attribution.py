"""Captum attributions agree exactly with the recorder; the channel view draws and refuses bad input."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from gradflow import GradFlowRecorder, RecorderConfig  # noqa: E402
from gradflow.adapters import adapter_for, block_modules  # noqa: E402
from gradflow.errors import GradflowError  # noqa: E402
from gradflow.hooks.attribution import (  # noqa: E402
    AttributionError,
    MLMObjective,
    attribute_channels,
    block_taps,
    chosen_labels,
    gradient_x_activation,
    integrated_gradients,
    site_hooks,
)
from gradflow.losses import cross_entropy  # noqa: E402
from gradflow.roles import Role  # noqa: E402
from tiny import tiny_batch, tiny_model  # noqa: E402

CROSS_CHECK_FAMILIES = ("bert", "roberta", "deberta-v2", "modernbert", "albert")
NON_LOSS = (Role.CONTEXT, Role.SPECIAL, Role.PAD)


def _record(model, batch, loss="mlm"):
    with GradFlowRecorder(model, RecorderConfig(sublayers=False)) as rec:
        return rec.record(batch, loss=loss, reduction="batch")


@pytest.fixture(scope="module", params=CROSS_CHECK_FAMILIES)
def family_attribution(request):
    model = tiny_model(request.param)
    batch = tiny_batch()
    return request.param, model, batch, gradient_x_activation(model, batch), _record(model, batch)


def test_captum_matches_recorder_at_every_block_output(family_attribution):
    """Captum's gradient (multiply_by_inputs=False) has the recorder's norm at every site, the
    captured activation has the recorder's activation norm, and Captum's g * h is their product."""
    family, model, batch, result, record = family_attribution
    assert result.site_names == ("embeddings.out", *[f"blocks.{i}.out" for i in range(record.num_blocks)])
    for s, site in enumerate(result.site_names):
        grad_norm, act_norm = record.site(site)
        g, h, gh = result.gradient[s], result.activation[s], result.grad_x_act[s]
        torch.testing.assert_close(torch.linalg.vector_norm(g, dim=-1), grad_norm, rtol=1e-6, atol=1e-12,
                                   msg=f"{family} {site} grad")
        torch.testing.assert_close(torch.linalg.vector_norm(h, dim=-1), act_norm, rtol=1e-6, atol=1e-12,
                                   msg=f"{family} {site} act")
        torch.testing.assert_close(gh, g * h, rtol=1e-6, atol=1e-12, msg=f"{family} {site} g*h")
    assert result.loss == pytest.approx(record.loss, rel=1e-6)


def test_last_block_attribution_is_exactly_zero_off_loss(family_attribution):
    family, model, batch, result, record = family_attribution
    last = result.per_position("attribution_norm")[-1]
    for role in NON_LOSS:
        assert torch.all(last[batch.roles == role] == 0), (family, role)
    assert torch.all(last[batch.roles == Role.MASKED] > 0), family
    earlier = result.per_position("grad_norm")[:-1]
    assert torch.all(earlier[:, batch.roles == Role.CONTEXT] > 0), family


def test_frame_is_tidy(family_attribution):
    family, model, batch, result, record = family_attribution
    frame = result.frame()
    n_real = int((batch.roles != Role.PAD).sum())
    assert len(frame) == n_real * len(result.site_names)
    assert {"layer", "position", "role", "attribution_sum", "attribution_norm", "grad_norm", "act_norm"} <= set(frame)
    assert "pad" not in set(frame["role"])
    last = frame[(frame.layer == record.num_blocks) & (frame.role == "context")]
    assert (last.attribution_sum == 0).all() and (last.grad_norm == 0).all()


def test_chosen_positions_match_a_restricted_loss():
    """Attributing one masked position = recording the batch loss restricted to that position."""
    model, batch = tiny_model("bert"), tiny_batch()
    result = gradient_x_activation(model, batch, positions=[(1, 8)])
    labels = chosen_labels(batch, [(1, 8)])
    assert int((labels != -100).sum()) == 1
    record = _record(model, batch, loss=lambda logits, b: cross_entropy(logits, labels, "batch"))
    for s, site in enumerate(result.site_names):
        torch.testing.assert_close(torch.linalg.vector_norm(result.gradient[s], dim=-1), record.site(site)[0],
                                   rtol=1e-6, atol=1e-12)
    # the last block: only the chosen channel carries gradient, the other loss positions too are exactly zero
    last = result.per_position("grad_norm")[-1]
    assert last[1, 8] > 0 and int(torch.count_nonzero(last)) == 1


def test_position_errors():
    batch = tiny_batch()
    with pytest.raises(AttributionError, match="carries no MLM loss"):
        chosen_labels(batch, [(0, 1)])  # a context position
    with pytest.raises(AttributionError, match="outside"):
        chosen_labels(batch, [(0, 99)])
    with pytest.raises(AttributionError, match="no loss position"):
        chosen_labels(batch, torch.zeros_like(batch.roles, dtype=torch.bool))
    assert issubclass(AttributionError, GradflowError)


def test_objective_rows_add_up_to_batch_loss():
    model, batch = tiny_model("bert"), tiny_batch()
    labels = chosen_labels(batch)
    objective = MLMObjective(model, float((labels != -100).sum()))
    with torch.no_grad():
        per_row = objective(batch.input_ids, batch.attention_mask, labels)
        logits = model(**batch.model_inputs()).logits
    assert per_row.shape == (batch.input_ids.shape[0],)
    assert float(per_row.sum()) == pytest.approx(float(cross_entropy(logits, batch.labels, "batch")), rel=1e-6)


@pytest.mark.parametrize("family", ["bert", "deberta-v2"])
def test_integrated_gradients_completeness_and_last_block_zero(family):
    """Layer IG at each site adds up to F(input) - F(baseline) and is exactly zero at context
    channels after the last attention."""
    model, batch = tiny_model(family), tiny_batch()
    attributions, delta = integrated_gradients(model, batch, baseline_token_id=4, n_steps=24)
    labels = chosen_labels(batch)
    objective = MLMObjective(model, float((labels != -100).sum()))
    reference = batch.input_ids.clone()
    real = (batch.roles != Role.SPECIAL) & (batch.roles != Role.PAD)
    reference[real] = 4
    with torch.no_grad():
        change = objective(batch.input_ids, batch.attention_mask, labels) - objective(reference, batch.attention_mask,
                                                                                        labels)
    for s, attr in enumerate(attributions):
        total = attr.sum(dim=(1, 2))
        torch.testing.assert_close(total, change, rtol=0.05, atol=2e-3 * float(change.abs().max()))
        assert torch.all(delta[s].abs() <= 0.05 * change.abs() + 2e-3 * float(change.abs().max()))
    last = torch.linalg.vector_norm(attributions[-1], dim=-1)
    assert torch.all(last[batch.roles == Role.CONTEXT] == 0)


def test_attribute_channels_with_integrated_gradients_frame():
    model, batch = tiny_model("bert"), tiny_batch()
    result = attribute_channels(model, batch, integrated=True, n_steps=4)
    frame = result.frame()
    assert {"ig_sum", "ig_norm", "ig_delta"} <= set(frame)


def test_hooks_and_taps_are_removed_also_on_errors():
    model = tiny_model("albert")  # one shared layer applied at every depth
    adapter = adapter_for(model)
    modules = [m for m in model.modules()]
    before = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules]
    seen: list[str] = []
    with pytest.raises(RuntimeError, match="boom"):
        with site_hooks(model, lambda site, h: seen.append(site), adapter, mid=True):
            model(**tiny_batch().model_inputs())
            raise RuntimeError("boom")
    with block_taps(model, adapter) as taps:
        assert len(taps) == len(block_modules(adapter, model.base_model)) + 1
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in modules] == before
    n = len(block_modules(adapter, model.base_model))
    assert seen == ["embeddings.out", *[f"blocks.{i}.{p}" for i in range(n) for p in ("mid", "out")]]


# ----------------------------------------------------------------------------------------------
# Channel view
# ----------------------------------------------------------------------------------------------

SENTENCE = "The progress of public credit is witnessed by a considerable rise of American stock abroad."


@pytest.fixture(scope="module")
def loaded(tiny_mlm_dir):
    from gradflow.models import load_model

    return load_model(str(tiny_mlm_dir))


def test_channel_view_grad_norm_files_and_zero_column(loaded, tmp_path):
    from gradflow.runs.channels import write_channel_view
    from gradflow.schema import CHANNEL_VIEW_COLUMNS

    paths = write_channel_view(loaded, SENTENCE, tmp_path / "cv", mask_positions=[3, 5], formats=("png",))
    assert [p.name for p in paths] == ["channel_view.png", "channel_view.csv"]
    assert all(p.stat().st_size > 0 for p in paths)
    table = pd.read_csv(paths[-1])
    assert tuple(table.columns) == CHANNEL_VIEW_COLUMNS
    assert set(table.loc[table.position.isin([3, 5]), "role"]) == {"masked"}
    last = len(block_modules(loaded.adapter, loaded.model.base_model)) - 1
    after = table[table.site.isin([f"blocks.{last}.mid", f"blocks.{last}.out"])]
    assert (after.loc[after.role != "masked", "grad_norm"] == 0).all()
    assert (after.loc[after.role == "masked", "grad_norm"] > 0).all()
    before = table[(table.site == f"blocks.{last - 1}.out") & (table.role == "context")]
    assert (before.grad_norm > 0).all()


def test_channel_view_attribution_default_masking(loaded, tmp_path):
    from gradflow.runs.channels import channel_batch, write_channel_view

    batch = channel_batch(loaded, SENTENCE)
    assert bool((batch.roles <= Role.KEPT).any())
    paths = write_channel_view(loaded, SENTENCE, tmp_path, quantity="attribution", formats=("png",))
    table = pd.read_csv(paths[-1])
    assert set(table.site) == {"embeddings.out", *[f"blocks.{i}.out" for i in range(2)]}
    loss_positions = set(torch.nonzero(batch.roles[0] <= Role.KEPT).squeeze(1).tolist())
    last = table[(table.site == "blocks.1.out") & ~table.position.isin(loss_positions)]
    assert (last.attribution_sum == 0).all()


def test_channel_view_plot_marks_zeros_and_roles(loaded):
    import matplotlib.pyplot as plt

    from gradflow.figures.channel_view import plot_channel_view
    from gradflow.runs.channels import channel_batch, channel_table

    table = channel_table(loaded, channel_batch(loaded, SENTENCE, [2]), "grad_norm")
    drawn = plot_channel_view(table)
    gids = [a.get_gid() for a in drawn]
    n_tok = table.position.nunique()
    unmasked = int((table[table.site == "embeddings.out"].role != "masked").sum())
    assert gids.count("channels:zero") == 2 * unmasked  # the last block's mid and out columns
    assert sum(1 for g in gids if g and g.startswith("channels:role:")) == n_tok
    assert "channels:last_block" in gids
    plt.close("all")


@pytest.mark.parametrize("kwargs, match", [
    ({"text": "credit " * 80}, "accepts at most"),
    ({"text": SENTENCE, "mask_positions": [99]}, "out of range"),
    ({"text": SENTENCE, "mask_positions": [0]}, "special token"),
    ({"text": SENTENCE, "mask_positions": []}, "empty"),
    ({"text": SENTENCE, "quantity": "nonsense"}, "unknown quantity"),
])
def test_channel_view_errors(loaded, tmp_path, kwargs, match):
    from gradflow.errors import ChannelViewError
    from gradflow.runs.channels import write_channel_view

    with pytest.raises(ChannelViewError, match=match):
        write_channel_view(loaded, out_dir=tmp_path, formats=("png",), **kwargs)
    assert issubclass(ChannelViewError, GradflowError)
    assert not (tmp_path / "channel_view.png").exists()
