"""pretrain.py's objectives of issue 52 (analyses/pretraining/objectives.py): 40% masking and masked diffusion.

mini-en's data order kept (the generator advances exactly as under mini-en's corruption), the corruption as
documented, and the diffusion loss equal to the library's ``weighted_cross_entropy`` (LLaDA's normalisation).
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from analyses.pretraining import objectives, pretrain
from transformers import RoFormerConfig, RoFormerForMaskedLM

from gradflow.losses import weighted_cross_entropy

TOKENIZER = SimpleNamespace(cls_token_id=2, sep_token_id=3, pad_token_id=0, mask_token_id=4)
VOCAB = 64


class _Tok(SimpleNamespace):
    def __len__(self) -> int:
        return VOCAB


TOK = _Tok(**vars(TOKENIZER))


def windows(b: int = 6, t: int = 20, seed: int = 0) -> torch.Tensor:
    """(b, t) ids: [CLS] words [SEP], the last two windows padded after 12 tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (b, t), generator=gen)
    ids[:, 0] = 2
    ids[:, -1] = 3
    ids[-2:, 12] = 3
    ids[-2:, 13:] = 0
    return ids


def mini_ens_corruption(ids: torch.Tensor, tokenizer, gen: torch.Generator, alltoken: bool):
    """mini-en's corruption as pretrain.py wrote it when mini-en was trained (the reference, by hand)."""
    special = (ids == tokenizer.cls_token_id) | (ids == tokenizer.sep_token_id) | (ids == tokenizer.pad_token_id)
    u = torch.rand(ids.shape, generator=gen)
    selected = (u < 0.15) & ~special
    action = torch.rand(ids.shape, generator=gen)
    inputs = ids.clone()
    inputs[selected & (action < 0.8)] = tokenizer.mask_token_id
    rand_pos = selected & (action >= 0.8) & (action < 0.9)
    inputs[rand_pos] = torch.randint(len(tokenizer), ids.shape, generator=gen)[rand_pos]
    loss_at = ~special if alltoken else selected
    return inputs, torch.where(loss_at, ids, torch.full_like(ids, -100)), selected


@pytest.mark.parametrize("objective", ["mask40", "diffusion"])
def test_the_generator_advances_as_under_mini_ens_corruption(objective: str) -> None:
    """After one corruption the recipe's generator is where mini-en's leaves it: the next windows are mini-en's."""
    ids = windows()
    ours, theirs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    objectives.corrupt(objective, ids, TOK, ours, torch.Generator().manual_seed(6))
    mini_ens_corruption(ids, TOK, theirs, alltoken=False)
    assert torch.equal(ours.get_state(), theirs.get_state())


@pytest.mark.parametrize("objective", ["mlm", "alltoken"])
def test_at_15_percent_the_corruption_is_mini_ens(objective: str) -> None:
    ids = windows()
    got = objectives.corrupt(objective, ids, TOK, torch.Generator().manual_seed(1))
    inputs, labels, selected = mini_ens_corruption(ids, TOK, torch.Generator().manual_seed(1), alltoken=objective == "alltoken")
    assert torch.equal(pretrain.corrupt(ids, TOK, torch.Generator().manual_seed(1), objective == "alltoken")[0], inputs)
    assert torch.equal(got.inputs, inputs) and torch.equal(got.labels, labels) and torch.equal(got.selected, selected)


def test_mask40_selects_40_percent_with_80_10_10() -> None:
    ids = windows(b=64, t=128)
    got = objectives.corrupt("mask40", ids, TOK, torch.Generator().manual_seed(0))
    special = objectives.special_positions(ids, TOK)
    share = float(got.selected.sum()) / float((~special).sum())
    assert 0.38 < share < 0.42
    masked = float((got.inputs[got.selected] == TOK.mask_token_id).float().mean())
    kept = float((got.inputs[got.selected] == ids[got.selected]).float().mean())
    assert 0.77 < masked < 0.83 and 0.08 < kept < 0.13
    assert torch.equal(got.labels != -100, got.selected) and got.ratio is None


