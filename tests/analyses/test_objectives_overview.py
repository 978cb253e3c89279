"""analyses.objectives.overview: issue 52's per-objective table is rewritten from the committed tables of Parts 1-4,
and each of its numbers is the one its own table gives (exact-zero sets, probe verdicts, the families' contrasts).
Issue 59: a model that did not leave the unigram stage (by the committed pretraining curves, not by its name) has
every cell marked and no bold contrast; a model that learned keeps its bold."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from analyses.objectives import measures, overview
from analyses.objectives import stage as stage_rule
from analyses.objectives.contrasts import short
from analyses.objectives.overview import UNLEARNED, Row, cell

COMMITTED = overview.OUT
FIRST_MEMBER = overview.ROOT / "figures/objectives/diffusion-v1"  # the first diffusion member's study, history
MODEL = {label: model for model, label in overview.LABELS.items()}


def close(row: Row, family_row: pd.Series) -> bool:
    """The overview's contrast (from the run summaries, AUCs written to 6 significant digits) is the family table's
    (from the runs): mean and CI within 2e-6, the Holm p within 1e-4 relative."""
    return (all(math.isclose(getattr(row, c), family_row[c], rel_tol=0, abs_tol=2e-6)
                for c in ("mean", "ci_low", "ci_high"))
            and math.isclose(row.p_holm, family_row.p_holm, rel_tol=1e-4))


def test_the_committed_overview_is_rewritten_from_the_committed_tables(tmp_path):
    if not (COMMITTED / "overview.md").is_file():
        pytest.skip("figures/objectives/overview.md is not committed yet")
    overview.write_overview(tmp_path)
    assert (tmp_path / "overview.md").read_text() == (COMMITTED / "overview.md").read_text()
    fresh, kept = pd.read_csv(tmp_path / "overview.csv"), pd.read_csv(COMMITTED / "overview.csv")
    assert list(fresh.columns) == list(kept.columns) and len(fresh) == len(kept)
    for column in ("mean", "ci_low", "ci_high", "p_holm"):
        assert np.allclose(fresh[column], kept[column], rtol=1e-9, atol=0, equal_nan=True), column
    for column in ("part", "measure", "model", "text", "learned"):
        assert fresh[column].fillna("").tolist() == kept[column].fillna("").tolist(), column


def test_the_exact_zero_sets_are_the_theory_s():
    rows = {r.model: r for r in overview.zero_rows() if r.measure.startswith("last block:")}
    assert set(rows) == set(overview.LABELS.values())
    for run in measures.COMPARES["own"]:
        meta = measures.run_meta(overview.MEASURES, run)
        theory = [] if meta["loss"] == "all-positions" else list(meta["after_mixing_sublayers"])
        assert rows[run.label].text == (", ".join(theory) or "none") and rows[run.label].mean == len(theory)
    assert [rows[m].mean for m in ("mini-en", "twin", "mask40", "diffusion")] == [6, 0, 6, 6]


def test_each_probe_verdict_is_the_one_its_robustness_table_states():
    for r in overview.probe_rows():
        if r.measure.endswith("verdict"):
            task = r.measure.split()[1].rstrip(":")
            text = (overview.PROBES[r.model] / "last_layer_drops.md").read_text()
            assert f"| {r.model} | {task} | {r.text} |" in text, (r.model, task, r.text)


def test_each_fine_tuning_contrast_is_its_family_s_number():
    rows = overview.finetune_rows()
    family_a = pd.read_csv(overview.FINETUNE / "family_a.csv")
    powered = pd.read_csv(overview.POWERED)
    tables = {"mini-en": powered[powered.regime == "convergence"], "mask40": family_a, "diffusion": family_a}
    checked = 0
    for r in rows:
        if r.part != "3" or r.model not in tables:
            continue
        task, arm = r.measure.split(", ")[1].split(":")[0], r.measure.split(": ")[1].split()[0]
        hit = tables[r.model][tables[r.model].contrast.str.endswith(f"{r.model} {arm} - full")
                              & (tables[r.model].task == task)].iloc[0]
        assert close(r, hit), (r, hit)
        checked += 1
    assert checked == 18  # 3 arms x 2 tasks x (mini-en, mask40, diffusion)
    family_b = overview.FINETUNE / "family_b.csv"
    if family_b.is_file():
        table = pd.read_csv(family_b)
        low = [r for r in rows if r.part == "4"]
        assert len(low) == 8
        for r in low:
            arm = r.measure.split(": ")[1].split()[0]
            hit = table[(table.model == MODEL[r.model]) & (table.arm == arm)].iloc[0]
            assert close(r, hit)


def test_the_seed_regime_rows_wait_for_family_b(tmp_path):
    for name in ("run_summaries_lr1e-4.csv", "family_a.csv"):
        shutil.copy(overview.FINETUNE / name, tmp_path / name)
    low = [r for r in overview.finetune_rows(tmp_path) if r.part == "4"]
    assert len(low) == 8 and {r.text for r in low} == {"not yet (Family B incomplete)"}
    assert all(math.isnan(r.mean) for r in low)


def test_a_contrast_is_bold_only_when_its_family_rejects_it():
    row = dict(part="3", measure="lr 1e-4, brown-pos: drop1 - full (AUC)", model="mini-en", mean=-0.02,
               ci_low=-0.03, ci_high=-0.01, digits=4)
    assert cell(Row(**row, p_holm=0.01)) == "**-0.0200** [-0.0300, -0.0100]"
    assert cell(Row(**row, p_holm=0.2)) == cell(Row(**row)) == "-0.0200 [-0.0300, -0.0100]"
    assert cell(Row("1", "context / loss ratio, layer 6", "mask40", 0.0, 0.0, 0.0)) == "0 (exact)"
    assert cell(Row("1", "context / loss ratio, layer 6", "twin", 0.02, 0.019, 0.021)) == "0.020 [0.019, 0.021]"
    assert cell(Row("4", "lr 1e-5, brown-pos: drop1 - full (AUC)", "twin", text="not run")) == "not run"


def test_the_results_page_carries_the_committed_overview_verbatim():
    if not (COMMITTED / "overview.md").is_file():
        pytest.skip("figures/objectives/overview.md is not committed yet")
    page = (overview.ROOT / "docs/results/objectives.md").read_text()
    assert (COMMITTED / "overview.md").read_text().rstrip("\n") in page


def test_a_missing_source_table_is_named_with_the_target_that_writes_it(tmp_path):
    with pytest.raises(SystemExit, match=r"not there: .*pressure\.csv \(make -C analyses objectives-pressure\)"):
        overview.overview(pressure_dir=tmp_path)


# ---------------------------------------------------------------------- issue 59: a model that did not learn
DIAGNOSTICS = overview.ROOT / "figures/objectives/diagnostics"


def test_every_member_learned_and_only_the_first_diffusion_member_did_not():
    """Issue 60: the second diffusion member (the study's now) left the unigram stage; the first, whose study is kept
    in figures/objectives/diffusion-v1, did not."""
    stage = overview.stages()
    assert {label: s.learned for label, s in stage.items()} == dict.fromkeys(("mini-en", "twin", "mask40",
                                                                              "diffusion"), True)
    assert math.isclose(stage["diffusion"].last_top1, 0.136, abs_tol=5e-4) and stage["diffusion"].last_step == 3059
    table = pd.read_csv(COMMITTED / "overview.csv")
    assert table.groupby("model").learned.agg(lambda v: set(v)).to_dict() == {
        "mini-en": {True}, "twin": {True}, "mask40": {True}, "diffusion": {True}}
    first = overview.stages(FIRST_MEMBER / "pretraining_curves.csv")
    assert [label for label, s in first.items() if not s.learned] == ["diffusion"]
    assert math.isclose(first["diffusion"].last_top1, 0.0540083, abs_tol=1e-7) and first["diffusion"].last_step == 3059
    history = pd.read_csv(FIRST_MEMBER / "overview.csv")
    assert history.groupby("model").learned.agg(lambda v: set(v)).to_dict() == {
        "mini-en": {True}, "twin": {True}, "mask40": {True}, "diffusion": {False}}


def test_the_rule_sorts_the_committed_diagnostics_as_the_results_page_does():
    """Plan deviation 1's 450-step runs: the all-[MASK] corruptions stay at the unigram stage, the two with kept
    tokens leave it; ``LEFT_UNIGRAM_TOP1`` puts every committed run on the side the page states."""
    runs = [pd.read_json(path, typ="series") for path in sorted(DIAGNOSTICS.glob("*.json"))]
    assert len(runs) == 12
    for run in runs:
        left = run.valid_top1 > overview.LEFT_UNIGRAM_TOP1
        assert left == (run.variant in ("mlm15", "maskkept15")), (run.variant, run.seed, run.valid_top1)


def test_a_significant_contrast_is_bold_only_for_a_model_that_learned():
    row = Row("3", "lr 1e-4, brown-pos: drop1 - full (AUC)", "diffusion", 0.2058, 0.1619, 0.2497, p_holm=2.6e-05,
              digits=4)
    assert cell(row, learned=True) == "**+0.2058** [+0.1619, +0.2497]"
    assert cell(row, learned=False) == f"+0.2058{UNLEARNED} [+0.1619, +0.2497]"
    assert cell(Row("2", "probe brown-pos: verdict", "diffusion", text="drop"), learned=False) == f"drop{UNLEARNED}"
    assert cell(Row("1", "context / loss ratio, layer 6", "diffusion", 0.0, 0.0, 0.0), False) == f"0{UNLEARNED} (exact)"


def test_the_committed_table_marks_nothing_and_bolds_every_significant_contrast():
    """Every member learned: no cell is marked, and each contrast its family rejects is bold, the diffusion member's
    included."""
    text = (COMMITTED / "overview.md").read_text()
    assert UNLEARNED not in text
    rows = [line.split(" | ") for line in text.splitlines()[2:] if line.startswith("| ")]
    table = pd.read_csv(COMMITTED / "overview.csv")
    significant = table[table.p_holm < 0.05]
    assert len(significant[significant.model == "diffusion"]) >= 3  # Family A: drop1, reinit1, repair1 on POS
    assert sum(c.count("**") // 2 for cells in rows for c in cells[2:]) == len(significant)


def test_the_first_member_s_table_marks_every_diffusion_cell_and_bolds_none():
    """The first diffusion member's overview, kept as history (figures/objectives/diffusion-v1)."""
    lines = (FIRST_MEMBER / "overview.md").read_text().splitlines()
    heading, rows = lines[0].split(" | "), [line.split(" | ") for line in lines[2:] if line.startswith("| ")]
    assert heading[-1].rstrip(" |").endswith(UNLEARNED) and not any(UNLEARNED in h for h in heading[:-1])
    table = pd.read_csv(FIRST_MEMBER / "overview.csv")
    significant = table[table.p_holm < 0.05]
    assert set(significant.model) == {"mini-en", "twin", "mask40", "diffusion"}  # each has a contrast to bold or not
    assert len(significant[significant.model == "diffusion"]) == 4
    for cells in rows:
        diffusion = cells[-1].rstrip(" |")
        assert UNLEARNED in diffusion and "**" not in diffusion, cells
        assert not any(UNLEARNED in c for c in cells[:-1]), cells
    bold = sum(c.count("**") // 2 for cells in rows for c in cells[2:-1])
    assert bold == len(significant[significant.model != "diffusion"])  # every learned model's significant contrast
    footnote = next(line for line in lines if line.startswith(UNLEARNED))
    assert "gradflow-mini-en-diffusion did not leave the unigram stage" in footnote
    assert "0.060 at its first evaluation (step 450) and 0.054 at its last (step 3,059), not above 0.10" in footnote


def test_the_mark_follows_the_curves_not_the_name(tmp_path):
    """Give mask40 the first diffusion member's last top-1 (the unigram stage) in a copy of the curves: mask40's
    column is marked and loses its bold, the diffusion member's significant contrasts stay bold."""
    curves = pd.read_csv(overview.CURVES)
    last = curves.dropna(subset=["valid_top1"]).groupby("model").step.idxmax()
    curves.loc[last["gradflow-mini-en-mask40"], "valid_top1"] = overview.stages(
        FIRST_MEMBER / "pretraining_curves.csv")["diffusion"].last_top1
    curves.to_csv(tmp_path / "curves.csv", index=False)
    overview.write_overview(tmp_path, curves=tmp_path / "curves.csv")
    lines = (tmp_path / "overview.md").read_text().splitlines()
    drop1 = next(line for line in lines if line.startswith("| 3 | lr 1e-4, brown-pos: drop1")).split(" | ")
    assert drop1[4] == f"-0.0101{UNLEARNED} [-0.0125, -0.0077]" and drop1[5].startswith("**+0.0078** [")
    assert "gradflow-mini-en-mask40 did not leave the unigram stage" in (tmp_path / "overview.md").read_text()


def test_the_masked_diffusion_guide_states_the_member_s_stage_from_the_curves():
    """Where a diffusion user lands: the shipped (second) member learned and the first did not, their top-1 as the
    curves give them (the second's: the study's; the first's: figures/objectives/diffusion-v1), and a link to the
    results page, before the guide's first section."""
    guide = (overview.ROOT / "docs/guides/masked-diffusion.md").read_text()
    top = " ".join(guide[: guide.index("\n## ")].split())
    second, mini = overview.stages()["diffusion"], overview.stages()["mini-en"]
    first = overview.stages(FIRST_MEMBER / "pretraining_curves.csv")["diffusion"]
    assert second.learned and not first.learned and "The first member" in top and "did not leave the unigram" in top
    assert f"Its validation top-1 at BERT 15% masking is {second.last_top1:.3f} after {second.last_step:,} steps" in top
    assert (f"{first.last_top1:.3f} after {first.last_step:,} steps, {first.first_top1:.3f} at its first "
            f"evaluation (step {first.first_step:,})") in top
    assert f"against {mini.last_top1:.3f} for `gradflow-mini-en`" in top
    assert "(../results/objectives.md#the-models-and-their-training-budget)" in top and "issue 60" in top
    assert "is the subject of issue 52" not in guide


def test_the_script_creates_its_output_folder(tmp_path, capsys):
    """Issue 59: ``--out new/folder`` ended in pandas' 'Cannot save file into a non-existent directory'."""
    out = tmp_path / "new" / "folder"
    assert overview.main(["--out", str(out)]) == 0
    assert (out / "overview.md").read_text() in capsys.readouterr().out and (out / "overview.csv").is_file()


@pytest.mark.slow  # make and a fresh interpreter: 10 s on 2 shared cores
@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_objectives_overview_creates_out(tmp_path):
    out = tmp_path / "new" / "folder"
    proc = subprocess.run(["make", "-s", "-C", str(overview.ROOT / "analyses"), "objectives-overview", f"OUT={out}",
                           f"PY={sys.executable}"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "overview.csv").is_file() and (out / "overview.md").is_file()


PAGE = overview.ROOT / "docs/results/objectives.md"


def unmarked(text: str, curves=overview.CURVES) -> tuple[list[str], int]:
    """(what is wrong, how many tables name a model that did not learn) in the Markdown tables of ``text``: every
    cell that names such a model (by the curves: its name, short name or label; not the objective "masked
    diffusion") carries ``UNLEARNED``, none of its rows or columns is bold, and the first line under the table is a
    footnote of that model (:func:`stage.footnote`, or the overview's own note)."""
    by_label = overview.stages(curves)
    learned_now = [s for s in by_label.values() if s.learned]
    names = {s.model: re.compile(rf"(?<!masked )(?<![\w-])({re.escape(s.model)}|{re.escape(short(s.model))}|"
                                 rf"{re.escape(label)})(?![\w-])")
             for label, s in by_label.items() if not s.learned}
    lines, problems, tables, i = text.splitlines(), [], 0, 0
    while i < len(lines):
        if not lines[i].startswith("|"):
            i += 1
            continue
        start = i
        while i < len(lines) and lines[i].startswith("|"):
            i += 1
        rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[start:i]]
        header, body = rows[0], rows[2:]
        named = [m for m, pattern in names.items() if any(pattern.search(c) for row in rows for c in row)]
        if not named:
            continue
        tables += 1
        where = f"the table at line {start + 1} ({' | '.join(header)[:60]})"
        for row in rows:
            for c in row:
                if any(names[m].search(c) for m in named) and UNLEARNED not in c:
                    problems.append(f"{where}: '{c}' is not marked {UNLEARNED}")
        columns = [k for k, c in enumerate(header) if any(names[m].search(c) for m in named)]
        for row in body:
            about = any(names[m].search(c) for m in named for c in row)
            if any("**" in c for c in (row if about else [row[k] for k in columns if k < len(row)])):
                problems.append(f"{where}: a row or column of a model that did not learn is bold: {row}")
        under = next((line for line in lines[i:] if line.strip()), "")
        notes = {stage_rule.footnote(s) for s in by_label.values() if s.model in named}
        notes |= {overview.unlearned_note(s, learned_now) for s in by_label.values() if s.model in named}
        if under not in notes:
            problems.append(f"{where}: the line under it is not the footnote of {', '.join(named)}: {under[:80]!r}")
    return problems, tables


def test_every_table_of_the_results_page_marks_a_model_that_did_not_learn():
    """Issue 59, point 6: copied out of any table of the results page (Family A, B, the secondary contrasts, the
    probes, Part 1's ratios and pressure, the models and the pilot, not the overview alone), a row or column about a
    model that did not leave the unigram stage (the committed curves decide which) carries † in its label, is not
    bold, and has a footnote under the table pointing to the overview's note. Since issue 60 every member of the
    study learned: nothing on the page is marked, and the same check with the first diffusion member's curves finds
    every diffusion table unmarked (it bites); the first member's own overview, kept as history, passes it."""
    page = PAGE.read_text(encoding="utf-8")
    assert unmarked(page) == ([], 0) and UNLEARNED not in page
    problems, tables = unmarked(page, FIRST_MEMBER / "pretraining_curves.csv")
    assert tables >= 9 and len(problems) >= tables, (tables, problems)
    history = (FIRST_MEMBER / "overview.md").read_text(encoding="utf-8")
    assert unmarked(history, FIRST_MEMBER / "pretraining_curves.csv") == ([], 1)
    assert unmarked(history.replace(f", unigram stage {UNLEARNED}", "", 1), FIRST_MEMBER / "pretraining_curves.csv")[0]
