"""Hooks: the site layer, the recorder and attribution hooks (one batch at a time; no files, no CLI)."""