def test_diffusion_masks_every_selected_token_at_its_windows_ratio() -> None:
    ids = windows(b=200, t=128)
    got = objectives.corrupt("diffusion", ids, TOK, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1))
    special = objectives.special_positions(ids, TOK)
    assert not got.selected[special].any()
    assert bool((got.inputs[got.selected] == TOK.mask_token_id).all())
    assert torch.equal(got.inputs[~got.selected], ids[~got.selected])
    assert torch.equal(got.labels != -100, got.selected)
    assert float(got.ratio.min()) >= objectives.EPS and float(got.ratio.max()) <= 1.0
    share = got.selected.sum(dim=1).float() / (~special).sum(dim=1).float()
    # each window's share is its ratio t up to binomial noise (126 tokens: sd <= 0.045)
    assert float((share - got.ratio).abs().max()) < 0.2
    assert abs(float(share.mean() - got.ratio.mean())) < 0.01
    assert 0.4 < float(got.ratio.mean()) < 0.6  # U(eps, 1) over 200 windows


def tiny_model() -> RoFormerForMaskedLM:
    torch.manual_seed(0)
    model = RoFormerForMaskedLM(RoFormerConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=48, max_position_embeddings=32,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    return model.eval()


@pytest.mark.parametrize("objective", ["mask40", "diffusion"])
def test_the_loss_is_the_reference_loss_on_the_whole_logits(objective: str) -> None:
    """Diffusion: ``sum CE / t`` over the masked positions divided by the batch's real tokens (LLaDA), as
    ``gradflow.losses.weighted_cross_entropy`` computes it on the logits of every position; mask40: the mean CE."""
    model, ids = tiny_model(), windows()
    batch = objectives.corrupt(objective, ids, TOK, torch.Generator().manual_seed(3), torch.Generator().manual_seed(4))
    attention = (ids != 0).long()
    loss, logits, targets = objectives.objective_loss(model, batch, attention)
    full = model(input_ids=batch.inputs, attention_mask=attention).logits
    if objective == "diffusion":
        weights = (1 / batch.ratio)[:, None].expand_as(ids)
        want = weighted_cross_entropy(full, batch.labels, weights, attention.sum(dim=1).float())
        hand = sum(F.cross_entropy(full[b, p], ids[b, p]) / batch.ratio[b] for b, p in batch.selected.nonzero()) / attention.sum()
        torch.testing.assert_close(want, hand, rtol=1e-6, atol=0)
    else:
        want = F.cross_entropy(full.reshape(-1, VOCAB), batch.labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=0)
    assert logits.shape == (int(batch.selected.sum()), VOCAB) and torch.equal(targets, ids[batch.selected])


def test_head_rows_round_up_to_a_multiple() -> None:
    labels = torch.full((4, 128), -100)
    assert objectives.head_rows(labels) == objectives.HEAD_ROWS
    labels[:, :70] = 1
    assert objectives.head_rows(labels) == 2 * objectives.HEAD_ROWS  # 280 positions


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnoprstuw") for _ in range(rng.randint(2, 7))) for _ in range(150)]
    for split, n_docs in (("train", 40), ("valid", 8)):
        docs = [" ".join(rng.choice(words) for _ in range(rng.randint(30, 120))) for _ in range(n_docs)]
        (root / f"{split}.txt").write_text("\n".join(docs) + "\n")
    return root


@pytest.mark.parametrize("objective", ["mask40", "diffusion"])
def test_pretrain_py_trains_the_objective_and_logs_its_own_metrics(objective: str, corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    pretrain.main(["--corpus", str(corpus), "--tokenizer", str(corpus / "tok"), "--out", str(out), "--vocab-size",
                   "256", "--steps", "3", "--warmup", "1", "--batch-size", "2", "--valid-windows", "4", "--eval-every",
                   "3", "--loss", objective])
    with open(out / "training_log.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["step"] for r in rows] == ["1", "2", "3"] and all(float(r["train_loss"]) > 0 for r in rows)
    assert float(rows[-1]["own_loss"]) > 0 and 0 <= float(rows[-1]["own_top1"]) <= 1
    assert float(rows[-1]["valid_loss"]) > 0  # BERT 15% validation, as mini-en's log
    with pytest.raises(SystemExit):
        pretrain.main(["--out", str(out), "--loss", objective, "--sparse"])


def test_a_pretraining_run_stopped_and_resumed_equals_one_that_never_stopped(corpus: Path, tmp_path: Path,
                                                                              capsys) -> None:
    from safetensors.torch import load_file

    def run(out: Path, *extra: str) -> None:
        pretrain.main(["--corpus", str(corpus), "--tokenizer", str(corpus / "tok"), "--out", str(out),
                       "--vocab-size", "256", "--steps", "5", "--warmup", "2", "--batch-size", "2", "--valid-windows",
                       "4", "--eval-every", "2", "--loss", "diffusion", *extra])

    run(tmp_path / "whole")
    assert not (tmp_path / "whole/checkpoint.pt").exists()  # a finished run leaves no state
    cut = tmp_path / "cut"
    run(cut, "--max-minutes", "0")  # past its deadline at once: stops after step 1 with its state
    assert torch.load(cut / "checkpoint.pt", weights_only=True)["step"] == 2
    assert "rerun to resume" in capsys.readouterr().out and not (cut / "model.safetensors").exists()
    with pytest.raises(SystemExit, match="flags lr differ"):
        run(cut, "--lr", "5e-4")
    run(cut, "--max-minutes", "0", "--state-every", "1")  # step 2, then stops again
    run(cut, "--state-every", "1")
    logs = [list(csv.DictReader(open(d / "training_log.csv"))) for d in (tmp_path / "whole", cut)]
    for row in logs[0] + logs[1]:
        row.pop("elapsed_s")
    assert logs[0] == logs[1] and len(logs[0]) == 5  # every step's loss, rate, tokens and evaluation
    a, b = (load_file(d / "model.safetensors") for d in (tmp_path / "whole", cut))
    assert all(torch.equal(a[k], b[k]) for k in a)
    recipes = [json.loads((d / "recipe.json").read_text()) for d in (tmp_path / "whole", cut)]
    assert recipes[0]["final"] == recipes[1]["final"] and recipes[0]["tokens_seen"] == recipes[1]["tokens_seen"]


@pytest.mark.parametrize("variant, unchanged_share, random_share", [
    ("allmask15", 0.0, 0.0), ("mlm15", 0.1, 0.1), ("maskkept15", 0.1, 0.0), ("maskrandom15", 0.0, 0.1)])
def test_the_diagnostic_corruptions_are_mini_ens_selection_with_their_documented_actions(
        variant: str, unchanged_share: float, random_share: float) -> None:
    """diagnose_diffusion's BERT-15% variants select exactly mini-en's positions and labels; of the selected ones,
    each masks, keeps or randomises the documented shares (allmask15 masks all, maskkept15 keeps mini-en's kept
    10%, maskrandom15 keeps its random 10%)."""
    from analyses.pretraining import diagnose_diffusion

    ids = windows(b=64, t=64)
    reference = objectives.corrupt_bert(ids, TOK, torch.Generator().manual_seed(3), 0.15)
    got = diagnose_diffusion.corruption(variant)("mlm", ids, TOK, torch.Generator().manual_seed(3))
    assert torch.equal(got.selected, reference.selected) and torch.equal(got.labels, reference.labels)
    sel = got.selected
    masked = sel & (got.inputs == TOK.mask_token_id)
    unchanged = sel & (got.inputs == ids)
    randomised = sel & ~masked & ~unchanged
    assert torch.equal(got.inputs[~sel], ids[~sel])
    ref_unchanged = sel & (reference.inputs == ids)
    ref_random = sel & (reference.inputs != TOK.mask_token_id) & ~ref_unchanged
    assert torch.equal(unchanged, ref_unchanged if unchanged_share else torch.zeros_like(sel))
    assert torch.equal(randomised, ref_random if random_share else torch.zeros_like(sel))
    n = int(sel.sum())
    assert n > 400 and abs(int(masked.sum()) / n - (1 - unchanged_share - random_share)) < 0.05


def test_the_unweighted_diagnostic_is_the_diffusion_corruption_with_t_one_while_it_trains(monkeypatch) -> None:
    """diagnose_diffusion's ``unweighted`` is the diffusion corruption with every ratio 1, also once run() has put it
    in objectives.corrupt's place (it once called itself there, without end)."""
    from analyses.pretraining import diagnose_diffusion

    ids = windows()
    reference = objectives.corrupt("diffusion", ids, TOK, torch.Generator().manual_seed(3),
                                   torch.Generator().manual_seed(4))
    unweighted = diagnose_diffusion.corruption("unweighted")
    monkeypatch.setattr(objectives, "corrupt", unweighted)
    got = objectives.corrupt("diffusion", ids, TOK, torch.Generator().manual_seed(3), torch.Generator().manual_seed(4))
    assert torch.equal(got.inputs, reference.inputs) and torch.equal(got.labels, reference.labels)
    assert torch.equal(got.ratio, torch.ones(ids.shape[0])) and not torch.equal(reference.ratio, got.ratio)
