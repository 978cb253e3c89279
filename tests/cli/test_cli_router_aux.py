"""``gradflow record --router-aux-loss`` (issue 61, part 2): refused in one sentence (exit 2, nothing left behind) for a
model whose adapter knows no auxiliary router loss, with a router (a remote-code MoE under ``--adapter auto``) or
without (a BERT); a coefficient must be a finite number >= 0."""

from __future__ import annotations

import pytest

from gradflow.cli import main
from models.remote_code.tiny_remote import build_moe_tiny


def _errors(err: str) -> list[str]:
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("gradflow: error:")]


def test_a_model_without_a_router_is_refused(tmp_path, tiny_mlm_dir, tiny_corpus, capsys):
    out = tmp_path / "run"
    argv = ["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(out), "--limit", "2",
            "--max-length", "24", "--quiet", "--router-aux-loss"]
    assert main(argv) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and errors[0].rstrip().endswith("'bert' (adapter bert) has none: drop the option")
    assert not out.exists()


def test_a_router_without_a_known_aux_loss_is_refused(tmp_path, tiny_corpus, capsys):
    model = build_moe_tiny(tmp_path / "moe")
    argv = ["record", "--model", str(model), "--texts", str(tiny_corpus), "--out", str(tmp_path / "run"),
            "--limit", "2", "--max-length", "24", "--quiet", "--trust-remote-code", "--adapter", "auto",
            "--router-aux-loss", "0.01"]
    assert main(argv) == 2
    errors = _errors(capsys.readouterr().err)
    assert len(errors) == 1 and "'tinymoe'" in errors[0] and errors[0].rstrip().endswith("drop the option")


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "lots"])
def test_a_bad_coefficient_is_refused(value, tmp_path, tiny_mlm_dir, tiny_corpus, capsys):
    argv = ["record", "--model", str(tiny_mlm_dir), "--texts", str(tiny_corpus), "--out", str(tmp_path / "run"),
            "--router-aux-loss", value]
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert "expected a finite coefficient >= 0 (or model)" in capsys.readouterr().err
