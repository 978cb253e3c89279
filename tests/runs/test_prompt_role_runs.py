"""The ``prompt`` role in recorded runs: an SFT run's ``prompt`` rows hold exactly what autograd gives at the prompt's
positions, the context / loss ratio leaves them out, a run without a prompt has no ``prompt`` row, and run
directories and checkpoints written before the role still load."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gradflow import GradFlowRecorder, RecorderConfig
from gradflow.adapters import adapter_for, get_module
from gradflow.analysis import load_run, read_sublayer_sequences, role_profile, role_ratios
from gradflow.inputs.corpus import read_documents
from gradflow.inputs.masking import MaskedDiffusion
from gradflow.inputs.pipeline import masked_batches
from gradflow.inputs.prompted import PromptFields
from gradflow.losses import get_loss
from gradflow.models import load_model
from gradflow.roles import LOSS_ROLES, TOKEN_ROLES, Role
from gradflow.runs.aggregate import SiteAggregator, SublayerAggregator
from gradflow.runs.checkpoint import Checkpoint
from gradflow.runs.record import RecordConfig, record_corpus
from gradflow.runs.resume import SITE_ARRAYS, restore_aggregators
from gradflow.schema import REPORTED_ROLES

PAIRS = [("What did the president say about public credit?",
          "The progress of public credit is witnessed by a considerable rise of American stock abroad."),
         ("Name a blessing of the year.", "The abundant fruits of another year have blessed our country with plenty."),
         ("What must we ensure?", "We must ensure that the laws are faithfully executed and the union preserved."),
         ("What will Congress consider?", "Congress will consider the state of the treasury and the revenues.")]
FIGURES = Path(__file__).resolve().parents[2] / "figures"


@pytest.fixture(scope="module")
def sft_batch(tmp_path_factory, tiny_mlm_dir):
    """The tiny BERT, a prompt/response corpus of four pairs, its recording's settings (t = 0.5) and its one batch."""
    path = tmp_path_factory.mktemp("sft") / "sft.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "response": r}) for p, r in PAIRS) + "\n", encoding="utf-8")
    config = RecordConfig(out=str(path.with_name("run")), model=str(tiny_mlm_dir), texts=str(path), max_length=64,
                          objective=MaskedDiffusion(ratio=0.5), prompted=PromptFields(), quiet=True)
    loaded = load_model(str(tiny_mlm_dir))
    batches = list(masked_batches(loaded.tokenizer, read_documents(path, PromptFields()), config.policy(),
                                  config.max_length, config.batch_size))
    assert len(batches) == 1
    return config, loaded, batches[0]


@pytest.fixture(scope="module")
def sft(sft_batch):
    """:func:`sft_batch` and the run recorded from its corpus."""
    config, loaded, batch = sft_batch
    record_corpus(config)
    return config, loaded, batch, load_run(config.out)


