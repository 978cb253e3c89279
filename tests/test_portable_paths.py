"""Provenance is portable: gradflow.provenance.portable_path, the writers that use it, and no
committed output (figures/, docs/, analyses/, README.md) carrying a machine's absolute path."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

import gradflow
from gradflow.provenance import content_hash, portable_command, portable_path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = Path(gradflow.__file__).resolve().parent
SCANNED = ("figures", "docs", "analyses", "README.md")
CODE = {".py", ".sh", ".mk", ".toml", ".cfg"} | {""}  # "" : Makefile
BINARY = {".png", ".pdf", ".jpg", ".jpeg", ".gif", ".parquet", ".safetensors", ".bin", ".pt", ".npz", ".gz", ".zip"}

# a Unix machine prefix anywhere a path can start (not inside a relative path like ../../root/x,
# nor inside a URL: the character before the slash must not be a word character, ".", ":" or "/")
MACHINE_PREFIX = re.compile(r"(?<![\w.~:/\\-])/(?:home|root|work|tmp|Users|usr|opt|var|mnt|srv|private|Volumes|"
                            r"scratch|nfs|media|gpfs|lustre)/")
# a Windows drive path (C:\Users, C:\\Users in JSON, C:/Users); not LaTeX ($x:\alpha$): a second separator is needed
WINDOWS_PATH = re.compile(r"(?<![\w$\\{])[A-Za-z]:(?:\\\\|\\|/)[\w .~-]*[\\/]")
# in data and documents (not code, which may name system files such as /proc/self/status): any
# other absolute path with two or more components where a value starts: after a quote, a backtick,
# a table pipe, whitespace, "(", "=", "," or "[" (URLs are "scheme://host/...": excluded)
GENERIC_PATH = re.compile(r"(?:^|[\s\"'`(=|,\[])((?:/[\w.+~-]+){2,})")
# a JSON or CSV value that is an absolute path (or starts with ~/ or a drive letter)
ABSOLUTE_VALUE = re.compile(r"^(?:/(?!/)\S|~/|[A-Za-z]:[\\/]|\\\\\w)")


def _tracked_text_files() -> list[Path]:
    if shutil.which("git") is None:
        pytest.skip("git is not available")
    proc = subprocess.run(["git", "ls-files", "-z", "--", *SCANNED], cwd=REPO, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout: {proc.stderr.strip()}")
    files = []
    for name in filter(None, proc.stdout.split("\0")):
        path = REPO / name
        if path.suffix.lower() in BINARY or not path.is_file():
            continue
        head = path.read_bytes()[:8192]
        if b"\0" in head:
            continue
        files.append(path)
    return files


def _strings(value):
    """Every string (keys included) in a parsed JSON value."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def absolute_paths_in(path: Path) -> list[str]:
    """``line: offending text`` for every absolute machine path in one text file."""
    text = path.read_text(encoding="utf-8", errors="replace")
    code = path.suffix in CODE
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        if number == 1 and line.startswith("#!"):
            continue  # a shebang (#!/usr/bin/env python) is not provenance
        patterns = (MACHINE_PREFIX, WINDOWS_PATH) if code else (MACHINE_PREFIX, WINDOWS_PATH, GENERIC_PATH)
        for pattern in patterns:
            for match in pattern.finditer(line):
                hits.append(f"{number}: {match.group(0).strip()}")
    if path.suffix == ".json":
        try:
            values = list(_strings(json.loads(text)))
        except ValueError:
            values = []
        hits += [f"json value: {v}" for v in values if ABSOLUTE_VALUE.match(v)]
    elif path.suffix in (".csv", ".tsv"):
        dialect = "excel-tab" if path.suffix == ".tsv" else "excel"
        for number, row in enumerate(csv.reader(io.StringIO(text), dialect), 1):
            hits += [f"{number}: csv cell {cell}" for cell in row if ABSOLUTE_VALUE.match(cell.strip())]
    return sorted(set(hits))


