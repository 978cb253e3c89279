"""analyses.diffusion_diagnosis.figure: the gradient flow during training, drawn from synthetic runs."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from pathlib import Path  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from analyses.diffusion_diagnosis import figure  # noqa: E402
from figure_layout import assert_clean_layout  # noqa: E402

STEPS = (0, 25, 50, 100, 150, 225, 300, 450, 600)
CELLS = ("base", "kept", "bert15")
ROLES = ("masked", "random", "kept", "context", "prompt", "special", "pad", "input", "output", "all", "tied")


def write_run(runs: Path, name: str, seed: int = 0, blocks: int = 6) -> None:
    """``<name>-s<seed>.{json,csv}`` in the runner's format, values made up but shaped like real ones: the last
    layer's ratio exactly 0, no kept or random tokens outside ``kept``/``bert15``, top-1 rising for ``bert15``."""
    k = CELLS.index(name) if name in CELLS else 0
    rows = []
    for step in STEPS:
        grow = math.log1p(step / 25.0)
        for probe in ("own", "t0.15"):
            def row(group: str, role: str, quantity: str, value: float) -> None:
                rows.append({"step": step, "group": group, "role": role, "quantity": quantity, "value": f"{value:.7g}",
                             "probe": probe})

            row("model", "all", "loss", 9.0 - grow)
            for layer in range(blocks + 1):
                group = "embeddings" if layer == 0 else f"blocks.{layer - 1}"
                row(group, "masked", "hidden_grad_mean", 1e-4 * (layer + 1))
                row(group, "context", "hidden_grad_mean", 1e-6 * (blocks - layer))
                ratio = 0.0 if layer == blocks else 0.01 * (blocks - layer) * (1 + grow) * (1 + k)
                row(group, "all", "context_loss_ratio", ratio)
                row(group, "all", "collapse", 0.9 - 0.05 * layer - 0.02 * grow * k)
                if layer:
                    row(group, "all", "attention_entropy", 4.0 - 0.1 * layer * grow)
                    row(group, "all", "attention_entropy_max", 4.2)
            for i, role in enumerate(ROLES):
                present = role in ("masked", "context", "special", "input", "output", "all") or (
                    role == "kept" and name in ("kept", "bert15")) or (role == "random" and name == "bert15")
                value = 0.0 if not present else (1.0 if role == "tied" else 0.5 / (i + 1) * (1 + 0.1 * step / 25))
                if role == "context" and step == 0 and name == "kept":
                    value = 0.0  # a zero at one step: a floor triangle, not a line point
                row("embeddings.word", role, "embedding_grad_norm", value)
    with (runs / f"{name}-s{seed}.csv").open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=["step", "group", "role", "quantity", "value", "probe"])
        writer.writeheader()
        writer.writerows(rows)
    checkpoints = [{"step": s, "train_loss": None if s == 0 else 8.0, "lr": 1e-3, "mask15_top1": 0.05 + 0.01 * k *
                    math.log1p(s / 25.0), "mask15_loss": 7.0, "mask15_positions": 2500} for s in STEPS]
    checkpoints[-1].update(own_loss=6.9, mask50_top1=0.05, bert15_top1=0.06)
    record = {"cell": name, "seed": seed, "steps": STEPS[-1], "recipe": {}, "changes": [], "candidate": True,
              "checkpoints": checkpoints, "final": checkpoints[-1], "train_s": 1.0}
    (runs / f"{name}-s{seed}.json").write_text(json.dumps(record), encoding="utf-8")


@pytest.fixture
def runs(tmp_path: Path) -> Path:
    out = tmp_path / "runs"
    out.mkdir()
    for name in CELLS:
        write_run(out, name)
    return out


def _drawn(fig, gid: str) -> list:
    return [a for ax in fig.axes for a in ax.get_lines() if a.get_gid() == gid]


