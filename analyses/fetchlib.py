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


def file_digest(path: Path, alg: str) -> str:
    """Hex digest of a file (``alg`` is a hashlib name such as "sha1" or "sha256"), read in chunks."""
    h = hashlib.new(alg)
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def deb_download(package: str, version: str, expected_sha256: str, workdir: Path) -> Path:
    """Download one Debian package at an exact version with ``apt-get download`` and check its SHA-256."""
    subprocess.run(["apt-get", "download", "-q", f"{package}={version}"], cwd=workdir, check=True,
                   capture_output=True, text=True)
    matches = sorted(workdir.glob(f"{package}_*.deb"))
    if len(matches) != 1:
        raise SystemExit(f"{package}={version}: expected one .deb in {workdir}, found {[m.name for m in matches]}")
    sha256 = file_digest(matches[0], "sha256")
    if sha256 != expected_sha256:
        raise SystemExit(f"{package}={version}: SHA-256 {sha256} does not match the pinned {expected_sha256}")
    return matches[0]
