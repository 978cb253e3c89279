"""``gradflow record`` on a remote-code mixture-of-experts model registered for ``AutoModel`` only (issue 61, part 1).

The tiny checkpoint (``tests/models/remote_code/moe_tiny``: LLaDA-MoE's shape, model type ``tinymoe`` without a
gradflow adapter) is recorded with ``--trust-remote-code --adapter auto``: the generic adapter finds its router and its
experts (fused 3-D, or a ModuleList), sublayers.csv splits them by role with exactly 0 at the last block from the
positions without a loss, and experts.csv counts the rows of each role routed to each expert. Experts that route
inside their own forward are refused in one sentence (exit 2) that names ``--norms-only``, which records.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from gradflow.cli import main
from gradflow.schema import EXPERT_DTYPES, EXPERTS_FILE, SUBLAYERS_FILE
from models.remote_code.tiny_remote import build_moe_tiny

FLAGS = ["--limit", "4", "--batch-size", "2", "--quiet", "--trust-remote-code", "--adapter", "auto",
         "--max-length", "64"]


@pytest.mark.parametrize("layout", ["fused", "list"])
def test_record_splits_remote_code_experts_and_router(layout, tmp_path, tiny_corpus):
    model = build_moe_tiny(tmp_path / f"moe-{layout}", layout)
    out = tmp_path / "run"
    assert main(["record", "--model", str(model), "--texts", str(tiny_corpus), *FLAGS, "--out", str(out)]) == 0
    table = pd.read_csv(out / SUBLAYERS_FILE)
    expert_names = {"fused": {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"},
                    "list": {"mlp.experts.gate_proj", "mlp.experts.up_proj", "mlp.experts.down_proj"}}[layout]
    moe = table[table.sublayer.isin(expert_names | {"mlp.gate"})]
    assert set(moe.sublayer) == expert_names | {"mlp.gate"}
    last = moe[moe.layer == 2]
    off_loss = last[~last.role.isin(["masked", "random", "kept"])]
    assert "context" in set(off_loss.role)
    assert len(off_loss) == (len(expert_names) + 1) * off_loss.role.nunique()
    assert (off_loss.contribution_norm_mean == 0.0).all() and (off_loss.n_nonzero == 0).all(), off_loss
    assert (last[last.role == "masked"].contribution_norm_mean > 0).all()
    earlier = moe[(moe.layer == 1) & (moe.role == "context")]
    assert (earlier.contribution_norm_mean > 0).all()
    experts = pd.read_csv(out / EXPERTS_FILE)
    assert tuple(experts.columns) == tuple(EXPERT_DTYPES) and set(experts.experts) == {"mlp.experts"}
    assert set(experts.expert) == {0, 1, 2, 3} and set(experts.layer) == {1, 2}
    positions = sum(json.loads((out / "meta.json").read_text())["counts"]["tokens_per_role"].values())
    assert experts.groupby("layer").n_rows.sum().tolist() == [2 * positions] * 2  # top-2: two rows a position
    # the router the generic adapter found (a flat sublayer with one output per expert) is named, and the report's
    # last-block table lists it beside the experts with exactly 0 from context
    assert json.loads((out / "meta.json").read_text())["routers"] == ["mlp.gate"]
    assert main(["report", str(out), "--out", str(tmp_path / "report"), "--format", "png"]) == 0
    summary = (tmp_path / "report" / "summary.md").read_text()
    last = summary.split("### Last block (layer 2)", 1)[1].split("\n### ", 1)[0]
    assert "| mlp.gate | context | exactly 0 | exactly 0 |" in last, last


def test_record_refuses_experts_it_cannot_split(tmp_path, tiny_corpus, capsys):
    model = build_moe_tiny(tmp_path / "moe-internal", "internal")
    argv = ["record", "--model", str(model), "--texts", str(tiny_corpus), *FLAGS]
    assert main([*argv, "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("gradflow: error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert "the experts module 'mlp.experts' (TinyMoeInternalExperts) cannot be split by role" in errors[0]
    assert errors[0].rstrip().endswith("record with --norms-only (sites only), or describe its routing in an "
                                       "Adapter's ExpertsSpec")
    assert main([*argv, "--norms-only", "--out", str(tmp_path / "sites")]) == 0
    assert (tmp_path / "sites" / "channels.csv").exists() and not (tmp_path / "sites" / EXPERTS_FILE).exists()