def _autograd(loaded, batch, reduction: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-position (B, T) norms from autograd: the loss gradient at every site's ``out`` (embeddings, then each
    block), and ``||g_t|| ||x_t||`` of every block's ``attn.q`` weight gradient."""
    model = loaded.model
    q_path = adapter_for(model).sublayers["attn.q"].path
    inputs, outputs = [], []

    def keep(module, args, output) -> None:
        inputs.append(args[0])
        outputs.append(output)

    handles = [get_module(block, q_path).register_forward_hook(keep) for block in GradFlowRecorder(model).blocks]
    try:
        out = model(**batch.model_inputs(), output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    loss = get_loss("mlm", reduction)(out.logits, batch)
    grads = torch.autograd.grad(loss, [*out.hidden_states, *outputs])
    sites = [g.norm(dim=-1) for g in grads[:len(out.hidden_states)]]
    q = [g.norm(dim=-1) * x.detach().norm(dim=-1) for g, x in zip(grads[len(out.hidden_states):], inputs)]
    return sites, q


def _per_sequence(values: torch.Tensor, batch, role: Role) -> dict[int, float]:
    """sequence_index -> the sum of (B, T) ``values`` over the row's positions of ``role`` (float64)."""
    at = batch.roles == role
    return {int(s): float(values[b][at[b]].double().sum()) for b, s in enumerate(batch.sequence_index)}


@pytest.mark.slow
def test_prompt_rows_sum_to_what_autograd_gives(sft):
    config, loaded, batch, run = sft
    prompt = batch.roles == Role.PROMPT
    assert int(prompt.sum()) >= 16 and run.meta["counts"]["tokens_per_role"]["prompt"] == int(prompt.sum())
    sites, q = _autograd(loaded, batch, config.reduction)
    rows = run.sequences[(run.sequences.role == "prompt") & (run.sequences.point == "out")]
    assert sorted(rows.layer.unique()) == list(range(len(sites)))
    for layer, norms in enumerate(sites):  # layer 0: embeddings.out; i + 1: blocks.i.out
        got = rows[rows.layer == layer].set_index("sequence_index")
        want = _per_sequence(norms, batch, Role.PROMPT)
        assert got.n_positions.to_dict() == {s: int(n) for s, n in zip(batch.sequence_index.tolist(),
                                                                          prompt.sum(1).tolist())}
        np.testing.assert_allclose(got.grad_norm_sum.reindex(list(want)).to_numpy(), list(want.values()),
                                   rtol=1e-5, atol=0)
        total = float(norms[prompt].double().sum())
        channel = run.channels.query("role == 'prompt' and point == 'out' and layer == @layer")
        np.testing.assert_allclose(channel.grad_norm_mean.item(), total / int(prompt.sum()), rtol=1e-5)
        if layer == len(sites) - 1:  # after the last block: no gradient at all at a clean channel
            assert total == 0.0 and (got.grad_norm_sum == 0).all()
        else:
            assert total > 0
    subs = read_sublayer_sequences(run)
    q_rows = subs[(subs.role == "prompt") & (subs.sublayer == "attn.q")]
    for depth, mags in enumerate(q):
        got = q_rows[q_rows.layer == depth + 1].set_index("sequence_index").magnitude_sum
        want = _per_sequence(mags, batch, Role.PROMPT)
        np.testing.assert_allclose(got.reindex(list(want)).to_numpy(), list(want.values()), rtol=1e-5, atol=0)
        assert (sum(want.values()) == 0) == (depth == len(q) - 1)  # the last block's query: exactly 0 from them


def test_prompt_role_matrices_sum_with_the_others_to_autograd(sft_batch):
    """The per-role split of every sublayer parameter, ``prompt`` one of its roles, sums to autograd's gradient;
    the prompt's part of the last block's query is exactly zero and of every earlier block's is not."""
    config, loaded, batch = sft_batch
    model = loaded.model
    with GradFlowRecorder(model, RecorderConfig(materialize=True)) as rec:
        record = rec.record(batch, reduction=config.reduction)
    loss = get_loss("mlm", config.reduction)(model(**batch.model_inputs()).logits, batch)
    params = dict(model.named_parameters())
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)))
    floor = 1e-3 * max(float(g.norm()) for g in grads.values() if g is not None)
    full = {id(p): n for n, p in params.items()}
    adapter, blocks = adapter_for(model), rec.blocks
    keys = {(d, s, p) for d, s, p, _ in record.matrices}
    assert {role for *_, role in record.matrices} >= {"prompt", "context", "masked"}
    for depth, sublayer, param in keys:
        weight = getattr(get_module(blocks[depth], adapter.sublayers[sublayer].path), param)
        total = sum(m.double() for (d, s, p, _), m in record.matrices.items() if (d, s, p) == (depth, sublayer, param))
        want = grads[full[id(weight)]].double()
        assert float((total - want).norm()) <= 1e-5 * max(float(want.norm()), floor), (depth, sublayer, param)
        if sublayer == "attn.q" and param == "weight":
            prompt_part = record.matrices[(depth, sublayer, param, "prompt")]
            assert (torch.count_nonzero(prompt_part) == 0) == (depth == record.num_blocks - 1)


