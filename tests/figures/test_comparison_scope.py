"""gradflow.figures.comparison_scope: a comparison says what each diffusion run pools over t, and compares at a t.

A tiny BERT recorded under BERT 15% and under masked diffusion on a grid of t: ``gradflow compare`` labels the
diffusion run with its scope on every figure, table and csv row, names each run's objective (not ``mlm`` for a
diffusion run), and with ``--mask-ratio`` compares the diffusion run's sequences of that t alone.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from gradflow.analysis import load_run, role_ratios  # noqa: E402
from gradflow.analysis.by_t import TSelection, select_by_t  # noqa: E402
from gradflow.cli.main import main  # noqa: E402
from gradflow.figures import report  # noqa: E402
from gradflow.formatting import objective_label  # noqa: E402

FAST = dict(n_resamples=60)
GRID = (0.25, 0.75)


@pytest.fixture(scope="module")
def two_runs(tiny_mlm_dir, tiny_corpus, tmp_path_factory):
    """(bert run, diffusion run) of the tiny BERT on the same 16 sequences."""
    base = tmp_path_factory.mktemp("scope")
    common = ["--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--max-length", "24", "--batch-size", "4",
              "--limit", "16", "--quiet"]
    assert main(["record", *common, "--out", str(base / "bert")]) == 0
    assert main(["record", *common, "--out", str(base / "diffusion"), "--objective", "diffusion",
                 "--mask-ratios", ",".join(map(str, GRID))]) == 0
    return base / "bert", base / "diffusion"


def test_a_pooled_diffusion_run_says_so_on_every_label(two_runs, tmp_path):
    report.write_comparison(list(two_runs), None, tmp_path, formats=("png",), **FAST)
    labels = set(pd.read_csv(tmp_path / "tables" / "ratios.csv")["label"])
    assert labels == {"bert", "diffusion (pooled over t 0.25\u20130.75)"}
    summary = (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert "| MLM | BERT 15% (80/10/10) | – |" in summary
    assert "| masked diffusion | diffusion t in {0.25, 0.75}, 1/t | pooled over t 0.25\u20130.75 |" in summary
    assert "Compare at a matched t with `--mask-ratio T`" in summary
    runs = summary.split("## Runs")[1].split("##")[0]
    assert "| objective |" in runs and "| mlm |" not in runs  # the loss's name alone no longer names the objective


def test_at_a_matched_t_only_those_sequences_are_compared(two_runs, tmp_path):
    paths = report.write_comparison(list(two_runs), ["bert", "diff"], tmp_path, formats=("png",),
                                    mask_ratio=TSelection(0.25, 0.25), **FAST)
    ratios = pd.read_csv(tmp_path / "tables" / "ratios.csv")
    assert set(ratios["label"]) == {"bert", "diff (t = 0.25)"}
    selected = select_by_t(load_run(two_runs[1]), TSelection(0.25, 0.25))
    expected = role_ratios(selected, roles=("context",), n_resamples=60)
    got = ratios[(ratios["label"] == "diff (t = 0.25)") & (ratios["role"] == "context")]
    assert got["ratio"].to_numpy() == pytest.approx(expected["ratio"].to_numpy(), rel=1e-12)
    assert set(got["n_sequences"]) <= {8}  # 8 of the 16 sequences have t = 0.25
    summary = (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert "| diff (t = 0.25) |" in summary and "| 8 of 16 |" in summary
    assert "keep only their sequences of t = 0.25" in summary and "still pool every t" in summary
    assert any(p.name == "compare_ratios.png" for p in paths)


def test_the_figure_legends_carry_the_scope(two_runs, tmp_path, monkeypatch):
    """The labels drawn in the comparison figures are the scoped labels (what the legend shows)."""
    drawn = []
    real = report.comparison_ratios

    def spy(comp, **kwargs):
        artists = real(comp, **kwargs)
        drawn.extend(a.get_label() for a in artists if a.get_gid() and a.get_gid().startswith("ratio:"))
        return artists
    monkeypatch.setattr(report, "comparison_ratios", spy)
    report.write_comparison(list(two_runs), None, tmp_path, formats=("png",), mask_ratio=TSelection(0.75, 0.75),
                            **FAST)
    assert drawn == ["bert", "diffusion (t = 0.75)"]


def test_the_cli_compares_at_a_t_and_names_a_bad_one(two_runs, tmp_path, capsys):
    bert, diffusion = map(str, two_runs)
    assert main(["compare", bert, diffusion, "--out", str(tmp_path / "c"), "--format", "png",
                 "--mask-ratio", "0.7,0.8"]) == 0
    assert "diffusion (t in [0.7, 0.8))" in set(pd.read_csv(tmp_path / "c" / "tables" / "ratios.csv")["label"])
    capsys.readouterr()
    assert main(["compare", bert, diffusion, "--out", str(tmp_path / "d"), "--mask-ratio", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "no sequence has t = 0.5; its sequences have t in {0.25, 0.75}" in err and "Traceback" not in err
    assert main(["compare", bert, diffusion, "--out", str(tmp_path / "e"), "--mask-ratio", "0.5,0.4"]) == 2
    assert "--mask-ratio: the bin '0.5,0.4' is empty" in capsys.readouterr().err
    assert main(["compare", bert, bert, "--labels", "a", "b", "--out", str(tmp_path / "f"),
                 "--mask-ratio", "0.5"]) == 2
    assert "none of these runs has t" in capsys.readouterr().err


def test_the_report_headline_names_the_objective(two_runs, tmp_path):
    report.write_report(two_runs[1], tmp_path, formats=("png",), **FAST)
    summary = (tmp_path / "summary.md").read_text(encoding="utf-8")
    assert "- Objective: masked diffusion (diffusion t in {0.25, 0.75}, 1/t; loss `mlm`)" in summary
    assert ("; pooled over t 0.25\u20130.75, so not comparable with a fixed selection rate (by t: Gradient flow by "
            "masking ratio t, below).") in summary
    assert "## Gradient flow by masking ratio t" in summary


def test_runs_without_t_have_no_t_column(two_runs, tmp_path):
    report.write_comparison([two_runs[0], two_runs[0]], ["a", "b"], tmp_path, formats=("png",), **FAST)
    runs = (tmp_path / "summary.md").read_text(encoding="utf-8").split("## Runs")[1].split("##")[0]
    assert "| label | model | objective | masking | blocks | sequences | complete |" in runs
    assert "pooled" not in runs and "--mask-ratio" not in runs


@pytest.mark.parametrize("meta, label", [
    ({"loss": "mlm", "masking": {"policy": "bert"}}, "MLM"),
    ({"loss": "mlm", "masking": {"policy": "diffusion"}}, "masked diffusion"),
    ({"loss": "mlm", "masking": {"policy": "diffusion"}, "prompted": {"prompt_field": "p"}}, "masked diffusion, SFT"),
    ({"loss": "all-positions", "masking": {"policy": "bert"}}, "all-positions"),
    ({"loss": "mlm", "masking": {"policy": "span"}}, "MLM"),
], ids=["bert", "diffusion", "diffusion sft", "all positions", "span"])
def test_objective_label(meta, label):
    assert objective_label(meta) == label
