"""gradflow-models: gradflow's embedded models that do not ship in the core ``gradflow`` wheel.

Each model is a folder of this package (``config.json``, ``model.safetensors`` in float16, the tokenizer files,
its card ``recipe.json`` and ``training_log.csv``). gradflow loads them by name, offline, wherever this package
is installed (``gradflow.load_model("gradflow-mini12-en")``); this package holds data and imports nothing.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"  # the same as gradflow's (tests/models/test_companion_models.py checks)

ROOT = Path(__file__).resolve().parent


def models() -> list[str]:
    """The names of the models this installation holds, sorted."""
    return sorted(p.name for p in ROOT.iterdir() if (p / "config.json").is_file())


__all__ = ["ROOT", "__version__", "models"]
