"""``gradflow demo``: the README's main job, offline, on the embedded models and the committed sample.

Records ``gradflow-mini-en`` under the MLM loss it was trained with and
``gradflow-mini-en-alltoken`` under its all-positions loss, then writes each run's report and
their comparison. Under one and the same MLM loss every model shows the exact last-block zero (it
is structural); what differs between the two models is what training did to the last block.
"""

from __future__ import annotations

from pathlib import Path

from gradflow.errors import OutputDirError
from gradflow.figures.report import write_comparison, write_report
from gradflow.runs.record import RecordConfig, RunSummary, record_corpus

DEMO_RUNS: tuple[tuple[str, str, str], ...] = (
    ("mini-en_mlm", "gradflow-mini-en", "mlm"),
    ("mini-en-alltoken_all-positions", "gradflow-mini-en-alltoken", "all-positions"),
)


def run_demo(out: str | Path, limit: int | None = None, overwrite: bool = False, quiet: bool = False,
             command: str = "") -> list[RunSummary]:
    """Record the demo runs into ``out/<run>`` and write reports into ``out/report``."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise OutputDirError(f"output directory {out} exists and is not empty; pass --overwrite or choose another "
                             "--out.")
    summaries = []
    for run_name, model, loss in DEMO_RUNS:
        if not quiet:
            print(f"[demo] recording {model} under the {loss} loss -> {out / run_name}", flush=True)
        config = RecordConfig(out=str(out / run_name), model=model, loss=loss, limit=limit, overwrite=True,
                              quiet=quiet, command=command)
        summaries.append(record_corpus(config))
    _reports(out, [out / name for name, _, _ in DEMO_RUNS], quiet)
    return summaries


def _reports(out: Path, run_dirs: list[Path], quiet: bool) -> None:
    for run_dir in run_dirs:
        write_report(run_dir, out / "report" / run_dir.name)
    write_comparison(run_dirs, ["mini-en (MLM loss)", "mini-en-alltoken (all-positions loss)"],
                     out / "report" / "compare")
    if not quiet:
        print(f"[demo] reports in {out / 'report'}", flush=True)