def test_committed_files_carry_no_absolute_machine_paths():
    files = _tracked_text_files()
    assert files, "git ls-files listed no text file under figures/, docs/, analyses/"
    offenders = {str(p.relative_to(REPO)): hits for p in files if (hits := absolute_paths_in(p))}
    listing = "\n".join(f"{name}: {hits[:3]}" for name, hits in sorted(offenders.items())[:20])
    assert not offenders, (f"{len(offenders)} committed files carry absolute machine paths (rewrite them with "
                           f"python -m analyses.maintenance.rewrite_portable_paths; fix the writer):\n{listing}")


@pytest.mark.parametrize("text, bad", [
    ('"data_root": "/work/main/data/tasks"', True),
    ("| run directory | `/home/me/gradflow/figures/runs/x` |", True),
    ("| tokenizer | /root/.cache/gradflow/zoo/antiberty |", True),
    ('"model": "C:\\\\Users\\\\me\\\\model"', True),
    ("see /srv/data/corpus.txt", True),
    ('"texts": "/data/corpus.txt"', True),
    ("https://github.com/owner/repo/blob/main/x.py", False),
    ("../../root/.cache/gradflow/zoo/x and data/tasks and gradflow:models/gradflow-mini-en", False),
    ("$\\frac{a}{b}$, tokens/s, and/or, 3/4, $x:\\alpha$", False),
    ("`gradflow-cache:zoo/antiberty`", False),
])
def test_the_scan_flags_absolute_paths_only(tmp_path, text, bad):
    path = tmp_path / "sample.md"
    path.write_text(text + "\n", encoding="utf-8")
    assert bool(absolute_paths_in(path)) is bad


def test_the_scan_reads_json_and_csv_values(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"texts": "/x", "url": "https://a.b/c", "rel": "data/tasks"}))
    (tmp_path / "b.csv").write_text("name,path\nrun,/opt/x\n")
    (tmp_path / "c.csv").write_text("name,path\nrun,./model\n")
    assert absolute_paths_in(tmp_path / "a.json") == ["json value: /x"]
    assert absolute_paths_in(tmp_path / "b.csv")
    assert absolute_paths_in(tmp_path / "c.csv") == []
    (tmp_path / "d.py").write_text('status = open("/proc/self/status")\n')  # code may name system files
    (tmp_path / "e.py").write_text('DATA = "/home/me/data"\n')  # but not a machine's home
    assert absolute_paths_in(tmp_path / "d.py") == []
    assert absolute_paths_in(tmp_path / "e.py")


