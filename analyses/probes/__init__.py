"""Layer-wise probes of the embedded models: ``python -m analyses.probes.run`` (see run.py)."""
