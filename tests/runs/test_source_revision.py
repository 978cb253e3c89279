"""meta.json pins the code that made a number: the git revision of a checkout, "unknown" elsewhere."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from gradflow import provenance

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_cache():
    provenance.source_revision.cache_clear()
    yield
    provenance.source_revision.cache_clear()


def test_a_checkout_gives_its_head_commit():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    revision = provenance.source_revision()
    assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", revision)
    assert revision.split("+")[0] == head


def test_outside_a_checkout_it_is_unknown(tmp_path, monkeypatch):
    package = tmp_path / "site-packages" / "gradflow"
    package.mkdir(parents=True)
    monkeypatch.setattr(provenance, "_package_root", lambda: package)
    assert provenance.source_revision() == "unknown"


def test_every_provenance_block_carries_the_revision(tmp_path, tiny_mlm_dir, tiny_corpus):
    import json

    from gradflow.runs.meta import versions
    from gradflow.runs.record import RecordConfig, record_corpus

    assert versions()["gradflow_revision"] == provenance.source_revision()
    record_corpus(RecordConfig(out=str(tmp_path / "run"), model=str(tiny_mlm_dir), texts=str(tiny_corpus), limit=4,
                               max_length=32, quiet=True))
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["versions"]["gradflow_revision"] == provenance.source_revision()
    assert meta["versions"]["gradflow"] == "0.1.0"
