"""tables.tex of probe directories (issue 26): structure, every estimate equal to the committed CSVs and
Markdown tables, and a pdflatex compile."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from gradflow.cli.main import main
from gradflow.runs.probe_tables import (
    accuracy_cell,
    best_earlier_cell,
    drop_cell,
    layer_table,
    write_comparison_tables,
    write_probe_tables,
)

ROOT = Path(__file__).resolve().parents[2]
PROBES = ROOT / "figures" / "probes"
MODELS = ("mini-en", "twin", "repaired")
TASKS = ("brown-pos", "brown-propn")
CELL = re.compile(r"(?<!\\)&")  # a cell boundary, not an escaped \&
SAMPLES = [p for p in (PROBES, PROBES / "n1500") if (p / "drops.md").is_file()]


def _tables(path: Path) -> list[str]:
    return re.findall(r"\\begin\{table\}.*?\\end\{table\}", path.read_text(encoding="utf-8"), flags=re.DOTALL)


def _rows(table: str) -> list[list[str]]:
    """Body rows of one LaTeX table as plain cells (the minus sign back to '-')."""
    lines = table.splitlines()
    body = lines[lines.index(r"\midrule") + 1: lines.index(r"\bottomrule")]
    return [[c.strip().replace("$-$", "-").replace(r"\%", "%") for c in CELL.split(line.removesuffix(r" \\"))]
            for line in body]


def _markdown_cells(path: Path) -> set[str]:
    return {c.strip() for line in path.read_text(encoding="utf-8").splitlines() for c in line.split("|")}


def test_cells_round_as_the_markdown_tables():
    assert accuracy_cell(0.92644, 0.92135, 0.93119) == "0.9264 [0.9214, 0.9312]"
    assert drop_cell("accuracy", -0.00321, -0.0063, -0.00041) == "-0.0032 [-0.0063, -0.0004]"
    assert drop_cell("code_length_bits", -393.6, -469.4, 29.2) == "-394 [-469, +29]"
    assert best_earlier_cell("accuracy", 4, 0.92961) == "4 (0.9296)"
    assert best_earlier_cell("code_length_bits", 4, 6140.4) == "4 (6.14 kbits)"


def test_without_code_length_the_layer_table_has_no_code_column():
    frame = pd.DataFrame({"model": "m", "task": "t", "regime": "unmasked", "site": ["embeddings.out", "blocks.0.out"],
                          "layer": [0, 1], "accuracy": [0.5, 0.6], "ci_low": [0.4, 0.5], "ci_high": [0.6, 0.7],
                          "selectivity": [0.1, 0.2], "code_length_bits": np.nan, "n_tokens": 1234, "n_sentences": 10})
    table = layer_table(frame, "m")
    assert table.header == ("layer", "site", "accuracy [95% CI]", "selectivity")
    assert table.rows == ((0, "embeddings.out", "0.5000 [0.4000, 0.6000]", "0.100"),
                          (1, "blocks.0.out", "0.6000 [0.5000, 0.7000]", "0.200"))
    assert "1,234 test words, 10 sentences" in table.caption and "code length" not in table.caption


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("task", TASKS)
def test_probe_tables_tex_has_every_layer_and_drop_of_the_markdown(sample, task, tmp_path):
    layers_md, drops_md = _markdown_cells(sample / f"layers_{task}.md"), _markdown_cells(sample / "drops.md")
    for model in MODELS:
        run = shutil.copytree(sample / "runs" / f"{model}-{task}", tmp_path / f"{model}-{task}")
        probes = pd.read_csv(run / "probes.csv")
        layers, drops = _tables(write_probe_tables(run))
        assert r"\toprule" in layers and r"\label{tab:gradflow-probe-" in layers and r"\caption{" in layers
        rows = _rows(layers)
        code = probes["code_length_bits"].notna().any()
        assert len(rows) == len(probes) and all(len(r) == (5 if code else 4) for r in rows)
        for row, r in zip(rows, probes.itertuples()):
            assert row[:2] == [str(r.layer), r.site]
            assert row[2] == f"{r.accuracy:.4f} [{r.ci_low:.4f}, {r.ci_high:.4f}]" and row[2] in layers_md
            assert float(row[3]) == pytest.approx(r.selectivity, abs=5e-4) and row[3] in layers_md
            if code:
                assert float(row[4]) == pytest.approx(r.code_length_bits / 1000, abs=5e-3) and row[4] in layers_md
        csv = pd.read_csv(run / "probe_drops.csv")
        drop_rows = _rows(drops)
        assert len(drop_rows) == len(csv)
        for row, r in zip(drop_rows, csv.itertuples()):
            assert row[2] in drops_md  # the estimate with its CI, to the digit
            value = float(row[2].split(" [")[0])
            assert value == pytest.approx(r.last_layer_drop, abs=5e-5 if r.metric == "accuracy" else 0.5)
        accuracy = csv[csv.metric == "accuracy"].iloc[0]
        assert f"{int(accuracy.best_earlier_layer)} ({accuracy.best_earlier_score:.4f})" in drops_md


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
def test_compare_tables_tex_has_each_drop_and_the_paired_differences(sample, tmp_path):
    dirs = [sample / "runs" / f"{model}-{task}" for task in TASKS for model in MODELS]
    differences = pd.read_csv(sample / "probe_drop_differences.csv")
    drops, paired = _tables(write_comparison_tables(dirs, list(MODELS) * 2, tmp_path, differences))
    drops_md = _markdown_cells(sample / "drops.md")
    rows = _rows(drops)
    assert len(rows) == len(dirs) and [r[2] for r in rows] == list(MODELS) * 2
    for row in rows:
        assert row[3] in drops_md and all(cell in drops_md for cell in row[5:])
    rows = _rows(paired)
    assert len(rows) == len(differences) == 4
    for row, r in zip(rows, differences.itertuples()):
        assert row[2] == f"{r.label} - {r.baseline}"
        assert f"{r.label} - {r.baseline}: {row[3]}" in drops_md
        assert float(row[3].split(" [")[0]) == pytest.approx(r.difference, abs=5e-5)
        assert row[4:] == [f"{r.n_words:,}", f"{r.n_sentences:,}"]


def test_committed_tables_tex_are_current(tmp_path):
    """Each committed tables.tex is what the writers make of the committed CSVs."""
    committed = sorted(PROBES.glob("**/runs/*/tables.tex"))
    assert committed, "no committed probe tables.tex (python -m analyses.probes.run --tables-only writes them)"
    for path in committed:
        run = shutil.copytree(path.parent, tmp_path / path.parent.parent.parent.name / path.parent.name)
        assert write_probe_tables(run).read_text(encoding="utf-8") == path.read_text(encoding="utf-8"), path
    for sample in SAMPLES:
        dirs = [sample / "runs" / f"{model}-{task}" for task in TASKS for model in MODELS]
        differences = pd.read_csv(sample / "probe_drop_differences.csv")
        made = write_comparison_tables(dirs, list(MODELS) * 2, tmp_path / sample.name, differences)
        assert made.read_text(encoding="utf-8") == (sample / "tables.tex").read_text(encoding="utf-8")


def _probe_dir(tmp_path: Path, tiny_mlm_dir: Path, name: str, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    words = ["the", "of", "a", "is", "nation", "year", "union", "congress", "treasury", "credit"]
    tags = {"the": "DET", "of": "ADP", "a": "DET", "is": "VERB"}
    lines = []
    for _ in range(40):
        lines += [f"{w}\t{tags.get(str(w), 'NOUN')}" for w in rng.choice(words, size=int(rng.integers(3, 7)))] + [""]
    (tmp_path / f"{name}.conll").write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / name
    assert main(["probe", "--model", str(tiny_mlm_dir), "--task", str(tmp_path / f"{name}.conll"), "--out", str(out),
                 "--limit", "40", "--no-code-length", "--resamples", "50", "--quiet", "--format", "png"]) == 0
    return out


@pytest.mark.skipif(shutil.which("pdflatex") is None, reason="no pdflatex here: the structure tests above still ran")
def test_probe_and_compare_tables_tex_compile(tiny_mlm_dir, tmp_path, capsys):
    _probe_dir(tmp_path, tiny_mlm_dir, "toy", 0)
    a = tmp_path / "toy"
    b = shutil.copytree(a, tmp_path / "copy")
    assert (a / "tables.tex").is_file() and len(_tables(a / "tables.tex")) == 2  # one regime + drops
    assert main(["compare", str(a), str(b), "--labels", "mini_en", "twin & co", "--out", str(tmp_path / "cmp"),
                 "--format", "png"]) == 0
    _, paired = _tables(tmp_path / "cmp" / "tables.tex")
    assert r"twin \& co $-$ mini\_en" in paired and _rows(paired)[0][3] == "+0.0000 [+0.0000, +0.0000]"
    (tmp_path / "paper.tex").write_text("\\documentclass{article}\\usepackage{booktabs}\\begin{document}"
                                        "\\input{toy/tables.tex}\\input{cmp/tables.tex}"
                                        "\\input{" + str(PROBES / "runs" / "mini-en-brown-pos-masked" / "tables.tex")
                                        + "}\\end{document}\n")
    proc = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "paper.tex"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:]


RESULTS = ROOT / "docs" / "results" / "probes-and-pressure.md"
ESTIMATE = re.compile(r"[+-]?\d[\d.]* \[[+-]?[\d.]+, [+-]?[\d.]+\]")
SNIPPET = re.compile(r'^--8<-- "(?P<path>[^"]+)"$', flags=re.MULTILINE)


def test_results_page_numbers_are_the_committed_tables():
    """The results page includes committed tables (snippets) and quotes no estimate they do not hold."""
    page = RESULTS.read_text(encoding="utf-8")
    included = [ROOT / m["path"] for m in SNIPPET.finditer(page)]
    assert included and all(p.is_file() for p in included)
    tables = "\n".join(p.read_text(encoding="utf-8") for p in included)
    quoted = ESTIMATE.findall(SNIPPET.sub("", page))
    assert len(quoted) >= 10
    assert [q for q in quoted if q not in tables] == []
    for words in re.findall(r"(\d[\d,]*) test words", page):
        assert f"| {words} |" in tables, words
    guide = (ROOT / "docs" / "guides" / "probes-and-pressure.md").read_text(encoding="utf-8")
    assert [q for q in ESTIMATE.findall(guide) if q not in tables] == []  # its sample-size example
