"""Each findings row about an objective says whether it survives the pretraining seeds (issue 60, item 4), and what
it quotes of them is the committed survival table's (``figures/objectives/seeds/seeds.csv``): the values at seeds
1 and 2 and the rule's verdict for rows 4, 9, 10, 15 and 17 (the findings the seeds re-measured), mini-en's values
at seeds 1 and 2 for rows 2 and 3 (descriptive), and "one pretraining seed" for every other row about the
objectives or the 6-block members (their runs were not repeated)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from tests.docs.test_citable_findings import findings

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "results" / "index.md"]
SEEDS = pd.read_csv(ROOT / "figures" / "objectives" / "seeds" / "seeds.csv")

DROP1_ROWS = {9: "drop1-mini-en", 15: "drop1-mask40", 17: "drop1-diffusion"}
"""Rows quoting a member's POS ``drop1 - full`` at pretraining seeds 1 and 2 and the rule's verdict."""
ONE_SEED_ROWS = (5, 6, 7, 8, 11, 12, 13, 14, 16, 18)
"""Rows measured at one pretraining seed (the seeds repeated Part 1's two measures and Part 3's POS drop1 only)."""


def _finding(key: str, seed: int) -> pd.Series:
    row = SEEDS[(SEEDS.kind == "finding") & (SEEDS.finding == key) & (SEEDS.seed == seed)]
    assert len(row) == 1, (key, seed)
    return row.iloc[0]


def _verdict(key: str) -> str:
    """The rule's verdict of ``key`` as a row says it: ``survives``, ``does not survive`` or ``not judged``."""
    return str(_finding(key, 0).verdict).split(":")[0]


def _seed_value(member: str, seed: int, quantity: str) -> float:
    row = SEEDS[(SEEDS.kind == "seed") & (SEEDS.member == member) & (SEEDS.seed == seed)
                & (SEEDS.quantity == quantity)]
    assert len(row) == 1 and pd.notna(row.iloc[0].value), (member, seed, quantity)
    return float(row.iloc[0].value)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_rows_quote_the_seeds_values_and_verdicts(page):
    rows = {n: row["claim"] for n, row in findings(page).items()}
    for n, key in DROP1_ROWS.items():
        values = [f"{float(_finding(key, seed).value):+.4f}".replace("+-", "-") for seed in (1, 2)]
        quoted = f"pretraining seeds 1 and 2: {values[0]}, {values[1]}; {_verdict(key)}"
        assert quoted in rows[n], (page.name, n, quoted)
    # row 4: mini-en's pressure over the twin's at each seed, and the rule's verdict on "ten times less"
    for sublayer, key in (("attn.q", "pressure-twin-q"), ("ffn.in", "pressure-twin-ffn")):
        times = [_seed_value("mini-en", s, f"pressure {sublayer}") / _seed_value("twin", s, f"pressure {sublayer}")
                 for s in (0, 1, 2)]
        quoted = f"{sublayer} " + " / ".join(f"{t:.1f}x" for t in times) + f" at pretraining seeds 0-2: {_verdict(key)}"
        assert quoted in rows[4], (page.name, quoted)
    # row 10: the null result's difference at seeds 1 and 2, which the rule does not judge
    values = [f"{float(_finding('drop1-twin-equal', s).value):+.4f}" for s in (1, 2)]
    assert _verdict("drop1-twin-equal") == "not judged"
    assert f"pretraining seeds 1 and 2: {values[0]}, {values[1]}; not judged (a null result)" in rows[10]
    # rows 2 and 3 (mini-en's own measures, descriptive): their values at seeds 1 and 2
    ratio = [f"{_seed_value('mini-en', s, 'ratio'):.3f}" for s in (1, 2)]
    assert f"after block 5 at pretraining seeds 1 and 2: {ratio[0]}, {ratio[1]}" in rows[2], page.name
    q, f = ([f"{_seed_value('mini-en', s, f'pressure {sub}'):.3f}" for s in (1, 2)] for sub in ("attn.q", "ffn.in"))
    assert f"at pretraining seeds 1 and 2: `attn.q` {q[0]}, {q[1]}, `ffn.in` {f[0]}, {f[1]}" in rows[3], page.name
    for n in ONE_SEED_ROWS:
        assert "one pretraining seed" in rows[n], (page.name, n)


def test_every_remeasured_finding_has_all_three_seeds():
    """The verdicts quoted are final: no finding of a quoted row still waits for a seed."""
    keys = [*DROP1_ROWS.values(), "pressure-twin-q", "pressure-twin-ffn", "drop1-twin-equal"]
    for key in keys:
        for seed in (0, 1, 2):
            assert pd.notna(_finding(key, seed).value), (key, seed)
        assert not _verdict(key).startswith("open"), key
