"""The GPU checklist (issue 29): the cuda tests and every benchmark with ``--device cuda``, step by step.

Each step runs in its own process group with a timeout of at most 9 minutes (``--step-timeout``,
capped at 540 s; a step that runs past it is killed and reported as timed out), its output
captured. Results are kept in ``<out>/<device-slug>.json`` and written out as
``<out>/<device-slug>.md`` (default ``benchmarks/results/``): the device, torch and CUDA versions,
the commit, and per step what it checks, the command, its status, wall time and the tail of its
output. ``--only NAME ...`` runs some steps and keeps the earlier results of the others, so the
checklist can be run one step per session on a machine lent for short periods; ``--list`` prints
the steps. ``--dry-run`` runs the same steps on the CPU at tiny sizes and writes the same report
structure (as ``dry-run-cpu``): it checks the script and the benchmarks' arguments, not a GPU.

    python benchmarks/gpu_checklist.py                       # every step, on the first CUDA device
    python benchmarks/gpu_checklist.py --only cuda-tests bench_recorder
    python benchmarks/gpu_checklist.py --dry-run --out /tmp/checklist
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_STEP_S = 540
"""Nine minutes: the longest any step may run."""
TAIL_LINES = 150


@dataclass(frozen=True)
class Step:
    """One checklist step: a command run from the repository root, at full size on a GPU or tiny on the CPU."""

    name: str
    what: str
    args: tuple[str, ...]
    dry_args: tuple[str, ...]

    def command(self, dry_run: bool) -> list[str]:
        """The argv of this step (the current interpreter, from the repository root)."""
        return [sys.executable, *(self.dry_args if dry_run else self.args)]


def _bench(name: str, *args: str) -> tuple[str, ...]:
    return ("-m", f"benchmarks.{name}", *args)


STEPS: tuple[Step, ...] = (
    Step("cuda-tests", "tests/hooks/test_cuda.py: exactness suite, hooks, bfloat16/float16, Trainer callback, NCCL",
         ("-m", "pytest", "tests/hooks/test_cuda.py", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider"),
         ("-m", "pytest", "tests/hooks/test_cuda.py", "-m", "cuda", "-q", "-rs", "-p", "no:cacheprovider",
          "-k", "hooks_removed or autocast or nccl")),
    Step("bench_recorder", "site norms and the per-role split against a bare forward+backward",
         _bench("bench_recorder", "--device", "cuda"),
         _bench("bench_recorder", "--device", "cpu", "--rounds", "1", "--warmup", "0", "--layers", "1",
                "--batch", "2", "--length", "16")),
    Step("bench_recorder-bfloat16", "bench_recorder with the model's weights in bfloat16",
         _bench("bench_recorder", "--device", "cuda", "--dtype", "bfloat16"),
         _bench("bench_recorder", "--device", "cpu", "--dtype", "bfloat16", "--rounds", "1", "--warmup", "0",
                "--layers", "1", "--batch", "2", "--length", "16")),
    Step("bench_recorder-float16", "bench_recorder with the model's weights in float16 (the split in float16)",
         _bench("bench_recorder", "--device", "cuda", "--dtype", "float16"),
         _bench("bench_recorder", "--device", "cpu", "--dtype", "float16", "--rounds", "1", "--warmup", "0",
                "--layers", "1", "--batch", "2", "--length", "16")),
    Step("bench_record_throughput", "gradflow record's tokens/s on a bert-base-shaped model, float32 and bfloat16",
         _bench("bench_record_throughput", "--device", "cuda"),
         _bench("bench_record_throughput", "--device", "cpu", "--dtypes", "float32", "--limit", "24", "--short", "8",
                "--batch-size", "8", "--layers", "1")),
    Step("bench_sparse_training", "sparse MLM training (head, last block) against the dense step, tokens/s",
         _bench("bench_sparse_training", "--device", "cuda", "--rounds", "5", "--steps", "5"),
         _bench("bench_sparse_training", "--device", "cpu", "--shapes", "mini", "--rounds", "1", "--steps", "1")),
    Step("bench_callback", "GradFlowCallback overhead in transformers.Trainer MLM training",
         _bench("bench_callback", "--device", "cuda"),
         _bench("bench_callback", "--device", "cpu", "--steps", "4", "--every", "3", "--rounds", "1", "--layers", "1",
                "--hidden", "64", "--vocab", "2000", "--batch", "2", "--seq", "16")),
    Step("bench_memory", "peak memory of gradflow record on a corpus and on one 10x larger",
         _bench("bench_memory", "--device", "cuda"),
         _bench("bench_memory", "--device", "cpu", "--sequences", "4")),
    Step("bench_pretrain", "training throughput of the pretraining recipe (bfloat16)",
         _bench("bench_pretrain", "--arch", "base", "tiny", "--device", "cuda", "--dtype", "bfloat16",
                "--batch-size", "64"),
         _bench("bench_pretrain", "--arch", "tiny", "--device", "cpu", "--steps", "1", "--warmup-steps", "0",
                "--batch-size", "2")),
    Step("checkpoint_overhead", "checkpoint overhead of gradflow record on the committed sample",
         _bench("checkpoint_overhead", "--device", "cuda"),
         _bench("checkpoint_overhead", "--device", "cpu", "--limit", "8", "--rounds", "1", "--dense", "4")),
    Step("long_document", "peak memory and first batch on a 1 GiB one-line file and a 1 GiB .jsonl record",
         _bench("long_document", "--device", "cuda", "--mb", "1024", "--jsonl-mb", "1024"),
         _bench("long_document", "--device", "cpu", "--mb", "1", "--small-mb", "1", "--jsonl-mb", "1")),
    Step("bench_explore", "explorer response time against its bare forward+backward",
         _bench("bench_explore", "--device", "cuda"),
         _bench("bench_explore", "--device", "cpu", "--rounds", "1", "--tokens", "12")),
)


def slug(name: str) -> str:
    """A file name for a device name: lower case, runs of other characters as one hyphen."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def device_info(dry_run: bool) -> dict:
    """The machine the checklist runs on: device name, torch and CUDA versions, CPUs."""
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "cpus": os.cpu_count(), "dry_run": dry_run}
    if dry_run:
        return {**info, "device": "dry run on the CPU", "slug": "dry-run-cpu", "gpus": 0}
    if not torch.cuda.is_available():
        raise SystemExit("gpu_checklist: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU "
                         "machine, or pass --dry-run to check the steps on the CPU.")
    name = torch.cuda.get_device_name(0)
    return {**info, "device": name, "slug": slug(name), "gpus": torch.cuda.device_count()}


