"""docs/guides/record.md names every embedded model that ships in src/gradflow/models/ or in the companion's
packages/gradflow-models/src/gradflow_models/ (issue 49: it listed only the 6-block pair)."""

from __future__ import annotations

import re
from pathlib import Path

from gradflow.models import EMBEDDED_MODELS, embedded_model_dir, installed_embedded_models

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = (ROOT / "src" / "gradflow" / "models", ROOT / "packages" / "gradflow-models" / "src" / "gradflow_models")


def _shipped() -> set[str]:
    return {p.name for folder in FOLDERS for p in folder.iterdir() if (p / "config.json").is_file()}


def test_every_model_folder_is_an_embedded_model():
    assert _shipped() == set(EMBEDDED_MODELS)
    installed = installed_embedded_models()  # all of them where ./setup.sh installed the companion (tests/models)
    assert all(embedded_model_dir(name) in (folder / name for folder in FOLDERS) for name in installed)


def test_the_record_guide_names_every_embedded_model():
    text = (ROOT / "docs" / "guides" / "record.md").read_text(encoding="utf-8")
    section = text.split("## Which model", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(gradflow-[a-z0-9-]+)`", section))
    missing = _shipped() - named
    assert not missing, f"docs/guides/record.md (Which model) does not name {sorted(missing)}"


def test_the_docs_home_and_readme_link_every_guide():
    """Every page of docs/guides/ is linked from docs/index.md and README.md (issue 49: the sparse-training guide
    was missing from the docs home)."""
    guides = sorted(p.name for p in (ROOT / "docs" / "guides").glob("*.md"))
    home, readme = (ROOT / "docs" / "index.md").read_text(), (ROOT / "README.md").read_text()
    assert guides and [g for g in guides if f"guides/{g}" not in home] == []
    assert [g for g in guides if f"docs/guides/{g}" not in readme] == []
