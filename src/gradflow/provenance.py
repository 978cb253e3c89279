"""Provenance: portable paths and the source revision (meta.json, result.json, plan.json, summary.md, ...).

Outputs are committed and compared across machines, so a path recorded in them must not be a
machine's absolute path. :func:`portable_path` is the one rule every writer uses;
:func:`portable_command` applies it to the paths in a recorded command line.
:func:`source_revision` names the code that made a number: the git commit of the checkout gradflow
runs from (``+dirty`` when it has uncommitted changes), or ``"unknown"`` for an installed wheel.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

PACKAGE_PREFIX = "gradflow:"
CACHE_PREFIX = "gradflow-cache:"
EXTERNAL_PREFIX = "external:"
COMPANION_PACKAGE = "gradflow_models"
"""The import package of the companion distribution gradflow-models (the embedded models beyond the core wheel's
pair): its model folders are recorded as ``gradflow:models/<name>``, as when they shipped in gradflow's own folder."""
_PREFIXES = (PACKAGE_PREFIX, CACHE_PREFIX, EXTERNAL_PREFIX)


@functools.lru_cache(maxsize=1)
def source_revision() -> str:
    """The git commit gradflow's source is at (40 hex digits, ``+dirty`` if the checkout has changes
    under ``src/``), or ``"unknown"`` outside a git checkout of gradflow (a wheel install: its version
    then pins the code)."""
    package = _package_root()
    top = package.parents[1]  # <checkout>/src/gradflow -> <checkout>
    if not (top / ".git").exists() or not (top / "pyproject.toml").exists():
        return "unknown"
    try:
        head = subprocess.run(["git", "-C", str(top), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        changes = subprocess.run(["git", "-C", str(top), "status", "--porcelain", "--", "src"], capture_output=True,
                                 text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+dirty" if changes else head


def _package_root() -> Path:
    return Path(__file__).resolve().parent


def _companion_root() -> Path | None:
    """The installed companion package's folder (found without importing it), or None."""
    try:
        spec = importlib.util.find_spec(COMPANION_PACKAGE)
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]).resolve() if locations else None


def cache_root() -> Path:
    """gradflow's cache, the one rule for every user: ``$GRADFLOW_CACHE``, else ``~/.cache/gradflow``
    (zoo models under ``zoo/``, the built-in task data under ``tasks/``)."""
    return Path(os.environ.get("GRADFLOW_CACHE") or Path.home() / ".cache" / "gradflow")


def _cache_root() -> Path | None:
    try:
        return cache_root().resolve()
    except RuntimeError:  # no home directory to expand
        return None


def _base_root() -> Path:
    """The repository holding the current directory (nearest ancestor with ``.git``), else the current directory."""
    cwd = Path.cwd().resolve()
    for directory in (cwd, *cwd.parents):
        if (directory / ".git").exists():
            return directory
    return cwd


def _under(path: Path, root: Path) -> str | None:
    """``path`` relative to ``root`` with forward slashes ("." for ``root`` itself), or None if outside."""
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return None


def portable_path(path: str | os.PathLike, out_dir: str | os.PathLike) -> str:
    """How ``path`` is written into the provenance of an output written to ``out_dir``.

    Never a machine's absolute path; always forward slashes. The first rule that applies wins:

    1. ``path`` is already portable (starts with ``gradflow:``, ``gradflow-cache:`` or
       ``external:``), or it is relative and names nothing on disk (a hub model name, an embedded
       model's name, ``zoo:NAME``, ``<3 texts>``): returned unchanged, so user-given strings stay
       as given.
    2. Inside the installed gradflow package: ``gradflow:<relative>``
       (``gradflow:models/gradflow-mini-en``, ``gradflow:data/sotu_sample.txt``); inside the companion
       package of embedded models (gradflow-models): ``gradflow:models/<relative>``
       (``gradflow:models/gradflow-mini12-en``), wherever either is installed.
    3. Inside the gradflow cache (``$GRADFLOW_CACHE`` or ``~/.cache/gradflow``, where ``zoo:NAME``
       models live): ``gradflow-cache:<relative>`` (``gradflow-cache:zoo/antiberty``).
    4. Inside ``out_dir``: relative to it, written ``.`` or ``./<relative>``.
    5. Inside the repository that holds the current directory (the nearest ancestor with ``.git``;
       without one, the current directory): relative to that root, without a leading ``./``
       (``data/tasks``, ``figures/runs/mini-en_mlm``).
    6. Anything else (a model or corpus elsewhere on this machine): the path as the caller gave it,
       absolute or relative to the directory the command ran in, so the record still names it when
       the output directory moves.

    Whatever rule names it, a model or corpus on disk outside the package and the cache (rules 4-6)
    is also identified by its content: the run's ``meta.json`` records :func:`content_hash` as
    ``inputs_sha256`` (:func:`is_local_input`), since checkpoints and corpora in a repository are
    usually git-ignored and the revision does not pin them.

    So a recorded value that is ``.`` or starts with ``./`` is relative to the output directory; a
    value under rules 2-5 is portable; anything else is the caller's own path. Symbolic links are
    resolved before comparing.
    """
    text = os.fspath(path)
    if text.startswith(_PREFIXES):
        return text
    raw = Path(os.path.expanduser(text))
    if not raw.is_absolute() and not raw.exists():
        return text.replace(os.sep, "/")
    form = _portable_form(raw.resolve(), Path(out_dir).expanduser().resolve())
    return form if form is not None else text.replace(os.sep, "/")


def _portable_form(target: Path, out: Path) -> str | None:
    """Rules 2-5 of :func:`portable_path` for a resolved ``target``; None where none applies."""
    rel = _under(target, _package_root())
    if rel is not None:
        return PACKAGE_PREFIX + rel
    companion = _companion_root()
    rel = _under(target, companion) if companion is not None else None
    if rel is not None:
        return PACKAGE_PREFIX + "models" + ("" if rel == "." else "/" + rel)
    cache = _cache_root()
    rel = _under(target, cache) if cache is not None else None
    if rel is not None:
        return CACHE_PREFIX + rel
    rel = _under(target, out)
    if rel is not None:
        return "." if rel == "." else "./" + rel
    rel = _under(target, _base_root())
    return rel if rel is not None and rel != "." else None


def is_external(path: str | os.PathLike, out_dir: str | os.PathLike) -> bool:
    """Whether ``path`` is on disk outside the package, the cache, ``out_dir`` and the repository (rule 6 of
    :func:`portable_path`: recorded as given, identified by :func:`content_hash`)."""
    text = os.fspath(path)
    raw = Path(os.path.expanduser(text))
    return not text.startswith(_PREFIXES) and raw.exists() and \
        _portable_form(raw.resolve(), Path(out_dir).expanduser().resolve()) is None


def is_local_input(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on disk outside the package and the cache: a model or corpus the user keeps (in a
    repository too, where checkpoints and corpora are usually git-ignored), so ``meta.json`` pins it by
    :func:`content_hash`. Package and cache content is pinned by gradflow's version and the zoo's wheels."""
    text = os.fspath(path)
    raw = Path(os.path.expanduser(text))
    if text.startswith(_PREFIXES) or not raw.exists():
        return False
    target = raw.resolve()
    cache, companion = _cache_root(), _companion_root()
    return _under(target, _package_root()) is None and (cache is None or _under(target, cache) is None) \
        and (companion is None or _under(target, companion) is None)


def content_hash(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """``sha256:<hex>`` of a file's bytes, or of a directory's files (sorted relative names and each file's
    sha256; hidden files left out): the same content gives the same hash on any machine."""
    root = Path(path).expanduser()
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()
                                                 and not any(part.startswith(".") for part in p.relative_to(root).parts))
    total = hashlib.sha256()
    for file in files:
        digest = hashlib.sha256()
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(chunk), b""):
                digest.update(block)
        if root.is_file():
            return "sha256:" + digest.hexdigest()
        total.update(f"{file.relative_to(root).as_posix()}\0{digest.hexdigest()}\n".encode())
    return "sha256:" + total.hexdigest()


def display_name(spec: str | os.PathLike) -> str:
    """How a model is named in titles: a hub name, ``zoo:NAME`` or an embedded name as is; a path by its
    last component (``/data/models/albert-smiles/`` -> ``albert-smiles``), never a chain of ``../``."""
    text = os.fspath(spec).rstrip("/\\")
    looks_like_path = text.startswith((".", "/", "~")) or os.sep in text and Path(text).expanduser().exists()
    if text.startswith(_PREFIXES):
        text = text.split(":", 1)[1]
        looks_like_path = True
    return Path(text).name if looks_like_path and Path(text).name else text


def portable_command(command: str | Sequence[str], out_dir: str | os.PathLike) -> str:
    """A command line for provenance: every argument that is an absolute path (alone or as
    ``--option=/path``) written as :func:`portable_path` writes it.

    ``command``: a string (returned unchanged when it holds no absolute path) or an argument list
    such as ``sys.argv`` (joined with shell quoting).
    """
    if isinstance(command, str):
        try:
            args = shlex.split(command)
        except ValueError:  # unbalanced quotes: split on whitespace
            args = command.split()
    else:
        args = [os.fspath(a) for a in command]
    new = []
    for arg in args:
        option, eq, value = arg.partition("=") if arg.startswith("-") else ("", "", arg)
        if os.path.isabs(os.path.expanduser(value)) and (eq or not option):
            arg = option + eq + portable_path(value, out_dir)
        new.append(arg)
    if isinstance(command, str) and new == args:
        return command
    return shlex.join(new)


__all__ = ["CACHE_PREFIX", "COMPANION_PACKAGE", "EXTERNAL_PREFIX", "PACKAGE_PREFIX", "cache_root", "content_hash",
           "display_name", "is_external", "is_local_input", "portable_command", "portable_path", "source_revision"]