# ---------------------------------------------------------------------------------------- portable_path
@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    """A fake repository (``.git``) as the current directory; the gradflow cache elsewhere."""
    root = tmp_path / "repo"
    (root / ".git").mkdir(parents=True)
    (root / "data" / "tasks").mkdir(parents=True)
    (root / "figures" / "run").mkdir(parents=True)
    monkeypatch.setenv("GRADFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(root)
    return root


def test_package_files_are_named_inside_gradflow(repo):
    out = repo / "figures" / "run"
    assert portable_path(PACKAGE / "models" / "gradflow-mini-en", out) == "gradflow:models/gradflow-mini-en"
    assert portable_path(str(PACKAGE / "data" / "sotu_sample.txt"), out) == "gradflow:data/sotu_sample.txt"


def test_cache_files_are_named_inside_the_cache(repo, tmp_path):
    assert portable_path(tmp_path / "cache" / "zoo" / "antiberty", repo / "figures" / "run") == \
        "gradflow-cache:zoo/antiberty"


def test_paths_under_the_output_directory_are_relative_to_it(repo):
    out = repo / "figures" / "run"
    assert portable_path(out, out) == "."
    assert portable_path(out / "model" / "config.json", out) == "./model/config.json"
    (out / "model").mkdir()
    assert portable_path("figures/run/model", "figures/run") == "./model"  # relative inputs: from the cwd
    assert portable_path("figures/run/missing", "figures/run") == "figures/run/missing"  # not on disk: as given


def test_paths_in_the_repository_are_relative_to_its_root(repo, monkeypatch):
    out = repo / "figures" / "run"
    assert portable_path(repo / "data" / "tasks", out) == "data/tasks"
    assert portable_path("data/tasks", out) == "data/tasks"
    monkeypatch.chdir(repo / "data")  # from a subdirectory: still relative to the repository root
    assert portable_path(repo / "data" / "tasks", out) == "data/tasks"
    assert portable_path("tasks", out) == "data/tasks"


def test_without_a_repository_the_current_directory_is_the_root(tmp_path, monkeypatch):
    if any((d / ".git").exists() for d in (tmp_path, *tmp_path.parents)):
        pytest.skip("the temporary directory lies inside a git checkout")
    (tmp_path / "work" / "corpus").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    assert portable_path(tmp_path / "work" / "corpus" / "a.txt", tmp_path / "out") == "corpus/a.txt"


def test_paths_elsewhere_are_recorded_as_given(repo, tmp_path):
    """Issue 27 point 7: a model or corpus outside the package, cache, output and repository is recorded as the
    user gave it (a chain of ../ broke when the run directory moved); its content hash identifies it elsewhere."""
    from gradflow.provenance import content_hash, is_external

    out = repo / "figures" / "run"
    elsewhere = tmp_path / "elsewhere" / "corpus.txt"
    elsewhere.parent.mkdir()
    elsewhere.write_text("the union\n")
    assert portable_path(elsewhere, out) == elsewhere.as_posix()
    assert portable_path(str(elsewhere), out) == str(elsewhere)
    assert is_external(elsewhere, out) and not is_external(repo / "data", out) and not is_external("bert-base", out)
    moved = tmp_path / "moved" / "corpus.txt"
    moved.parent.mkdir()
    moved.write_text("the union\n")
    assert content_hash(elsewhere) == content_hash(moved) != content_hash(PACKAGE / "roles.py")


def test_names_and_portable_values_are_kept_as_given(repo):
    out = repo / "figures" / "run"
    for value in ("gradflow-mini-en", "zoo:antiberty", "bert-base-uncased", "org/model", "<3 texts>", "./not/here/",
                  "gradflow:models/gradflow-mini-en", "gradflow-cache:zoo/rxnfp"):
        assert portable_path(value, out) == value


def test_portable_forms_are_never_absolute_always_forward_slashes(repo, tmp_path):
    out = repo / "figures" / "run"
    for path in (PACKAGE / "roles.py", tmp_path / "cache" / "x", out / "a", repo / "data"):
        value = portable_path(path, out)
        assert not os.path.isabs(value) and "\\" not in value, (path, value)
        if not value.startswith(("gradflow:", "gradflow-cache:")):
            assert portable_path(repo / value if not value.startswith(".") else out / value, out) == value


def test_portable_command(repo):
    out = repo / "figures" / "run"
    assert portable_command("python analyses/make_figures.py ", out) == "python analyses/make_figures.py "
    spaced = shlex.quote(str(repo / "data" / "a b.txt"))
    assert portable_command(f"gradflow record --texts {spaced} --out={out}", out) == \
        "gradflow record --texts 'data/a b.txt' --out=."
    assert portable_command(["gradflow", "record", "--model", "gradflow-mini-en", "--out", str(out)], out) == \
        "gradflow record --model gradflow-mini-en --out ."


# ---------------------------------------------------------------------------------------- writers
def test_record_meta_json_is_portable(tmp_path, tiny_mlm_dir, tiny_corpus):
    from gradflow.runs.record import RecordConfig, record_corpus

    out = tmp_path / "runs" / "r"
    command = f"gradflow record --model {tiny_mlm_dir} --texts={tiny_corpus} --out {out}"
    record_corpus(RecordConfig(out=str(out), model=str(tiny_mlm_dir), texts=str(tiny_corpus), max_length=24,
                               batch_size=4, limit=4, quiet=True, command=command))
    meta = json.loads((out / "meta.json").read_text())
    given = (str(tiny_mlm_dir), str(tiny_corpus))  # outside the repository: as the user gave them
    assert not [v for v in _strings(meta) if ABSOLUTE_VALUE.match(v) and v not in given]
    assert meta["model"] == meta["model_path"] == str(tiny_mlm_dir) and meta["texts"] == str(tiny_corpus)
    assert meta["inputs_sha256"] == {"model": content_hash(tiny_mlm_dir), "texts": content_hash(tiny_corpus)}
    assert meta["tokenizer"]["name_or_path"] == meta["model_path"]
    assert meta["command"] == f"gradflow record --model {tiny_mlm_dir} --texts={tiny_corpus} --out ."


@pytest.mark.slow
def test_record_meta_names_the_default_corpus_and_embedded_model_in_the_package(tmp_path):
    from gradflow.runs.record import RecordConfig, record_corpus

    out = tmp_path / "r"
    record_corpus(RecordConfig(out=str(out), max_length=24, batch_size=4, limit=2, quiet=True))
    meta = json.loads((out / "meta.json").read_text())
    assert meta["model"] == "gradflow-mini-en"
    assert meta["model_path"] == "gradflow:models/gradflow-mini-en"
    assert meta["tokenizer"]["name_or_path"] == "gradflow:models/gradflow-mini-en"
    assert meta["texts"] == "gradflow:data/sotu_sample.txt"


def test_finetune_result_json_is_portable(tmp_path, tiny_mlm_dir):
    from gradflow.interventions.finetune import FinetuneConfig, Task, finetune

    task = Task("toy", "sequence", "accuracy", ("neg", "pos"), None, {})
    rows = [{"text": f"the union {'treasury' if i % 2 else 'nation'}", "label": ("neg", "pos")[i % 2]}
            for i in range(16)]
    out = tmp_path / "ft" / "run"
    finetune(FinetuneConfig(model=str(tiny_mlm_dir), task="toy", out_dir=str(out), data_root=str(tmp_path / "tasks"),
                            steps=2, batch_size=4, eval_every=2, max_length=32, progress=False),
             task=task, data={"train": rows, "validation": rows, "test": rows})
    config = json.loads((out / "result.json").read_text())["config"]
    assert config["out_dir"] == "."
    assert config["data_root"] == str(tmp_path / "tasks")  # outside the repository: as given
    assert config["task"] == "toy"
    assert config["model"] == str(tiny_mlm_dir)
    assert not [v for v in _strings(config) if ABSOLUTE_VALUE.match(v) and v not in (str(tiny_mlm_dir),
                                                                                   str(tmp_path / "tasks"))]


def test_surgery_json_is_portable(tmp_path, tiny_mlm_dir):
    from gradflow.interventions.surgery import SURGERY_FILE, surgery_to_dir

    out = surgery_to_dir(str(tiny_mlm_dir), tmp_path / "cut", drop_last=1)
    meta = json.loads((out / SURGERY_FILE).read_text())
    assert Path(meta["source"]).resolve() == Path(meta["source_path"]).resolve() == Path(tiny_mlm_dir).resolve()
    assert meta["source"] == str(tiny_mlm_dir)  # outside the repository: as given


@pytest.mark.slow
def test_diagnostics_meta_json_is_portable(tmp_path, tiny_mlm_dir, tiny_corpus):
    from gradflow.models import load_model
    from gradflow.runs.diagnose import diagnose_corpus

    loaded = load_model(str(tiny_mlm_dir))
    out = tmp_path / "diag"
    diagnose_corpus(loaded, tiny_corpus, out, max_length=24, batch_size=4, limit=2, max_per_group=50)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["texts"] == str(tiny_corpus) and Path(meta["model_path"]).resolve() == Path(tiny_mlm_dir).resolve()
    assert meta["inputs_sha256"] == {"model": content_hash(tiny_mlm_dir), "texts": content_hash(tiny_corpus)}
    diagnose_corpus(loaded, ["the union and the nation"] * 3, out, max_length=24, batch_size=4, max_per_group=50)
    assert json.loads((out / "meta.json").read_text())["texts"] == "<3 texts>"


# ---------------------------------------------------------------------------------------- readers
@pytest.fixture
def grid_module():
    from analyses.last_block_finetuning import grid

    return grid


def _finished(out: Path, run_id: str, config: dict) -> None:
    run_dir = out / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "result.json").write_text(json.dumps({"config": config, "final": {}, "seconds": 1.0}))


