"""``gradflow record`` on a tiny native DiffusionGemma (issue 61, part 3): both objectives, both corpus kinds, and
the one-sentence refusals of a prompt that leaves the canvas no room and of `gradflow check` (not two-pass yet);
``--canvas-length C`` (item 3): the prompt and canvas counts of each window by the split rule, the response of a pair
cut to C, ``two_pass`` in meta.json, the default equal to the config's C, and its refusals (exit 2, one sentence).

The run directory joins the encoder pass (the prompt, role ``prompt``) and the decoder pass (the canvas) of each
depth: at the last layer every after-mixing sublayer has exactly 0 from the prompt (and, under masked diffusion,
from the canvas's ``context``), the key path does not, and the last block's sites get no gradient at the prompt.
"""

from __future__ import annotations

import json

import pandas as pd
import pytest

from gradflow.adapters.diffusion_gemma import DIFFUSION_GEMMA
from gradflow.cli.main import main
from gradflow.roles import ALL_ROLES
from gradflow.schema import CHANNELS_FILE, EXPERTS_FILE, SEQUENCES_FILE, SUBLAYERS_FILE
from gradflow.schema_reports import RECORD_META_KEYS, undeclared_keys
from tiny_diffusion_gemma import build_tiny_diffusion_gemma_dir

