"""docs/guides/callback.md's example runs as written (with fewer steps, through its ``STEPS`` variable): it writes
the callback's CSV, and the default log mode sends a handful of scalars per logged step where ``log="all"`` floods."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradflow import schema

pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate")

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "callback.md"
BLOCKS = re.findall(r"```python\n(.*?)```", GUIDE.read_text(encoding="utf-8"), flags=re.DOTALL)
STEPS = re.compile(r"^STEPS = \d+", flags=re.MULTILINE)
ATTACH = "GradFlowCallback.attach(trainer, every=10)"


def _run(code: str, steps: int, directory: Path, monkeypatch) -> dict:
    """Run ``code`` with ``STEPS = steps`` in ``directory``; return its namespace."""
    code, n = STEPS.subn(f"STEPS = {steps}", code)
    assert n == 1, "the example sets STEPS once, at the start of a line"
    directory.mkdir()
    monkeypatch.chdir(directory)
    namespace: dict = {"__name__": "__main__"}
    exec(compile(code, str(GUIDE), "exec"), namespace)  # noqa: S102 - the guide's own example
    return namespace


def _scalars_per_logged_step(trainer) -> dict[int, list[str]]:
    out = {}
    for entry in trainer.state.log_history:
        names = [k for k in entry if k.startswith("gradflow/")]
        if names:
            out[entry["step"]] = names
    return out


def test_the_guide_has_one_short_example():
    assert len(BLOCKS) == 1
    lines = [line for line in BLOCKS[0].splitlines() if line.strip()]
    assert len(lines) <= 20 and ATTACH in BLOCKS[0]  # attached in the default log mode


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        namespace = _run(BLOCKS[0], 10, tmp_path_factory.mktemp("guide") / "default", monkeypatch)
    return namespace


def test_example_writes_the_csv(example):
    log = example["log"]
    assert tuple(log.columns) == schema.CALLBACK_COLUMNS
    assert sorted(log.step.unique()) == [1, 10]
    assert set(log.quantity) == set(schema.CALLBACK_QUANTITIES)
    assert set(log.group) == {"embeddings", *(f"blocks.{i}" for i in range(6)), "other"}
    drift = log[log.quantity == "drift"]
    assert (drift.value > 0).all() and (drift.value < 0.1).all()
    # the claim the guide prints: the last block's context positions get exactly nothing under MLM
    hidden = example["hidden"]
    assert (hidden[(hidden.group == "blocks.5") & (hidden.role == "context")].value == 0.0).all()
    assert (hidden[(hidden.group == "blocks.4") & (hidden.role == "context")].value > 0).all()


def test_default_mode_sends_a_handful_of_scalars(example):
    per_step = _scalars_per_logged_step(example["trainer"])
    assert sorted(per_step) == [1, 10]
    for names in per_step.values():
        assert names == list(schema.CALLBACK_SUMMARY_SCALARS) and len(names) <= 10
    assert len(example["log"]) > 10 * len(schema.CALLBACK_SUMMARY_SCALARS)  # ... while the CSV holds every row


def test_log_all_floods_by_comparison(example, tmp_path, monkeypatch):
    code = BLOCKS[0].replace(ATTACH, ATTACH.replace("every=10", 'every=10, log="all"'))
    namespace = _run(code, 1, tmp_path / "all", monkeypatch)
    per_step = _scalars_per_logged_step(namespace["trainer"])
    assert list(per_step) == [1]
    log = namespace["log"]
    assert len(per_step[1]) == int((log.quantity != "n_positions").sum()) > 60
    summary = _scalars_per_logged_step(example["trainer"])[1]
    assert len(per_step[1]) > 8 * len(summary)
