"""benchmarks/gpu_checklist.py: every benchmark on cuda in steps of at most 9 minutes; its dry run writes the report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from benchmarks import gpu_checklist as checklist

ROOT = Path(__file__).resolve().parents[2]


def test_every_benchmark_is_a_step_on_cuda():
    benchmarks = {"bench_recorder", "bench_record_throughput", "bench_callback", "bench_memory", "bench_pretrain", "checkpoint_overhead",
                  "long_document", "bench_explore"}
    assert all((ROOT / "benchmarks" / f"{name}.py").exists() for name in benchmarks)
    steps = {s.name: s for s in checklist.STEPS}
    assert benchmarks <= set(steps) and "cuda-tests" in steps
    for step in checklist.STEPS:
        full, dry = step.command(False), step.command(True)
        assert full[0] == dry[0] == sys.executable
        if step.name == "cuda-tests":
            assert "tests/hooks/test_cuda.py" in full and full[full.index("-m", 2) + 1] == "cuda"
        else:
            assert full[full.index("--device") + 1] == "cuda" and dry[dry.index("--device") + 1] == "cpu", step.name
    assert checklist.MAX_STEP_S <= 9 * 60


@pytest.mark.slow
def test_a_step_past_its_timeout_is_killed_and_reported():
    code = "import subprocess, sys, time; print('started', flush=True); time.sleep(120)"
    result = checklist.run_step([sys.executable, "-c", code], timeout_s=1.5)
    assert result["status"] == "timed out after 1.5 s" and result["exit_code"] != 0
    assert result["wall_s"] < 60 and "started" in result["output"]
    failed = checklist.run_step([sys.executable, "-c", "import sys; print('\\n'.join(['x'] * 400)); sys.exit(3)"], 60)
    assert failed["status"] == "failed (exit 3)" and failed["output_lines"] > checklist.TAIL_LINES
    assert len(failed["output"].splitlines()) == checklist.TAIL_LINES


def test_the_slug_names_a_file():
    assert checklist.slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert checklist.slug("NVIDIA A100-SXM4-40GB") == "nvidia-a100-sxm4-40gb"


def test_the_timeout_is_capped_at_nine_minutes(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(checklist, "run_step", lambda argv, timeout_s: seen.append(timeout_s) or
                        {"status": "passed", "exit_code": 0, "wall_s": 0.0, "output": "", "output_lines": 0})
    assert checklist.main(["--dry-run", "--out", str(tmp_path), "--only", "bench_memory",
                           "--step-timeout", "3600"]) == 0
    assert seen == [checklist.MAX_STEP_S]


@pytest.mark.slow
def test_dry_run_writes_the_report_and_keeps_earlier_steps(tmp_path, monkeypatch):
    """The real dry run of the cuda tests (they skip on the CPU, with their reason), then one more step."""
    assert checklist.main(["--dry-run", "--out", str(tmp_path), "--only", "cuda-tests"]) == 0
    report = (tmp_path / "dry-run-cpu.md").read_text()
    state = json.loads((tmp_path / "dry-run-cpu.json").read_text())
    assert report.startswith("# GPU checklist: dry run on the CPU\n")
    assert "| cuda-tests | passed |" in report and "| bench_explore | not run | | | |" in report
    assert [line for line in report.splitlines() if line.startswith("## ")] == [f"## {s.name}" for s in
                                                                              checklist.STEPS]
    ran = state["steps"]["cuda-tests"]
    assert ran["status"] == "passed" and ran["timeout_s"] == checklist.MAX_STEP_S
    import torch

    if not torch.cuda.is_available():  # dry run: every selected cuda test skipped with its reason
        assert "no CUDA device: torch.cuda.is_available() is False" in ran["output"]
        assert " passed" not in ran["output"].splitlines()[-1]
    # a later step (here a command that fails) is added; the earlier result stays
    fake = checklist.Step("bench_explore", "a stand-in", (), ("-c", "import sys; print('boom'); sys.exit(2)"))
    monkeypatch.setattr(checklist, "STEPS", tuple(fake if s.name == "bench_explore" else s for s in checklist.STEPS))
    assert checklist.main(["--dry-run", "--out", str(tmp_path), "--only", "bench_explore"]) == 1
    report = (tmp_path / "dry-run-cpu.md").read_text()
    assert "| cuda-tests | passed |" in report and "| bench_explore | failed (exit 2) |" in report
    assert "```text\nboom\n```" in report


def test_without_cuda_the_full_run_is_refused(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device here .* pass --dry-run"):
        checklist.main(["--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_record_throughput_dry_run_counts_the_long_runs_extra_sequences():
    step = next(s for s in checklist.STEPS if s.name == "bench_record_throughput")
    result = checklist.run_step(step.command(True), timeout_s=300)
    assert result["status"] == "passed", result["output"]
    rows = [json.loads(line) for line in result["output"].splitlines() if line.startswith("{")]
    header = [line for line in result["output"].splitlines() if line.startswith("float32")]
    assert [line.split()[1] for line in header] == ["norms", "full"]
    for row in rows:  # a row is printed only when the rate is measurable
        assert row["dtype"] == "float32" and row["sequences"] == 24 - 8 and row["tokens"] > row["sequences"]
        assert row["tokens_per_s"] == pytest.approx(row["tokens"] / row["wall_s"], rel=1e-2)
