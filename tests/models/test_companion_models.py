"""The embedded models in two distributions (issue 52): the core pair in gradflow, the rest in the companion
gradflow-models (packages/gradflow-models). Which folder holds which model, that a companion model is found
wherever the companion is installed, and the one sentence when it is not (simulated by the finder returning
nothing, and in a process where the companion cannot be imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

import gradflow
from gradflow.cli import main
from gradflow.errors import ModelLoadError
from gradflow.models import (
    COMPANION,
    CORE_MODELS,
    DEFAULT_MODEL,
    EMBEDDED_MODELS,
    embedded,
    embedded_model_dir,
    installed_embedded_models,
    load_model,
    resolve_model_path,
)
from gradflow.provenance import COMPANION_PACKAGE, display_name, is_local_input, portable_path

ROOT = Path(__file__).resolve().parents[2]
CORE_FOLDER = ROOT / "src" / "gradflow" / "models"
COMPANION_DIR = ROOT / "packages" / "gradflow-models"
COMPANION_FOLDER = COMPANION_DIR / "src" / COMPANION_PACKAGE
COMPANION_MODELS = [name for name in EMBEDDED_MODELS if name not in CORE_MODELS]
MISSING = ("gradflow-mini12-en ships in the companion package gradflow-models, which is not installed: "
           "pip install gradflow-models (or ./setup.sh from a checkout).")
FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
WHEEL_LIMIT = 100 * 2**20  # PyPI's default per-file limit
needs_companion = pytest.mark.skipif(embedded.companion_root() is None,
                                     reason=f"the companion {COMPANION} is not installed (pip install {COMPANION})")
"""For tests of the installed companion; without it they skip and the two setup checks (here, test_embedded_models)
fail, naming it."""


def _models_in(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if (p / "config.json").is_file()}


@pytest.fixture
def no_companion(monkeypatch):
    """gradflow as a plain `pip install gradflow` has it: the finder finds no companion package."""
    monkeypatch.setattr(embedded, "companion_root", lambda: None)


def test_the_core_wheel_holds_the_default_model_and_the_demo_pair():
    from gradflow.runs.demo import DEMO_RUNS

    assert DEFAULT_MODEL in CORE_MODELS and {model for _, model, _ in DEMO_RUNS} <= set(CORE_MODELS)
    assert _models_in(CORE_FOLDER) == set(CORE_MODELS)


def test_the_companion_folder_holds_every_other_embedded_model():
    assert COMPANION_MODELS and _models_in(COMPANION_FOLDER) == set(COMPANION_MODELS)
    for name in EMBEDDED_MODELS:
        folder = (CORE_FOLDER if name in CORE_MODELS else COMPANION_FOLDER) / name
        assert FILES <= {p.name for p in folder.iterdir()}, name


def test_each_distribution_s_models_fit_under_the_wheel_limit():
    """Weights in float16 barely compress, so the model files' total bounds each wheel (.ci/wheel_check measures
    the wheels themselves); 10 MB is left for the rest of the core package (2 MB today)."""
    for folder in (CORE_FOLDER, COMPANION_FOLDER):
        size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
        assert size < WHEEL_LIMIT - 10 * 2**20, (folder, size)


@needs_companion
def test_the_companion_s_metadata():
    project = tomllib.loads((COMPANION_DIR / "pyproject.toml").read_text())
    assert project["project"]["name"] == COMPANION
    assert f"gradflow>={gradflow.__version__}" in project["project"]["dependencies"]
    patterns = project["tool"]["setuptools"]["package-data"][COMPANION_PACKAGE]
    assert patterns == ["gradflow-*/*"] and all(name.startswith("gradflow-") for name in COMPANION_MODELS)
    import gradflow_models

    assert gradflow_models.__version__ == gradflow.__version__
    assert gradflow_models.models() == sorted(COMPANION_MODELS)


def test_setup_installs_the_companion_and_its_models_are_found_there():
    root = embedded.companion_root()
    assert root is not None, "gradflow-models is not installed: run ./setup.sh"
    for name in COMPANION_MODELS:
        assert embedded.distribution_of(name) == COMPANION
        assert embedded_model_dir(name) == root / name
        assert resolve_model_path(name) == (str(root / name), True)
    assert [embedded.distribution_of(name) for name in CORE_MODELS] == ["gradflow"] * len(CORE_MODELS)
    assert installed_embedded_models() == list(EMBEDDED_MODELS)


def test_a_companion_installed_elsewhere_is_found_there(tmp_path, monkeypatch):
    """Wherever the companion package lives (a wheel in site-packages, an editable checkout), its folder is used."""
    (tmp_path / "gradflow-mini12-en").mkdir()
    (tmp_path / "gradflow-mini12-en" / "config.json").write_text("{}")
    monkeypatch.setattr(embedded, "companion_root", lambda: tmp_path)
    assert resolve_model_path("gradflow-mini12-en") == (str(tmp_path / "gradflow-mini12-en"), True)


def test_a_missing_companion_is_one_sentence_with_the_install_command(no_companion):
    with pytest.raises(ModelLoadError) as err:
        load_model("gradflow-mini12-en")
    assert str(err.value) == MISSING
    for name in COMPANION_MODELS:
        with pytest.raises(ModelLoadError, match=f"^{name} ships in the companion package gradflow-models, "):
            resolve_model_path(name)
    assert installed_embedded_models() == list(CORE_MODELS)


def test_the_core_pair_loads_without_the_companion(no_companion, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model(DEFAULT_MODEL)
    assert Path(loaded.path) == CORE_FOLDER / DEFAULT_MODEL
    assert resolve_model_path("gradflow-mini-en-alltoken") == (str(CORE_FOLDER / "gradflow-mini-en-alltoken"), True)


def test_the_cli_prints_the_sentence_as_one_line_and_exits_2(no_companion, capsys):
    assert main(["check", "--model", "gradflow-mini12-en"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"gradflow: error: {MISSING}\n" and captured.out == ""


def test_an_older_companion_without_the_model_says_to_upgrade(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "companion_root", lambda: tmp_path)
    monkeypatch.setattr(embedded, "_companion_version", lambda: "0.0.9")
    with pytest.raises(ModelLoadError) as err:
        resolve_model_path("gradflow-mini12-en")
    assert str(err.value) == ("gradflow-mini12-en is not in the installed gradflow-models 0.0.9 (an older release): "
                              "pip install -U gradflow-models (or ./setup.sh from a checkout).")


def test_an_unknown_name_is_not_an_embedded_model():
    with pytest.raises(ModelLoadError, match="'gradflow-mini-en-mask80' is not an embedded model; the embedded"):
        embedded_model_dir("gradflow-mini-en-mask80")


@needs_companion
def test_companion_models_are_recorded_as_before_in_provenance(tmp_path):
    """A companion model's folder is written gradflow:models/<name>, as when it shipped in gradflow's folder (the
    committed meta.json files name it so), and is pinned by the version, not hashed as a user's own input."""
    path = embedded_model_dir("gradflow-mini12-en")
    assert portable_path(path, tmp_path) == "gradflow:models/gradflow-mini12-en"
    assert portable_path(path / "config.json", tmp_path) == "gradflow:models/gradflow-mini12-en/config.json"
    assert not is_local_input(path) and display_name(portable_path(path, tmp_path)) == "gradflow-mini12-en"
    assert portable_path(embedded_model_dir(DEFAULT_MODEL), tmp_path) == "gradflow:models/gradflow-mini-en"


@pytest.mark.slow
def test_without_the_companion_package_the_command_says_how_to_install_it(tmp_path):
    """A process in which gradflow_models cannot be imported (as after `pip install gradflow` alone)."""
    code = ("import sys; sys.modules['gradflow_models'] = None\n"
            "from gradflow.cli import main\n"
            "sys.exit(main(['record', '--model', 'gradflow-mini12-en', '--out', 'run']))")
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"gradflow: error: {MISSING}"
