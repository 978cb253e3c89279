"""Checks and one-off rewrites of the repository itself (not results): demo identity, portable
paths, the MLM coverage page."""
