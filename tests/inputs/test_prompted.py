"""Prompt/response corpora (diffusion SFT): the prompt is never masked, the response is the normaliser, bad lines
are named."""

from __future__ import annotations

import json

import pytest
import torch

from gradflow.cli.main import main
from gradflow.errors import CorpusError
from gradflow.inputs.corpus import CorpusCounts, iter_windows, read_documents
from gradflow.inputs.masking import MaskedDiffusion
from gradflow.inputs.pipeline import masked_batches
from gradflow.inputs.prompted import PromptFields
from gradflow.roles import Role

PAIRS = [("What did the president say about public credit?",
          "The progress of public credit is witnessed by a considerable rise of American stock abroad."),
         ("Name a blessing.", "The abundant fruits of another year have blessed our country with plenty."),
         ("What must we ensure?", "We must ensure that the laws are faithfully executed.")]


@pytest.fixture(scope="module")
def tokenizer(tiny_mlm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_mlm_dir)


def _corpus(tmp_path, records, name="sft.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def test_prompt_is_never_masked_even_at_t_1(tmp_path, tokenizer):
    path = _corpus(tmp_path, [{"q": p, "a": r} for p, r in PAIRS])
    fields = PromptFields("q", "a")
    batch = next(masked_batches(tokenizer, read_documents(path, fields), MaskedDiffusion(ratio=1.0), 64, 8))
    for row, (prompt, response) in enumerate(PAIRS):
        n_prompt = len(tokenizer(prompt)["input_ids"])  # [CLS] prompt [SEP]
        n_response = len(tokenizer(response, add_special_tokens=False)["input_ids"])
        roles = batch.roles[row]
        assert (roles[1:n_prompt - 1] == Role.PROMPT).all() and roles[0] == roles[n_prompt - 1] == Role.SPECIAL
        assert (roles[n_prompt:n_prompt + n_response] == Role.MASKED).all()  # t = 1: the whole response
        assert torch.equal(batch.input_ids[row, :n_prompt], batch.original_ids[row, :n_prompt])
        assert float(batch.loss_norm[row]) == n_response + 1  # the response and its [SEP], as LLaDA counts
    assert batch.mean_over_sequences


def test_a_long_response_is_cut_and_counted(tmp_path, tokenizer):
    path = _corpus(tmp_path, [{"prompt": "Say it.", "response": " ".join(["the union is preserved"] * 20)}])
    counts = CorpusCounts()
    windows = list(iter_windows(tokenizer, read_documents(path, PromptFields()), 32, counts))
    assert len(windows) == 1 and len(windows[0].encoding["input_ids"]) == 32
    assert counts.truncated_responses == 1
    assert windows[0].encoding["prompt_length"] == len(tokenizer("Say it.")["input_ids"])


@pytest.mark.parametrize("records, message", [
    ([{"prompt": "a"}, {"prompt": "b", "response": "c"}], "line 1: no string \"response\" field"),
    ([{"prompt": "a", "response": "b"}, {"response": "c"}], "line 2: no string \"prompt\" field"),
    ([{"prompt": 3, "response": "b"}], "line 1: no string \"prompt\" field"),
    ([{"prompt": " ".join(["public credit"] * 20), "response": "yes"}], "line 1: the prompt takes 43 of the "
                                                                         "window's 24 tokens"),
], ids=["response missing", "prompt missing on line 2", "prompt not a string", "prompt longer than the window"])
def test_bad_lines_are_named(tmp_path, tokenizer, records, message):
    path = _corpus(tmp_path, records)
    with pytest.raises(CorpusError, match=message):
        list(iter_windows(tokenizer, read_documents(path, PromptFields()), 24, CorpusCounts()))


def test_not_json_and_not_jsonl_are_refused(tmp_path, tokenizer):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{oops\n')
    with pytest.raises(CorpusError, match="line 2: not valid JSON"):
        list(read_documents(bad, PromptFields()))
    text = tmp_path / "plain.txt"
    text.write_text("a line\n")
    with pytest.raises(CorpusError, match="--prompt-field needs a .jsonl file"):
        list(read_documents(text, PromptFields()))


def test_record_cli_sft_run_and_its_refusals(tmp_path, capsys, tiny_mlm_dir):
    path = _corpus(tmp_path, [{"prompt": p, "response": r} for p, r in PAIRS])
    out = tmp_path / "run"
    assert main(["record", "--model", str(tiny_mlm_dir), "--texts", str(path), "--prompt-field", "prompt",
                 "--objective", "diffusion", "--mask-ratio", "0.5", "--out", str(out), "--quiet", "--max-length", "64"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["prompted"] == {"prompt_field": "prompt", "response_field": "response"}
    assert meta["counts"]["truncated_responses"] == 0 and meta["counts"]["windows"] == 3
    capsys.readouterr()
    assert main(["record", "--model", str(tiny_mlm_dir), "--texts", str(path), "--response-field", "a",
                 "--out", str(tmp_path / "x")]) == 2
    assert "give --prompt-field too" in capsys.readouterr().err
    missing = _corpus(tmp_path, [{"prompt": "a", "response": "b"}, {"prompt": "c"}], "missing.jsonl")
    assert main(["record", "--model", str(tiny_mlm_dir), "--texts", str(missing), "--prompt-field", "prompt",
                 "--objective", "diffusion", "--out", str(tmp_path / "y"), "--quiet", "--max-length", "64"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("line 2: no string \"response\" field; each line must be a JSON object with string "
                        "\"prompt\" and \"response\" fields (choose the names with --prompt-field and "
                        "--response-field).") and "\n" not in err


# ------------------------------------------------------------------------ a prompt/response file without --prompt-field
LONG = "word " * 14_000  # over LONG_LINE_BYTES: the record is scanned as it streams in, not parsed whole


@pytest.mark.parametrize("record, hint", [
    ({"prompt": "a", "response": "b"}, "its string fields are \"prompt\", \"response\": if it is a prompt/response "
     "corpus for supervised fine-tuning, record it with --prompt-field prompt --response-field response"),
    ({"id": 7, "Instruction": "a", "input": "b", "output": "c"}, "--prompt-field Instruction --response-field output"),
    ({"answer": "a", "question": "b"}, "--prompt-field question --response-field answer"),
    ({"answer": "a", "context": "b"}, "--prompt-field context --response-field answer"),
    ({"q text": "a", "reply": "b"}, "--prompt-field 'q text' --response-field reply"),
    ({"a": "x", "b": "y", "c": "z"}, "its string fields are \"a\", \"b\", \"c\": a plain .jsonl corpus reads each "
     "line's text from a string \"text\" field, and a prompt/response corpus is recorded with --prompt-field NAME "
     "--response-field NAME"),
    ({"body": "a", "n": 3}, "its only string field is \"body\": a plain .jsonl corpus reads each line's text from a "
     "string \"text\" field (rename the field)."),
    ({"text": 3}, "no string \"text\" field. Each line of a .jsonl corpus must be an object with a \"text\" field."),
], ids=["prompt and response", "instruction, input and output", "question after its answer",
        "two fields, one an answer", "a name to quote", "three unnamed fields", "one string field", "no string field"])
@pytest.mark.parametrize("long", [False, True], ids=["a short record", "a long record"])
def test_a_record_without_text_names_what_it_has(tmp_path, record, hint, long):
    if long:  # the longest string field grows past LONG_LINE_BYTES
        key = max((k for k, v in record.items() if isinstance(v, str)), key=lambda k: len(record[k]), default=None)
        record = {**record, key: LONG} if key else {**record, "padding": [LONG]}
    path = _corpus(tmp_path, [record])
    with pytest.raises(CorpusError) as err:
        list(read_documents(path))
    message = str(err.value)
    assert message.startswith(f"{path}, line 1: no string \"text\" field") and hint in message and "\n" not in message


def test_a_prompt_response_file_without_prompt_field_is_refused_with_the_flags_that_record_it(tmp_path, capsys,
                                                                                                 tiny_mlm_dir):
    path = _corpus(tmp_path, [{"prompt": p, "response": r} for p, r in PAIRS])
    argv = ["record", "--model", str(tiny_mlm_dir), "--texts", str(path), "--quiet", "--max-length", "64"]
    assert main([*argv, "--out", str(tmp_path / "plain")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err == (f"gradflow: error: {path}, line 1: no string \"text\" field; its string fields are \"prompt\", "
                   "\"response\": if it is a prompt/response corpus for supervised fine-tuning, record it with "
                   "--prompt-field prompt --response-field response (gradflow record; the prompt is never masked), "
                   "else a plain .jsonl corpus reads each line's text from a string \"text\" field.")
    flags = err.split("record it with ")[1].split(" (gradflow record")[0].split()
    assert main([*argv, *flags, "--out", str(tmp_path / "sft")]) == 0  # the flags it names record the file
    assert json.loads((tmp_path / "sft" / "meta.json").read_text())["counts"]["windows"] == len(PAIRS)
