"""Analysis: pure functions over run tables (profiles, ratios, shares, CIs, tests, comparisons)."""

from gradflow.analysis.run_data import *  # noqa: F401,F403  (temporary during the split)