FLAGS = ["--max-length", "24", "--batch-size", "2", "--limit", "4", "--quiet", "--mask-ratio", "0.5"]
OBJECTIVES = {"diffusion": ("context",), "random-canvas": ()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_diffusion_gemma_dir(tmp_path_factory.mktemp("diffusion_gemma"))


@pytest.mark.parametrize("objective", OBJECTIVES)
def test_records_under_both_objectives(objective, model_dir, tiny_corpus, tmp_path):
    out = tmp_path / "run"
    assert main(["record", "--model", str(model_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--objective", objective, *FLAGS]) == 0
    meta = json.loads((out / "meta.json").read_text())
    tokens = meta["counts"]["tokens_per_role"]
    assert tokens["prompt"] > 0 and (tokens["masked"] > 0) == (objective == "diffusion")
    assert (tokens["random"] > 0 and tokens["kept"] > 0 and tokens["context"] == 0) == (objective != "diffusion")
    table = pd.read_csv(out / SUBLAYERS_FILE)
    last = table[table.layer == 3]
    after = set(DIFFUSION_GEMMA.after_mixing())
    for role in ("prompt", *OBJECTIVES[objective]):
        rows = last[last.role == role]
        zero = rows[rows.sublayer.isin(after)]
        assert set(zero.sublayer) == after
        assert (zero.contribution_norm_mean == 0).all() and (zero.n_nonzero == 0).all(), zero
        assert (rows[rows.sublayer == "attn.k"].contribution_norm_mean > 0).all(), role
    loss_roles = ["masked"] if objective == "diffusion" else ["random", "kept"]
    assert (last[last.role.isin(loss_roles)].contribution_norm_mean > 0).all()
    earlier = table[(table.layer == 2) & (table.role == "prompt")]
    assert (earlier.contribution_norm_mean > 0).all()  # the tied weights' prompt pass, below the last block
    channels = pd.read_csv(out / CHANNELS_FILE)
    prompt_last = channels[(channels.layer == 3) & (channels.role == "prompt")]
    assert len(prompt_last) == 2 and (prompt_last.grad_norm_zero_fraction == 1).all()
    assert (channels[(channels.layer == 2) & (channels.role == "prompt")].grad_norm_mean > 0).all()
    assert set(pd.read_csv(out / EXPERTS_FILE).layer) == {1, 2, 3}


def _jsonl(path, prompt: str) -> str:
    rows = [{"prompt": prompt, "response": "The abundant fruits of another year have blessed our country."}] * 3
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_records_prompt_response_pairs(model_dir, tmp_path):
    texts = _jsonl(tmp_path / "pairs.jsonl", "What did the president say?")
    out = tmp_path / "run"
    assert main(["record", "--model", str(model_dir), "--texts", texts, "--prompt-field", "prompt", "--out", str(out),
                 "--objective", "random-canvas", *FLAGS]) == 0
    tokens = json.loads((out / "meta.json").read_text())["counts"]["tokens_per_role"]
    assert tokens["prompt"] > 0 and tokens["random"] + tokens["kept"] + tokens["special"] <= 3 * 8  # the canvas: 8


def test_a_prompt_that_leaves_the_canvas_no_room_is_one_sentence(model_dir, tmp_path, capsys):
    texts = _jsonl(tmp_path / "long.jsonl", " ".join(["the progress of public credit"] * 10))
    code = main(["record", "--model", str(model_dir), "--texts", texts, "--prompt-field", "prompt", "--out",
                 str(tmp_path / "refused"), "--objective", "diffusion", *FLAGS])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert "line 1: the prompt takes" in err
    assert "leaves none for the response (a two-pass model's canvas: no room)" in err
    assert not (tmp_path / "refused" / "meta.json").exists()


def test_check_refuses_a_two_pass_model_in_one_sentence(model_dir, tiny_corpus, capsys):
    code = main(["check", "--model", str(model_dir), "--texts", str(tiny_corpus), "--max-length", "24"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "Traceback" not in err
    assert "gradflow check does not run two-pass models yet" in err and "gradflow record does" in err


# --canvas-length (issue 61, item 3). The tiny corpus's first 4 windows of at most 24 tokens hold n = 18, 24, 12 and
# 24 tokens (special tokens included); the split rule puts a window's last min(C, n - 1) tokens on the canvas.
WINDOWS = [18, 24, 12, 24]
RANDOM_CANVAS = [*FLAGS, "--objective", "random-canvas"]


def _record(model_dir, texts, out, *extra) -> int:
    return main(["record", "--model", str(model_dir), "--texts", str(texts), "--out", str(out), *RANDOM_CANVAS,
                 *extra])


def _split(out) -> tuple[list[int], list[int]]:
    """Each recorded sequence's prompt and canvas positions (every role but prompt; padding has no row), counted
    from sequences.parquet at its first site (every site covers all the positions of a window)."""
    table = pd.read_parquet(out / SEQUENCES_FILE)
    one = table[table.site == table.site.iloc[0]]
    prompt = one[one.role == "prompt"].groupby("sequence_index").n_positions.sum()
    canvas = one[one.role != "prompt"].groupby("sequence_index").n_positions.sum()
    return prompt.tolist(), canvas.tolist()


def _tables_equal(a, b) -> None:
    for name in (CHANNELS_FILE, SUBLAYERS_FILE, EXPERTS_FILE):
        pd.testing.assert_frame_equal(pd.read_csv(a / name), pd.read_csv(b / name), check_exact=True)
    pd.testing.assert_frame_equal(pd.read_parquet(a / SEQUENCES_FILE), pd.read_parquet(b / SEQUENCES_FILE),
                                  check_exact=True)


def test_canvas_length_moves_the_split_by_the_rule(model_dir, tiny_corpus, tmp_path):
    runs = {c: tmp_path / f"c{c}" for c in ("default", 8, 5, 23)}
    for c, out in runs.items():
        assert _record(model_dir, tiny_corpus, out, *([] if c == "default" else ["--canvas-length", str(c)])) == 0
    for c, prompt, canvas in (("default", [10, 16, 4, 16], [8] * 4), (8, [10, 16, 4, 16], [8] * 4),
                              (5, [13, 19, 7, 19], [5] * 4), (23, [1] * 4, [17, 23, 11, 23])):
        size = 8 if c == "default" else c  # the default: the tiny model config's canvas_length, 8
        assert _split(runs[c]) == ([n - min(size, n - 1) for n in WINDOWS], [min(size, n - 1) for n in WINDOWS])
        assert _split(runs[c]) == (prompt, canvas)  # the rule's numbers, written out
        meta = json.loads((runs[c] / "meta.json").read_text())
        tokens = meta["counts"]["tokens_per_role"]
        assert (tokens["prompt"], sum(tokens.values()) - tokens["prompt"] - tokens["pad"]) == (sum(prompt),
                                                                                               sum(canvas))
        assert tokens["pad"] == 18  # batches (18, 24) and (12, 24): 2 x 24 positions each, 42 and 36 of them real
        assert meta["two_pass"] == {"canvas_length": size,
                                    "canvas_length_from": "config" if c == "default" else "--canvas-length"}
        assert undeclared_keys(meta, RECORD_META_KEYS, ALL_ROLES) == []  # two_pass is in the schema and the docs
    assert (sum([10, 16, 4, 16]), sum([13, 19, 7, 19]), sum([1] * 4)) == (46, 58, 4)
    _tables_equal(runs["default"], runs[8])  # the default is the config's C: the same run, table for table


def test_canvas_length_cuts_the_response_of_prompt_response_pairs(model_dir, tmp_path):
    texts = _jsonl(tmp_path / "pairs.jsonl", "the state of the treasury")  # words the tokenizer learned whole
    runs = {c: tmp_path / f"c{c}" for c in ("default", 3, 30)}
    for c, out in runs.items():
        extra = [] if c == "default" else ["--canvas-length", str(c)]
        assert _record(model_dir, texts, out, "--prompt-field", "prompt", *extra) == 0
    # [CLS] the state of the treasury [SEP]: a prompt of 7; the response, 11 tokens and its [SEP]: 12, in a window of 24
    for c, canvas, special in (("default", 8, 0), (3, 3, 0), (30, 12, 3)):
        assert _split(runs[c]) == ([7] * 3, [canvas] * 3)  # the response cut to its first C tokens (8: the config's)
        counts = json.loads((runs[c] / "meta.json").read_text())["counts"]
        tokens = counts["tokens_per_role"]
        canvas_roles = (tokens["special"], tokens["random"] + tokens["kept"], tokens["pad"])
        assert canvas_roles == (special, 3 * canvas - special, 0)
        assert counts["truncated_responses"] == 0  # (that count is of responses cut to fit the window, not to C)


def _one_sentence(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("length, max_length", [(24, 24), (30, 24), (1, 1)])
def test_a_canvas_length_that_leaves_no_prompt_is_one_sentence(length, max_length, model_dir, tiny_corpus, tmp_path,
                                                               capsys):
    out = tmp_path / "refused"
    flags = ["--max-length", str(max_length), *RANDOM_CANVAS[2:]]  # (RANDOM_CANVAS's --max-length 24 replaced)
    code = main(["record", "--model", str(model_dir), "--texts", str(tiny_corpus), "--out", str(out), *flags,
                 "--canvas-length", str(length)])
    err = _one_sentence(capsys)
    assert code == 2 and not out.exists()
    assert (f"--canvas-length {length} leaves windows of --max-length {max_length} tokens no prompt (the split rule "
            f"keeps each window's first token in the prompt, so a canvas holds at most {max_length - 1}): ") in err
    fit = f"pass --canvas-length {max_length - 1} or less, or " if max_length > 1 else ""
    assert err.endswith(f"{fit}raise --max-length above {length}.")


def test_canvas_length_of_a_one_pass_model_is_one_sentence(tiny_mlm_dir, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "refused"
    code = main(["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--max-length", "24", "--limit", "2", "--quiet", "--canvas-length", "4"])
    err = _one_sentence(capsys)
    assert code == 2 and not out.exists()
    assert err == (f"gradflow: error: --canvas-length applies to two-pass models (DiffusionGemma) only, and "
                   f"{tiny_mlm_dir} (bert) runs one pass: drop --canvas-length.")


def test_canvas_length_below_one_is_refused_while_parsing(model_dir, tiny_corpus, tmp_path, capsys):
    assert _record(model_dir, tiny_corpus, tmp_path / "refused", "--canvas-length", "0") == 2
    err = _one_sentence(capsys)
    assert "--canvas-length" in err and ">= 1" in err and not (tmp_path / "refused").exists()


def test_a_resume_with_another_canvas_length_is_refused(model_dir, tiny_corpus, tmp_path, capsys, monkeypatch):
    passes = []

    def interrupt_at_the_second_batch(point: str) -> None:
        passes.append(point)
        if passes.count("kill_at_batch") == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("gradflow.runs.record.fault", interrupt_at_the_second_batch)
    out = tmp_path / "run"
    assert _record(model_dir, tiny_corpus, out, "--checkpoint-every", "2") == 130
    assert json.loads((out / "meta.json").read_text())["progress"]["sequences"] == 2
    capsys.readouterr()
    assert _record(model_dir, tiny_corpus, out, "--resume", "--canvas-length", "5") == 2
    assert "settings differ from the checkpoint's (canvas_length: 8 -> 5)" in _one_sentence(capsys)
