"""Write docs/mlm-coverage.md from gradflow's adapter registry and refusal table.

Run after adding an adapter or a refusal: ``.venv/bin/python -m analyses.maintenance.make_mlm_coverage``
(tests/adapters/test_mlm_coverage.py fails while the file is out of date).
"""

from pathlib import Path

from gradflow.adapters.coverage import coverage_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "mlm-coverage.md"

if __name__ == "__main__":
    DOC.write_text(coverage_markdown(), encoding="utf-8")
    print(f"wrote {DOC}")
