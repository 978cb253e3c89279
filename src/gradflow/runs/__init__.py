"""Runs: corpus jobs and the files they write.

What it offers (import from the modules; nothing is re-exported here, so one job does not load the others):

- :mod:`.record`: :func:`~gradflow.runs.record.record_corpus` with :class:`RecordConfig` (``gradflow record``);
- :mod:`.job`: the one corpus-job skeleton every job uses; :mod:`.meta`: the one meta.json builder;
- :mod:`.demo`, :mod:`.diagnose`, :mod:`.channels`, :mod:`.check` (``gradflow check``), :mod:`.evaluation`,
  :mod:`.probe`, :mod:`.atlas` and :mod:`.atlas_merge`: the other jobs;
- :mod:`.aggregate`, :mod:`.representations`, :mod:`.logit_lens`: streaming accumulators; :mod:`.files`: writers.

The run-directory contract is :mod:`gradflow.schema` (``gradflow.runs.schema`` still names it).
"""
