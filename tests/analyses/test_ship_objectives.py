"""Issue 60 item 2: the second diffusion member shipped into the companion, the first kept as history
(``analyses/pretraining/ship_objectives.py``, ``make -C analyses objectives-v2-ship``)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from analyses.objectives import stage as stage_rule
from analyses.pretraining import ship_objectives as ship

DIFFUSION = "gradflow-mini-en-diffusion"
SHIPPED = ship.COMPANION / DIFFUSION / "recipe.json"
STUDY = ship.ROOT / "figures/objectives"  # the study's cards and curves (staged in diffusion-v2, moved here)
MEMBER = ship.ROOT / "figures/diffusion-diagnosis/member.csv"


def test_the_card_s_objective_comes_from_the_recipe() -> None:
    assert ship.objective_label(DIFFUSION, {"loss": "diffusion"}) == ship.NEW[DIFFUSION]
    assert ship.objective_label(DIFFUSION, {"recipe": "mdlm"}).startswith("masked diffusion, MDLM recipe")
    assert ship.objective_label("gradflow-mini-en-mask40", {"recipe": None}) == "BERT 40% (80/10/10)"


def test_the_companion_holds_the_member_rule_5_chose() -> None:
    """The shipped card is the diagnosis's recipe at the budget rule 5 named, not the first member."""
    card = json.loads(SHIPPED.read_text())
    member = pd.read_csv(MEMBER)
    chosen = member[member.ships.astype(str).str.lower().isin(["true", "yes"])] if "ships" in member else member
    assert card["recipe"] == "mdlm" and card["steps"] == 3059 and card["budget"]["label"] == "1x"
    assert card["tie_embeddings"] is False and card["zero_output"] is True and card["t_sampler"] == "antithetic"
    assert card["objective"] == ship.RECIPES["mdlm"] and not chosen.empty
    assert card["final"]["valid_top1"] > stage_rule.LEFT_UNIGRAM_TOP1  # it learned, by the overview's rule
    assert card["held_out"]["bert15"]["sample_top1"] > 2 * json.loads(
        (ship.HISTORY / "card.json").read_text())["held_out"]["bert15"]["sample_top1"]


def test_the_first_member_stays_as_history() -> None:
    first = json.loads((ship.HISTORY / "card.json").read_text())
    assert "recipe" not in first and first["lr"] == 0.001 and first["objective"] == ship.NEW[DIFFUSION]
    assert first["final"]["valid_top1"] <= stage_rule.LEFT_UNIGRAM_TOP1  # the unigram stage
    log = pd.read_csv(ship.HISTORY / "training_log.csv")
    assert int(log.step.iloc[-1]) == first["steps"] and log.valid_top1.dropna().iloc[-1] == pytest.approx(
        first["final"]["valid_top1"], rel=1e-5)


def test_the_committed_cards_are_the_shipped_cards() -> None:
    """figures/objectives/cards.md is cards_markdown of the five cards as shipped (history last, marked as such)."""
    cards = {name: ship.core_card(name) for name in ship.CORE}
    cards.update({name: json.loads((ship.COMPANION / name / "recipe.json").read_text()) for name in ship.NEW})
    cards[ship.HISTORY_NAME] = json.loads((ship.HISTORY / "card.json").read_text())
    text = (STUDY / "cards.md").read_text()
    assert text == ship.cards_markdown(cards)
    assert "`gradflow-mini-en-diffusion`, first member (history) | masked diffusion (t ~ U(0.001, 1)" in text


def test_the_curves_carry_both_diffusion_members_and_only_the_second_learned() -> None:
    stages = stage_rule.stages(STUDY / "pretraining_curves.csv")
    assert stages[DIFFUSION].learned and not stages[ship.HISTORY_NAME].learned
    assert all(stages[name].learned for name in (*ship.CORE, "gradflow-mini-en-mask40"))


def test_only_names_a_member_and_a_missing_run_is_refused(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        ship.main(["--only", "gradflow-mini-en", "--build", str(tmp_path)])
    assert "invalid choice: 'gradflow-mini-en'" in capsys.readouterr().err
    assert ship.main(["--only", DIFFUSION, "--build", str(tmp_path), "--figures", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / DIFFUSION / 'model.safetensors'} missing" in err and "mask40" not in err
    assert not (tmp_path / "f").exists()  # nothing written
