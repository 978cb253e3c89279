"""A pretraining run's weight snapshots, checked by SHA-256 and loaded as gradflow models.

A run directory of the recipe (``analyses/pretraining/recipe/``) holds ``meta.json`` (the run's
``config``, ``vocab_size``, ``tokenizer`` folder and its ``tokenizer_sha256``) and
``snapshots/snapshots.csv`` (step, tokens, file, sha256). :func:`run_snapshots` lists the snapshots
with every file's hash checked against the index; :func:`load_snapshot` rebuilds the recipe's
RoFormerForMaskedLM from the config and loads the snapshot's weights with safetensors only.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, fields
from pathlib import Path

from safetensors.torch import load_file
from transformers import BertTokenizerFast

from analyses.pretraining.recipe.config import RunConfig
from analyses.pretraining.recipe.model import build_model
from analyses.pretraining.recipe.snapshots import SNAPSHOT_DIR, read_index
from gradflow.adapters import adapter_for
from gradflow.errors import ModelLoadError, UsageError
from gradflow.models import LoadedModel
from gradflow.models.zoo import sha256 as file_sha256


@dataclass(frozen=True)
class Snapshot:
    """One snapshot of a run: optimiser step, tokens seen (training windows' tokens), file and its SHA-256."""

    step: int
    tokens: int
    path: Path
    sha256: str


@dataclass(frozen=True)
class RunInfo:
    """What loading a run's snapshots needs: its config, vocabulary size and tokenizer folder (and its snapshots)."""

    path: Path
    config: RunConfig
    vocab_size: int
    tokenizer: Path
    tokenizer_sha256: str
    snapshots: tuple[Snapshot, ...] = ()  # filled by the caller from :func:`run_snapshots` (checked files)


def read_run(run: str | Path, tokenizer: str | Path | None = None) -> RunInfo:
    """The run's ``meta.json`` as :class:`RunInfo`; ``tokenizer`` overrides the folder it names.

    The tokenizer folder is taken as written in meta.json (relative to the current directory, as the
    recipe's command gave it), else relative to the run's parent; its ``tokenizer.json`` must have the
    hash the run recorded. Raises :class:`ModelLoadError` for a missing or mismatching piece.
    """
    run = Path(run)
    meta_file = run / "meta.json"
    if not meta_file.is_file():
        raise ModelLoadError(f"{run} has no meta.json: pass the --out folder of a pretraining run "
                             "(python -m analyses.pretraining.pretrain_base)")
    meta = json.loads(meta_file.read_text(encoding="utf-8"))
    known = {f.name for f in fields(RunConfig)}
    config = RunConfig(**{k: v for k, v in meta["config"].items() if k in known})
    given = Path(tokenizer) if tokenizer is not None else Path(meta.get("tokenizer") or run / "tokenizer")
    folder = next((p for p in (given, run.parent / given) if (p / "tokenizer.json").is_file()), None)
    if folder is None:
        raise ModelLoadError(f"the tokenizer of {run} ({given}) has no tokenizer.json here; pass its folder with "
                             "--tokenizer")
    digest = file_sha256(folder / "tokenizer.json")
    if digest != meta["tokenizer_sha256"]:
        raise ModelLoadError(f"{folder / 'tokenizer.json'} has SHA-256 {digest[:12]}..., not the "
                             f"{meta['tokenizer_sha256'][:12]}... {run} was trained with; pass the run's own tokenizer")
    return RunInfo(run, config, int(meta["vocab_size"]), folder, digest)


def run_snapshots(run: str | Path) -> list[Snapshot]:
    """The run's snapshots in step order, each file's SHA-256 checked against ``snapshots.csv``.

    Raises :class:`ModelLoadError` when a listed file is missing or its bytes differ from the index.
    """
    run = Path(run)
    snapshots = []
    for row in read_index(run):
        path = run / SNAPSHOT_DIR / row["file"]
        if not path.is_file():
            raise ModelLoadError(f"{path} is listed in {run / SNAPSHOT_DIR / 'snapshots.csv'} but missing")
        digest = file_sha256(path)
        if digest != row["sha256"]:
            raise ModelLoadError(f"{path} has SHA-256 {digest[:12]}..., but snapshots.csv lists "
                                 f"{row['sha256'][:12]}...: the file is not the snapshot the run wrote; refusing "
                                 "to measure it (restore the file or rerun the recipe to that step)")
        snapshots.append(Snapshot(int(row["step"]), int(row["tokens"]), path, digest))
    return snapshots


def load_snapshot(info: RunInfo, snapshot: Snapshot, label: str) -> LoadedModel:
    """The snapshot as a float32 CPU model in eval mode with its tokenizer and adapter (``name``: ``label``).

    Raises :class:`ModelLoadError` when the file's hash differs from the snapshot's or its tensors do
    not fill the model (tied weights, stored once, excepted).
    """
    digest = file_sha256(snapshot.path)
    if digest != snapshot.sha256:
        raise ModelLoadError(f"{snapshot.path} has SHA-256 {digest[:12]}..., not {snapshot.sha256[:12]}...: refusing "
                             "to measure a file that is not the recorded snapshot")
    tokenizer = BertTokenizerFast.from_pretrained(str(info.tokenizer))
    if len(tokenizer) != info.vocab_size:
        raise ModelLoadError(f"the tokenizer in {info.tokenizer} has {len(tokenizer)} tokens, the run's model "
                             f"{info.vocab_size}")
    model = build_model(info.config, info.vocab_size, tokenizer.pad_token_id)
    state = load_file(str(snapshot.path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    stored = {t.data_ptr() for name, t in model.state_dict().items() if name in state}
    untied = [name for name in missing if model.state_dict()[name].data_ptr() not in stored]
    if unexpected or untied:
        raise ModelLoadError(f"{snapshot.path} does not fit the model of {info.path}/meta.json (missing "
                             f"{untied[:3]}, unexpected {unexpected[:3]})")
    model.eval()
    config_hash = hashlib.sha256(model.config.to_json_string(use_diff=False).encode()).hexdigest()[:16]
    return LoadedModel(model, tokenizer, label, str(snapshot.path), adapter_for(model), config_hash)


def parse_runs(items: list[str]) -> dict[str, Path]:
    """``LABEL=DIR`` items -> {label: run folder}; :class:`UsageError` for a malformed or repeated label."""
    runs: dict[str, Path] = {}
    for item in items:
        label, sep, folder = item.partition("=")
        if not sep or not label or not folder:
            raise UsageError(f"--run takes LABEL=DIR (e.g. gradflow-mini12-en=build/gradflow-mini12-en), got {item!r}")
        if label in runs:
            raise UsageError(f"--run names {label!r} twice; give each model once")
        runs[label] = Path(folder)
    return runs


__all__ = ["RunInfo", "Snapshot", "load_snapshot", "parse_runs", "read_run", "run_snapshots"]
