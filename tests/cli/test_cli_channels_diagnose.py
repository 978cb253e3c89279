"""`gradflow channels` and `gradflow diagnose` from the command line: outputs, bad input (exit 2, one
clear message, no traceback), and diagnostics state that stays bounded however long the corpus."""

from __future__ import annotations

import json

import numpy as np
import torch

from gradflow.cli import main


def _bad(capsys, argv: list[str], expected: str) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert expected in err, err
    assert "Traceback" not in err and err.startswith("gradflow: error:"), err
    return err


# ---------------------------------------------------------------------------------------- channels
def test_channels_writes_figure_and_table(tmp_path, capsys, tiny_mlm_dir):
    out = tmp_path / "fig"
    assert main(["channels", "--model", str(tiny_mlm_dir), "--text", "the nation and the union",
                 "--mask-positions", "2", "--out", str(out), "--format", "png"]) == 0
    assert "wrote" in capsys.readouterr().out
    pngs = list(out.glob("*.png"))
    assert pngs and all(p.stat().st_size > 0 for p in pngs)


def test_channels_bad_input_exit_2(tmp_path, capsys, tiny_mlm_dir, bare_encoder_dir):
    base = ["channels", "--model", str(tiny_mlm_dir), "--out", str(tmp_path / "o")]
    _bad(capsys, base + ["--text", " ".join(["nation"] * 200)], "accepts at most 64")
    _bad(capsys, base + ["--text", "the nation", "--mask-positions", "40"], "out of range")
    _bad(capsys, base + ["--text", "the nation", "--mask-positions", "-1"], "out of range")
    _bad(capsys, base + ["--text", "the nation", "--mask-positions", "0"], "special token")
    err = _bad(capsys, ["channels", "--model", str(bare_encoder_dir), "--text", "the nation", "--out",
                        str(tmp_path / "o")], "no masked-LM head")
    assert "ForMaskedLM" in err
    _bad(capsys, ["channels", "--model", str(tmp_path / "no-such-model"), "--text", "the nation", "--out",
                  str(tmp_path / "o")], "no-such-model")
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


# ---------------------------------------------------------------------------------------- diagnose
def test_diagnose_cli_writes_tables_figures_and_meta(tmp_path, capsys, tiny_mlm_dir, tiny_corpus):
    out = tmp_path / "diag"
    assert main(["diagnose", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(out),
                 "--max-length", "32", "--limit", "8", "--format", "png"]) == 0
    meta = json.loads((out / "meta.json").read_text())
    assert meta["complete"] is True and meta["counts"]["sequences"] == 8
    assert meta["command"].startswith("gradflow diagnose --model")
    assert {p.stem for p in out.glob("*.csv")} == {"logit_lens", "input_shift", "anisotropy", "transformation"}
    assert len(list(out.glob("*.png"))) >= 4


def test_diagnose_bad_input_exit_2(tmp_path, capsys, tiny_mlm_dir, tiny_corpus, bare_encoder_dir):
    out = str(tmp_path / "d")
    _bad(capsys, ["diagnose", "--model", str(bare_encoder_dir), "--texts", str(tiny_corpus), "--out", out],
         "no masked-LM head")
    _bad(capsys, ["diagnose", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", out,
                  "--max-length", "1000"], "positions")
    _bad(capsys, ["diagnose", "--model", str(tiny_mlm_dir), "--texts", str(tmp_path / "missing.txt"), "--out", out,
                  "--max-length", "32"],
         "does not exist")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n", encoding="utf-8")
    _bad(capsys, ["diagnose", "--model", str(tiny_mlm_dir), "--texts", str(empty), "--out", out, "--max-length", "32"],
         "no text")
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    _bad(capsys, ["diagnose", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(a_file),
                  "--max-length", "32"], "is a file")
    assert a_file.read_text() == "keep me"


