"""``gradflow atlas``: record, check, diagnose and probe a list of checkpoints, one directory per model.

Per model ``DIR/<slug>/`` holds each step's own output directory, written by the existing jobs
(:data:`gradflow.schema.ATLAS_STEP_DIRS`): ``record/`` (``gradflow record`` under the MLM loss),
``pressure/`` (with ``pressure=True``: the same under the all-positions loss, for the counterfactual
context pressure), ``check/`` (``check.json``, :func:`gradflow.runs.check.check_model`),
``diagnostics/`` (``gradflow diagnose``'s tables) and ``probes/`` (``gradflow probe`` on the probe
task, when the model's vocabulary fits the task's words; otherwise the reason is recorded), each
with its ``meta.json``, then the model's own ``meta.json`` and, last, ``atlas_done.json``.

Resumable: a model whose ``atlas_done.json`` exists is skipped. A model directory without it (an interrupted
model) started with the same settings (``atlas_started.json``) keeps its record, pressure and diagnostics steps:
a finished step is kept, an unfinished one resumes from its last checkpoint (the tables of an uninterrupted
run); everything else in it is redone. Started with other settings, it is redone from scratch. ``shard=(i, n)``
runs only the models at positions i-1, i-1+n, i-1+2n, ... of the list (1-based i), so the n tasks of a cluster
array job cover the list once between them; :func:`gradflow.runs.atlas_merge.merge_atlas` builds the table.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from gradflow.errors import OutputDirError, TaskError, UsageError
from gradflow.inputs.corpus import check_corpus_path, default_texts
from gradflow.inputs.labelled import LabelledSplits
from gradflow.inputs.masking import BertMasking
from gradflow.models import LoadedModel, load_model, resolve_model_path
from gradflow.models.zoo import example_inputs_path
from gradflow.provenance import portable_path
from gradflow.runs.atlas_merge import merge_atlas
from gradflow.runs.check import check_model
from gradflow.runs.checkpoint import has_checkpoint
from gradflow.runs.diagnose import diagnose_corpus
from gradflow.runs.files import write_meta
from gradflow.runs.meta import JobInputs, JobOutcome, job_meta
from gradflow.runs.probe import ProbeConfig, resolve_task, run_probes
from gradflow.runs.probe_features import tokenised_words
from gradflow.runs.record import RecordConfig, record_corpus
from gradflow.runs.resume import DEFAULT_EVERY, DEFAULT_MINUTES, plain
from gradflow.schema import ATLAS_DONE_FILE, ATLAS_STARTED_FILE, ATLAS_STEP_DIRS, CHECK_FILE, META_FILE

ZOO_PREFIX = "zoo:"
DEFAULT_MAX_LENGTH = 128
ZOO_MAX_LENGTH = 256
"""Window length of the zoo models' shipped inputs (antibody and reaction sequences are long)."""
MAX_PIECES_PER_WORD = 2.0
MAX_UNKNOWN_FRACTION = 0.05
"""A vocabulary fits a probe task when its words split into at most this many pieces on average and at
most this fraction of them contain the unknown token (on the first :data:`FIT_SENTENCES` train sentences)."""
FIT_SENTENCES = 200


@dataclass
class AtlasConfig:
    """Options of one atlas run (see ``gradflow atlas --help``)."""

    models: tuple[str, ...]
    out: str
    texts: tuple[str, ...] = ()          # MODEL=FILE items, or one FILE for every model without its own
    shard: tuple[int, int] = (1, 1)
    limit: int | None = None
    max_length: int | None = None        # None: 256 for zoo models, 128 otherwise (capped by the model)
    batch_size: int = 8
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    pressure: bool = False
    probes: bool = True
    probe_task: str = "brown-pos"
    probe_limit: int = 600
    data_root: str | None = None
    resamples: int = 2000
    formats: tuple[str, ...] = ("pdf", "png")
    latex_layout: str = "page"           # the tables' LaTeX layout (gradflow.figures.tables.LATEX_LAYOUTS)
    quiet: bool = False
    trust_remote_code: bool = False
    command: str = ""
    checkpoint_every: int = DEFAULT_EVERY
    checkpoint_minutes: float = DEFAULT_MINUTES


@dataclass(frozen=True)
class AtlasModel:
    """One planned model: its place in the list, spec, label (atlas.csv's ``model``), slug and inputs."""

    index: int
    spec: str
    label: str
    slug: str
    texts: str | None
    max_length: int | None


