"""``make -C analyses pressure OUT=...`` (analyses/pressure/run.py): with OUT the scratch runs go under OUT, never into
the clone's ``runs/``; at the committed location they stay in ``runs/pressure-*`` as the committed results were made.

The script's path logic is tested with its ``gradflow`` subprocess replaced: no model is recorded (the real job takes
about 3 min).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from analyses.pressure import run as pressure

ROOT = Path(__file__).resolve().parents[2]


class _StopAtCompare(Exception):
    pass


def _listing(folder: Path) -> list[str] | None:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else None


@pytest.mark.parametrize("pair", sorted(pressure.PAIRS))
def test_scratch_runs_go_under_out_when_out_is_not_the_committed_location(pair, tmp_path):
    runs = pressure.scratch_runs(pair, tmp_path / "p")
    models, _ = pressure.PAIRS[pair]
    assert runs == {label: tmp_path / "p" / "runs" / label for label in models}


def test_scratch_runs_at_the_committed_location_are_the_ones_the_results_were_made_with():
    assert pressure.scratch_runs("mini-en", pressure.ROOT / "figures/pressure") == {
        "mini-en": ROOT / "runs/pressure-mini-en", "twin": ROOT / "runs/pressure-twin"}
    assert pressure.scratch_runs("mini12-en", pressure.ROOT / "figures/twelve-blocks/pressure") == {
        "mini12-en": ROOT / "runs/pressure-mini12-en-mini12-en", "twin": ROOT / "runs/pressure-mini12-en-twin"}
    # the arguments the recorded commands got: relative to the repository root, as before
    assert pressure.as_argument(ROOT / "runs/pressure-twin") == "runs/pressure-twin"
    assert pressure.scratch_runs("objectives", pressure.ROOT / "figures/objectives/pressure") == {
        label: ROOT / f"runs/pressure-objectives-{label}" for label in ("mini-en", "twin", "mask40", "diffusion")}


def test_the_last_block_table_has_two_columns_a_model(tmp_path):
    """The pairs' header is unchanged (mini-en ..., twin ...); the four objectives get a pressure and a ratio each."""
    assert pressure.last_block_lines(_frame(["mini-en", "twin"]), ["mini-en", "twin"])[0] == (
        "| last-block sublayer | mini-en pressure [95% CI] | mini-en vs earlier blocks | twin pressure [95% CI] | "
        "twin vs earlier blocks |")
    labels = list(pressure.PAIRS["objectives"][0])
    lines = pressure.last_block_lines(_frame(labels), labels)
    assert lines[1] == "|---|" + "---|" * 8 and lines[0].count("|") == 10
    assert lines[2].startswith("| attn.q | 0.500 [0.400, 0.600] |")


def _frame(labels: list[str]):
    import pandas as pd

    row = {"sublayer": "attn.q", "last_block": True, "pressure": 0.5, "ci_low": 0.4, "ci_high": 0.6,
           "vs_earlier": 0.25, "vs_earlier_ci_low": 0.2, "vs_earlier_ci_high": 0.3}
    return pd.DataFrame([{**row, "model": label} for label in labels])


@pytest.mark.parametrize("pair", sorted(pressure.PAIRS))
def test_the_script_with_out_writes_nothing_into_the_clones_runs(pair, tmp_path, monkeypatch):
    commands = []

    def fake_gradflow(*args):
        commands.append(args)
        if args[0] == "compare":
            raise _StopAtCompare
        out = Path(args[args.index("--out") + 1])
        if out.is_relative_to(tmp_path):  # what `gradflow record` would create (never made in the clone by the test)
            out.mkdir(parents=True)

    monkeypatch.setattr(pressure, "gradflow", fake_gradflow)
    before = _listing(ROOT / "runs")
    with pytest.raises(_StopAtCompare):
        pressure.main(["--pair", pair, "--out", str(tmp_path / "out")])
    assert _listing(ROOT / "runs") == before
    records = [c for c in commands if c[0] == "record"]
    n = len(pressure.PAIRS[pair][0])
    assert len(records) == n and commands[-1][0] == "compare"
    outs = [Path(c[c.index("--out") + 1]) for c in records]
    assert outs == [tmp_path / "out" / "runs" / label for label in pressure.PAIRS[pair][0]]
    assert all(out.is_dir() for out in outs)
    compare = commands[-1]
    assert [Path(p) for p in compare[1:1 + n]] == outs and Path(compare[compare.index("--out") + 1]) == tmp_path / "out"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("target", ["pressure", "twelve-blocks-pressure", "objectives-pressure"])
def test_the_make_targets_hand_out_to_the_script(target, tmp_path):
    proc = subprocess.run(["make", "-n", "-s", "-C", str(ROOT / "analyses"), target, f"OUT={tmp_path}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "-m analyses.pressure.run" in proc.stdout and f"--out {tmp_path}" in proc.stdout
