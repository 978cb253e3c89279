"""What a paper needs to pin gradflow: a licence file, citation metadata and one version, all agreeing."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

import gradflow

ROOT = Path(__file__).resolve().parents[2]


def test_citation_metadata_names_this_version_and_licence():
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert citation["cff-version"] == "1.2.0" and citation["type"] == "software"
    assert citation["version"] == gradflow.__version__ == citation["preferred-citation"]["version"]
    assert citation["license"] == project["license"] == "Apache-2.0"
    assert citation["authors"] and project["authors"]


def test_the_licence_file_is_the_apache_2_text_pyproject_names():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["license-files"] == ["LICENSE"]


def test_the_version_is_written_once():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert "version" not in project["project"] and project["project"]["dynamic"] == ["version"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "gradflow.version.__version__"}


def test_the_changelog_has_a_section_for_this_version():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert f"\n## {gradflow.__version__}\n" in text and "\n## Unreleased\n" in text


def _bibtex_fields(text: str) -> dict[str, str]:
    """The fields of the one ```bibtex block of docs/cite.md, ``name = {value},`` per line."""
    block = re.search(r"```bibtex\n(.*?)\n```", text, re.S)
    assert block, "docs/cite.md has no ```bibtex block"
    return {m["name"]: m["value"] for m in re.finditer(r"^\s*(?P<name>\w+)\s*=\s*\{(?P<value>.*)\},?\s*$",
                                                       block[1], re.M)}


def test_the_bibtex_has_year_and_url_and_agrees_with_citation_cff():
    fields = _bibtex_fields((ROOT / "docs" / "cite.md").read_text(encoding="utf-8"))
    preferred = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))["preferred-citation"]
    for name in ("author", "title", "version", "year", "url", "license", "note"):
        assert fields.get(name, "").strip(), f"the BibTeX in docs/cite.md has no {name}"
    assert fields["title"] == preferred["title"]
    assert fields["version"] == preferred["version"] == gradflow.__version__
    assert fields["license"] == preferred["license"]
    assert re.fullmatch(r"20\d\d", fields["year"]) and int(fields["year"]) == preferred["year"]
    # the repository's public address is not written in CITATION.cff yet: the BibTeX says URL and the page
    # says where to read it; once CITATION.cff names it, the BibTeX must carry the same address
    address = preferred.get("url") or preferred.get("repository-code")
    assert fields["url"] == (address or "URL")


def test_the_bibtex_reader_sees_a_missing_year_or_url():
    """The check above would fail on the page as it was before (no year, no url)."""
    before = "```bibtex\n@software{gradflow,\n  title   = {t},\n  version = {0.1.0},\n}\n```\n"
    fields = _bibtex_fields(before)
    assert fields == {"title": "t", "version": "0.1.0"}
    assert "year" not in fields and "url" not in fields