@dataclass
class AtlasSummary:
    """What one invocation did: models finished now, skipped as already done, and the shard's models."""

    out: Path
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    shard_models: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------- planning
def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 1 <= i <= n; a clear :class:`UsageError` otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
    expected = "I/N with integers 1 <= I <= N (run the I-th of N slices of the model list, e.g. 2/4)"
    if not match:
        raise UsageError(f"--shard must be {expected}, got {text!r}")
    i, n = int(match.group(1)), int(match.group(2))
    if n < 1 or not 1 <= i <= n:
        raise UsageError(f"--shard must be {expected}, got {text!r}")
    return i, n


def shard_of(models: list[AtlasModel], shard: tuple[int, int]) -> list[AtlasModel]:
    """The models of slice ``shard`` = (i, n): list positions i-1, i-1+n, ... (deterministic by position)."""
    i, n = shard
    return models[i - 1::n]


def model_label(spec: str) -> str:
    """``atlas.csv``'s model name: the spec as given, a local directory's name for a path on disk."""
    path = Path(spec).expanduser()
    return path.resolve().name if path.exists() else spec


def slugify(label: str) -> str:
    """A directory name for ``label``: ``zoo:antiberty`` -> ``zoo-antiberty``, ``org/name`` -> ``org--name``."""
    slug = label.replace(ZOO_PREFIX, "zoo-", 1).replace("/", "--")
    return re.sub(r"[^A-Za-z0-9._-]+", "-", slug).strip("-.") or "model"


def plan_models(config: AtlasConfig) -> list[AtlasModel]:
    """Check every model and input before anything runs; :class:`UsageError` (or the loader's error) if bad."""
    if not config.models:
        raise UsageError("gradflow atlas needs at least one MODEL (or --merge DIR... to merge finished atlases)")
    if len(set(config.models)) != len(config.models):
        raise UsageError(f"a model is listed twice in {' '.join(config.models)}; list each model once")
    for spec in config.models:
        resolve_model_path(spec)  # unknown local paths and zoo names fail here, before any model runs
    labels = [model_label(s) for s in config.models]
    slugs = [slugify(lab) for lab in labels]
    clash = sorted({s for s in slugs if slugs.count(s) > 1})
    if clash:
        raise UsageError(f"two models would share the directory {clash[0]!r}; give them distinct directory names")
    per_model, every = parse_texts(config.texts, config.models, labels)
    planned = []
    for k, (spec, label, slug) in enumerate(zip(config.models, labels, slugs)):
        texts = per_model.get(spec, per_model.get(label, every))
        max_length = config.max_length
        if texts is None and spec.startswith(ZOO_PREFIX):
            texts = example_inputs_path(spec[len(ZOO_PREFIX):])
            max_length = max_length or ZOO_MAX_LENGTH
        if texts is not None:
            check_corpus_path(texts)
        planned.append(AtlasModel(k, spec, label, slug, texts, max_length))
    return planned


def parse_texts(items: tuple[str, ...], specs: tuple[str, ...], labels: list[str]) -> tuple[dict[str, str], str | None]:
    """``MODEL=FILE`` items (MODEL: a listed spec or label) and at most one plain ``FILE`` for the others."""
    per_model: dict[str, str] = {}
    every = None
    for item in items:
        key, sep, path = item.partition("=")
        if sep and key in (*specs, *labels):
            per_model[key] = path
        elif sep and not Path(item).exists():
            raise UsageError(f"--texts {item!r} names model {key!r}, which is not in the model list "
                             f"({', '.join(specs)}); use MODEL=FILE with a listed model")
        elif every is not None:
            raise UsageError(f"--texts has two files for every model ({every!r} and {item!r}); give one FILE, "
                             "or MODEL=FILE per model")
        else:
            every = item
    return per_model, every


def resolve_probe_task(config: AtlasConfig) -> LabelledSplits | None:
    """The probe task (loaded once, cut to ``probe_limit`` sentences per split), or None without probes."""
    if not config.probes:
        return None
    try:
        task = resolve_task(config.probe_task, config.seed, config.data_root)
    except TaskError as err:
        raise TaskError(f"{str(err).rstrip('.')}. The atlas probes every model whose vocabulary fits the task: "
                        "fetch the task data (gradflow tasks fetch), pass --probe-task FILE, or "
                        "--no-probes.") from None
    n = config.probe_limit
    return LabelledSplits(task.name, task.train.head(n), task.validation.head(n), task.test.head(n), task.labels,
                          task.source)


