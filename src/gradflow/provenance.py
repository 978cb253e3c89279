"""Provenance: portable paths and the source revision (meta.json, result.json, plan.json, summary.md, ...).

Outputs are committed and compared across machines, so a path recorded in them must not be a
machine's absolute path. :func:`portable_path` is the one rule every writer uses;
:func:`portable_command` applies it to the paths in a recorded command line.
:func:`source_revision` names the code that made a number: the git commit of the checkout gradflow
runs from (``+dirty`` when it has uncommitted changes), or ``"unknown"`` for an installed wheel.
"""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
from collections.abc import Sequence
from pathlib import Path

PACKAGE_PREFIX = "gradflow:"
CACHE_PREFIX = "gradflow-cache:"
EXTERNAL_PREFIX = "external:"
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


def _cache_root() -> Path | None:
    # the same place as gradflow.zoo.cache_root(), not imported so this module depends on nothing
    try:
        return Path(os.environ.get("GRADFLOW_CACHE") or Path.home() / ".cache" / "gradflow").resolve()
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
       (``gradflow:models/gradflow-mini-en``, ``gradflow:data/sotu_sample.txt``).
    3. Inside the gradflow cache (``$GRADFLOW_CACHE`` or ``~/.cache/gradflow``, where ``zoo:NAME``
       models live): ``gradflow-cache:<relative>`` (``gradflow-cache:zoo/antiberty``).
    4. Inside ``out_dir``: relative to it, written ``.`` or ``./<relative>``.
    5. Inside the repository that holds the current directory (the nearest ancestor with ``.git``;
       without one, the current directory): relative to that root, without a leading ``./``
       (``data/tasks``, ``figures/runs/mini-en_mlm``).
    6. Anything else: ``os.path.relpath(path, out_dir)`` (``../../elsewhere/corpus.txt``); where no
       relative path exists (another drive on Windows), ``external:<file name>``.

    So a recorded value that is ``.`` or starts with ``./`` or ``../`` is relative to the output
    directory; any other plain relative value is relative to the repository root. Relative inputs
    are taken relative to the current directory; symbolic links are resolved before comparing.
    """
    text = os.fspath(path)
    if text.startswith(_PREFIXES):
        return text
    raw = Path(os.path.expanduser(text))
    if not raw.is_absolute() and not raw.exists():
        return text.replace(os.sep, "/")
    target = raw.resolve()
    rel = _under(target, _package_root())
    if rel is not None:
        return PACKAGE_PREFIX + rel
    cache = _cache_root()
    rel = _under(target, cache) if cache is not None else None
    if rel is not None:
        return CACHE_PREFIX + rel
    out = Path(out_dir).expanduser().resolve()
    rel = _under(target, out)
    if rel is not None:
        return "." if rel == "." else "./" + rel
    base = _base_root()
    rel = _under(target, base)
    if rel is not None and rel != ".":
        return rel
    try:
        return Path(os.path.relpath(target, out)).as_posix()
    except ValueError:  # no relative path between two drives
        return EXTERNAL_PREFIX + target.name


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


__all__ = ["CACHE_PREFIX", "EXTERNAL_PREFIX", "PACKAGE_PREFIX", "portable_command", "portable_path"]
