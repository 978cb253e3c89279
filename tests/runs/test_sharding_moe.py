"""`gradflow record --shard fsdp2` on mixtures of experts (issues 61 and 62): the remote-code LLaDA-MoE-shaped tiny
model (``--trust-remote-code --adapter auto``), its experts fused 3-D parameters on 3 gloo ranks and a ModuleList of
Linear experts on 2, gives one process's tables: every number within 1e-5 relative, exact zeros identical (the last
block's experts and router get exactly 0 from context on every rank), and experts.csv's per-expert role counts equal
to the row."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from gradflow.cli import main
from gradflow.schema import EXPERTS_FILE, SUBLAYERS_FILE
from models.remote_code.tiny_remote import build_moe_tiny
from tests.runs.test_sharding import assert_equal_tables, record_args, torchrun

FLAGS = ("--trust-remote-code", "--adapter", "auto")


@pytest.mark.slow
def test_fsdp2_moe_on_three_and_two_ranks_equals_one_process(tmp_path, tiny_corpus):
    layouts = {"fused": 3, "list": 2}
    models = {layout: build_moe_tiny(tmp_path / f"moe-{layout}", layout) for layout in layouts}
    runs = {}
    for port, (layout, ranks) in enumerate(layouts.items(), start=29776):  # both at once
        runs[layout] = torchrun(ranks, port, record_args(models[layout], tiny_corpus, tmp_path / f"{layout}-many",
                                                         *FLAGS))
    for layout in layouts:
        one = tmp_path / f"{layout}-one"
        assert main(record_args(models[layout], tiny_corpus, one, *FLAGS)) == 0
        _, err = runs[layout].communicate(timeout=600)
        assert runs[layout].returncode == 0, err[-3000:]
        assert err.count("generic adapter (adapter='auto')") == 1, err[-3000:]  # rank 0 describes the model, once
        many = tmp_path / f"{layout}-many"
        meta = json.loads((many / "meta.json").read_text())
        assert meta["sharding"]["kind"] == "fsdp2" and meta["sharding"]["world_size"] == layouts[layout]
        assert_equal_tables(one, many)
        experts = [pd.read_csv(d / EXPERTS_FILE).sort_values(["layer", "expert", "role"]).reset_index(drop=True)
                   for d in (one, many)]
        assert experts[0].equals(experts[1]) and experts[0].n_rows.sum() > 0  # counts: exactly equal
        table = pd.read_csv(many / SUBLAYERS_FILE)
        last = table[(table.layer == table.layer.max()) & table.sublayer.str.startswith("mlp.")
                     & (table.role == "context")]
        assert len(last) >= 3 and (last.contribution_norm_mean == 0.0).all() and (last.n_nonzero == 0).all()
