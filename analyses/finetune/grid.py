"""Moved to ``analyses/last_block_finetuning/grid.py``; this name stays only for the ``grid_module``
fixture of ``tests/test_portable_paths.py`` (it imports ``grid`` from this folder). Delete this file
once that fixture imports ``analyses.last_block_finetuning.grid``."""

from analyses.last_block_finetuning.grid import *  # noqa: F403
