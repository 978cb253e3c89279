"""``gradflow probe``: layer-wise linear probes of a model's word features (issue 14, part 1).

For every regime (``unmasked``, and ``masked`` when asked) and every site, one probe recipe:
:func:`gradflow.analysis.probes.fit_probe` (C chosen on validation, scored on test, sentence
bootstrap CI; with ``probe="mlp"``, :func:`gradflow.analysis.mlp_probe.fit_mlp_probe` instead),
the Hewitt & Liang control task (word type -> random label) with the same probe
(the C the task probe chose at that site),
and the Voita & Titov online code length of the **train** labels (bits), with one fixed C
(``code_c``) at every site so that code lengths compare across layers and models.
The headline, per regime and metric, is :func:`~gradflow.analysis.probes.last_layer_drop` over the
block-output sites (``embeddings.out`` = layer 0 ... last block = layer L) with a paired CI.

Writes ``probes.csv``, ``probe_drops.csv``, ``probe_words.parquet`` (per test word and block output:
was the probe right; what ``gradflow compare`` pairs across models), ``meta.json`` (columns in
:mod:`gradflow.schema`) and, once finished, ``tables.tex`` (:mod:`gradflow.runs.probe_tables`); rows are flushed after every site with ``"complete": false`` until the end, so an
interrupted run keeps what it fitted and says so.
"""

from __future__ import annotations

import shlex
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from gradflow.adapters import block_modules
from gradflow.analysis.mlp_probe import DEFAULT_MLP_CS, fit_mlp_probe
from gradflow.analysis.probes import (
    DEFAULT_CS,
    ProbeResult,
    code_length_drop,
    code_length_drop_ci,
    control_labels,
    fit_probe,
    last_layer_drop,
    last_layer_drop_ci,
    online_code_length,
    sentence_bootstrap_ci,
)
from gradflow.errors import TaskError
from gradflow.inputs.labelled import BUILTIN_PROBE_TASKS, LabelledSplits, load_labelled
from gradflow.inputs.tasks import default_data_root, load_task
from gradflow.models import LoadedModel, load_model
from gradflow.runs.files import prepare_output_dir, write_csv, write_meta
from gradflow.runs.meta import JobInputs, JobOutcome, job_meta
from gradflow.runs.probe_features import SplitFeatures, extract_all
from gradflow.runs.probe_tables import TABLES_TEX, write_probe_tables
from gradflow.schema import (
    META_FILE,
    PROBE_COLUMNS,
    PROBE_DROP_COLUMNS,
    PROBE_DROPS_FILE,
    PROBE_REGIMES,
    PROBE_WORD_COLUMNS,
    PROBE_WORDS_FILE,
    PROBES_FILE,
)
from gradflow.site_names import layer_of, point_of

PROBE_FAMILIES: dict[str, tuple[float, ...]] = {"logistic": DEFAULT_CS, "mlp": DEFAULT_MLP_CS}
"""Probe families (``fit_probe``, ``fit_mlp_probe``; both return a ``ProbeResult``) -> their default Cs."""


@dataclass
class ProbeConfig:
    """Options of one probe run (see ``gradflow probe --help`` for each).

    ``limit`` sentences are read from each split; ``train_limit`` (when set) replaces it for train only: a
    count, or ``"all"`` for the whole training split. Validation and test stay the first ``limit`` sentences,
    so runs differing only in ``train_limit`` score the same test words. ``probe`` names the family
    (:data:`PROBE_FAMILIES`); ``cs`` None means that family's default Cs.
    """

    model: str
    task: str
    out: str
    regimes: tuple[str, ...] = ("unmasked",)
    pooling: str = "first"
    mid: bool = False
    limit: int | None = 2000
    train_limit: int | str | None = None
    max_length: int = 128
    batch_size: int = 32
    seed: int = 0
    n_resamples: int = 1000
    cs: tuple[float, ...] | None = None
    probe: str = "logistic"
    code_length: bool = True
    code_c: float = 0.01
    feature_dtype: str = "float16"
    feature_cache: str | None = None
    device: str = "cpu"
    data_root: str | None = None
    overwrite: bool = False
    command: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ProbeRun:
    """What a probe run wrote: its directory and the two tables."""

    out: Path
    probes: pd.DataFrame
    drops: pd.DataFrame


def resolve_task(spec: str, seed: int = 0, data_root: str | Path | None = None) -> LabelledSplits:
    """A built-in task name (``brown-pos``, ``brown-propn``; data under ``data_root``, else where
    :func:`~gradflow.inputs.tasks.resolve_data_root` finds it; built by ``gradflow tasks fetch``) or a
    labelled file / directory (see :mod:`gradflow.inputs.labelled`)."""

    if spec in BUILTIN_PROBE_TASKS:
        task = load_task(spec, data_root if data_root is not None else default_data_root())
        return load_labelled(task.path, seed, name=spec, label_order=task.labels)
    path = Path(spec)
    if not path.exists():
        raise TaskError(f"unknown task {spec!r}: use {', '.join(BUILTIN_PROBE_TASKS)} or the path of a labelled "
                        "file ('word<TAB>label' lines, or .jsonl with 'tokens' and 'labels') or directory")
    return load_labelled(path, seed)


