"""Issue 60's diagnosis: the factorial's cells (corruptions, t samplers), the runner on a short run, and the plan's
rules and table, recomputed from the committed runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import BertTokenizerFast

from analyses.diffusion_diagnosis import cells as C
from analyses.diffusion_diagnosis import table as T
from analyses.pretraining import objectives

REPO = Path(__file__).resolve().parents[2]
COMMITTED = REPO / "figures/diffusion-diagnosis"
TOKENIZER = REPO / "src/gradflow/models/gradflow-mini-en"


@pytest.fixture(scope="module")
def tokenizer() -> BertTokenizerFast:
    return BertTokenizerFast.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def windows(tokenizer) -> torch.Tensor:
    from analyses.pretraining.pretrain import window_rows
    from conftest import SAMPLE_LINES

    rows = []
    for line in SAMPLE_LINES:
        rows += window_rows(tokenizer, tokenizer(line, add_special_tokens=False)["input_ids"], 128)
    return torch.tensor(rows[:48] * (48 // len(rows[:48]) + 1))[:48]


# ----------------------------------------------------------------------------------------------- cells
@pytest.mark.parametrize("sampler", C.SAMPLERS)
def test_every_sampler_draws_t_in_its_range(sampler: str) -> None:
    t = C.draw_t(sampler, 4096, torch.Generator().manual_seed(0))
    top = 0.5 if sampler == "low" else 1.0
    assert t.shape == (4096,) and float(t.min()) >= C.EPS and float(t.max()) <= top
    assert abs(float(t.mean()) - (C.EPS + top) / 2) < 0.02  # each is symmetric about the middle of its range


def test_the_antithetic_draw_spreads_a_batch_evenly_and_the_bell_draw_avoids_the_ends() -> None:
    t = C.draw_t("antithetic", 16, torch.Generator().manual_seed(3))
    gaps = torch.diff(torch.sort((t - C.EPS) / (1 - C.EPS)).values)
    torch.testing.assert_close(gaps, torch.full((15,), 1 / 16), rtol=0, atol=1e-5)
    bell = C.draw_t("bell", 20000, torch.Generator().manual_seed(0))
    uniform = C.draw_t("uniform", 20000, torch.Generator().manual_seed(0))
    assert float(((bell < 0.1) | (bell > 0.9)).float().mean()) < 0.5 * float(((uniform < 0.1) | (uniform > 0.9)).float().mean())


def test_the_diffusion_cells_mask_every_selected_token_and_the_kept_cells_leave_a_tenth(tokenizer, windows) -> None:
    for name, kept in (("base", 0.0), ("kept", 0.1)):
        gen, ratio_gen = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
        batch = C.corrupt(C.cell(name), windows, tokenizer, gen, ratio_gen)
        unchanged = batch.selected & (batch.inputs == windows)
        masked = batch.selected & (batch.inputs == tokenizer.mask_token_id)
        assert bool((unchanged | masked)[batch.selected].all())  # no random tokens
        assert torch.equal(batch.labels != -100, batch.selected)
        share = float(unchanged.sum()) / float(batch.selected.sum())
        assert share == 0.0 if kept == 0 else 0.06 < share < 0.14
        assert batch.ratio is not None and batch.ratio.shape == (len(windows),)
    # the same generators give the same selection and t with or without kept tokens: only the inputs differ
    a = C.corrupt(C.cell("base"), windows, tokenizer, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1))
    b = C.corrupt(C.cell("kept"), windows, tokenizer, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1))
    assert torch.equal(a.selected, b.selected) and torch.equal(a.ratio, b.ratio)


def test_bert15_is_mini_ens_corruption_and_the_acceptance_corruption_masks_at_t(tokenizer, windows) -> None:
    ours = C.corrupt(C.cell("bert15"), windows, tokenizer, torch.Generator().manual_seed(5), torch.Generator())
    theirs = objectives.corrupt_bert(windows, tokenizer, torch.Generator().manual_seed(5), 0.15)
    assert torch.equal(ours.inputs, theirs.inputs) and torch.equal(ours.labels, theirs.labels) and ours.ratio is None
    at = C.corrupt_at(windows, tokenizer, 0.5, torch.Generator().manual_seed(0))
    real = ~objectives.special_positions(windows, tokenizer)
    assert 0.45 < float(at.selected.sum()) / float(real.sum()) < 0.55
    assert bool((at.inputs[at.selected] == tokenizer.mask_token_id).all()) and not bool(at.selected[~real].any())
    assert C.unweighted(at).ratio is None


def test_cells_say_what_they_change_and_refuse_impossible_recipes() -> None:
    assert C.CELLS[0].name == "base" and C.cell("base").changes() == ()
    assert C.cell("mdlm").changes() == ("untied embeddings", "zero-initialised output", "t antithetic",
                                        "lr 0.0003 constant")
    assert [c.name for c in C.CELLS if not c.candidate] == ["kept", "untied-kept", "untied-zero-kept", "bert15"]
    with pytest.raises(ValueError, match="needs untied embeddings"):
        C.Cell("x", zero_output=True)
    with pytest.raises(ValueError, match="choose one of uniform"):
        C.Cell("x", sampler="cosine")
    with pytest.raises(ValueError, match="the cells are base, kept"):
        C.cell("nope")


# ----------------------------------------------------------------------------------------------- the runner
def test_a_short_run_trains_measures_and_writes_its_files(tmp_path: Path, tokenizer, windows, monkeypatch) -> None:
    from analyses.diffusion_diagnosis import train

    monkeypatch.setattr(train, "CHECKPOINTS", (0, 2))
    for name, value in (("EVAL_WINDOWS", 4), ("FINAL_WINDOWS", 8), ("OWN_WINDOWS", 4), ("PROBE_WINDOWS", 4)):
        monkeypatch.setattr(train, name, value)
    torch.set_num_threads(2)
    record = train.run_cell(C.cell("untied-zero"), 0, 2, (tokenizer, windows, windows), tmp_path, save=True)
    saved = __import__("transformers").AutoModelForMaskedLM.from_pretrained(tmp_path / "untied-zero-s0.model")
    assert not saved.config.tie_word_embeddings and (tmp_path / "untied-zero-s0.model" / "tokenizer.json").exists()
    assert [c["step"] for c in record["checkpoints"]] == [0, 2]
    assert set(record["final"]) >= {"mask15_top1", "own_loss", "mask50_top1", "bert15_top1"}
    assert record["candidate"] and record["precision"] == "float32"
    frame = __import__("pandas").read_csv(tmp_path / "untied-zero-s0.csv")
    assert set(frame["probe"]) == {"own", "t0.15"} and set(frame["step"]) == {0, 2}
    tied = frame[(frame.quantity == "embedding_grad_norm") & (frame.role == "tied")]["value"]
    assert set(tied) == {0.0}  # the cell's output layer is its own matrix
    # a zero output layer sends no gradient into the body at step 0: every hidden-state gradient is exactly 0
    start = frame[(frame.step == 0) & (frame.quantity == "hidden_grad_mean")]["value"]
    assert len(start) and set(start) == {0.0}
    last = frame[(frame.step == 2) & (frame.quantity == "hidden_grad_mean") & (frame.group == "blocks.5")
                 & (frame.role == "context")]["value"]
    assert list(last) == [0.0, 0.0]  # no mixing after the last block (both probes)


def shrink(monkeypatch, train) -> None:
    for name, value in (("EVAL_WINDOWS", 4), ("FINAL_WINDOWS", 8), ("OWN_WINDOWS", 4), ("PROBE_WINDOWS", 4)):
        monkeypatch.setattr(train, name, value)
    monkeypatch.setattr(train, "CHECKPOINTS", (0, 2, 4))
    torch.set_num_threads(2)


def test_a_run_stopped_and_resumed_equals_one_that_never_stopped(tmp_path: Path, tokenizer, windows,
                                                                 monkeypatch) -> None:
    from analyses.diffusion_diagnosis import train
    from safetensors.torch import load_file

    shrink(monkeypatch, train)
    data, c = (tokenizer, windows, windows), C.cell("mdlm")
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    whole.mkdir(), cut.mkdir()
    once = train.run_cell(c, 0, 5, data, whole, save=True, budgets=[3])
    assert [r["step"] for r in once["budgets"]] == [3, 5] and "own_loss" in once["budgets"][0]
    assert "own_loss" not in once["checkpoints"][1]  # step 2: an ordinary checkpoint
    assert not (whole / "mdlm-s0.state.pt").exists()  # a finished run leaves no state
    # a deadline in the past stops the run after each training step, its state kept; the third call finishes it
    assert train.run_cell(c, 0, 5, data, cut, save=True, budgets=[3], deadline=0.0) is None
    partial = json.loads((cut / "mdlm-s0.partial.json").read_text())
    assert partial["partial"] and [r["step"] for r in partial["checkpoints"]] == [0]
    assert train.run_cell(c, 0, 5, data, cut, save=True, budgets=[3], deadline=0.0) is None
    assert torch.load(cut / "mdlm-s0.state.pt", weights_only=True)["step"] == 2
    resumed = train.run_cell(c, 0, 5, data, cut, save=True, budgets=[3])
    assert [r["step"] for r in resumed["checkpoints"]] == [0, 2, 3, 4, 5]
    untimed = [[{k: v for k, v in r.items() if k not in ("wall_s", "cpu_s")} for r in run["checkpoints"]]
               for run in (once, resumed)]
    assert untimed[0] == untimed[1]  # every measure, bit for bit
    assert all(r["cpu_s"] >= 0 for r in resumed["checkpoints"])  # the times so far, the resumed calls' included
    for name in ("mdlm-s0-3.model", "mdlm-s0.model"):
        x, y = load_file(whole / name / "model.safetensors"), load_file(cut / name / "model.safetensors")
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    frames = [__import__("pandas").read_csv(d / "mdlm-s0.csv") for d in (whole, cut)]
    assert frames[0].equals(frames[1])  # no snapshot row lost or repeated


def test_long_runs_of_a_decaying_schedule_and_misplaced_budgets_are_refused(capsys) -> None:
    from analyses.diffusion_diagnosis import train

    for argv in (["--cells", "base", "--steps", "4000"], ["--cells", "mdlm", "--steps", "100", "--budgets", "100"]):
        with pytest.raises(SystemExit):
            train.main(argv)
        assert "--" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- rules
def results_of(scores: dict[str, tuple[float, float]]) -> dict[str, T.CellResult]:
    out = {}
    for c in C.CELLS:
        pair = scores.get(c.name)
        finals = {s: {"mask15_top1": v, "mask15_loss": 6.0} for s, v in enumerate(pair)} if pair else {}
        out[c.name] = T.CellResult(c.name, {s: f["mask15_top1"] for s, f in finals.items()}, finals, 600)
    return out


ALL_LOW = {c.name: (0.06, 0.061) for c in C.CELLS}


def test_the_confound_reading_and_the_recipe() -> None:
    scores = {**ALL_LOW, "kept": (0.20, 0.21), "untied": (0.18, 0.17), "untied-kept": (0.185, 0.18),
              "untied-zero": (0.19, 0.185), "mdlm": (0.15, 0.16)}
    results = results_of(scores)
    by = {c.label: c for c in T.contrasts(results)}
    assert by["kept in tied"].effect and by["untying"].effect and not by["kept in untied"].effect
    assert math.isclose(by["kept in tied"].mean, 0.1445)
    assert T.explanation(list(by.values())) == "the confound: kept tokens matter through the tied embeddings"
    # untied-zero (0.1875) is best, untied (0.175) is not within 0.01: the best wins
    assert T.choose_recipe(results) == ("untied-zero",)
    # within 0.01 with fewer changes: the simpler cell wins
    assert T.choose_recipe(results_of({**scores, "untied": (0.183, 0.18)})) == ("untied",)


def test_the_other_readings_and_the_fallback() -> None:
    kept_everywhere = results_of({**ALL_LOW, "kept": (0.2, 0.2), "untied-kept": (0.2, 0.2)})
    assert T.explanation(T.contrasts(kept_everywhere)) == "kept tokens matter whatever the embeddings"
    tied = results_of({**ALL_LOW, "untied": (0.2, 0.2), "untied-kept": (0.2, 0.2)})
    assert T.explanation(T.contrasts(tied)) == "the tied embeddings"
    # an effect needs the same sign in both seeds
    mixed = results_of({**ALL_LOW, "bell": (0.2, 0.05)})
    assert not {c.label: c for c in T.contrasts(mixed)}["bell t"].effect
    assert T.explanation(T.contrasts(mixed)) == "none of the plan's readings; effects: none"
    sampler = results_of({**ALL_LOW, "low-t": (0.09, 0.095)})
    assert T.explanation(T.contrasts(sampler)) == "none of the plan's readings; effects: lower maximum t"
    # no candidate left the unigram stage: the two best train at the full budget
    assert T.choose_recipe(sampler) == ("low-t", "base")  # ties keep the plan's order
    assert "two best" in T.markdown(sampler)
    # plan.md decision 2: equal top-1 is broken by the lower all-[MASK] loss at t = 0.15
    tied = results_of(ALL_LOW)
    for name, loss in (("bell", 5.9), ("mdlm", 5.95)):
        for final in tied[name].finals.values():
            final["mask15_loss"] = loss
    assert T.choose_recipe(tied) == ("bell", "mdlm")


def test_missing_seeds_decide_nothing(tmp_path: Path) -> None:
    partial = results_of({**ALL_LOW, "untied": (0.2,)})
    assert partial["untied"].left_unigram is None and not partial["untied"].complete
    assert T.choose_recipe(partial) == ()
    assert T.explanation(T.contrasts(partial)).startswith("not yet decided")
    assert "not yet decided" in T.markdown(partial)


def test_runs_of_an_unknown_cell_or_of_different_lengths_are_refused(tmp_path: Path) -> None:
    def write(name: str, seed: int, steps: int) -> None:
        record = {"cell": name, "seed": seed, "steps": steps, "final": {"mask15_top1": 0.1, "mask15_loss": 6.0}}
        (tmp_path / f"{name}-s{seed}.json").write_text(json.dumps(record))

    write("base", 0, 600)
    write("base", 1, 450)
    with pytest.raises(ValueError, match="different lengths"):
        T.load_results(tmp_path)
    write("base", 1, 600)
    write("cosine", 0, 600)
    with pytest.raises(ValueError, match="unknown cells"):
        T.load_results(tmp_path)


def test_the_committed_table_is_recomputed_from_the_committed_runs() -> None:
    results = T.load_results(COMMITTED / "runs")
    assert any(r.scores for r in results.values()), "no committed diagnosis run"
    assert (COMMITTED / "diagnosis.md").read_text(encoding="utf-8") == T.markdown(results)
    assert (COMMITTED / "diagnosis.csv").read_text(encoding="utf-8") == T.csv_text(results)


# ----------------------------------------------------------------------------------------------- the member's recipe
def test_pretrain_takes_a_cells_recipe(tokenizer, windows, monkeypatch, capsys) -> None:
    import argparse

    from analyses.pretraining import pretrain

    args = argparse.Namespace(loss="diffusion", recipe="mdlm")
    ours = pretrain.corruption(args)(windows, tokenizer, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1))
    theirs = C.corrupt(C.cell("mdlm"), windows, tokenizer, torch.Generator().manual_seed(0),
                       torch.Generator().manual_seed(1))
    assert torch.equal(ours.inputs, theirs.inputs) and torch.equal(ours.ratio, theirs.ratio)
    plain = pretrain.corruption(argparse.Namespace(loss="diffusion", recipe=None))
    assert plain.func is objectives.corrupt and plain.args == ("diffusion",)
    # the flags the recipe sets, and a constant rate after the warm-up
    seen = {}
    monkeypatch.setattr(pretrain, "_train", lambda a: seen.update(vars(a)))
    pretrain.main(["--loss", "diffusion", "--recipe", "mdlm", "--out", "unused"])
    assert (seen["tie_embeddings"], seen["zero_output"], seen["lr"], seen["constant_lr"]) == (False, True, 3e-4, True)
    model = torch.nn.Linear(2, 2)
    opt, schedule = pretrain.make_optimizer(model, argparse.Namespace(lr=3e-4, warmup=4, steps=10, constant_lr=True))
    rates = []
    for _ in range(12):
        rates.append(schedule.get_last_lr()[0])
        opt.step()
        schedule.step()
    assert rates[3:] == [pytest.approx(3e-4)] * 9 and rates[0] == pytest.approx(3e-4 / 4)
    for bad, message in ((["--loss", "mlm", "--recipe", "mdlm"], "use it with --loss diffusion"),
                         (["--loss", "diffusion", "--recipe", "bert15"], "not a diffusion cell"),
                         (["--loss", "diffusion", "--recipe", "nope"], "no cell 'nope'")):
        with pytest.raises(SystemExit):
            pretrain.main([*bad, "--out", "unused"])
        assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- rules 4 and 5
def _full_run(path: Path, rows: dict[int, tuple[float, float, float]], partial: bool = False) -> None:
    """A run record with the full measures (top-1, all-[MASK] loss, own loss) at the given steps."""
    checkpoints = [{"step": 0, "mask15_top1": 0.0, "mask15_loss": 9.0}]
    for step, (top1, loss, own) in sorted(rows.items()):
        checkpoints += [{"step": step - 1, "mask15_top1": top1, "mask15_loss": loss},
                        {"step": step, "mask15_top1": top1, "mask15_loss": loss, "own_loss": own,
                         "mask50_top1": 0.1, "bert15_top1": 0.2}]
    name = path.name.replace(".json", ".partial.json") if partial else path.name
    (path.parent / name).write_text(json.dumps({"checkpoints": checkpoints, "partial": partial}))


def test_rule_4_picks_the_better_candidate_and_rule_5_the_first_budget_that_passes(tmp_path: Path) -> None:
    from analyses.diffusion_diagnosis import member as M

    _full_run(tmp_path / "mdlm-lr-s0.json", {3059: (0.12, 6.0, 6.5), 4589: (0.16, 5.5, 6.2)}, partial=True)
    assert M.choose(M.load_budgets(tmp_path)) is None  # mdlm has not reached 3,059 steps
    _full_run(tmp_path / "mdlm-s0.json", {3059: (0.12, 6.1, 6.4)})
    budgets = M.load_budgets(tmp_path)
    assert M.choose(budgets) == "mdlm-lr"  # a tie at top-1, broken by the lower all-[MASK] loss
    member = M.shipped(budgets["mdlm-lr"])
    assert (member.step, member.share) == (4589, "1.5x")
    assert member.margin == pytest.approx(M.UNIGRAM_CE - 6.2)
    assert "ships at **1.5x**" in M.verdict(budgets)
    # the first budget fails on the loss margin alone: 0.16 top-1 but 6.5 nats is 0.27 below the unigram
    _full_run(tmp_path / "mdlm-lr-s0.json", {3059: (0.16, 6.0, 6.5)}, partial=True)
    budgets = M.load_budgets(tmp_path)
    assert not budgets["mdlm-lr"][0].passes and M.shipped(budgets["mdlm-lr"]) is None
    assert "undecided" in M.verdict(budgets) and budgets["mdlm-lr"][1].passes is None
    rows = M.csv_text(budgets).splitlines()
    assert rows[0].startswith("cell,step,budget,mask15_top1") and len(rows) == 1 + 2 * len(M.BUDGETS)


def test_the_unigram_cross_entropy_is_a_hand_count() -> None:
    from analyses.diffusion_diagnosis import member as M

    train = torch.tensor([[0, 5, 5, 6, 1]])  # 0 and 1 special: counts 5 -> 2, 6 -> 1, add-one over 8 tokens
    valid = torch.tensor([[0, 5, 7, 1]])
    expected = -(math.log(3 / 11) + math.log(1 / 11)) / 2
    assert M.unigram_cross_entropy(train, valid, [0, 1], 8) == pytest.approx(expected, rel=1e-12)


def test_the_committed_member_table_is_recomputed_from_the_committed_runs() -> None:
    from analyses.diffusion_diagnosis import member as M

    committed = COMMITTED / "member.md"
    if not committed.exists():
        pytest.skip("the full-length runs have not written figures/diffusion-diagnosis/member.md yet")
    budgets = M.load_budgets(COMMITTED / "full")
    assert committed.read_text() == M.markdown(budgets)
    assert (COMMITTED / "member.csv").read_text() == M.csv_text(budgets)


def test_the_shipped_budget_becomes_a_member_laid_out_as_pretrain_writes_one(tmp_path: Path, tokenizer, windows,
                                                                             monkeypatch) -> None:
    from analyses.diffusion_diagnosis import member as M
    from analyses.diffusion_diagnosis import to_member, train

    shrink(monkeypatch, train)
    runs, out = tmp_path / "full", tmp_path / "member"
    runs.mkdir()
    seen = []  # (windows, real tokens) of every loss the runs compute: training batches have 16 windows
    real_loss = train.cell_loss
    monkeypatch.setattr(train, "cell_loss", lambda model, batch, mask: seen.append(tuple(mask.shape[:1]) + (
        int(mask.sum()),)) or real_loss(model, batch, mask))
    records = {name: train.run_cell(C.cell(name), 0, 5, (tokenizer, windows, windows), runs, save=True, budgets=[3])
               for name in M.FALLBACK}
    for name, record in records.items():
        (runs / f"{name}-s0.json").write_text(json.dumps(record))
    monkeypatch.setattr(M, "BUDGETS", {3: "1x", 5: "1.5x"})
    monkeypatch.setattr(M, "SHIP_TOP1", -1.0)  # every budget passes: the first ships
    monkeypatch.setattr(M, "SHIP_MARGIN", -100.0)
    monkeypatch.setattr(to_member, "load_data", lambda corpus, tok: (tokenizer, windows, windows))
    recipe = to_member.build_member(runs, out, Path("unused"), TOKENIZER)
    chosen = M.choose(M.load_budgets(runs))
    assert recipe["recipe"] == chosen and recipe["steps"] == 3 and recipe["budget"]["label"] == "1x"
    # the tokens replayed from the run's generators are the tokens it trained on
    trained = [n for windows_, n in seen if windows_ == 16]
    own = trained[:5] if chosen == M.FALLBACK[0] else trained[5:]
    assert len(trained) == 10 and to_member.replay_tokens(C.cell(chosen), 0, 5, windows, tokenizer) == [
        sum(own[:k]) for k in range(6)]
    log = __import__("pandas").read_csv(out / "training_log.csv")
    assert list(log.columns) == list(to_member.FIELDS) and list(log.step) == [2, 3]
    assert log.valid_top1.isna().tolist() == [True, False]  # measured at the saved budget only
    assert recipe["final"]["valid_positions"] > 0 and recipe["cpu_s"] is not None
    shipped = __import__("transformers").AutoModelForMaskedLM.from_pretrained(out)
    assert next(shipped.parameters()).dtype == torch.float16
