"""The redesign of issue 13 preserved behaviour: the demo's tables are byte-identical to the ones the
pre-redesign code (commit 1f731dc) wrote, on the first 16 sequences of the committed sample.

The references in ``tests/data/demo_reference_limit16`` were written by that commit with
``gradflow demo --limit 16``. ``analyses/check_demo_identity.py`` repeats the check on the whole
demo against any git revision.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gradflow.runs.demo import DEMO_RUNS
from gradflow.runs.record import RecordConfig, record_corpus

REFERENCE = Path(__file__).parent / "data" / "demo_reference_limit16"


@pytest.mark.parametrize(("run_name", "model", "loss"), DEMO_RUNS)
def test_demo_tables_byte_identical_to_pre_redesign(tmp_path, run_name, model, loss):
    out = tmp_path / run_name
    record_corpus(RecordConfig(out=str(out), model=model, loss=loss, limit=16, quiet=True))
    for name in ("channels.csv", "sublayers.csv"):
        expected = (REFERENCE / run_name / name).read_bytes()
        assert (out / name).read_bytes() == expected, f"{run_name}/{name} differs from the pre-redesign output"