def limited_splits(task: LabelledSplits, limit: int | None, train_limit: int | str | None = None) -> LabelledSplits:
    """The first ``limit`` sentences of each split; train's first ``train_limit`` instead when it is set
    (``"all"``: the whole split). Validation and test never depend on ``train_limit``."""
    if train_limit is None:
        train_limit = limit
    elif train_limit == "all":
        train_limit = None
    elif not isinstance(train_limit, int) or isinstance(train_limit, bool) or train_limit < 1:
        raise TaskError(f"train_limit must be a count >= 1 or 'all', got {train_limit!r}")
    return LabelledSplits(task.name, task.train.head(train_limit), task.validation.head(limit),
                          task.test.head(limit), task.labels, task.source)


def run_probes(config: ProbeConfig, loaded: LoadedModel | None = None,
               progress: Callable[[str, int], Callable[[int], None]] | None = None) -> ProbeRun:
    """Extract features, fit every probe, write the tables and meta.json; return them.

    ``progress(label, total)`` (optional) returns a callback taking a count of words done.
    """
    start = time.time()
    for regime in config.regimes:
        if regime not in PROBE_REGIMES:
            raise TaskError(f"unknown regime {regime!r}; choose from {', '.join(PROBE_REGIMES)}")
    if config.probe not in PROBE_FAMILIES:
        raise TaskError(f"unknown probe family {config.probe!r}; choose from {', '.join(PROBE_FAMILIES)}")
    task = limited_splits(resolve_task(config.task, config.seed, config.data_root), config.limit, config.train_limit)
    if loaded is None:
        loaded = load_model(config.model, device=config.device)
    out = Path(config.out)
    prepare_output_dir(out, config.overwrite)
    for name in (PROBES_FILE, PROBE_DROPS_FILE, PROBE_WORDS_FILE, TABLES_TEX):
        (out / name).unlink(missing_ok=True)
    job = _Job(config, loaded, task, out, start)
    error: BaseException | None = None
    try:
        for regime in config.regimes:
            job.regime(regime, progress)
    except (KeyboardInterrupt, Exception) as err:  # flush what was fitted, mark it incomplete, re-raise
        error = err
        raise
    finally:
        job.write(error)
    write_probe_tables(out)  # tables.tex, only for a finished run
    return ProbeRun(out, job.frame(), job.drops_frame())


