"""One-off: rewrite the absolute machine paths in committed outputs as portable ones.

Outputs written before ``gradflow.provenance.portable_path`` existed (``result.json``, ``plan.json``,
``meta.json``, ``continued.json``, ``summary.md`` under ``figures/``) recorded absolute paths of
the machine that made them (``<checkout>/data/tasks``, ``~/.cache/gradflow/zoo/antiberty`` spelled
out in full).
This script maps each such path onto this checkout and writes what ``portable_path`` writes today,
with the file's own directory as the output directory:

- ``<anything>/src/gradflow/<rest>`` or ``<anything>/site-packages/gradflow/<rest>``: this
  checkout's package, so ``gradflow:<rest>``;
- ``<anything>/.cache/gradflow/<rest>``: the gradflow cache, so ``gradflow-cache:<rest>``;
- ``<root>/<rest>`` where ``<root>`` is the checkout that wrote the file (inferred from the paths
  themselves: whatever precedes ``/src/gradflow/`` or ``/figures/``; or given with
  ``--origin-root``): this checkout's ``<rest>`` (``data/tasks``, ``figures/runs/mini-en_mlm``).

Only the path strings change (JSON is edited in place, its layout kept; Markdown and CSV text
likewise); numbers and tables are left alone. Idempotent: a second run changes nothing. Paths it
cannot map are listed and the exit status is 1. Usage (from the repository root)::

    python -m analyses.maintenance.rewrite_portable_paths [--dry-run] [--origin-root OLD_CHECKOUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from gradflow.provenance import _cache_root, portable_path

REPO = Path(__file__).resolve().parents[2]

SCOPE = ("figures", "docs", "README.md")
SUFFIXES = {".json", ".md", ".csv", ".tsv", ".txt"}
JSON_STRING = re.compile(r'"((?:[^"\\]|\\.)*)"')
# an absolute POSIX path in prose or a table: "/" not preceded by a word character, "." or another
# "/" (so neither relative paths nor URLs), then at least two components, up to whitespace or
# Markdown/CSV punctuation
TEXT_PATH = re.compile(r"(?<![\w.~:/\\-])/[^\s/`|'\"()<>,;]+(?:/[^\s/`|'\"()<>,;]+)+/?")
PACKAGE_MARKERS = ("/src/gradflow/", "/site-packages/gradflow/")
CACHE_MARKER = "/.cache/gradflow/"
ROOT_MARKERS = ("/src/gradflow/", "/figures/")


def tracked_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z", "--", *SCOPE], cwd=REPO, check=True, capture_output=True,
                           text=True).stdout.split("\0")
    return [REPO / n for n in names if n and Path(n).suffix in SUFFIXES]


def origin_roots(values: list[str], given: list[str]) -> list[str]:
    """Checkout roots the absolute ``values`` were written under (longest first)."""
    roots = {str(REPO), *(os.path.normpath(g) for g in given)}
    for value in values:
        for marker in ROOT_MARKERS:
            if marker in value:
                roots.add(value[:value.index(marker)])
    return sorted((r for r in roots if r not in ("", "/")), key=len, reverse=True)


def on_this_machine(value: str, roots: list[str]) -> Path | None:
    """The path on this checkout (or in this machine's gradflow cache) that ``value`` stands for."""
    for marker in PACKAGE_MARKERS:
        if marker in value:
            return REPO / "src" / "gradflow" / value.split(marker, 1)[1]
    if CACHE_MARKER in value:
        cache = _cache_root()
        if cache is not None:
            return cache / value.split(CACHE_MARKER, 1)[1]
    for root in roots:
        if value == root or value.startswith(root + "/"):
            return REPO / value[len(root):].lstrip("/")
    return None


def absolute_strings(path: Path, text: str) -> list[str]:
    if path.suffix == ".json":
        found = [json.loads(f'"{m.group(1)}"') for m in JSON_STRING.finditer(text)]
        return [s for s in found if s.startswith("/")]
    return TEXT_PATH.findall(text)


def rewrite(path: Path, text: str, roots: list[str], unknown: set[str]) -> str:
    out_dir = path.parent

    def portable(value: str) -> str | None:
        local = on_this_machine(value, roots)
        if local is None:
            unknown.add(f"{path.relative_to(REPO)}: {value}")
            return None
        return portable_path(local, out_dir)

    if path.suffix == ".json":
        def json_sub(match: re.Match) -> str:
            value = json.loads(f'"{match.group(1)}"')
            if not value.startswith("/"):
                return match.group(0)
            new = portable(value)
            return match.group(0) if new is None else json.dumps(new)
        return JSON_STRING.sub(json_sub, text)

    def text_sub(match: re.Match) -> str:
        value = match.group(0)
        trail = "/" if value.endswith("/") and len(value) > 1 else ""
        new = portable(value.rstrip("/") if trail else value)
        return match.group(0) if new is None else new + trail
    return TEXT_PATH.sub(text_sub, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--origin-root", action="append", default=[],
                        help="a checkout the outputs were written in (inferred when omitted)")
    parser.add_argument("--dry-run", action="store_true", help="list the files that would change")
    args = parser.parse_args()
    os.chdir(REPO)  # portable_path writes plain relative paths relative to this repository
    files = {p: p.read_text(encoding="utf-8") for p in tracked_files()}
    roots = origin_roots([s for p, t in files.items() for s in absolute_strings(p, t)], args.origin_root)
    changed, unknown = [], set()
    for path, text in files.items():
        new = rewrite(path, text, roots, unknown)
        if new != text:
            changed.append(path)
            if not args.dry_run:
                path.write_text(new, encoding="utf-8")
    verb = "would rewrite" if args.dry_run else "rewrote"
    print(f"{verb} {len(changed)} of {len(files)} files (origin roots: {', '.join(roots)})")
    for path in changed:
        print(f"  {path.relative_to(REPO)}")
    if unknown:
        print(f"{len(unknown)} absolute paths could not be mapped (pass --origin-root):", file=sys.stderr)
        for line in sorted(unknown):
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
