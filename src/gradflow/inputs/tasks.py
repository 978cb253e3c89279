"""Fine-tuning tasks: what a task is, where its data lives, and how it is scored.

A task directory holds ``train.jsonl``, ``validation.jsonl``, ``test.jsonl`` and ``task.json``
(``name``, ``kind``, ``metric``, ``labels``), as written by ``gradflow tasks fetch``
(:mod:`gradflow.inputs.task_data`).

Where the built-in tasks are looked for (:func:`resolve_data_root`): ``$GRADFLOW_TASKS`` if set, else
``./data/tasks`` if it exists (a repository checkout), else the user cache (``$GRADFLOW_CACHE/tasks``,
else ``~/.cache/gradflow/tasks``, where the zoo's models live too).

- ``kind="token"``: rows ``{"tokens": [...], "tags": [...]}``, one tag per word;
- ``kind="sequence"``: rows ``{"text": "...", "label": "..."}``.

Metrics: ``accuracy`` (per word for token tasks, per example for sequence tasks) and
``entity_f1`` (BIO spans scored by seqeval's default, CoNLL-style matching: a span counts when its
type and both boundaries match).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from gradflow.errors import TaskError
from gradflow.provenance import cache_root

KINDS = ("token", "sequence")
METRICS = ("accuracy", "entity_f1")
SPLITS = ("train", "validation", "test")
BUILTIN_TASKS: dict[str, str] = {
    "brown-pos": "Brown corpus, 12 universal POS tags (token accuracy)",
    "brown-propn": "Brown corpus, proper-noun spans as a named-entity stand-in (entity F1)",
    "movie-sentiment": "movie-review snippets, positive vs negative (accuracy)",
}
DATA_ROOT_ENV = "GRADFLOW_TASKS"
CHECKOUT_DATA_ROOT = Path("data/tasks")
FETCH_HINT = "gradflow tasks fetch"


@dataclass(frozen=True)
class Task:
    """A classification task: token or sequence level, its label set and metric."""

    name: str
    kind: str
    metric: str
    labels: tuple[str, ...]
    path: Path | None = None
    meta: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise TaskError(f"task {self.name}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.metric not in METRICS:
            raise TaskError(f"task {self.name}: metric must be one of {', '.join(METRICS)}, got {self.metric!r}")
        if len(set(self.labels)) != len(self.labels) or len(self.labels) < 2:
            raise TaskError(f"task {self.name}: labels must be at least two distinct names")

    @property
    def label2id(self) -> dict[str, int]:
        return {label: i for i, label in enumerate(self.labels)}

    @property
    def num_labels(self) -> int:
        return len(self.labels)

    def fallback_label(self) -> str:
        """The label predicted for words the model never saw (truncated): ``O`` if present."""
        return "O" if "O" in self.labels else self.labels[0]


@dataclass(frozen=True)
class DataRoot:
    """Where the built-in tasks are looked for, and why there (``source``: ``env``, ``checkout`` or ``cache``)."""

    path: Path
    source: str

    @property
    def reason(self) -> str:
        """The rule that chose :attr:`path`, in words."""
        return {"env": f"${DATA_ROOT_ENV} is set", "checkout": f"./{CHECKOUT_DATA_ROOT} exists",
                "cache": "the user cache"}[self.source]


def tasks_cache_dir() -> Path:
    """The built-in tasks' directory in the user cache (``<cache>/tasks``)."""
    return cache_root() / "tasks"


def resolve_data_root() -> DataRoot:
    """``$GRADFLOW_TASKS`` if set, else ``./data/tasks`` if it exists (repository checkouts), else the user cache."""
    if os.environ.get(DATA_ROOT_ENV):
        return DataRoot(Path(os.environ[DATA_ROOT_ENV]), "env")
    if CHECKOUT_DATA_ROOT.is_dir():
        return DataRoot(CHECKOUT_DATA_ROOT, "checkout")
    return DataRoot(tasks_cache_dir(), "cache")


def default_data_root() -> Path:
    """Where the built-in tasks are looked for when no data root is given (see :func:`resolve_data_root`)."""
    return resolve_data_root().path