@pytest.mark.slow
def test_the_context_ratio_leaves_the_prompt_out(sft):
    config, loaded, batch, run = sft
    sites, _ = _autograd(loaded, batch, config.reduction)
    ratios = role_ratios(run, ("context", "prompt"), n_resamples=50).set_index(["layer", "role"])
    context, loss, prompt = batch.roles == Role.CONTEXT, batch.roles <= Role.KEPT, batch.roles == Role.PROMPT
    assert ratios.loc[(1, "context"), "n_positions"] == int(context.sum())  # the response's clean tokens only
    for layer, norms in enumerate(sites[:-1]):
        loss_mean = float(norms[loss].double().mean())
        want = float(norms[context].double().mean()) / loss_mean
        with_prompt = float(norms[context | prompt].double().mean()) / loss_mean  # what context was before
        np.testing.assert_allclose(ratios.loc[(layer, "context"), "ratio"], want, rtol=1e-5)
        np.testing.assert_allclose(ratios.loc[(layer, "prompt"), "ratio"],
                                   float(norms[prompt].double().mean()) / loss_mean, rtol=1e-5)
        assert abs(with_prompt - want) > 1e-3 * want  # the test tells the two apart
    profile = role_profile(run, n_resamples=50)
    assert list(dict.fromkeys(profile.role)) == ["masked", "context", "prompt", "special", "loss"]  # display order
    assert set(run.sublayers.role) == {"masked", "context", "prompt", "special"}


@pytest.mark.slow
def test_a_run_without_a_prompt_has_no_prompt_row(tmp_path, tiny_mlm_dir, tiny_corpus):
    for name, objective in (("bert", None), ("diffusion", MaskedDiffusion())):
        out = tmp_path / name
        record_corpus(RecordConfig(out=str(out), model=str(tiny_mlm_dir), texts=str(tiny_corpus), limit=6,
                                   max_length=64, objective=objective, quiet=True))
        run = load_run(out)
        subs = read_sublayer_sequences(run, None)
        for frame in (run.channels, run.sublayers, run.sequences, subs):
            assert "prompt" not in set(frame.role) and "context" in set(frame.role)
        tokens = run.meta["counts"]["tokens_per_role"]
        assert list(tokens) == sorted(TOKEN_ROLES) and tokens["prompt"] == 0  # meta.json's keys are sorted
        n = run.channels.query("point == 'out' and layer == 0").set_index("role").n_positions
        assert n.to_dict() == {r: tokens[r] for r in REPORTED_ROLES if tokens[r]}  # every other role where it was


@pytest.mark.parametrize("run", ["mini-en_mlm", "mini-en-alltoken_all-positions", "zoo-rxnfp_mlm"])
def test_a_run_directory_written_before_the_prompt_role_loads(run):
    loaded = load_run(FIGURES / "runs" / run)
    assert "prompt" not in set(loaded.channels.role) and "prompt" not in loaded.meta["counts"]["tokens_per_role"]
    assert set(loaded.channels.role) <= set(REPORTED_ROLES) and {"context", "masked"} <= set(loaded.channels.role)
    profile = role_profile(loaded, n_resamples=20)
    assert "prompt" not in set(profile.role) and set(LOSS_ROLES) <= set(profile.role)


def test_a_checkpoint_written_before_the_prompt_role_resumes_with_a_zero_prompt_column():
    names, layers, points = ("embeddings.out", "blocks.0.out"), (0, 1), ("out", "out")
    fresh = SiteAggregator(names, layers, points)
    old_roles = [r for r in REPORTED_ROLES if r != "prompt"]  # the five columns of a checkpoint before the role
    rng = np.random.default_rng(0)
    saved = {name: rng.random((2, len(old_roles), *getattr(fresh, name).shape[2:])) for name in SITE_ARRAYS}
    tensors = {f"sites.{k}": torch.from_numpy(v) for k, v in saved.items()}
    checkpoint = Checkpoint({"sublayer_keys": []}, {**tensors, "subs.sums": torch.zeros(0, 6, dtype=torch.float64)})
    restored = SiteAggregator(names, layers, points)
    restore_aggregators(checkpoint, restored, SublayerAggregator())
    at = REPORTED_ROLES.index("prompt")
    for name in SITE_ARRAYS:
        array = getattr(restored, name)
        assert array.shape == getattr(fresh, name).shape and (array[:, at] == 0).all()
        np.testing.assert_array_equal(np.delete(array, at, axis=1), saved[name])
