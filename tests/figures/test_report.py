"""gradflow.figures.report: figures and summary.md written, incomplete-run warnings, comparison checks."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib as mpl  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from gradflow import schema  # noqa: E402
from gradflow.analysis import RunError  # noqa: E402
from gradflow.figures import canvas, report  # noqa: E402
from gradflow.figures.report_moe import MOE_TABLES  # noqa: E402
from synthetic_runs import write_run  # noqa: E402

FIGURES = ("depth_profile", "ratio_heatmap", "last_block", "distributions", "context_coverage", "context_share")
FAST = dict(n_resamples=60)


def _written_tables(out) -> dict[str, tuple[str, ...]]:
    """Name -> header of every ``tables/<name>.csv`` under ``out``."""
    return {p.stem: tuple(pd.read_csv(p).columns) for p in sorted((out / "tables").glob("*.csv"))}


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


@pytest.fixture
def banners(monkeypatch) -> list[str]:
    """Record every banner added to a figure."""
    seen: list[str] = []
    original = canvas.add_banner

    def spy(fig, text=canvas.INCOMPLETE_BANNER):
        seen.append(text)
        return original(fig, text)
    monkeypatch.setattr(canvas, "add_banner", spy)
    return seen


@pytest.mark.slow
def test_write_report_writes_figures_tables_and_summary(tmp_path, banners):
    rc = dict(mpl.rcParams)
    run_dir = write_run(tmp_path / "run", num_layers=3, n_sequences=20)
    paths = report.write_report(run_dir, tmp_path / "out", **FAST)
    assert all(p.is_file() and p.stat().st_size > 0 for p in paths)
    names = {p.name for p in paths}
    for fig in FIGURES:
        assert f"{fig}.pdf" in names and f"{fig}.png" in names
    assert "role_ratios.csv" in names and "layer_tests.csv" in names
    tables = _written_tables(tmp_path / "out")  # every table but context_pressure (mlm run) and mask_ratio_profile
    assert tables == {k: v for k, v in schema.REPORT_TABLES.items()  # (no mask_ratios.parquet), schema columns
                      if k not in ("context_pressure", "mask_ratio_profile", *MOE_TABLES)}
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert summary.startswith("# gradflow report: synthetic/bert-tiny")
    assert "| layer | site | context / loss [95% CI]" in summary
    assert "tok-a" in summary and "gradflow run synthetic" in summary  # provenance
    assert "incomplete" not in summary.lower()
    assert banners == []
    assert plt.get_fignums() == []  # every figure closed
    rc.pop("backend", None)
    after = dict(mpl.rcParams)
    after.pop("backend", None)
    assert after == rc  # the style never leaks into the caller's rcParams


@pytest.mark.slow
def test_one_sequence_run_reports_no_interval(tmp_path):
    run_dir = write_run(tmp_path / "run", num_layers=3, n_sequences=1)
    report.write_report(run_dir, tmp_path / "out", **FAST)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "[–, –]" in summary and "One sequence gives no bootstrap interval" in summary
    report.write_report(write_run(tmp_path / "two", num_layers=3, n_sequences=2), tmp_path / "out2", **FAST)
    assert "One sequence" not in (tmp_path / "out2" / "summary.md").read_text()


def test_incomplete_run_warns_on_every_figure_and_summary(tmp_path, banners):
    run_dir = write_run(tmp_path / "run", num_layers=2, n_sequences=10, complete=False)
    paths = report.write_report(run_dir, tmp_path / "out", formats=("png",), width="double", **FAST)
    pngs = [p for p in paths if p.suffix == ".png"]
    assert len(pngs) == len(FIGURES)
    assert len(banners) == len(FIGURES) and all("INCOMPLETE" in b for b in banners)
    lines = (tmp_path / "out" / "summary.md").read_text().splitlines()
    assert any("Warning: incomplete run" in line for line in lines[:4])


def test_report_errors_are_run_errors(tmp_path):
    with pytest.raises(RunError, match="does not exist"):
        report.write_report(tmp_path / "missing", tmp_path / "out")
    run_dir = write_run(tmp_path / "run", num_layers=2, n_sequences=5)
    (run_dir / "channels.csv").unlink()
    with pytest.raises(RunError, match="channels.csv"):
        report.write_report(run_dir, tmp_path / "out")


@pytest.mark.slow
def test_write_comparison(tmp_path, banners):
    a = write_run(tmp_path / "a", num_layers=3, n_sequences=20)
    b = write_run(tmp_path / "b", num_layers=3, n_sequences=20, seed=4, loss="all-positions", complete=False)
    paths = report.write_comparison([a, b], ["mlm", "all"], tmp_path / "out", formats=("pdf", "png"), **FAST)
    names = {p.name for p in paths}
    for fig in ("compare_profiles", "compare_ratios", "compare_last_block"):
        assert f"{fig}.pdf" in names and f"{fig}.png" in names
    assert all(p.stat().st_size > 0 for p in paths)
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "all − mlm" in summary and "### mlm" in summary and "### all" in summary
    assert "incomplete run(s): all" in summary.splitlines()[2]
    tables = _written_tables(tmp_path / "out")
    assert tables == {k: v for k, v in schema.COMPARISON_TABLES.items() if k != "context_pressure"}
    assert len(banners) == 3 and all("all" in b for b in banners)


def test_pressure_table_has_the_schema_columns():
    from gradflow.figures.pressure import pressure_csv

    rows = pd.DataFrame([dict.fromkeys(schema.PRESSURE_COLUMNS, 0.0)])
    tables = pressure_csv({"mlm": rows, "all": rows})
    assert tuple(tables["context_pressure"].columns) == schema.REPORT_TABLES["context_pressure"]
    assert schema.COMPARISON_TABLES["context_pressure"] == schema.REPORT_TABLES["context_pressure"]


def test_comparison_rejects_different_tokenizers(tmp_path):
    a = write_run(tmp_path / "a", num_layers=2, n_sequences=5)
    b = write_run(tmp_path / "b", num_layers=2, n_sequences=5, tokenizer_hash="other")
    with pytest.raises(RunError, match="different tokenizers"):
        report.write_comparison([a, b], None, tmp_path / "out", **FAST)
    assert not (tmp_path / "out" / "summary.md").exists()


def test_comparison_needs_two_runs(tmp_path):
    a = write_run(tmp_path / "a", num_layers=2, n_sequences=5)
    with pytest.raises(RunError, match="at least two"):
        report.write_comparison([a], None, tmp_path / "out")


def test_the_tokenizer_refusal_names_the_command_that_compares_such_models(tmp_path, capsys):
    """Issue 27 point 1: the refusal gives the atlas command (unpaired, normalised depth) for these very models,
    and that command parses."""
    import json
    import shlex

    from gradflow.cli.main import build_parser, main

    runs = []
    for name, model, tok in (("a", "gradflow-mini-en", "tok-a"), ("b", "/data/albert-smiles", "tok-b")):
        path = write_run(tmp_path / name, num_layers=2, n_sequences=5, tokenizer_hash=tok)
        meta = json.loads((path / "meta.json").read_text())
        (path / "meta.json").write_text(json.dumps({**meta, "model": model}))
        runs.append(str(path))
    assert main(["compare", *runs, "--out", str(tmp_path / "out")]) == 2
    message = capsys.readouterr().err
    command = message.split("run: ", 1)[1].split(" (it records", 1)[0]
    assert command == "gradflow atlas gradflow-mini-en /data/albert-smiles --out atlas --no-probes"
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.models == ["gradflow-mini-en", "/data/albert-smiles"] and args.probes is False


@pytest.mark.slow
@pytest.mark.parametrize(("n_sequences", "warned"), [(12, True), (29, True), (30, False), (40, False)])
def test_a_headline_over_few_sequences_carries_a_small_sample_warning(tmp_path, n_sequences, warned):
    run = write_run(tmp_path / "run", num_layers=2, n_sequences=n_sequences)
    report.write_report(run, tmp_path / "out", formats=("png",), **FAST)
    headline = (tmp_path / "out" / "summary.md").read_text().split("## Headline", 1)[1].split("\n## ", 1)[0]
    assert ("**Small sample**" in headline) is warned
    if warned:
        assert f"over {n_sequences} sequences" in headline and "--limit" in headline
