"""The deficit through pretraining (analyses/twelve_blocks): snapshots of a tiny recipe run measured, resumed,
refused when their bytes differ, and drawn from a small table."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from analyses.pretraining.pretrain import train_tokenizer
from analyses.pretraining.recipe.config import RunConfig
from analyses.pretraining.recipe.model import build_model
from analyses.pretraining.recipe.snapshots import SNAPSHOT_DIR, read_index, write_snapshot
from analyses.twelve_blocks import dynamics, dynamics_figure
from analyses.twelve_blocks.snapshot import load_snapshot, read_run, run_snapshots

from gradflow.errors import ModelLoadError, UsageError
from gradflow.inputs.corpus import default_texts
from gradflow.models.zoo import sha256 as file_sha256

WORDS = ["the", "nation", "of", "public", "credit", "is", "by", "a", "we", "must", "that", "laws", "are", "congress",
         "will", "year", "union", "people", "government", "states"]
TAGS = {"the": "DET", "a": "DET", "of": "ADP", "by": "ADP", "that": "ADP", "is": "VERB", "are": "VERB",
        "will": "VERB", "must": "VERB", "we": "PRON"}
SETTINGS = dynamics.Settings(limit=4, batch_size=4, max_length=32, resamples=50, probe_limit=60, probe_resamples=50)
LABEL = "tiny"


def make_run(root: Path, steps: tuple[int, ...]) -> Path:
    """A recipe run folder (meta.json, tokenizer, snapshots at ``steps`` of a 3-block hidden-32 model)."""
    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    lines = Path(default_texts()).read_text(encoding="utf-8").splitlines()[:200]
    (corpus / "train.txt").write_text("\n".join([*lines, " ".join(WORDS)]) + "\n", encoding="utf-8")
    tokenizer = train_tokenizer(corpus, root / "tokenizer", 400)
    run = root / "run"
    cfg = RunConfig.from_arch("tiny", corpus=str(corpus), out=str(run), tokenizer=str(root / "tokenizer"), layers=3,
                              steps=16, warmup=2, snapshots=4)
    model = build_model(cfg, len(tokenizer), tokenizer.pad_token_id)
    generator = torch.Generator().manual_seed(0)
    for step in steps:  # weights that move between snapshots, as training would move them
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=generator))
        write_snapshot(run, model, step, tokens=100 * step)
    meta = {"config": asdict(cfg), "vocab_size": len(tokenizer), "tokenizer": str(root / "tokenizer"),
            "tokenizer_sha256": file_sha256(root / "tokenizer" / "tokenizer.json")}
    (run / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return run


def make_task(path: Path, sentences: int = 60) -> Path:
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(sentences):
        lines += [f"{w}\t{TAGS.get(str(w), 'NOUN')}" for w in rng.choice(WORDS, size=int(rng.integers(3, 8)))] + [""]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dynamics.Settings]:
    root = tmp_path_factory.mktemp("dynamics")
    run = make_run(root, (2, 4))
    settings = dynamics.Settings(**{**asdict(SETTINGS), "tasks": (str(make_task(root / "toy.conll")),)})
    out = root / "out"
    dynamics.measure({LABEL: run}, out, settings, root / "work")
    return run, out, settings


def test_a_snapshot_loads_with_the_weights_written(tmp_path: Path):
    run = make_run(tmp_path, (3,))
    info = read_run(run)
    (snap,) = run_snapshots(run)
    loaded = load_snapshot(info, snap, "x")
    from safetensors.torch import load_file

    stored = load_file(str(snap.path))
    state = loaded.model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in stored.items())
    tied = set(state) - set(stored)  # the decoder weight and bias: the embeddings' and the head's own, stored once
    assert tied and all(any(state[t].data_ptr() == state[s].data_ptr() for s in stored) for t in tied)
    assert loaded.adapter is not None and not loaded.model.training


@pytest.mark.slow
def test_the_measurement_has_one_row_set_per_snapshot(measured):
    run, out, _ = measured
    table = dynamics.read_table(out)
    assert tuple(table.columns) == dynamics.COLUMNS
    index = {int(r["step"]): r for r in read_index(run)}
    assert sorted(table["step"].unique()) == [2, 4]
    for step, rows in table.groupby("step"):
        assert set(rows["sha256"]) == {index[step]["sha256"]} and set(rows["tokens"]) == {int(index[step]["tokens"])}
        ratio = rows[rows["measure"] == "context_loss_ratio"].set_index("layer")
        assert list(ratio.index) == [0, 1, 2, 3]
        assert ratio.loc[3, "value"] == 0.0  # MLM: no gradient reaches the last block's output at context positions
        assert (ratio.loc[[0, 1, 2], "value"] > 0).all()
        pressure = rows[rows["measure"] == "pressure"]
        assert set(pressure["layer"]) == {3} and len(pressure) == 2 * pressure["detail"].nunique()
        assert {"attn.q", "ffn.in"} <= set(pressure["detail"])
        assert (pressure.loc[pressure["metric"] == "pressure", "value"] > 0).all()
        probe = rows[rows["measure"] == "probe_drop"]
        assert sorted(probe["metric"]) == ["accuracy", "code_length_bits"] and set(probe["layer"]) == {3}
        assert ((rows["ci_low"] <= rows["value"] + 1e-12) & (rows["value"] <= rows["ci_high"] + 1e-12)).all()
    meta = json.loads((out / "meta.json").read_text())
    model = meta["models"][LABEL]
    assert model["planned_steps"] == [2, 4, 8, 16] and model["measured_steps"] == [2, 4]
    assert [(s["step"], s["sha256"]) for s in model["snapshots"]] == [(2, index[2]["sha256"]), (4, index[4]["sha256"])]
    assert meta["partial"] is True and "partial" in meta["note"]
    assert [m["step"] for m in meta["measured"]] == [2, 4] and all(m["total_s"] > 0 for m in meta["measured"])
    assert not any((out.parent / "work").rglob("*.parquet"))  # intermediate runs removed


def test_the_ratio_equals_gradflow_record_of_the_snapshot_saved_as_a_model(measured, tmp_path: Path):
    """The snapshot saved with save_pretrained and recorded the ordinary way (load_model) gives the table's ratios."""
    from gradflow.analysis import context_ratio, load_run
    from gradflow.runs.record import RecordConfig, record_corpus

    run, out, settings = measured
    snap = run_snapshots(run)[-1]
    loaded = load_snapshot(read_run(run), snap, LABEL)
    folder = tmp_path / "model"
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    record_corpus(RecordConfig(out=str(tmp_path / "rec"), model=str(folder), limit=settings.limit,
                               batch_size=settings.batch_size, max_length=settings.max_length, quiet=True))
    expected = context_ratio(load_run(tmp_path / "rec"), n_resamples=settings.resamples, seed=settings.seed)
    table = dynamics.read_table(out)
    got = table[(table["step"] == snap.step) & (table["measure"] == "context_loss_ratio")]
    np.testing.assert_array_equal(got["layer"], expected["layer"])
    np.testing.assert_allclose(got["value"], expected["ratio"], rtol=1e-5)  # the CSV keeps 6 significant digits
    np.testing.assert_allclose(got["ci_high"], expected["ci_high"], rtol=1e-5)


