"""Does removing (dropping, re-initialising, repairing) the last block help fine-tuning?

The three small experiments (``drop_or_reinit``, ``continued_mlm``, ``blocks_kept``; tables: ``report_tables``),
the powered experiment (``powered_experiment``, ``arm_probes``, ``sentiment``, ``powered_report``,
``powered_figures``; plan: ``figures/finetune/last-block-finetuning/plan.md``) and their shared grid runner (``grid``).
"""