def default_fetch_root() -> Path:
    """Where ``gradflow tasks fetch`` writes without ``--out``: ``$GRADFLOW_TASKS`` if set, else the user cache."""
    return Path(os.environ[DATA_ROOT_ENV]) if os.environ.get(DATA_ROOT_ENV) else tasks_cache_dir()


def task_present(name: str, data_root: str | Path | None = None) -> bool:
    """Whether ``data_root`` (default: :func:`default_data_root`) holds the task's ``task.json`` and its splits."""
    path = Path(data_root if data_root is not None else default_data_root()) / name
    return all((path / f).is_file() for f in ("task.json", *(f"{s}.jsonl" for s in SPLITS)))


def load_task(spec: str | Path, data_root: str | Path | None = None) -> Task:
    """A task from a directory with ``task.json``, or a task name under ``data_root``."""
    path = Path(spec)
    if not (path / "task.json").exists():
        path = Path(data_root) if data_root is not None else default_data_root()
        path = path / str(spec)
    meta_path = path / "task.json"
    if not meta_path.exists():
        hint = (f" Build the built-in tasks with `{FETCH_HINT} --out {path.parent}`."
                if str(spec) in BUILTIN_TASKS else
                f" Name a built-in task ({', '.join(BUILTIN_TASKS)}) or a directory that holds a task.json.")
        raise TaskError(f"no task {spec!r}: {meta_path} does not exist.{hint}")
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    return Task(meta["name"], meta["kind"], meta["metric"], tuple(meta["labels"]), path, meta)


def load_split(task: Task, split: str) -> list[dict]:
    """The rows of one split (``train``, ``validation`` or ``test``), checked against the task."""
    if task.path is None:
        raise TaskError(f"task {task.name} has no directory; pass its rows directly")
    path = task.path / f"{split}.jsonl"
    if not path.exists():
        raise TaskError(f"task {task.name}: {path} does not exist (splits: {', '.join(SPLITS)})")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    check_rows(task, rows, split)
    return rows


def check_rows(task: Task, rows: list[dict], split: str = "") -> None:
    """Raise :class:`TaskError` on rows that do not fit the task (first offending row named)."""
    known = set(task.labels)
    for i, row in enumerate(rows):
        if task.kind == "token":
            tokens, tags = row.get("tokens"), row.get("tags")
            bad = tokens is None or tags is None or len(tokens) != len(tags) or not set(tags) <= known
        else:
            bad = not isinstance(row.get("text"), str) or row.get("label") not in known
        if bad:
            raise TaskError(f"task {task.name} {split} row {i}: does not match a {task.kind} task with labels "
                            f"{', '.join(task.labels)}: {json.dumps(row)[:200]}")


# ---------------------------------------------------------------------------------------- metrics
def accuracy(gold: list, pred: list) -> float:
    """Fraction of equal items; token tasks pass lists of tag lists (scored per word)."""
    flat_gold = [g for seq in gold for g in seq] if gold and isinstance(gold[0], list) else list(gold)
    flat_pred = [p for seq in pred for p in seq] if pred and isinstance(pred[0], list) else list(pred)
    if len(flat_gold) != len(flat_pred):
        raise ValueError(f"{len(flat_gold)} gold items but {len(flat_pred)} predictions")
    if not flat_gold:
        return float("nan")
    return sum(g == p for g, p in zip(flat_gold, flat_pred)) / len(flat_gold)


def entity_scores(gold: list[list[str]], pred: list[list[str]]) -> dict[str, float]:
    """Entity-level precision, recall and F1 of BIO tag sequences (seqeval, default mode)."""
    from seqeval.metrics import f1_score, precision_score, recall_score

    return {"precision": float(precision_score(gold, pred, zero_division=0)),
            "recall": float(recall_score(gold, pred, zero_division=0)),
            "entity_f1": float(f1_score(gold, pred, zero_division=0))}


def score(task: Task, gold: list, pred: list) -> dict[str, float]:
    """The task's metric (and, for entity F1, precision and recall and word accuracy)."""
    if task.metric == "entity_f1":
        return {**entity_scores(gold, pred), "accuracy": accuracy(gold, pred)}
    return {"accuracy": accuracy(gold, pred)}
