"""MkDocs hook: publish the repository's committed figures in the site.

Every ``figures/**/*.png`` and ``figures/**/*.svg`` of the repository becomes the site file
``figures/<same path>``, so a page at ``docs/x.md`` shows ``figures/report/...png`` and a page at
``docs/guides/x.md`` shows ``../figures/report/...png``, without copying the figures into ``docs/``.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

SUFFIXES = (".png", ".svg")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the repository's figures as generated files under ``figures/`` (a page's own file wins)."""
    root = Path(config.config_file_path).resolve().parent
    figures = root / "figures"
    if not figures.is_dir():
        raise FileNotFoundError(f"docs/hooks.py publishes {figures}, which does not exist")
    for path in sorted(figures.rglob("*")):
        if path.suffix.lower() not in SUFFIXES or not path.is_file():
            continue
        src_uri = "figures/" + path.relative_to(figures).as_posix()
        if files.get_file_from_path(src_uri) is None:
            files.append(File.generated(config, src_uri, abs_src_path=str(path)))
    return files
