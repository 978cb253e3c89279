"""What a paper needs to pin gradflow: a licence file, citation metadata and one version, all agreeing."""

from __future__ import annotations

import tomllib
from pathlib import Path

import yaml

import gradflow

ROOT = Path(__file__).resolve().parents[1]


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
