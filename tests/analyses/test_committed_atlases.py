"""The committed atlases (figures/atlas, figures/twelve-blocks/atlas) say what the theory and the results pages
say: exact zeros in the last block, no disagreement, and the 6-block rows of the twelve-block atlas equal to the
6-block atlas."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from synthetic_runs import AFTER_MIXING

ROOT = Path(__file__).resolve().parents[2]
ATLASES = [ROOT / "figures/atlas/atlas.csv", ROOT / "figures/twelve-blocks/atlas/atlas.csv"]


@pytest.mark.parametrize("path", ATLASES, ids=lambda p: p.parent.name)
def test_every_models_last_block_gets_exactly_zero_from_context_after_mixing(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path.relative_to(ROOT)} is not committed")
    atlas = pd.read_csv(path)
    for model, rows in atlas.groupby("model"):
        last = rows[rows.depth_fraction == 1.0].set_index("metric").value
        for sublayer in AFTER_MIXING:
            assert last[f"context_share:{sublayer}"] == 0.0, (model, sublayer)
        assert last["context_share:attn.k"] > 0.5 and last["context_share:attn.v"] > 0.5, model
        assert last["context_loss_ratio"] == 0.0, model
        assert rows[rows.metric == "theory_disagreements"].value.eq(0).all(), model


def test_the_six_block_rows_of_the_twelve_block_atlas_are_the_six_block_atlas() -> None:
    if not all(p.exists() for p in ATLASES):
        pytest.skip("both atlases are needed")
    six, twelve = (pd.read_csv(p) for p in ATLASES)
    keys = ["model", "metric", "depth_fraction"]
    shared = six.merge(twelve, on=keys, suffixes=("_six", "_twelve"))
    assert set(shared.model) == {"gradflow-mini-en", "gradflow-mini-en-alltoken"}
    assert len(shared) == (twelve.model.isin(set(shared.model))).sum()
    for column in ("value", "ci_low", "ci_high"):
        pd.testing.assert_series_equal(shared[f"{column}_six"], shared[f"{column}_twelve"], check_names=False,
                                       rtol=1e-9, atol=1e-12)