def test_the_grid_resumes_runs_recorded_with_portable_paths(tmp_path, grid_module):
    out = tmp_path / "exp"
    config = {"model": str(out / "runs" / "r0" / "m"), "task": "brown-pos", "lr": 1e-3,
              "data_root": str(REPO / "data" / "tasks")}
    run = grid_module.GridRun("r0", {"seed": 0}, config)
    _finished(out, "r0", {**config, "model": "./m", "data_root": "data/tasks", "out_dir": "."})
    assert grid_module.pending([run], out) == []  # finished, same config: skipped, not refused
    other = grid_module.GridRun("r1", {"seed": 1}, {**config, "data_root": str(REPO / "data" / "other")})
    _finished(out, "r1", {**config, "model": "../r1/m", "data_root": "data/tasks"})
    with pytest.raises(SystemExit, match="another config"):
        grid_module.pending([run, other], out)


def test_the_grid_plan_is_portable(tmp_path, grid_module):
    out = tmp_path / "exp"
    config = {"model": "gradflow-mini-en", "data_root": str(REPO / "data" / "tasks")}
    extra = {"work": str(REPO / "build" / "seed"), "nested": {"corpus": str(tmp_path / "c")}}
    grid_module.write_plan([grid_module.GridRun("r0", {"seed": 0}, config)], out, extra)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["runs"][0]["config"] == {"model": "gradflow-mini-en", "data_root": "data/tasks"}
    assert plan["work"] == "build/seed" and plan["nested"]["corpus"] == str(tmp_path / "c")  # outside: as given
    assert "earlier_commands" not in plan


