"""Corpus jobs and the run directory: streaming accumulators, schema, files, meta.json."""
