"""analyses.pretraining.diagnose_diffusion's table (plan deviation 1): one row per variant and learning rate, one
value per seed, rewritten from the committed run files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from analyses.pretraining import diagnose_diffusion as dd

COMMITTED = Path(__file__).resolve().parents[2] / "figures/objectives/diagnostics"


def result(variant: str, seed: int, top1: float, lr: float = 1e-3) -> dict:
    return {"variant": variant, "steps": 450, "lr": lr, "seed": seed, "train_s": 80.5, "valid_loss": 6.0 + top1,
            "valid_top1": top1, "valid_positions": 4770}


def test_the_table_has_a_row_per_variant_and_lr_and_a_value_per_seed(tmp_path: Path) -> None:
    for r in (result("mlm15", 1, 0.2), result("allmask15", 0, 0.063), result("mlm15", 0, 0.209),
              result("allmask15", 0, 0.074, lr=3e-4)):
        dd.run_path(tmp_path, r).write_text(json.dumps(r))
    rows = [line for line in dd.summary(tmp_path).splitlines() if line.startswith("| ") and "variant" not in line]
    assert rows == ["| allmask15 | 0.001 | 450 | 0: 0.063 (6.06) | 80.5 |",
                    "| allmask15 | 0.0003 | 450 | 0: 0.074 (6.07) | 80.5 |",
                    "| mlm15 | 0.001 | 450 | 0: 0.209 (6.21); 1: 0.200 (6.20) | 80.5, 80.5 |"]
    assert dd.run_path(tmp_path, result("mlm15", 1, 0.2)).name == "mlm15-lr0.001-s1.json"


def test_no_runs_is_one_sentence(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no diagnostic runs under"):
        dd.summary(tmp_path)


def test_the_committed_summary_is_rewritten_from_the_committed_runs() -> None:
    if not (COMMITTED / "summary.md").is_file():
        pytest.skip("figures/objectives/diagnostics/summary.md is not committed")
    assert dd.summary(COMMITTED) == (COMMITTED / "summary.md").read_text(encoding="utf-8")
