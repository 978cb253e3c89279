"""gradflow: where the training signal of a masked language model goes.

The public API: what the Getting-started page uses, re-exported from the modules that define it.

- load a model: :func:`load_model` -> :class:`LoadedModel`;
- mask a batch: :func:`mask_batch` with :class:`BertMasking` (or :class:`ExplicitMasking`) -> :class:`MaskedBatch`;
  other training objectives: :class:`MaskedDiffusion` (LLaDA, MDLM: a ratio t per sequence, 1/t weights) and
  :class:`SpanMasking` (SpanBERT); any of them shifted with ``shift=True`` (Dream);
- record one batch: :class:`GradFlowRecorder` (:class:`RecorderConfig`) -> :class:`BatchRecord`;
- record a corpus: :func:`record_corpus` with :class:`RecordConfig` -> :class:`RunSummary` (a run directory);
- read a run: :func:`load_run` -> :class:`Run`; report it: :func:`write_report`, :func:`write_comparison`;
- inside your own training: :class:`GradFlowCallback` (a transformers ``TrainerCallback``);
- train a masked LM without the compute that gets no gradient: :func:`sparse_mlm`, :class:`SparseMLMTrainer`;
- one sentence, interactively: :func:`channel_view` -> :class:`ChannelView`;
- the contracts: position roles (:class:`Role`, :data:`TOKEN_ROLES`, ...), losses, adapters, errors.

``import gradflow`` loads the recorder's layer only (torch, transformers); the corpus job, the
reading side, the figures, the callback and the explorer are imported on first use of their names,
so pyarrow, matplotlib, starlette and plotly load only when needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gradflow.adapters import Adapter, SublayerSpec, adapter_for, register_adapter, supported_model_types
from gradflow.errors import (
    CorpusError,
    GradflowError,
    ModelLoadError,
    RunError,
    UnsupportedArchitectureError,
    UsageError,
)
from gradflow.hooks.recorder import BatchRecord, GradFlowRecorder, RecorderConfig, RecorderError
from gradflow.inputs.masking import BertMasking, ExplicitMasking, MaskedBatch, TokenizerInfo, mask_batch
from gradflow.inputs.objectives import MaskedDiffusion, SpanMasking
from gradflow.losses import all_positions_loss, mlm_loss
from gradflow.models import LoadedModel, load_model
from gradflow.roles import ALL_ROLES, LOSS_ROLES, TOKEN_ROLES, Role
from gradflow.version import __version__

if TYPE_CHECKING:  # the names below load on first use (see __getattr__)
    from gradflow.analysis.run_data import Run, load_run
    from gradflow.explore.view import ChannelView, channel_view
    from gradflow.figures.report import write_comparison, write_report
    from gradflow.interventions.callback import GradFlowCallback
    from gradflow.runs.record import RecordConfig, RunSummary, record_corpus
    from gradflow.training import sparse_mlm
    from gradflow.training.trainer import SparseMLMTrainer

# name -> the module that defines it; imported on first access (PEP 562)
_ON_FIRST_USE = {
    "RecordConfig": "gradflow.runs.record",
    "RunSummary": "gradflow.runs.record",
    "record_corpus": "gradflow.runs.record",
    "Run": "gradflow.analysis.run_data",
    "load_run": "gradflow.analysis.run_data",
    "write_report": "gradflow.figures.report",
    "write_comparison": "gradflow.figures.report",
    "GradFlowCallback": "gradflow.interventions.callback",
    "ChannelView": "gradflow.explore.view",
    "channel_view": "gradflow.explore.view",
    "sparse_mlm": "gradflow.training.sparse",
    "SparseMLMTrainer": "gradflow.training.trainer",
}


def __getattr__(name: str) -> Any:
    if name in _ON_FIRST_USE:
        value = getattr(importlib.import_module(_ON_FIRST_USE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'gradflow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "ALL_ROLES", "LOSS_ROLES", "TOKEN_ROLES", "Adapter", "BatchRecord", "BertMasking", "ChannelView", "CorpusError",
    "ExplicitMasking", "GradFlowCallback", "GradFlowRecorder", "GradflowError", "LoadedModel", "MaskedBatch",
    "MaskedDiffusion", "ModelLoadError", "SpanMasking", "RecordConfig", "RecorderConfig", "RecorderError", "Role", "Run", "RunError", "RunSummary",
    "SparseMLMTrainer", "SublayerSpec", "TokenizerInfo", "UnsupportedArchitectureError", "UsageError", "__version__", "adapter_for",
    "all_positions_loss", "channel_view", "load_model", "load_run", "mask_batch", "mlm_loss", "record_corpus",
    "register_adapter", "sparse_mlm", "supported_model_types", "write_comparison", "write_report",
]
