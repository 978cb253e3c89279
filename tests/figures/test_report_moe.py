"""gradflow.figures.report_moe: ``gradflow report`` of a mixture-of-experts run (issue 61).

A tiny OLMoE (2 blocks, 4 experts, top-2) is recorded with and without ``--router-aux-loss`` and reported: the
report's expert tables are recomputed here from the raw experts.csv, sublayers.csv and router_aux.csv; the last
block's experts (and, without the auxiliary term, its router) are reported as exactly zero from context positions
where the tables hold 0.0; the per-expert counts add up to experts.csv; a run without router_aux.csv has no
auxiliary-loss section, and a dense run's report has neither section nor any new file.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import json  # noqa: E402
import shutil  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from gradflow import schema as S  # noqa: E402
from gradflow import schema_reports as R  # noqa: E402
from gradflow.analysis import RunError, load_run  # noqa: E402
from gradflow.figures import report  # noqa: E402
from gradflow.figures.report_moe import MOE_TABLES, moe_tables  # noqa: E402
from gradflow.formatting import format_number  # noqa: E402
from gradflow.runs.record import RecordConfig, record_corpus  # noqa: E402
from synthetic_runs import write_run  # noqa: E402
from test_record_router_aux import _olmoe  # noqa: E402  (tests/runs: the tiny OLMoE of the router-aux tests)

FAST = dict(formats=("png",), n_resamples=20)
WEIGHTS = ("ffn.experts.down_proj", "ffn.experts.gate_up_proj")
LAST = 2
EXACT = "exactly 0"
DTYPE_KINDS = {"str": "O", "int64": "i", "float64": "f", "bool": "b"}


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


@pytest.fixture(scope="module")
def moe(tiny_mlm_dir, tiny_corpus, tmp_path_factory):
    """name -> (run dir, report dir): the tiny OLMoE recorded with the auxiliary router loss (``aux``) and without
    (``plain``), 6 sequences each, and reported."""
    root = tmp_path_factory.mktemp("moe_report")
    out = {}
    for name, aux in (("aux", "model"), ("plain", None)):
        run = root / name
        record_corpus(RecordConfig(out=str(run), model=str(tiny_mlm_dir), texts=str(tiny_corpus), limit=6,
                                   batch_size=3, max_length=24, quiet=True, router_aux_loss=aux),
                      loaded=_olmoe(tiny_mlm_dir))
        report.write_report(run, root / f"{name}_report", **FAST)
        out[name] = (run, root / f"{name}_report")
    return out


def _section(summary: str, title: str) -> str:
    """The text of ``summary.md``'s section ``## title`` (to the next ``## ``)."""
    assert f"\n## {title}\n" in summary, title
    return summary.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _markdown_rows(section: str, header_start: str) -> list[list[str]]:
    """The body rows of the first Markdown table of ``section`` whose header starts with ``header_start``."""
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


def _expected_roles(run) -> pd.DataFrame:
    """expert_roles recomputed from experts.csv and sublayers.csv: per (layer, role) the rows and the magnitudes
    summed over the experts' weights, their shares, and the pooled loss."""
    experts = pd.read_csv(run / S.EXPERTS_FILE)
    sub = pd.read_csv(run / S.SUBLAYERS_FILE)
    rows = []
    for layer in (1, 2):
        routed = experts[(experts.layer == layer) & (experts.role != "pad")]
        n = routed.groupby("role").n_rows.sum()
        mine = sub[(sub.layer == layer) & sub.sublayer.isin(WEIGHTS) & (sub.param == "weight")]
        mag = mine.groupby("role").magnitude_sum.sum()
        for role in [*[r for r in S.REPORTED_ROLES if n.get(r, 0) > 0 or r in mag.index], "loss"]:
            count = n.reindex(S.LOSS_ROLES, fill_value=0).sum() if role == "loss" else n.get(role, 0)
            m = mag.reindex(S.LOSS_ROLES).sum() if role == "loss" else mag[role]
            rows.append({"layer": layer, "role": role, "n_rows": count, "row_share": count / n.sum(),
                         "magnitude_sum": m, "share": m / mag.sum()})
    return pd.DataFrame(rows)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["aux", "plain"])
