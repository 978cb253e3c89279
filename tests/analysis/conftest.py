"""Fixtures of the analysis tests: a tiny masked-diffusion run recorded once for the session."""

from __future__ import annotations

import pytest

from gradflow.cli.main import main

DIFFUSION_GRID = (0.2, 0.5, 0.8)
"""The grid of t of :func:`diffusion_run`: its 24 sequences cycle through it (8 a value)."""


@pytest.fixture(scope="session")
def diffusion_run(tiny_mlm_dir, tiny_corpus, tmp_path_factory):
    """24 sequences of the tiny 2-block BERT under masked diffusion, t cycling through DIFFUSION_GRID."""
    out = tmp_path_factory.mktemp("diffusion") / "run"
    assert main(["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--objective", "diffusion", "--mask-ratios", ",".join(map(str, DIFFUSION_GRID)), "--max-length",
                 "24", "--batch-size", "4", "--limit", "24", "--quiet"]) == 0
    return out