# ---------------------------------------------------------------------------------------- bounded state
def _state_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes held in numpy arrays and torch tensors reachable from an accumulator (modules excluded)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, torch.nn.Module):
        return 0
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_state_bytes(k, seen) + _state_bytes(v, seen) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set)):
        return sum(_state_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__"):
        return _state_bytes(vars(obj), seen)
    return 0


def test_diagnostics_state_is_bounded_over_a_long_corpus(tiny_mlm_dir, tiny_corpus):
    """Streaming: once the reservoirs are full, 10x more batches leave the accumulated state the same size."""
    from gradflow.hooks.states import collect_states
    from gradflow.inputs.corpus import CorpusCounts, batches, iter_windows, read_documents
    from gradflow.inputs.masking import BertMasking, mask_batch
    from gradflow.models import load_model
    from gradflow.runs.diagnose import Diagnostics

    loaded = load_model(str(tiny_mlm_dir))
    diag = Diagnostics(loaded.model, loaded.adapter, max_per_group=16, seed=0)
    policy = BertMasking(seed=0)
    sizes, n_batches = [], 0
    for _ in range(8):  # the corpus 8 times over
        windows = iter_windows(loaded.tokenizer, read_documents(str(tiny_corpus)), 32, CorpusCounts(), None)
        for group in batches(windows, 4):
            batch = mask_batch(loaded.tokenizer, policy=policy, indices=[w.sequence_index for w in group],
                               encodings=[w.encoding for w in group], max_length=32)
            diag.add(collect_states(loaded.model, batch, loaded.adapter, keep_logits=n_batches == 0), batch)
            n_batches += 1
        sizes.append(_state_bytes(diag))
    assert n_batches >= 8 * 6
    assert sizes[1] == sizes[-1] > 0  # after the first pass filled the reservoirs, nothing grows
    assert all(r.values.shape[0] == 16 for r in diag.input_shift.reservoirs.values())
    assert diag.input_shift.moments[(0, "context")].n > 16 * 8


def test_channels_seed_is_recorded_and_selection_is_per_token(tmp_path, capsys):
    """--seed draws BERT's masking (each token on its own, so a short sentence is rarely 15%), is written to
    meta.json with what it selected, and the same seed gives the same selection."""
    import pandas as pd

    from gradflow.explore.service import DEFAULT_TEXT

    runs = {}
    for name, seed in (("a", 0), ("b", 0), ("c", 4)):
        out = tmp_path / name
        assert main(["channels", "--text", DEFAULT_TEXT, "--seed", str(seed), "--out", str(out), "--format", "png"]) == 0
        printed = capsys.readouterr().out
        runs[name] = (json.loads((out / "meta.json").read_text()), printed, pd.read_csv(out / "channel_view.csv"))
    meta, printed, table = runs["a"]
    assert meta["seed"] == 0 and meta["masking"]["policy"] == "bert" and meta["masking"]["seed"] == 0
    assert meta["command"].startswith("gradflow channels --text") and "--seed 0" in meta["command"]
    assert meta["selection"] == {"positions": [3, 4, 12, 14], "selected": 4, "maskable": 17, "fraction": 0.2353,
                                 "masked": 4, "random": 0, "kept": 0}  # 24%, not 15%: per-token draws
    assert "4 of 17 tokens carry the loss (24%; 4 masked; BERT's masking, seed 0" in printed
    loss_rows = table[table.site == "embeddings.out"].query("role in ['masked', 'random', 'kept']").position.tolist()
    assert loss_rows == meta["selection"]["positions"]
    assert runs["b"][0]["selection"] == meta["selection"]  # same seed, same draw
    assert runs["c"][0]["seed"] == 4 and runs["c"][0]["selection"]["selected"] == 1  # seed 4 draws 1 of 17 (6%)
    # the four attribution columns are there and empty for grad_norm (documented in the guide)
    assert table[["attribution_sum", "attribution_norm", "ig_sum", "ig_norm"]].isna().all().all()


def test_channels_explicit_positions_record_no_draw(tmp_path, capsys):
    out = tmp_path / "explicit"
    assert main(["channels", "--text", "The nation is at peace.", "--mask-positions", "2", "--out", str(out),
                 "--format", "png"]) == 0
    assert "1 of 6 tokens carry the loss (17%; 1 masked; the positions given)" in capsys.readouterr().out
    meta = json.loads((out / "meta.json").read_text())
    assert meta["masking"] == {"policy": "explicit", "action": "mask", "positions": [2]}
    assert meta["selection"]["positions"] == [2]
