"""Loading speaks gradflow's language: no transformers load report for unused heads, one warning for
encoder weights the checkpoint lacks (issue 27 point 9); remote code (masked diffusion LMs, issue 51) is refused in
one sentence without --trust-remote-code, runs not at all then, and loads through AutoModel with it."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from transformers import BertConfig, BertForPreTraining

from conftest import build_tiny_mlm_dir
from gradflow.cli.main import main
from gradflow.errors import ModelLoadError
from gradflow.models import load_model
from models.remote_code.tiny_remote import build_dream_tiny, build_llada_tiny, build_unknown_type_tiny


def test_unused_heads_in_the_checkpoint_print_nothing(tmp_path, capfd):
    path = build_tiny_mlm_dir(tmp_path / "pretraining")
    torch.manual_seed(0)
    BertForPreTraining(BertConfig.from_pretrained(path)).save_pretrained(path)  # + pooler and NSP head
    capfd.readouterr()
    load_model(str(path))
    captured = capfd.readouterr()
    assert "LOAD REPORT" not in captured.err + captured.out
    assert "UNEXPECTED" not in captured.err + captured.out and "warning" not in captured.err


def test_missing_encoder_weights_get_one_gradflow_warning(tmp_path, capfd):
    path = build_tiny_mlm_dir(tmp_path / "short", layers=2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))  # block 2 is not saved
    capfd.readouterr()
    load_model(str(path))
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err
    warnings = [line for line in err.splitlines() if line.startswith("gradflow: warning:")]
    assert len(warnings) == 1 and "bert.encoder.layer.2." in warnings[0] and "initialised at random" in warnings[0]


# ---------------------------------------------------------------------------------------------- remote code (issue 51)
def test_remote_code_is_refused_in_one_sentence_and_never_runs_without_the_flag(tmp_path, monkeypatch):
    for build in (build_llada_tiny, build_dream_tiny):
        path = build(tmp_path / build.__name__)
        log = tmp_path / f"{build.__name__}.log"
        monkeypatch.setenv("GRADFLOW_TEST_REMOTE_CODE_LOG", str(log))
        with pytest.raises(ModelLoadError) as err:
            load_model(str(path))
        message = str(err.value)
        assert "--trust-remote-code" in message and "modeling_" in message
        assert message.endswith(".") and message.count(". ") == 0, message  # one sentence
        assert not log.exists()  # not a line of the checkpoint's code ran
        load_model(str(path), trust_remote_code=True)
        assert "__init__" in log.read_text(encoding="utf-8")  # the log does see the code when it runs
        monkeypatch.delenv("GRADFLOW_TEST_REMOTE_CODE_LOG")


def test_automodel_only_remote_code_loads_with_the_flag(tmp_path, capfd):
    llada = build_llada_tiny(tmp_path / "llada")
    assert set(json.loads((llada / "config.json").read_text())["auto_map"]) == {"AutoConfig", "AutoModel"}
    capfd.readouterr()
    loaded = load_model(str(llada), trust_remote_code=True)
    err = capfd.readouterr().err
    assert type(loaded.model).__name__ == "LLaDAModelLM" and loaded.adapter.family == "llada"
    # the tokenizer declares no mask token: the config's mask_token_id gives it, with one notice
    assert loaded.tokenizer.mask_token == "<|mdm_mask|>" and loaded.tokenizer.mask_token_id == loaded.model.config.mask_token_id
    assert "declares no mask token; using '<|mdm_mask|>'" in err and "LOAD REPORT" not in err
    dream = load_model(str(build_dream_tiny(tmp_path / "dream")), trust_remote_code=True)
    assert type(dream.model).__name__ == "DreamModel" and dream.adapter.family == "dream"
    assert dream.adapter.shifted_head and not loaded.adapter.shifted_head


def test_automodel_without_logits_is_refused(tmp_path):
    # a copy under another name: a new code module (building registered the built one's config class in AutoModel)
    path = shutil.copytree(build_dream_tiny(tmp_path / "dream"), tmp_path / "bare_decoder")
    config = json.loads((path / "config.json").read_text())
    config["auto_map"]["AutoModel"] = "modeling_dream.DreamBaseModel"  # the decoder without its lm_head
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="loaded with AutoModel .* returns no logits"):
        load_model(str(path), trust_remote_code=True)


def test_auto_map_of_a_type_transformers_knows_needs_no_flag(tmp_path):
    """A checkpoint of a model type transformers implements may still name its own code in auto_map (hub copies of
    nomic_bert, jina): transformers' class loads it without that code, so the flag is not asked for."""
    path = build_tiny_mlm_dir(tmp_path / "bert_with_auto_map")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "auto_map": {
        "AutoModelForMaskedLM": "modeling_absent.AbsentForMaskedLM"}}))
    assert type(load_model(str(path)).model).__name__ == "BertForMaskedLM"