def test_the_figure_is_written_with_a_clean_layout(runs, tmp_path):
    paths = figure.write_figure(runs, CELLS, 0, tmp_path / "out" / "training_flow")
    assert [p.name for p in paths] == ["training_flow.pdf", "training_flow.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    fig = figure.draw_training_flow([figure.load_run(runs, n, 0) for n in CELLS])
    assert_clean_layout(fig, "training flow, three cells")
    assert fig.get_figwidth() == pytest.approx(7.0)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles[0].replace("\n", " ").startswith("(a) base: the first member's recipe")
    assert "BERT 15%" in titles[2] and titles[3] == "(d) "
    plt.close(fig)


def test_the_ratio_lines_are_the_csv_values_and_zeros_sit_on_the_floor(runs):
    fig = figure.draw_training_flow([figure.load_run(runs, n, 0) for n in CELLS])
    with (runs / "kept-s0.csv").open(encoding="utf-8") as fh:
        rows = [r for r in csv.DictReader(fh) if r["quantity"] == "context_loss_ratio" and r["probe"] == "t0.15"]
    for layer, group in ((0, "embeddings"), (3, "blocks.2")):
        (line,) = _drawn(fig, f"ratio:kept:{layer}")
        expected = [float(r["value"]) for r in rows if r["group"] == group]
        np.testing.assert_allclose(line.get_ydata(), expected)
        np.testing.assert_array_equal(line.get_xdata(), STEPS)
    (last,) = _drawn(fig, "ratio:kept:6")
    assert np.isnan(last.get_ydata()).all()  # exactly 0 at every step: no line point on the log axis
    (floor,) = _drawn(fig, "zeros:ratio:kept:6")
    np.testing.assert_array_equal(floor.get_xdata(), STEPS)
    (top1,) = _drawn(fig, "top1:bert15")
    np.testing.assert_allclose(top1.get_ydata(), [0.05 + 0.02 * math.log1p(s / 25.0) for s in STEPS], rtol=1e-6)
    (final,) = _drawn(fig, "top1-final:bert15")  # the last step's 1,024 windows: an open circle
    assert list(final.get_xdata()) == [600] and final.get_markerfacecolor() == "white"
    plt.close(fig)


def test_no_zero_or_negative_value_is_drawn_on_a_log_axis(runs):
    fig = figure.draw_training_flow([figure.load_run(runs, n, 0) for n in CELLS])
    log_axes = [ax for ax in fig.axes if ax.get_yscale() == "log"]
    assert len(log_axes) == 2 * len(CELLS)
    for ax in log_axes:
        for line in ax.get_lines():
            if str(line.get_gid()).startswith("zeros:"):
                continue
            y = np.asarray(line.get_ydata(), float)
            assert not (y[np.isfinite(y)] <= 0).any(), line.get_gid()
    (floor,) = _drawn(fig, "zeros:embedding:kept:context")  # the one zero of a drawn role
    assert list(floor.get_xdata()) == [0]
    assert not _drawn(fig, "embedding:base:kept") and _drawn(fig, "embedding:bert15:random")  # absent roles left out
    labels = [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()]
    assert "exactly 0" in labels and "output layer" in labels
    plt.close(fig)


def test_a_missing_run_names_the_file_and_the_command(runs, capsys):
    (runs / "kept-s0.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"kept-s0\.json.*python -m analyses\.diffusion_diagnosis\.train "
                                                r"--cells kept --seeds 0"):
        figure.load_run(runs, "kept", 0)
    with pytest.raises(SystemExit, match="missing run file .*kept-s0.json"):
        figure.main(["--runs", str(runs), "--cells", "base", "kept", "--out", str(runs / "x")])


def test_the_cli_writes_both_files(runs, tmp_path, capsys):
    figure.main(["--runs", str(runs), "--cells", "base", "kept", "--out", str(tmp_path / "fig")])
    assert (tmp_path / "fig.pdf").exists() and (tmp_path / "fig.png").exists()
    assert "fig.png" in capsys.readouterr().out


def test_a_long_run_is_read_from_its_own_folder_partial_while_it_trains(tmp_path: Path) -> None:
    long_runs = tmp_path / "full"
    long_runs.mkdir()
    write_run(long_runs, "mdlm")
    record = json.loads((long_runs / "mdlm-s0.json").read_text())
    (long_runs / "mdlm-s0.json").unlink()
    record["checkpoints"] = [{k: v for k, v in r.items() if k != "own_loss"} for r in record["checkpoints"][:5]]
    (long_runs / "mdlm-s0.partial.json").write_text(json.dumps({**record, "partial": True}))
    run = figure.load_run(tmp_path / "unused", f"mdlm@{long_runs}", 0)
    assert run.cell == "mdlm" and list(run.checkpoints.step) == list(STEPS[:5])
    assert run.rows.step.max() == STEPS[4]  # snapshot rows past the partial record's last checkpoint left out
    assert figure.full_steps(run.checkpoints) == []  # no budget reached: every point on 128 windows
    record["checkpoints"][3]["own_loss"] = 6.5  # a budget measured on 1,024 windows
    (long_runs / "mdlm-s0.partial.json").write_text(json.dumps({**record, "partial": True}))
    assert figure.full_steps(figure.load_run(tmp_path, f"mdlm@{long_runs}", 0).checkpoints) == [STEPS[3]]
