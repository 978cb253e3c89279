"""Issue 52: four pretraining objectives at six blocks (``figures/objectives/plan.md``), the fine-tuning parts.

- ``design``: Parts 3 and 4 as data: the models, arms, tasks, configs and the runs of each part;
- ``budget``: Part 4's step-budget rule (S) and seeds rule (n) applied to the pilot's curves;
- ``finetune``: the runner (``python -m analyses.objectives.finetune --part lr1e-4|pilot|seed-regime|decision``);
- ``contrasts``: Family A, the secondary model contrasts and Family B from per-run summaries (pure);
- ``report``: reads the committed per-run files and writes the tables (``python -m analyses.objectives.report``);
- ``figures``: each arm's mean validation curve with its 95% band, Parts 3 and 4 (called by ``report``);
- ``measures``: Part 1's measures 1-2 (record, report, compare, check) and the summary with measure 3's pressure
  table (``python -m analyses.objectives.measures``; measure 3: ``python -m analyses.pressure.run --pair objectives``);
- ``pretraining_seeds``: issue 60 item 4, pretraining seeds 1 and 2 of each member (train, measure, finetune, the
  committed commands); ``seeds_table``: their table, spread and the survival verdicts of the objective findings.
"""
