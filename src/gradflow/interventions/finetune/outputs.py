"""Where a fine-tuning run's results go: ``eval.csv`` (rewritten after every evaluation),
``result.json`` (paths portable, non-finite floats as null) and, on request, the model."""

from __future__ import annotations

import json
import math
from pathlib import Path

from torch import nn

from gradflow.provenance import portable_path
from gradflow.runs.meta import versions
from gradflow.schema import EVAL_FILE, FINETUNE_RESULT_FILE


def write_history(result, out: Path | None) -> None:
    """Rewrite ``out/eval.csv`` from ``result`` (a ``FinetuneResult``); nothing when ``out`` is None."""
    if out is not None:
        result.frame().to_csv(out / EVAL_FILE, index=False)


def write_outputs(result, out: Path | None, model: nn.Module, tokenizer) -> None:
    """``eval.csv``, ``result.json`` and (``config.save_model``) ``model/`` under ``out``."""
    if out is None:
        return
    write_history(result, out)
    record = json.dumps(_portable({**result.to_dict(), "versions": versions()}, out), indent=2, default=_json_default)
    (out / FINETUNE_RESULT_FILE).write_text(record + "\n")
    if result.config.save_model:
        model.save_pretrained(out / "model")
        tokenizer.save_pretrained(out / "model")


def _portable(record: dict, out: Path) -> dict:
    """``record`` with the config's paths (model or task directory, out_dir, data_root) portable: see
    :func:`gradflow.provenance.portable_path` (model names and hub names are kept as given)."""

    config = dict(record["config"])
    for key in ("model", "task", "out_dir", "data_root"):
        if isinstance(config.get(key), (str, Path)):
            config[key] = portable_path(config[key], out)
    return {**record, "config": config}


def _json_default(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
