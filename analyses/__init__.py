"""Scripts that regenerate every published artefact (run from the repository root)."""
