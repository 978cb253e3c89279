"""``gradflow demo``: the README's main job, offline, on the embedded models and the committed sample.

Records ``gradflow-mini-en`` under the MLM loss it was trained with and
``gradflow-mini-en-alltoken`` under its all-positions loss, then writes each run's report and
their comparison. Under one and the same MLM loss every model shows the exact last-block zero (it
is structural); what differs between the two models is what training did to the last block.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from gradflow.errors import OutputDirError
from gradflow.figures.report import write_comparison, write_report
from gradflow.formatting import format_estimate
from gradflow.runs.record import RecordConfig, RunSummary, record_corpus

DEMO_RUNS: tuple[tuple[str, str, str], ...] = (
    ("mini-en_mlm", "gradflow-mini-en", "mlm"),
    ("mini-en-alltoken_all-positions", "gradflow-mini-en-alltoken", "all-positions"),
)
DEMO_LABELS = ("mini-en (MLM loss)", "mini-en-alltoken (all-positions loss)")


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
    _reports(out, [out / name for name, _, _ in DEMO_RUNS])
    print(demo_headline(out), flush=True)  # the answer, also with quiet (which silences progress only)
    return summaries


def _reports(out: Path, run_dirs: list[Path]) -> None:
    for run_dir in run_dirs:
        write_report(run_dir, out / "report" / run_dir.name)
    write_comparison(run_dirs, list(DEMO_LABELS), out / "report" / "compare")


def demo_headline(out: str | Path) -> str:
    """The demo's answer, from its report tables: per run, the context / loss gradient-norm ratio (95% CI)
    entering and leaving the last block, the last block's sublayers with exactly zero context share, and
    where the summaries and figures are."""
    out = Path(out)
    lines = ["", "gradflow demo: where the training signal goes (context / loss-position gradient-norm ratio, 95% CI)"]
    for (run_name, _, _), label in zip(DEMO_RUNS, DEMO_LABELS):
        tables = out / "report" / run_name / "tables"
        ratios = pd.read_csv(tables / "role_ratios.csv")
        context = ratios[ratios["role"] == "context"].set_index("layer")
        last = int(context.index.max())
        enter, leave = (format_estimate(*context.loc[layer, ["ratio", "ci_low", "ci_high"]])
                        for layer in (last - 1, last))
        block = pd.read_csv(tables / "last_block.csv")
        zero = block.loc[block["exact_zero"] & (block["param"] == "weight"), "sublayer"].tolist()
        lines += [f"  {label}: {enter} entering the last block, {leave} leaving it;",
                  f"    last block, exactly zero context share: {', '.join(zero) if zero else 'none'} "
                  f"({len(zero)} of {block['sublayer'].nunique()} sublayers)"]
    lines += [f"  summaries: {out / 'report'}/*/summary.md; figures (PDF + PNG) beside them; "
              f"the two models side by side: {out / 'report' / 'compare'}"]
    return "\n".join(lines)
