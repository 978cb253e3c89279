"""torchrun with 2 gloo processes gives the same tables as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
       "GRADFLOW_BACKEND": "gloo"}


def _run(args: list[str]) -> None:
    proc = subprocess.run(args, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_two_process_gloo_equals_one_process(tmp_path, tiny_mlm_dir, tiny_corpus):
    common = ["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--max-length", "24",
              "--batch-size", "3", "--quiet"]
    one, two = tmp_path / "one", tmp_path / "two"
    _run([sys.executable, "-m", "gradflow", *common, "--out", str(one)])
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29731",
          "-m", "gradflow", *common, "--out", str(two)])
    assert_same_tables(one, two)


def assert_same_tables(one, two, rtol: float = 1e-6) -> None:
    """A 2-process run directory ``two`` holds the tables of the 1-process run ``one`` (means to ``rtol``)."""
    meta1 = json.loads((one / "meta.json").read_text())
    meta2 = json.loads((two / "meta.json").read_text())
    assert meta2["world_size"] == 2 and meta2["complete"]
    for key in ("windows", "sequences_recorded", "documents"):
        assert meta1["counts"][key] == meta2["counts"][key], key
    for role in ("masked", "random", "kept", "context", "special"):
        assert meta1["counts"]["tokens_per_role"][role] == meta2["counts"]["tokens_per_role"][role]
    c1 = pd.read_csv(one / "channels.csv").set_index(["site", "role"]).sort_index()
    c2 = pd.read_csv(two / "channels.csv").set_index(["site", "role"]).sort_index()
    assert c1.index.equals(c2.index)
    assert (c1.n_positions == c2.n_positions).all()
    for col in ("grad_norm_mean", "act_norm_mean"):
        a, b = c1[col].to_numpy(), c2[col].to_numpy()
        assert np.all(np.abs(a - b) <= rtol * np.maximum(np.abs(a), 1e-30)), col
    s1 = pd.read_csv(one / "sublayers.csv").set_index(["layer", "sublayer", "param", "role"]).sort_index()
    s2 = pd.read_csv(two / "sublayers.csv").set_index(["layer", "sublayer", "param", "role"]).sort_index()
    assert (s1.n_positions == s2.n_positions).all() and (s1.n_nonzero == s2.n_nonzero).all()
    a, b = s1.magnitude_sum.to_numpy(), s2.magnitude_sum.to_numpy()
    assert np.all(np.abs(a - b) <= rtol * np.maximum(np.abs(a), 1e-30))
    seq1 = pd.read_parquet(one / "sequences.parquet")
    seq2 = pd.read_parquet(two / "sequences.parquet")
    assert len(seq1) == len(seq2) and seq2.sequence_index.is_monotonic_increasing
    sub1 = pd.read_parquet(one / "sublayer_sequences.parquet")
    sub2 = pd.read_parquet(two / "sublayer_sequences.parquet")
    assert len(sub1) == len(sub2) and sub2.sequence_index.is_monotonic_increasing
    assert not list(two.glob("*rank*"))  # the per-process parts are merged away
    keys = ["sequence_index", "layer", "sublayer", "param", "role"]
    sub1, sub2 = (s.sort_values(keys).reset_index(drop=True) for s in (sub1, sub2))
    assert sub1[[*keys, "n_positions"]].equals(sub2[[*keys, "n_positions"]])
    np.testing.assert_allclose(sub2.magnitude_sum, sub1.magnitude_sum, rtol=max(rtol, 1e-5), atol=1e-30)