# ------------------------------------------------------- an unknown remote-code type: every flag in one refusal (issue 59)
@pytest.fixture(scope="module")
def unknown_type_dir(tmp_path_factory):
    return build_unknown_type_tiny(tmp_path_factory.mktemp("unknown") / "tinydiff_remote")


def test_the_remote_code_refusal_names_what_the_files_tell_without_running_code(unknown_type_dir, tmp_path,
                                                                                 monkeypatch):
    log = tmp_path / "ran.log"
    monkeypatch.setenv("GRADFLOW_TEST_REMOTE_CODE_LOG", str(log))
    with pytest.raises(ModelLoadError) as err:
        load_model(str(unknown_type_dir), max_length=128)
    assert str(err.value) == (
        f"{str(unknown_type_dir)!r} ships its own model code (configuration_dream.py, modeling_dream.py), which "
        "gradflow runs only with --trust-remote-code (trust_remote_code=True): review that code, then pass the flag; "
        "its files also say that model_type 'tinydiff' has no gradflow adapter (the generic one, discovered from its "
        "modules, is --adapter auto) and that it accepts 64 positions, fewer than --max-length 128: after the review, "
        "run it again with --trust-remote-code --adapter auto --max-length 64.")
    for kept, absent in [({"max_length": 64}, "--max-length"), ({}, "--max-length"),
                         ({"adapter": "auto", "max_length": 128}, "--adapter auto")]:
        with pytest.raises(ModelLoadError) as err:
            load_model(str(unknown_type_dir), **kept)
        assert absent not in str(err.value).split("review that code")[1]  # a window that fits, or a flag given
    assert not log.exists()  # reading config.json and tokenizer_config.json ran none of its code
    with pytest.raises(ModelLoadError) as err:
        load_model(str(unknown_type_dir), trust_remote_code=True, max_length=128)
    assert str(err.value).endswith("A model without an adapter may be recorded with the generic one, discovered "
                                   "from its modules: pass --adapter auto; its files also say that it accepts 64 "
                                   "positions, fewer than --max-length 128: run it again with --trust-remote-code "
                                   "--adapter auto --max-length 64.")


NEXT = re.compile(r"run it again with (--[^:;]*)\.$|pass (--max-length \d+) or less\.$")


@pytest.mark.parametrize("given", [
    pytest.param([], id="no flag"),
    pytest.param(["--trust-remote-code"], id="trusting its code"),
    pytest.param(["--trust-remote-code", "--adapter", "auto"], id="trusting its code with the generic adapter",
                 marks=pytest.mark.slow),  # 1.6 s: the refusal comes after loading
])
def test_an_unknown_remote_code_type_records_at_the_second_run(unknown_type_dir, tiny_corpus, tmp_path, capsys, given):
    """Issue 59: such a checkpoint took four runs, one refusal each; now the first refusal, wherever one starts,
    names every flag still missing, and the command with them records."""
    argv = ["record", "--model", str(unknown_type_dir), "--texts", str(tiny_corpus), "--limit", "2", "--quiet"]
    assert main([*argv, *given, "--out", str(tmp_path / "first")]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("gradflow: error:")]
    assert len(errors) == 1 and "Traceback" not in err
    found = NEXT.search(errors[0])
    assert found, errors[0]
    flags = (found.group(1) or found.group(2)).split()
    assert set(flags) >= {"--max-length", "64"} and (given or {"--trust-remote-code", "--adapter", "auto"} <= set(flags))
    again = [*given, *flags] if found.group(2) else flags
    assert main([*argv, *again, "--out", str(tmp_path / "second")]) == 0
    assert json.loads((tmp_path / "second" / "meta.json").read_text())["counts"]["windows"] == 2


def test_a_causal_lm_checkpoint_is_refused_in_one_sentence_that_says_what_loads(tmp_path, capsys):
    """A native causal MoE LM (OLMoE) maps to no masked-LM class: one sentence naming its class and how a masked
    diffusion LM of that shape loads (remote code, --trust-remote-code), never transformers' list of 50 configs."""
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(vocab_size=64, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, num_experts=2, num_experts_per_tok=1, pad_token_id=0,
                         bos_token_id=None, eos_token_id=None)
    path = build_tiny_mlm_dir(tmp_path / "olmoe")  # its tokenizer; the model replaced by a causal MoE LM
    for name in ("config.json", "model.safetensors"):
        (path / name).unlink()
    torch.manual_seed(0)
    OlmoeForCausalLM(config).save_pretrained(path)
    with pytest.raises(ModelLoadError) as err:
        load_model(str(path))
    message = str(err.value)
    assert "'olmoe', OlmoeForCausalLM" in message and "--trust-remote-code" in message
    assert "\n" not in message and "BertConfig" not in message and message.endswith(".")
    capsys.readouterr()
    assert main(["record", "--model", str(path), "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"gradflow: error: {message}"]

