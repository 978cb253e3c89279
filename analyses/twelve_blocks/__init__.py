"""Twelve blocks (issue 31; plan: ``figures/twelve-blocks/plan.md``): the 12-block pair's analyses.

The deficit through pretraining ("Measures through pretraining" in the plan). The pretraining runs keep
weight snapshots at 8 log-spaced steps (``python -m analyses.pretraining.pretrain_base ... --snapshots 8``;
the files stay in ``build/``, their SHA-256 are in each run's ``snapshots/snapshots.csv`` and in the
committed ``meta.json``). Two steps:

    # 1. measure every snapshot not yet measured (needs build/gradflow-mini12-en{,-alltoken}; resumable)
    make -C analyses twelve-blocks-measure
    python -m analyses.twelve_blocks.dynamics --run gradflow-mini12-en=build/gradflow-mini12-en \\
        --run gradflow-mini12-en-alltoken=build/gradflow-mini12-en-alltoken --out figures/twelve-blocks/dynamics
    # 2. the figure and its table from the committed measurements (no model needed)
    make -C analyses twelve-blocks-dynamics
    python -m analyses.twelve_blocks.dynamics_figure --out figures/twelve-blocks/dynamics

The findings at twelve blocks reuse the 6-block runners with ``--pair mini12-en`` (``make -C analyses
twelve-blocks-ship twelve-blocks-probes twelve-blocks-pressure twelve-blocks-convergence``); ``finetune_report``
tests the plan's 8 fine-tuning contrasts and applies its verdict rule.

Modules: ``snapshot`` (a run's snapshots listed and checked by SHA-256, loaded as gradflow models),
``dynamics`` (the measures of one snapshot: context/loss ratio by depth, the last block's counterfactual
pressure, the probe last-layer drops; ``dynamics.csv`` and ``meta.json``), ``dynamics_figure`` (the
table -> ``dynamics.{pdf,png,md}``).
"""