def commit() -> str:
    """The repository's commit (short hash, "+changes" when the work tree differs), or "unknown"."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def run_step(argv: list[str], timeout_s: float) -> dict:
    """Run one command in its own process group; status, exit code, wall seconds and its output's tail.

    Past ``timeout_s`` the whole group is killed (SIGKILL) and the status is ``timed out``."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace", start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
        status = "passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = f"timed out after {timeout_s:g} s"
    wall = time.perf_counter() - start
    lines = (output or "").splitlines()
    return {"status": status, "exit_code": proc.returncode, "wall_s": round(wall, 2),
            "output": "\n".join(lines[-TAIL_LINES:]), "output_lines": len(lines)}


def render(state: dict) -> str:
    """The markdown report of every step (those not run yet say so)."""
    info = state["machine"]
    mode = ("dry run on the CPU at tiny sizes (the report's structure, not GPU numbers)" if info["dry_run"]
            else f"{info['gpus']} CUDA device(s)")
    out = [f"# GPU checklist: {info['device']}", "",
           f"- device: {info['device']}; {mode}",
           f"- torch {info['torch']}, CUDA {info['cuda'] or 'none'}, {info['cpus']} CPUs",
           f"- written by `benchmarks/gpu_checklist.py`; step timeout {state['timeout_s']:g} s", "",
           "| step | status | wall s | ran at (UTC) | commit |", "|---|---|---:|---|---|"]
    for step in STEPS:
        r = state["steps"].get(step.name)
        out.append(f"| {step.name} | {r['status']} | {r['wall_s']:.1f} | {r['ran_at']} | {r['commit']} |" if r
                   else f"| {step.name} | not run | | | |")
    for step in STEPS:
        r = state["steps"].get(step.name)
        out += ["", f"## {step.name}", "", step.what, ""]
        if r is None:
            out.append("Not run yet.")
            continue
        lines = r["output_lines"]
        shown = lines if lines <= TAIL_LINES else f"the last {TAIL_LINES} of {lines}"
        out += [f"Command: `{r['command']}`", "",
                f"Status: {r['status']} in {r['wall_s']:.1f} s (timeout {r['timeout_s']:g} s), at {r['ran_at']} UTC, "
                f"commit {r['commit']}. Output ({shown} lines):", "", "```text", r["output"], "```"]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", choices=[s.name for s in STEPS], help="run these steps only (default: all)")
    p.add_argument("--dry-run", action="store_true", help="run every step on the CPU at tiny sizes")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"), help="folder of the report")
    p.add_argument("--step-timeout", type=float, default=MAX_STEP_S, help=f"seconds per step (at most {MAX_STEP_S})")
    p.add_argument("--list", action="store_true", help="print the steps and their commands, run nothing")
    args = p.parse_args(argv)
    if args.list:
        for step in STEPS:
            print(f"{step.name:20} {' '.join(step.command(args.dry_run)[1:])}")
        return 0
    info = device_info(args.dry_run)
    timeout = min(args.step_timeout, MAX_STEP_S)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / f"{info['slug']}.json"
    state = json.loads(store.read_text()) if store.exists() else {"steps": {}}
    state.update(machine=info, timeout_s=timeout)
    chosen = [s for s in STEPS if not args.only or s.name in args.only]
    failed = 0
    for step in chosen:
        argv_step = step.command(args.dry_run)
        print(f"[{step.name}] {' '.join(argv_step[1:])}", flush=True)
        result = run_step(argv_step, timeout)
        result.update(command="python " + " ".join(argv_step[1:]), timeout_s=timeout, commit=commit(),
                      ran_at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"))
        state["steps"][step.name] = result
        failed += result["status"] != "passed"
        print(f"[{step.name}] {result['status']} in {result['wall_s']:.1f} s", flush=True)
        store.write_text(json.dumps(state, indent=1) + "\n")  # after every step: a killed checklist keeps its steps
        (out / f"{info['slug']}.md").write_text(render(state), encoding="utf-8")
    print(f"report: {out / (info['slug'] + '.md')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