def test_expert_roles_are_the_raw_tables_numbers(moe, name):
    run, out = moe[name]
    got = pd.read_csv(out / "tables" / "expert_roles.csv")
    want = _expected_roles(run)
    assert (got.experts == "ffn.experts").all()
    assert got[["layer", "role"]].values.tolist() == want[["layer", "role"]].values.tolist()
    assert got.n_rows.tolist() == want.n_rows.tolist()
    for column in ("row_share", "magnitude_sum", "share"):
        assert got[column].tolist() == pytest.approx(want[column].tolist(), rel=1e-12, abs=0), column
    assert got.exact_zero.tolist() == (want.magnitude_sum == 0.0).tolist()
    # the summary's per-block table: the same shares as percentages (0 only where the table holds 0.0)
    section = _section((out / "summary.md").read_text(), "Experts (mixture of experts)")
    body = _markdown_rows(section, "| layer | rows: loss |")
    header = next(line for line in section.splitlines() if line.startswith("| layer | rows: loss |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    for cells in body:
        at = got[got.layer == int(cells[0])].set_index("role")
        for column, cell in zip(columns[1:], cells[1:]):
            kind, role = column.split(": ")
            value = at.loc[role, "row_share" if kind == "rows" else "share"]
            assert cell == ("0" if value == 0.0 else f"{format_number(100 * value)}%"), (column, cell)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["aux", "plain"])
def test_the_last_blocks_experts_are_exactly_zero_from_context(moe, name):
    run, out = moe[name]
    sub = pd.read_csv(run / S.SUBLAYERS_FILE).set_index(["layer", "sublayer", "role"])
    for weight in WEIGHTS:  # the premise: the raw table holds 0.0 (else this test proves nothing)
        assert sub.loc[(LAST, weight, "context"), "magnitude_sum"] == 0.0
        assert sub.loc[(LAST, weight, "context"), "contribution_norm_mean"] == 0.0
        assert sub.loc[(LAST - 1, weight, "context"), "magnitude_sum"] > 0
    roles = pd.read_csv(out / "tables" / "expert_roles.csv").set_index(["layer", "role"])
    assert roles.loc[(LAST, "context"), "magnitude_sum"] == 0.0 and roles.loc[(LAST, "context"), "share"] == 0.0
    assert roles.loc[(LAST, "context"), "exact_zero"] and not roles.loc[(LAST - 1, "context"), "exact_zero"]
    section = _section((out / "summary.md").read_text(), "Experts (mixture of experts)")
    router = sub.loc[(LAST, "ffn.router", "context"), "magnitude_sum"]
    zeros = ["`ffn.router`"] * int(router == 0.0) + [f"`{w}`" for w in WEIGHTS]
    assert f"Context positions send exactly 0 (0.0 in sublayers.csv) to {', '.join(zeros)}:" in section
    table = {(r[0], r[1]): r[2:] for r in _markdown_rows(section, "| sublayer | role |")}
    for weight in WEIGHTS:
        assert table[(weight, "context")] == [EXACT, EXACT]
    if name == "plain":  # the loss alone: the last router is exactly zero from context too
        assert router == 0.0 and table[("ffn.router", "context")] == [EXACT, EXACT]
    else:  # the auxiliary term reaches it from every position
        share = sub.loc[(LAST, "ffn.router", "context"), "share"]
        assert router > 0 and table[("ffn.router", "context")][0] == f"{format_number(100 * share)}%"
        assert f"`ffn.router` gets {format_number(100 * share)}% of its signal from context positions. This " \
               "run's split includes the auxiliary router loss" in section


@pytest.mark.slow
def test_per_expert_counts_add_up_to_experts_csv(moe):
    run, out = moe["aux"]
    raw = pd.read_csv(run / S.EXPERTS_FILE)
    got = pd.read_csv(out / "tables" / "expert_rows.csv")
    keys = ["layer", "experts", "expert", "role"]
    assert got[[*keys, "n_rows"]].equals(raw[[*keys, "n_rows"]])
    with_rows = got.groupby(["layer", "role"]).n_rows.transform("sum") > 0
    assert all(total == pytest.approx(1.0, rel=1e-12)
               for total in got[with_rows].groupby(["layer", "role"]).expert_share.sum())
    assert got[~with_rows].expert_share.isna().all()  # prompt: no rows, no share
    section = _section((out / "summary.md").read_text(), "Experts (mixture of experts)")
    header = next(line for line in section.splitlines() if line.startswith("| layer | expert |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    body = _markdown_rows(section, "| layer | expert |")
    assert len(body) == 2 * 4
    wide = raw.pivot_table(index=["layer", "expert"], columns="role", values="n_rows", aggfunc="sum")
    for cells in body:
        layer, expert = int(cells[0]), int(cells[1])
        counts = dict(zip(columns[2:-1], map(int, cells[2:-1])))
        assert counts == {r: int(wide.loc[(layer, expert), r]) for r in columns[2:-1]}
        assert int(cells[-1]) == sum(counts.values()) == int(wide.loc[(layer, expert)].sum())
    assert set(columns[2:-1]) == set(raw.groupby("role").n_rows.sum().loc[lambda s: s > 0].index)
    positions = sum(json.loads((run / S.META_FILE).read_text())["counts"]["tokens_per_role"].values())
    for layer in (1, 2):  # top-2: every position (pad included) is two rows of each block
        assert sum(int(c[-1]) for c in body if int(c[0]) == layer) == int(raw[raw.layer == layer].n_rows.sum()) \
            == 2 * positions


@pytest.mark.slow
def test_router_aux_ratio_and_its_section(moe):
    run, out = moe["aux"]
    raw = pd.read_csv(run / S.ROUTER_AUX_FILE)
    got = pd.read_csv(out / "tables" / "router_aux_ratio.csv")
    assert got[list(S.ROUTER_AUX_DTYPES)].equals(raw)
    assert got.aux_ratio.tolist() == pytest.approx((raw.norm_aux / raw.norm_loss).tolist(), rel=1e-12, abs=0)
    last = got[(got.layer == LAST) & got.sublayer.isin(WEIGHTS)]
    assert (last.norm_aux == 0.0).all() and (last.aux_ratio == 0.0).all()
    router = got[(got.layer == LAST) & (got.sublayer == "ffn.router")].iloc[0]
    assert router.norm_aux > 0 and router.aux_ratio > 0
    section = _section((out / "summary.md").read_text(), "Auxiliary router loss")
    assert "so it reaches the last block's router from every position" in section
    assert "The last block's experts get exactly 0 from the term" in section
    body = _markdown_rows(section, "| layer | sublayer |")
    assert [[int(c[0]), c[1]] for c in body] == raw[["layer", "sublayer"]].values.tolist()
    for cells, row in zip(body, got.itertuples()):
        assert cells[2:] == [format_number(row.norm_loss), format_number(row.norm_aux), format_number(row.aux_ratio)]


@pytest.mark.slow
def test_without_router_aux_csv_there_is_no_aux_section(moe):
    run, out = moe["plain"]
    assert not (run / S.ROUTER_AUX_FILE).exists()
    summary = (out / "summary.md").read_text()
    assert "## Experts (mixture of experts)" in summary and "Auxiliary router loss" not in summary
    assert not (out / "tables" / "router_aux_ratio.csv").exists()
    assert (out / "tables" / "expert_roles.csv").is_file() and (out / "tables" / "expert_rows.csv").is_file()


@pytest.mark.slow
def test_a_dense_runs_report_has_no_experts(tmp_path):
    run = write_run(tmp_path / "run", num_layers=2, n_sequences=6)
    paths = report.write_report(run, tmp_path / "out", **FAST)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "## Experts" not in summary and "Auxiliary router loss" not in summary
    assert {p.stem for p in (tmp_path / "out" / "tables").glob("*.csv")} == set(S.REPORT_TABLES) - {
        "context_pressure", "mask_ratio_profile", *MOE_TABLES}
    assert not {p.stem for p in paths} & set(MOE_TABLES)


@pytest.mark.slow
@pytest.mark.parametrize("name", MOE_TABLES)
def test_the_tables_follow_the_schema(moe, name):
    frame = pd.read_csv(moe["aux"][1] / "tables" / f"{name}.csv")
    assert tuple(frame.columns) == S.REPORT_TABLES[name]
    assert not frame.duplicated(R.TABLE_KEYS[f"report:{name}"].split(", ")).any()
    for column in frame.columns:
        values = frame[column].dropna()
        assert values.dtype.kind in DTYPE_KINDS[R.describe(name, column).dtype], (name, column)


@pytest.mark.slow
def test_a_malformed_experts_csv_is_refused(moe, tmp_path):
    run = shutil.copytree(moe["plain"][0], tmp_path / "run")
    pd.read_csv(run / S.EXPERTS_FILE).drop(columns="n_rows").to_csv(run / S.EXPERTS_FILE, index=False)
    with pytest.raises(RunError, match="experts.csv' lacks the column.s. n_rows"):
        moe_tables(load_run(run))
