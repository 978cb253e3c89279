"""Shared helpers of the fetch scripts: pinned npm tarballs and safe tar extraction."""

from __future__ import annotations

import hashlib
import subprocess
import tarfile
from pathlib import Path


def npm_pack(spec: str, expected_sha1: str, workdir: Path) -> Path:
    """Download one npm tarball with ``npm pack`` and check its SHA-1 (the registry's shasum)."""
    out = subprocess.run(["npm", "pack", "--silent", spec], cwd=workdir, check=True, capture_output=True, text=True)
    tarball = workdir / out.stdout.strip().splitlines()[-1]
    sha1 = hashlib.sha1(tarball.read_bytes()).hexdigest()
    if sha1 != expected_sha1:
        raise SystemExit(f"{spec}: SHA-1 {sha1} does not match the pinned {expected_sha1}")
    return tarball


def safe_extract(tar: tarfile.TarFile, dest: Path) -> None:
    """Extract a tarball refusing absolute paths and ``..`` (the "data" filter where Python has it)."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
        return
    for member in tar.getmembers():
        if member.name.startswith("/") or ".." in member.name.split("/") or not (member.isfile() or member.isdir()):
            raise SystemExit(f"refusing to extract {member.name!r}")
    tar.extractall(dest)
