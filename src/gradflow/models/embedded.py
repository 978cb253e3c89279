"""The embedded models: their names, which distribution ships each, and where each is installed.

The core ``gradflow`` wheel carries :data:`CORE_MODELS`: the default model and its all-token twin, what
``gradflow demo`` and the README's first command record (folders of ``gradflow/models/``). The other embedded
models ship in the companion distribution ``gradflow-models`` (import package ``gradflow_models``, built from
``packages/gradflow-models/`` of the repository; ``./setup.sh`` installs both), so that every wheel stays under
PyPI's 100 MB per-file limit as the family grows. :func:`embedded_model_dir` finds a model wherever its
distribution is installed; a missing companion is one sentence naming the command that installs it.

A new member of the family is an entry of :data:`EMBEDDED_MODELS` and a folder of
``packages/gradflow-models/src/gradflow_models/`` (``tests/models/test_companion_models.py`` checks both sides).
"""

from __future__ import annotations

from importlib import metadata, resources
from pathlib import Path

from gradflow.errors import ModelLoadError
from gradflow.provenance import COMPANION_PACKAGE

EMBEDDED_MODELS: dict[str, str] = {
    "gradflow-mini-en": "BERT MLM (6 layers, hidden 256) pretrained on SOTU + Brown with standard 15% MLM",
    "gradflow-mini-en-alltoken": "its twin trained with the all-token loss (predict the original token everywhere)",
    "gradflow-mini12-en": "the same block at 12 layers (hidden 256), one pass of the large corpus (25.7 M tokens), "
                          "standard 15% MLM",
    "gradflow-mini12-en-alltoken": "its twin trained with the all-token loss for the same compute (9,829 steps, "
                                   "20.0 M tokens of the large corpus)",
    "gradflow-mini-en-mask40": "mini-en's recipe trained with BERT masking at 40% (80/10/10), at mini-en's compute "
                               "(3,262 steps)",
    "gradflow-mini-en-diffusion": "mini-en's recipe trained as a masked diffusion LM (t ~ U(0.001, 1) per sequence, "
                                  "1/t weights), at mini-en's compute (3,059 steps)",
}
DEFAULT_MODEL = "gradflow-mini-en"
CORE_MODELS: tuple[str, ...] = ("gradflow-mini-en", "gradflow-mini-en-alltoken")
"""The embedded models in the core ``gradflow`` wheel (the default model and the demo's pair); the rest are the
companion's."""
COMPANION = "gradflow-models"
"""The companion distribution (PyPI name) that ships every embedded model not in :data:`CORE_MODELS`."""
INSTALL_COMPANION = "pip install gradflow-models (or ./setup.sh from a checkout)"


def distribution_of(name: str) -> str:
    """The distribution that ships the embedded model ``name``: ``gradflow`` or ``gradflow-models``."""
    _known(name)
    return "gradflow" if name in CORE_MODELS else COMPANION


def companion_root() -> Path | None:
    """The folder of the installed companion package (one sub-folder per model), or None when it is not installed.
    The one place gradflow looks for it: an editable install (``./setup.sh``) and a wheel are found alike."""
    try:
        return Path(str(resources.files(COMPANION_PACKAGE)))
    except ImportError:  # ModuleNotFoundError: gradflow-models is not installed
        return None


def embedded_model_dir(name: str) -> Path:
    """Directory of an embedded model where its distribution is installed: the gradflow package for
    :data:`CORE_MODELS`, the companion package ``gradflow_models`` for the others. Raises ModelLoadError, one
    sentence naming the install command, when the companion is not installed."""
    if distribution_of(name) == "gradflow":
        return Path(str(resources.files("gradflow") / "models" / name))
    root = companion_root()
    if root is None:
        raise ModelLoadError(f"{name} ships in the companion package {COMPANION}, which is not installed: "
                             f"{INSTALL_COMPANION}.")
    return root / name


def find_embedded_model(name: str) -> Path:
    """The directory of the installed embedded model ``name`` (it has ``config.json``); ModelLoadError, one
    sentence, when it is not installed (a missing companion, an older companion without it, a broken install)."""
    path = embedded_model_dir(name)
    if (path / "config.json").is_file():
        return path
    if distribution_of(name) == COMPANION:
        raise ModelLoadError(f"{name} is not in the installed {COMPANION} {_companion_version()} (an older release): "
                             f"pip install -U {COMPANION} (or ./setup.sh from a checkout).")
    raise ModelLoadError(f"the embedded model {name} is missing from this installation ({path}): reinstall gradflow "
                         "(the weights ship in the package).")


def installed_embedded_models() -> list[str]:
    """The embedded models this installation can load by name, in :data:`EMBEDDED_MODELS` order."""
    found = []
    for name in EMBEDDED_MODELS:
        try:
            found += [name] if (embedded_model_dir(name) / "config.json").is_file() else []
        except ModelLoadError:
            continue
    return found


def _known(name: str) -> None:
    if name not in EMBEDDED_MODELS:
        raise ModelLoadError(f"{name!r} is not an embedded model; the embedded models are "
                             f"{', '.join(EMBEDDED_MODELS)}.")


def _companion_version() -> str:
    try:
        return metadata.version(COMPANION)
    except metadata.PackageNotFoundError:
        return "(version unknown)"


__all__ = ["COMPANION", "CORE_MODELS", "DEFAULT_MODEL", "EMBEDDED_MODELS", "INSTALL_COMPANION", "companion_root",
           "distribution_of", "embedded_model_dir", "find_embedded_model", "installed_embedded_models"]
