"""`gradflow atlas`: resumable per model, shardable, merged into one atlas.csv of the schema's columns.

Tiny random BERT MLMs saved from configs (tests/conftest.py), a tiny corpus and a tiny probe task.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

import gradflow.runs.atlas as atlas_job
from conftest import SAMPLE_LINES, build_tiny_mlm_dir
from gradflow.cli.main import main
from gradflow.schema import ATLAS_COLUMNS, ATLAS_DONE_FILE, ATLAS_FILE, ATLAS_STEP_DIRS, CHECK_FILE, META_FILE

COMMON = ["--limit", "8", "--max-length", "24", "--batch-size", "4", "--resamples", "50", "--format", "png",
          "--quiet"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("atlas_models")
    return [str(build_tiny_mlm_dir(root / "tiny_a", layers=2, seed=0)),
            str(build_tiny_mlm_dir(root / "tiny_b", layers=3, seed=1))]


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    """'word<TAB>label' sentences from the tiny corpus's own words (so the tiny vocabulary fits them)."""
    rng = np.random.default_rng(0)
    words = sorted({w.strip(".,").lower() for line in SAMPLE_LINES for w in line.split()})
    tags = {w: ("DET" if w in ("the", "a", "an") else "ADP" if w in ("of", "by", "with", "and", "that") else "NOUN")
            for w in words}
    lines = []
    for _ in range(40):
        for w in rng.choice(words, size=int(rng.integers(3, 8))):
            lines.append(f"{w}\t{tags[str(w)]}")
        lines.append("")
    path = tmp_path_factory.mktemp("atlas_task") / "tags.conll"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def _atlas(out, models, corpus, *extra) -> int:
    return main(["atlas", *models, "--out", str(out), "--texts", str(corpus), *COMMON, *extra])


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory, models, tiny_corpus, task_file):
    out = tmp_path_factory.mktemp("atlas_all")
    assert _atlas(out, models, tiny_corpus, "--probe-task", task_file, "--probe-limit", "20") == 0
    return out


