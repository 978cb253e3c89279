"""A resumable pretraining recipe for gradflow's English MLM pairs (issue 18, Part A).

Modules, one job each:
- ``config``: the run as a dataclass (architecture presets, loss, schedule, device) and which
  fields must match on resume.
- ``data``: tokenizer, window cache, and a token stream whose batch at step ``s`` is a pure
  function of ``(seed, s)``, so the data position is just the step.
- ``model``: the RoFormer MLM and its loss at the selected positions.
- ``checkpoint``: atomic save / ``weights_only`` load of everything a resume needs.
- ``snapshots``: weight snapshots at log-spaced steps (for measures through pretraining).
- ``train``: the loop (checkpoint interval, signals, wall-time limit, evaluation, CSV curve).

The command line is ``python -m analyses.pretraining.pretrain_base``; see ``docs/pretraining-recipe.md``.
"""