def vocabulary_fit(tokenizer, task: LabelledSplits, max_length: int = 128) -> dict:
    """How the tokenizer splits the task's words: ``pieces_per_word``, ``unknown_fraction`` and ``fits``."""
    unk = getattr(tokenizer, "unk_token_id", None)
    words = pieces = unknown = 0
    for ids, positions in tokenised_words(tokenizer, task.train.head(FIT_SENTENCES), max_length):
        for p in positions:
            if p:
                words += 1
                pieces += len(p)
                unknown += any(ids[i] == unk for i in p)
    if words == 0:
        return {"fits": False, "words": 0, "pieces_per_word": None, "unknown_fraction": None}
    ppw, unk_frac = pieces / words, unknown / words
    return {"fits": ppw <= MAX_PIECES_PER_WORD and unk_frac <= MAX_UNKNOWN_FRACTION, "words": words,
            "pieces_per_word": round(ppw, 4), "unknown_fraction": round(unk_frac, 4)}


def probe_ready(loaded: LoadedModel, trust_remote_code: bool = False) -> LoadedModel:
    """``loaded`` with a tokenizer that takes pre-split words: byte-level BPE tokenizers saved with
    ``add_prefix_space=False`` (RoBERTa's) are reloaded with a prefix space, as fine-tuning does."""
    if getattr(loaded.tokenizer, "add_prefix_space", None) is not False:
        return loaded
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(loaded.path, add_prefix_space=True, trust_remote_code=trust_remote_code)
    return replace(loaded, tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------- running
def run_atlas(config: AtlasConfig) -> AtlasSummary:
    """Run the shard's models that are not finished; merge into ``out`` when the run is not sharded."""
    shard = parse_shard(f"{config.shard[0]}/{config.shard[1]}")
    models = plan_models(config)
    task = resolve_probe_task(config)
    out = Path(config.out)
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output path {out} exists and is a file; pass a directory with --out.")
    out.mkdir(parents=True, exist_ok=True)
    mine = shard_of(models, shard)
    summary = AtlasSummary(out, shard_models=[m.label for m in mine])
    if not mine:
        _say(config, f"[atlas] shard {shard[0]}/{shard[1]} has no models ({len(models)} models in the list)")
    for k, model in enumerate(mine, 1):
        where = f"[atlas] {k}/{len(mine)} {model.label}"
        if (out / model.slug / ATLAS_DONE_FILE).is_file():
            _say(config, f"{where}: finished before, skipped")
            summary.skipped.append(model.label)
            continue
        run_model(model, config, task, out, lambda step, w=where: _say(config, f"{w}: {step}"))
        summary.ran.append(model.label)
    if shard[1] == 1:
        merge_atlas([out], out, config.formats, config.resamples, 0, config.command, config.latex_layout)
    return summary


def _say(config: AtlasConfig, text: str) -> None:
    if not config.quiet:
        print(text, flush=True)


RESUMABLE_STEPS = ("record", "pressure", "diagnostics")  # kept when finished, else resumed; the others redone
UNSETTLED = ("models", "out", "command", "texts", "quiet", "shard", "formats", "resamples", "checkpoint_every",
             "checkpoint_minutes", "latex_layout")
"""Atlas options that do not change a model's recorded and diagnosed steps."""


def _settings(model: AtlasModel, config: AtlasConfig) -> dict:
    """What an interrupted model's kept steps must share with this run (``atlas_started.json``'s ``settings``)."""
    options = {k: v for k, v in asdict(config).items() if k not in UNSETTLED}
    return plain({**options, "spec": model.spec, "texts": model.texts, "max_length": model.max_length})


def _prepare_model_dir(path: Path, settings: dict, say) -> bool:
    """Make ``path`` ready for the model's steps; True when an interrupted model's steps are kept (same settings),
    False when it starts from scratch. A directory the atlas did not start is refused, never removed."""
    if not path.exists():
        return False
    if not path.is_dir() or (any(path.iterdir()) and not (path / ATLAS_STARTED_FILE).is_file()):
        raise OutputDirError(f"{path} exists but was not made by gradflow atlas (no {ATLAS_STARTED_FILE}); move it "
                             "away or choose another --out.")
    try:
        started = json.loads((path / ATLAS_STARTED_FILE).read_text(encoding="utf-8")).get("settings")
    except (OSError, ValueError, AttributeError):
        started = None
    if started != settings:
        shutil.rmtree(path)
        return False
    keep = {ATLAS_STARTED_FILE, *(ATLAS_STEP_DIRS[step] for step in RESUMABLE_STEPS)}
    for item in [p for p in path.iterdir() if p.name not in keep]:
        if item.is_dir():
            shutil.rmtree(item)
        else:
            item.unlink()
    say("resuming the interrupted model (finished steps kept, unfinished ones from their checkpoints)")
    return True


def _step_state(out: Path) -> str:
    """``done`` (a finished step's directory), ``resume`` (it has a checkpoint) or ``new``."""
    if has_checkpoint(out):
        return "resume"
    try:
        return "done" if json.loads((out / META_FILE).read_text(encoding="utf-8")).get("complete") is True else "new"
    except (OSError, ValueError, AttributeError):
        return "new"


def run_model(model: AtlasModel, config: AtlasConfig, task: LabelledSplits | None, out: Path,
              say=lambda step: None) -> dict:
    """Every step of one model into ``out/<slug>/`` from scratch; ``atlas_done.json`` last. Returns the marker."""
    start = time.time()
    path = out / model.slug
    settings = _settings(model, config)
    resumed = _prepare_model_dir(path, settings, say)  # refuses a foreign directory before the model is loaded
    loaded = load_model(model.spec, config.device, config.dtype, config.trust_remote_code)
    max_length = min(model.max_length or DEFAULT_MAX_LENGTH, loaded.max_positions())
    if not resumed:
        path.mkdir(parents=True)
        write_meta(path / ATLAS_STARTED_FILE, {"model": model.label, "slug": model.slug, "index": model.index,
                                               "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "settings": settings})
    steps: dict[str, dict] = {}
    for loss, step in (("mlm", "record"), *((("all-positions", "pressure"),) if config.pressure else ())):
        say(f"{step} ({loss} loss)")
        steps[step] = _record(model, config, loaded, path / ATLAS_STEP_DIRS[step], loss, max_length)
    say("check")
    steps["check"] = _check(model, config, loaded, path / ATLAS_STEP_DIRS["check"], max_length)
    say("diagnostics")
    steps["diagnostics"] = _diagnose(model, config, loaded, path / ATLAS_STEP_DIRS["diagnostics"], max_length)
    steps["probes"] = _probe(model, config, loaded, task, path / ATLAS_STEP_DIRS["probes"], say)
    num_layers = steps["check"]["num_blocks"]
    texts = model.texts or default_texts()
    inputs = JobInputs(model=model.spec, texts=texts, masking=BertMasking(seed=config.seed).describe(),
                       seed=config.seed, num_layers=num_layers)
    options = {k: v for k, v in asdict(config).items() if k not in ("models", "out", "command", "texts", "quiet")}
    fields = {"kind": "atlas-model", "label": model.label, "slug": model.slug, "index": model.index,
              "models": list(config.models), "max_length": max_length, "steps": steps, "options": options}
    write_meta(path / META_FILE, job_meta(loaded, inputs, JobOutcome(True, None, start, config.command, str(path)),
                                          fields))
    done = {"model": model.label, "spec": portable_path(model.spec, path), "slug": model.slug,
            "index": model.index, "family": loaded.adapter.family, "n_layers": num_layers,
            "steps": {name: step["status"] for name, step in steps.items()},
            "probe_skip_reason": steps["probes"].get("reason"), "wall_s": round(time.time() - start, 2)}
    write_meta(path / ATLAS_DONE_FILE, done)
    say(f"done in {done['wall_s']:.1f} s")
    return done


def _record(model: AtlasModel, config: AtlasConfig, loaded: LoadedModel, out: Path, loss: str,
            max_length: int) -> dict:
    """The record step: kept when finished before, resumed from its checkpoint, or run (over what is there)."""
    state = _step_state(out)
    if state == "done":
        sequences = json.loads((out / META_FILE).read_text(encoding="utf-8"))["counts"]["sequences_recorded"]
    else:
        sequences = record_corpus(RecordConfig(
            out=str(out), model=model.spec, texts=model.texts, seed=config.seed, max_length=max_length,
            batch_size=config.batch_size, limit=config.limit, device=config.device, dtype=config.dtype, loss=loss,
            quiet=True, trust_remote_code=config.trust_remote_code, command=config.command,
            resume=state == "resume", overwrite=state == "new", checkpoint_every=config.checkpoint_every,
            checkpoint_minutes=config.checkpoint_minutes), loaded).sequences
    return {"status": "done", "dir": out.name, "loss": loss, "sequences": sequences}


def _check(model: AtlasModel, config: AtlasConfig, loaded: LoadedModel, out: Path, max_length: int) -> dict:
    start = time.time()
    result = check_model(loaded, model.texts, seed=config.seed, batch_size=config.batch_size, max_length=max_length)
    out.mkdir(parents=True)
    payload = result.to_dict()
    payload["batch"]["texts"] = portable_path(model.texts or default_texts(), out)
    (out / CHECK_FILE).write_text(json.dumps(payload, indent=1, default=str) + "\n", encoding="utf-8")
    inputs = JobInputs(model=model.spec, texts=model.texts or default_texts(),
                       masking=BertMasking(seed=config.seed).describe(), seed=config.seed,
                       num_layers=result.num_blocks)
    fields = {"kind": "check", "batch_size": config.batch_size, "max_length": max_length,
              "skippable_share": result.skippable_share, "disagreements": len(result.disagreements)}
    write_meta(out / META_FILE, job_meta(loaded, inputs, JobOutcome(True, None, start, config.command, str(out)),
                                         fields))
    return {"status": "done", "dir": out.name, "num_blocks": result.num_blocks,
            "skippable_share": result.skippable_share, "disagreements": len(result.disagreements)}


def _diagnose(model: AtlasModel, config: AtlasConfig, loaded: LoadedModel, out: Path, max_length: int) -> dict:
    """The diagnostics step: kept when finished before, resumed from its checkpoint, or run."""
    state = _step_state(out)
    if state != "done":
        diagnose_corpus(loaded, model.texts, out, max_length=max_length, batch_size=config.batch_size,
                        limit=config.limit, seed=config.seed, command=config.command, resume=state == "resume",
                        overwrite=True, checkpoint_every=config.checkpoint_every,
                        checkpoint_minutes=config.checkpoint_minutes)
    return {"status": "done", "dir": out.name}


def _probe(model: AtlasModel, config: AtlasConfig, loaded: LoadedModel, task: LabelledSplits | None, out: Path,
           say) -> dict:
    if task is None:
        return {"status": "skipped", "reason": "probes turned off (--no-probes)"}
    try:
        fit = vocabulary_fit(probe_ready(loaded, config.trust_remote_code).tokenizer, task)
    except (TaskError, ValueError) as err:  # e.g. a tokenizer that cannot take pre-split words
        say(f"probes skipped: {err}")
        return {"status": "skipped", "reason": f"the tokenizer cannot split {task.name}'s words: {err}"}
    if not fit["fits"]:
        reason = (f"the vocabulary does not fit {task.name}'s words: {fit['pieces_per_word']} pieces per word "
                  f"(at most {MAX_PIECES_PER_WORD}), {fit['unknown_fraction']} of words with an unknown token (at "
                  f"most {MAX_UNKNOWN_FRACTION}) on its first {FIT_SENTENCES} train sentences")
        say(f"probes skipped: {reason}")
        return {"status": "skipped", "reason": reason, "vocabulary_fit": fit}
    loaded = probe_ready(loaded, config.trust_remote_code)
    say(f"probes ({task.name})")
    config_ = ProbeConfig(model=model.spec, task=config.probe_task, out=str(out), limit=config.probe_limit,
                          max_length=min(DEFAULT_MAX_LENGTH, loaded.max_positions()), seed=config.seed,
                          n_resamples=config.resamples, code_length=False, device=config.device,
                          data_root=config.data_root, command=shlex.split(config.command))
    run_probes(config_, loaded)
    return {"status": "done", "dir": out.name, "task": task.name, "vocabulary_fit": fit}


__all__ = ["AtlasConfig", "AtlasModel", "AtlasSummary", "model_label", "parse_shard", "plan_models", "run_atlas",
           "probe_ready", "run_model", "shard_of", "slugify", "vocabulary_fit"]
