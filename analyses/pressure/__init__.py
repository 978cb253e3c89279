"""Counterfactual context pressure of gradflow-mini-en and its all-token twin: ``python -m analyses.pressure.run``."""