class _Job:
    """Rows fitted so far and the files they go to."""

    def __init__(self, config: ProbeConfig, loaded: LoadedModel, task: LabelledSplits, out: Path, start: float):
        self.config, self.loaded, self.task, self.out, self.start = config, loaded, task, out, start
        self.fit: Callable[..., ProbeResult] = fit_probe if config.probe == "logistic" else fit_mlp_probe
        self.cs = tuple(config.cs) if config.cs is not None else PROBE_FAMILIES[config.probe]
        self.rows: list[dict] = []
        self.drops: list[dict] = []
        self.words: list[pd.DataFrame] = []
        self.counts: dict[str, dict] = {}

    def regime(self, regime: str, progress: Callable[[str, int], Callable[[int], None]] | None) -> None:
        folder = self.out / f".features-{regime}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        try:
            total = sum(self.task.split(s).num_words for s in ("train", "validation", "test"))
            tick = progress(f"features ({regime})", total) if progress else None
            c = self.config
            splits = extract_all(self.loaded, self.task, folder, tick, regime=regime, pooling=c.pooling,
                                 max_length=c.max_length, batch_size=c.batch_size, mid=c.mid, dtype=c.feature_dtype,
                                 cache=Path(c.feature_cache) if c.feature_cache else None)
            self.counts[regime] = {s: {"words": int(f.labels.size), "dropped_words": f.dropped,
                                       "sentences": int(np.unique(f.sentence).size)} for s, f in splits.items()}
            self._fit_sites(regime, splits, progress)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _fit_sites(self, regime: str, splits: dict[str, SplitFeatures],
                   progress: Callable[[str, int], Callable[[int], None]] | None) -> None:
        c = self.config
        sites = list(splits["test"].features)
        num_layers = max(layer_of(s) for s in sites)
        all_types = [*splits["train"].word_types, *splits["validation"].word_types, *splits["test"].word_types]
        all_labels = np.concatenate([splits[s].labels for s in ("train", "validation", "test")])
        control = control_labels(all_types, all_labels, seed=c.seed)
        n_train, n_val = splits["train"].labels.size, splits["validation"].labels.size
        control_split = {"train": control[:n_train], "validation": control[n_train:n_train + n_val],
                         "test": control[n_train + n_val:]}
        test_ids = splits["test"].sentence
        tick = progress(f"probes ({regime})", len(sites)) if progress else None
        correct_by_layer, bits_by_layer = {}, {}
        for site in sites:
            xs = {s: np.asarray(splits[s].features[site], dtype=np.float64) for s in splits}
            result = self.fit(xs["train"], splits["train"].labels, xs["validation"], splits["validation"].labels,
                              xs["test"], splits["test"].labels, self.cs, seed=c.seed)
            ctrl = self.fit(xs["train"], control_split["train"], xs["validation"], control_split["validation"],
                            xs["test"], control_split["test"], (result.best_c,), seed=c.seed)
            low, high = sentence_bootstrap_ci(result.correct, test_ids, c.n_resamples, c.seed)
            code = (online_code_length(xs["train"], splits["train"].labels, len(self.task.labels), c=c.code_c,
                                       seed=c.seed) if c.code_length else None)
            layer = layer_of(site)
            self.rows.append({
                "model": self.loaded.name, "task": self.task.name, "regime": regime, "site": site, "layer": layer,
                "depth_fraction": layer / num_layers, "split": "test", "accuracy": result.accuracy,
                "ci_low": low, "ci_high": high, "control_accuracy": ctrl.accuracy,
                "selectivity": result.accuracy - ctrl.accuracy,
                "code_length_bits": code.online_bits if code else np.nan,
                "uniform_code_bits": code.uniform_bits if code else np.nan,
                "compression": code.compression if code else np.nan,
                "majority_accuracy": result.majority_accuracy, "best_c": result.best_c,
                "n_tokens": int(splits["test"].labels.size), "n_sentences": int(np.unique(test_ids).size)})
            if point_of(site) == "out":
                correct_by_layer[layer] = result.correct
                self.words.append(pd.DataFrame({"regime": regime, "layer": layer, "sentence": test_ids,
                                                "word": splits["test"].word, "correct": result.correct.astype(bool)},
                                               columns=list(PROBE_WORD_COLUMNS)))
                if code:
                    bits_by_layer[layer] = code.token_bits
            self.write(None)
            if tick:
                tick(1)
        self._drops(regime, correct_by_layer, bits_by_layer, test_ids, splits["train"].sentence)

    def _drops(self, regime: str, correct: dict[int, np.ndarray], bits: dict[int, np.ndarray],
               test_ids: np.ndarray, train_ids: np.ndarray) -> None:
        c = self.config
        accuracy = {layer: float(v.mean()) for layer, v in correct.items()}
        self.drops.append(self._drop_row(regime, "accuracy", accuracy, last_layer_drop(accuracy),
                                         last_layer_drop_ci(correct, test_ids, c.n_resamples, c.seed), max))
        if bits:
            totals = {layer: float(v.sum()) for layer, v in bits.items()}
            self.drops.append(self._drop_row(regime, "code_length_bits", totals, code_length_drop(totals),
                                             code_length_drop_ci(bits, train_ids, c.n_resamples, c.seed), min))

    def _drop_row(self, regime: str, metric: str, scores: dict[int, float], drop: float, ci: tuple[float, float],
                  best: Callable) -> dict:
        last = max(scores)
        earlier = {k: v for k, v in scores.items() if k != last}
        best_layer = best(earlier, key=earlier.get)
        return {"model": self.loaded.name, "task": self.task.name, "regime": regime, "metric": metric,
                "last_layer_drop": drop, "ci_low": ci[0], "ci_high": ci[1], "last_score": scores[last],
                "best_earlier_score": earlier[best_layer], "best_earlier_layer": best_layer}

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=list(PROBE_COLUMNS))

    def drops_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.drops, columns=list(PROBE_DROP_COLUMNS))

    def write(self, error: BaseException | None) -> None:
        """Flush both tables and meta.json (complete only after every regime, without an error)."""
        done = error is None and len(self.drops) >= len(self.config.regimes)
        write_csv(self.frame(), self.out / PROBES_FILE, PROBE_COLUMNS)
        write_csv(self.drops_frame(), self.out / PROBE_DROPS_FILE, PROBE_DROP_COLUMNS)
        if self.words:
            pd.concat(self.words, ignore_index=True).to_parquet(self.out / PROBE_WORDS_FILE, index=False)
        message = None if error is None else (f"{type(error).__name__}: {error}" or type(error).__name__)
        if error is None and not done:
            message = "running (rows so far are final; the run is not finished)"
        inputs = JobInputs(model=self.config.model, texts=self.task.source, masking={"regimes": list(self.config.regimes)},
                           seed=self.config.seed,
                           num_layers=len(block_modules(self.loaded.adapter, self.loaded.model.base_model)))
        options = {k: v for k, v in asdict(self.config).items() if k not in ("command", "model", "out", "overwrite")}
        options["cs"] = list(self.cs)
        fields = {"kind": "probe", "task": {"name": self.task.name, "source": self.task.source,
                                            "labels": list(self.task.labels)},
                  "options": options, "counts": self.counts}
        command = shlex.join(self.config.command)
        meta = job_meta(self.loaded, inputs, JobOutcome(done, message, self.start, command, str(self.out)), fields,
                        extra_versions={"scikit-learn": _sklearn_version()})
        write_meta(self.out / META_FILE, meta)


def _sklearn_version() -> str:
    import sklearn

    return sklearn.__version__


__all__ = ["BUILTIN_PROBE_TASKS", "PROBE_FAMILIES", "ProbeConfig", "ProbeRun", "limited_splits", "resolve_task",
           "run_probes"]