def _mtimes(path):
    return {p: p.stat().st_mtime_ns for p in sorted(path.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------ (1) resumable per model
@pytest.mark.slow
def test_interrupted_model_is_redone_and_finished_models_are_not(tmp_path, models, tiny_corpus, monkeypatch):
    out = tmp_path / "atlas"
    real_diagnose = atlas_job._diagnose

    def interrupt_second(model, *args, **kwargs):
        if model.index == 1:
            raise KeyboardInterrupt("simulated Ctrl-C")
        return real_diagnose(model, *args, **kwargs)

    monkeypatch.setattr(atlas_job, "_diagnose", interrupt_second)
    assert _atlas(out, models, tiny_corpus, "--no-probes") == 130
    first, second = out / "tiny_a", out / "tiny_b"
    assert (first / ATLAS_DONE_FILE).is_file() and not (second / ATLAS_DONE_FILE).exists()
    assert (second / ATLAS_STEP_DIRS["record"] / META_FILE).is_file()  # the partial model's steps so far
    (second / "leftover.txt").write_text("from the interrupted run", encoding="utf-8")
    before = _mtimes(first)

    monkeypatch.setattr(atlas_job, "_diagnose", real_diagnose)
    recorded = []
    real_record = atlas_job._record
    monkeypatch.setattr(atlas_job, "_record", lambda model, *a, **k: recorded.append(model.label)
                        or real_record(model, *a, **k))
    assert _atlas(out, models, tiny_corpus, "--no-probes") == 0
    assert recorded == ["tiny_b"]  # the finished model was not recomputed
    assert _mtimes(first) == before
    assert (second / ATLAS_DONE_FILE).is_file() and not (second / "leftover.txt").exists()  # redone from scratch
    done = json.loads((second / ATLAS_DONE_FILE).read_text())
    assert done["steps"]["probes"] == "skipped" and "--no-probes" in done["probe_skip_reason"]
    table = pd.read_csv(out / ATLAS_FILE)
    assert list(dict.fromkeys(table["model"])) == ["tiny_a", "tiny_b"]

    recorded.clear()
    assert _atlas(out, models, tiny_corpus, "--no-probes") == 0  # everything finished: nothing runs
    assert recorded == []


def test_a_directory_the_atlas_did_not_start_is_refused(tmp_path, models, tiny_corpus, capsys):
    out = tmp_path / "atlas"
    (out / "tiny_a").mkdir(parents=True)
    (out / "tiny_a" / "precious.txt").write_text("not the atlas's", encoding="utf-8")
    assert _atlas(out, models[:1], tiny_corpus, "--no-probes") == 2
    assert "was not made by gradflow atlas" in capsys.readouterr().err
    assert (out / "tiny_a" / "precious.txt").is_file()


# ------------------------------------------------------------------------------ (2) shards + merge == one run
@pytest.mark.slow
def test_shards_merged_equal_one_unsharded_run(tmp_path, models, tiny_corpus, task_file, unsharded):
    for i, shard_dir in ((1, tmp_path / "s1"), (2, tmp_path / "s2")):
        assert _atlas(shard_dir, models, tiny_corpus, "--probe-task", task_file, "--probe-limit", "20",
                      "--shard", f"{i}/2") == 0
        assert not (shard_dir / ATLAS_FILE).exists()  # a shard does not merge
        assert len([p for p in shard_dir.iterdir() if (p / ATLAS_DONE_FILE).is_file()]) == 1
    merged = tmp_path / "merged"
    assert main(["atlas", "--merge", str(tmp_path / "s2"), str(tmp_path / "s1"), "--out", str(merged),
                 "--resamples", "50", "--format", "png"]) == 0
    expected = pd.read_csv(unsharded / ATLAS_FILE)
    got = pd.read_csv(merged / ATLAS_FILE)
    pd.testing.assert_frame_equal(got, expected)
    assert (merged / ATLAS_FILE).read_text() == (unsharded / ATLAS_FILE).read_text()
    meta = json.loads((merged / META_FILE).read_text())
    assert [m["model"] for m in meta["models"]] == ["tiny_a", "tiny_b"] and meta["complete"] is True


def test_shard_assignment_is_by_position():
    models = [atlas_job.AtlasModel(k, f"m{k}", f"m{k}", f"m{k}", None, None) for k in range(5)]
    slices = [[m.index for m in atlas_job.shard_of(models, (i, 3))] for i in (1, 2, 3)]
    assert slices == [[0, 3], [1, 4], [2]]
    assert atlas_job.shard_of(models, (4, 9)) == [models[3]]


# ------------------------------------------------------------------------------ (3) the table and its files
def test_atlas_csv_has_exactly_the_schema_columns_and_the_metrics(unsharded):
    table = pd.read_csv(unsharded / ATLAS_FILE)
    assert tuple(table.columns) == ATLAS_COLUMNS
    kinds = set(table["metric"].str.split(":").str[0])
    assert {"context_loss_ratio", "context_share", "logit_lens_top1_context", "probe_accuracy",
            "skippable_flop_share", "theory_disagreements"} <= kinds
    for model, n_layers in (("tiny_a", 2), ("tiny_b", 3)):
        rows = table[table["model"] == model]
        assert set(rows["n_layers"]) == {n_layers} and set(rows["family"]) == {"bert"}
        ratio = rows[rows["metric"] == "context_loss_ratio"]
        assert np.allclose(sorted(ratio["depth_fraction"]), np.arange(n_layers + 1) / n_layers)
        last = ratio[ratio["depth_fraction"] == 1.0]
        assert float(last["value"].iloc[0]) == 0.0  # the structural zero after the last attention
        shares = rows[rows["metric"].str.startswith("context_share:") & (rows["depth_fraction"] == 1.0)]
        zero = set(shares.loc[shares["value"] == 0.0, "metric"].str.split(":").str[1])
        assert {"attn.q", "attn.out", "attn.norm", "ffn.in", "ffn.out", "ffn.norm"} <= zero
        assert set(shares.loc[shares["value"] > 0, "metric"].str.split(":").str[1]) == {"attn.k", "attn.v"}
        probe = rows[rows["metric"].str.startswith("probe_accuracy:")]
        assert len(probe) == n_layers + 1 and probe["value"].between(0, 1).all()
        flops = rows[rows["metric"] == "skippable_flop_share"]["value"]
        assert 0 < float(flops.iloc[0]) < 1
        assert float(rows[rows["metric"] == "theory_disagreements"]["value"].iloc[0]) == 0
    for model in ("tiny_a", "tiny_b"):
        for step in ("record", "check", "diagnostics", "probes"):
            assert (unsharded / model / ATLAS_STEP_DIRS[step] / META_FILE).is_file(), (model, step)
        assert (unsharded / model / ATLAS_STEP_DIRS["check"] / CHECK_FILE).is_file()
        assert json.loads((unsharded / model / META_FILE).read_text())["complete"] is True
    assert json.loads((unsharded / META_FILE).read_text())["kind"] == "atlas"
    assert (unsharded / "atlas_context_ratio.png").is_file() and (unsharded / "atlas_last_block_shares.png").is_file()


def test_vocabulary_that_does_not_fit_the_task_is_skipped_with_its_reason(models, task_file):
    from gradflow.inputs.labelled import load_labelled
    from gradflow.models import load_model

    tokenizer = load_model(models[0]).tokenizer
    assert atlas_job.vocabulary_fit(tokenizer, load_labelled(task_file, 0))["fits"]
    foreign = "MKTAYIAKQRQISFVKSHFSRQ\tX\nEVQLVESGGGLVQPGGSLRLSC\tY\n\n"
    path = task_file.replace("tags.conll", "protein.conll")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(foreign * 10)
    fit = atlas_job.vocabulary_fit(tokenizer, load_labelled(path, 0))
    assert not fit["fits"] and fit["unknown_fraction"] > atlas_job.MAX_UNKNOWN_FRACTION  # one [UNK] per word here


# ------------------------------------------------------------------------------ (4) bad input: exit 2
@pytest.mark.parametrize("shard", ["0/2", "3/2", "1/0", "two", "1-2", "-1/2"])
def test_bad_shard_exits_2_with_a_clear_message(tmp_path, models, tiny_corpus, shard, capsys):
    assert main(["atlas", models[0], "--out", str(tmp_path / "a"), f"--shard={shard}", "--no-probes"]) == 2
    assert "--shard must be I/N with integers 1 <= I <= N" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("bad, message", [
    (["/no/such/model_dir"], "does not exist"),
    (["zoo:no-such-zoo-model"], "unknown zoo model"),
])
def test_unknown_model_exits_2_before_anything_runs(tmp_path, models, bad, message, capsys):
    assert main(["atlas", models[0], *bad, "--out", str(tmp_path / "a"), "--no-probes"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "a").exists()


def test_other_bad_input_exits_2(tmp_path, models, tiny_corpus, capsys):
    out = str(tmp_path / "a")
    cases = [
        (["atlas", models[0], "--out", out, "--texts", f"other={tiny_corpus}", "--no-probes"], "not in the model list"),
        (["atlas", models[0], models[0], "--out", out, "--no-probes"], "listed twice"),
        (["atlas", "--out", out], "at least one MODEL"),
        (["atlas", models[0], "--merge", out, "--out", out], "not models"),
        (["atlas", "--merge", str(tmp_path), "--out", out], "no finished model"),
        (["atlas", models[0], "--out", out, "--probe-task", "no-such-task"], "unknown task"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert not (tmp_path / "a").exists()


def test_byte_level_bpe_tokenizer_gets_a_prefix_space_for_probes(tmp_path):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import AutoTokenizer, RobertaTokenizerFast

    from gradflow.models import LoadedModel

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(SAMPLE_LINES * 4, vocab_size=300, min_frequency=1,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    RobertaTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                         pad_token="<pad>", mask_token="<mask>", cls_token="<s>", sep_token="</s>",
                         add_prefix_space=False).save_pretrained(tmp_path)
    loaded = LoadedModel(None, AutoTokenizer.from_pretrained(tmp_path), "tiny-roberta", str(tmp_path), None, "")
    assert loaded.tokenizer.add_prefix_space is False
    ready = atlas_job.probe_ready(loaded)
    assert ready.tokenizer.add_prefix_space is True and ready.model is loaded.model
    word = ready.tokenizer([["progress"]], is_split_into_words=True)["input_ids"][0]
    assert ready.tokenizer.convert_ids_to_tokens(word)[1].startswith("Ġ")  # the word as it appears inside text
    bare = loaded.tokenizer([["progress"]], is_split_into_words=True)["input_ids"][0]
    assert not loaded.tokenizer.convert_ids_to_tokens(bare)[1].startswith("Ġ")


def test_last_block_bars_without_exact_zeros_keep_the_axes_full_size():
    """Regression: an empty unclipped marker line at the figure origin squeezed the constrained layout."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    from gradflow.figures.atlas import last_block_bars
    from gradflow.figures.style import gradflow_style

    rows = [{"model": m, "family": "bert", "n_layers": 2, "depth_fraction": d, "metric": f"pressure:{s}",
             "value": 0.5 + d, "ci_low": 0.4, "ci_high": 0.9}
            for m in ("a", "b") for d in (0.5, 1.0) for s in ("attn.q", "ffn.in")]
    with gradflow_style("single"):
        fig = last_block_bars(pd.DataFrame(rows), "pressure", "pressure", "t", ["a", "b"])
        fig.canvas.draw()
        ax = fig.axes[0]
        assert not [a for a in ax.lines if isinstance(a, Line2D) and len(a.get_xdata()) == 0]
        assert ax.get_position().height > 0.4
        plt.close(fig)