def test_resume_measures_only_new_snapshots(measured, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    run, out, settings = measured
    copy = tmp_path / "out"
    copy.mkdir()
    for name in ("dynamics.csv", "meta.json"):
        (copy / name).write_bytes((out / name).read_bytes())
    before = (copy / "dynamics.csv").read_bytes()
    seen = []

    def fake(loaded, label, snapshot, settings, work):
        seen.append(snapshot.step)
        rows = dynamics.read_table(out)
        rows = rows[rows["step"] == 4].assign(step=snapshot.step, tokens=snapshot.tokens, sha256=snapshot.sha256)
        return rows, {"record": 0.0}

    monkeypatch.setattr(dynamics, "measure_snapshot", fake)
    dynamics.measure({LABEL: run}, copy, settings, tmp_path / "work")
    assert seen == [] and (copy / "dynamics.csv").read_bytes() == before
    index = tmp_path / "run-copy"  # a third snapshot appears: only it is measured
    import shutil

    shutil.copytree(run, index)
    model = load_snapshot(read_run(index), run_snapshots(index)[-1], LABEL).model
    write_snapshot(index, model, 8, tokens=800)
    table = dynamics.measure({LABEL: index}, copy, settings, tmp_path / "work")
    assert seen == [8] and sorted(table["step"].unique()) == [2, 4, 8]
    with pytest.raises(UsageError, match="other settings"):
        dynamics.measure({LABEL: index}, copy, dynamics.Settings(**{**asdict(settings), "limit": 5}), tmp_path / "w")


def test_a_snapshot_with_other_bytes_is_refused(measured, tmp_path: Path):
    run, out, settings = measured
    import shutil

    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    path = bad / SNAPSHOT_DIR / "step-000004.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="SHA-256"):
        run_snapshots(bad)
    index = bad / SNAPSHOT_DIR / "snapshots.csv"  # the index rewritten for the new bytes: the table's step 4 differs
    rows = read_index(bad)
    rows[-1]["sha256"] = file_sha256(path)
    with open(index, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    with pytest.raises(UsageError, match="retrained"):
        dynamics.measure({LABEL: bad}, copy, settings, tmp_path / "work")
    snap = run_snapshots(bad)[-1]
    path.write_bytes(b"not the snapshot")
    with pytest.raises(ModelLoadError, match="refusing"):
        load_snapshot(read_run(bad), snap, LABEL)


def test_missing_runs_and_bad_options_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture):
    code = dynamics.main(["--run", f"x={tmp_path / 'none'}", "--out", str(tmp_path / "o"), "--tasks"])
    assert code == 2 and "none of the runs exists" in capsys.readouterr().err
    assert dynamics.main(["--run", "no-equals-sign", "--out", str(tmp_path / "o")]) == 2
    assert "LABEL=DIR" in capsys.readouterr().err


def test_a_run_folder_still_starting_is_skipped_one_with_snapshots_and_no_meta_refused(measured, tmp_path: Path,
                                                                                      capsys: pytest.CaptureFixture):
    run, out, settings = measured
    copy = tmp_path / "out"
    copy.mkdir()
    for name in ("dynamics.csv", "meta.json"):
        (copy / name).write_bytes((out / name).read_bytes())
    starting = tmp_path / "starting"
    (starting / "cache").mkdir(parents=True)  # what the recipe has written before its meta.json
    table = dynamics.measure({LABEL: run, "twin": starting}, copy, settings, tmp_path / "work")
    assert "twin" in capsys.readouterr().out and set(table["model"]) == {LABEL}
    assert json.loads((copy / "meta.json").read_text())["models"]["twin"]["found"] is False
    (starting / SNAPSHOT_DIR).mkdir()
    with pytest.raises(ModelLoadError, match="no meta.json"):
        dynamics.measure({LABEL: run, "twin": starting}, copy, settings, tmp_path / "work")


def test_a_run_folder_gone_since_keeps_its_snapshot_record(measured, tmp_path: Path):
    # a machine that did not keep build/: the measured model's hashes and steps stay in meta.json, its rows in
    # the table
    run, out, settings = measured
    copy = tmp_path / "out"
    copy.mkdir()
    for name in ("dynamics.csv", "meta.json"):
        (copy / name).write_bytes((out / name).read_bytes())
    before = json.loads((out / "meta.json").read_text())["models"][LABEL]
    assert before["found"] and [s["step"] for s in before["snapshots"]] == before["measured_steps"] == [2, 4]
    table = dynamics.measure({LABEL: tmp_path / "gone", "twin": run}, copy, settings, tmp_path / "work",
                             max_snapshots=0)
    meta = json.loads((copy / "meta.json").read_text())
    assert meta["models"][LABEL] == {**before, "folder_gone": True}
    assert set(table["model"]) == {LABEL}  # the twin (the same run under another label) not measured: max 0
    assert meta["partial"] and not meta["models"]["twin"]["complete"], meta["models"]["twin"]


def small_table() -> pd.DataFrame:
    rows = []
    for m, model in enumerate(("mini12", "twin")):
        for s, (step, tokens) in enumerate(((10, 1_000), (100, 10_000), (1000, 100_000))):
            base = dict(model=model, step=step, tokens=tokens, sha256=f"{m}{s}" * 32)
            for layer in range(5):
                v = 0.0 if layer == 4 else 1.0 / (layer + 1 + s)
                rows.append({**base, "measure": "context_loss_ratio", "detail": "out", "metric": "ratio",
                             "layer": layer, "value": v, "ci_low": v * 0.9, "ci_high": v * 1.1})
            for sub in ("attn.q", "ffn.in", "ffn.out"):
                for metric, v in (("pressure", 0.3 + 0.1 * s - 0.2 * m), ("vs_earlier", 0.5 + 0.05 * s)):
                    rows.append({**base, "measure": "pressure", "detail": sub, "metric": metric, "layer": 4,
                                 "value": v, "ci_low": v - 0.02, "ci_high": v + 0.02})
            for task in ("brown-pos", "brown-propn"):
                for metric, v in (("accuracy", -0.003 * s), ("code_length_bits", -100.0 * s)):
                    rows.append({**base, "measure": "probe_drop", "detail": task, "metric": metric, "layer": 4,
                                 "value": v, "ci_low": v - 0.002, "ci_high": v + 0.002})
    return pd.DataFrame(rows, columns=list(dynamics.COLUMNS))


@pytest.mark.slow
def test_the_figure_and_table_render_from_a_small_csv(tmp_path: Path):
    table = small_table()
    src = tmp_path / "in"
    src.mkdir()
    table.to_csv(src / "dynamics.csv", index=False)
    (src / "meta.json").write_text(json.dumps({"partial": True}))
    assert dynamics_figure.main(["--table", str(src / "dynamics.csv"), "--out", str(tmp_path / "fig")]) == 0
    png, pdf, md = (tmp_path / "fig" / f"dynamics.{ext}" for ext in ("png", "pdf", "md"))
    assert png.stat().st_size > 10_000 and pdf.read_bytes().startswith(b"%PDF")
    text = md.read_text()
    assert "Partial" in text and text.count("| mini12 |") == 3 and text.count("| twin |") == 3
    assert "context/loss ratio, layer 2" in text and "brown-propn drop, bits" in text
    assert "| mini12 | 10 | 1,000 | 0.5 [0.45, 0.55] |" in text  # layer 1 at step 10: value [95% CI]
    fig, drawn = dynamics_figure.draw(table)
    assert dynamics_figure.ratio_layers(table) == [1, 2, 3]
    assert len(drawn["ratio"]) == 2 * 3 and len(drawn["pressure"]) == 2 * 2 and len(drawn["accuracy"]) == 2 * 2
    line = drawn["accuracy"][0]  # mini12, brown-pos: the drops at the three snapshots, against tokens
    assert list(line.get_xdata()) == [1_000, 10_000, 100_000]
    np.testing.assert_allclose(line.get_ydata(), [0.0, -0.003, -0.006])
    assert fig.axes[0].get_xscale() == "log"
    again = tmp_path / "again"
    dynamics_figure.write(table.sort_values(["model", "step"]), again, partial=True)
    assert (again / "dynamics.png").read_bytes() == png.read_bytes()  # byte-stable


def test_the_figure_refuses_a_missing_table(tmp_path: Path, capsys: pytest.CaptureFixture):
    assert dynamics_figure.main(["--table", str(tmp_path / "none.csv"), "--out", str(tmp_path)]) == 2
    assert "measure first" in capsys.readouterr().err


def test_token_ticks_are_short_labels_that_do_not_collide():
    assert [dynamics_figure.compact_count(v) for v in (300, 3e5, 1e6, 2.5e7, 3e9)] == ["300", "300k", "1M", "25M", "3G"]
    table = small_table()
    narrow = table[table["tokens"] <= 10_000].assign(tokens=lambda t: t["tokens"] * 200)  # 200k..2M: under a decade
    fig, _ = dynamics_figure.draw(narrow)
    fig.canvas.draw()
    for ax in fig.axes:
        if ax.get_xscale() != "log":
            continue
        low, high = ax.get_xlim()
        labels = [t for t, x in zip(ax.get_xticklabels(), ax.get_xticks()) if t.get_text() and low <= x <= high]
        assert [t.get_text() for t in labels] == ["300k", "1M"], [t.get_text() for t in labels]
        assert not [t.get_text() for t in ax.get_xticklabels(minor=True) if t.get_text()]
        boxes = [t.get_window_extent() for t in labels]
        assert all(not a.overlaps(b) for a, b in zip(boxes, boxes[1:]))


@pytest.mark.slow
def test_the_drop_axes_and_note_say_which_way_is_better(tmp_path: Path):
    """Both probe drops are above 0 when the last layer is the better feature; the labels must say so for bits."""
    from gradflow.analysis.probes import code_length_drop, last_layer_drop

    assert last_layer_drop([0.80, 0.90, 0.85]) == pytest.approx(-0.05)  # last layer worse: below 0
    assert code_length_drop([100.0, 80.0, 90.0]) == pytest.approx(-10.0)  # last layer needs 10 more bits: below 0
    fig, _ = dynamics_figure.draw(small_table())
    labels = {ax.get_title(): ax.get_ylabel() for ax in fig.axes}
    assert labels[dynamics_figure.PROBE_METRICS["accuracy"]] == "last - best earlier layer"
    assert labels[dynamics_figure.PROBE_METRICS["code_length_bits"]] == "best earlier - last layer (bits)"
    dynamics_figure.write(small_table(), tmp_path, partial=False)
    assert "below 0 the last layer needs more bits" in (tmp_path / "dynamics.md").read_text()
