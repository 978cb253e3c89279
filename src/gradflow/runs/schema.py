"""Moved: the run-directory contract is :mod:`gradflow.schema`, a leaf every layer may import.

This name keeps working for code written against gradflow 0.1's ``gradflow.runs.schema``.
"""

from gradflow.schema import *  # noqa: F401,F403