def test_a_plan_written_again_keeps_the_earlier_commands(tmp_path, grid_module, monkeypatch):
    # an experiment run in parts (the MLM model's runs, then the twin's): each part's command is kept
    out = tmp_path / "exp"
    run = grid_module.GridRun("r0", {"seed": 0}, {"model": "gradflow-mini-en"})
    for models in ("mlm", "twin", "twin", "both"):
        monkeypatch.setattr("sys.argv", [str(REPO / "analyses" / "x.py"), "--models", models])
        grid_module.write_plan([run], out)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["command"].endswith("--models both")
    assert [c.rsplit(" ", 1)[-1] for c in plan["earlier_commands"]] == ["mlm", "twin"]


def test_titles_name_a_model_not_a_path(tmp_path):
    from gradflow.provenance import display_name

    assert display_name("/data/models/albert-smiles/") == "albert-smiles"
    assert display_name("../../../elsewhere/albert-smiles") == "albert-smiles"
    assert display_name("gradflow:models/gradflow-mini-en") == "gradflow-mini-en"
    for name in ("gradflow-mini-en", "bert-base-uncased", "FacebookAI/roberta-base", "zoo:antiberty"):
        assert display_name(name) == name


@pytest.mark.slow
def test_a_report_of_a_model_elsewhere_is_titled_by_its_name(tmp_path, tiny_mlm_dir, tiny_corpus):
    from gradflow.figures.report import write_report
    from gradflow.runs.record import RecordConfig, record_corpus

    run = tmp_path / "run"
    record_corpus(RecordConfig(out=str(run), model=str(tiny_mlm_dir), texts=str(tiny_corpus), max_length=24,
                               batch_size=4, limit=4, quiet=True))
    write_report(run, tmp_path / "report", formats=("png",), n_resamples=20)
    title = (tmp_path / "report" / "summary.md").read_text().splitlines()[0]
    assert title == f"# gradflow report: {Path(tiny_mlm_dir).name}" and "../" not in title


def test_local_inputs_are_hashed_wherever_they_are(tmp_path, monkeypatch):
    """A checkpoint or corpus inside the working repository (usually git-ignored) is pinned by content too;
    package and cache content and hub names are not hashed."""
    from gradflow.provenance import is_local_input

    (tmp_path / ".git").mkdir()
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "corpus.txt").write_text("a b c\n")
    monkeypatch.chdir(tmp_path)
    assert is_local_input("ckpt") and is_local_input("./corpus.txt") and is_local_input(tmp_path / "corpus.txt")
    assert not is_local_input("bert-base-uncased") and not is_local_input("gradflow:models/gradflow-mini-en")
    import gradflow
    assert not is_local_input(Path(gradflow.__file__).parent / "models")
