"""Peak memory of `gradflow record` on a corpus and on one 10x larger (memory must not grow).

Each recording runs in a fresh process; the process reports its own peak RSS (VmHWM). Prints both
peaks and their ratio (target: within +5%). Not a test: numbers are printed, never asserted.

    python benchmarks/bench_memory.py [--model gradflow-mini-en] [--sequences 200] [--device cpu]

With ``--device cuda`` the recording runs on the GPU; the peak printed is still the process's host
RSS (what must not grow with the corpus), and the GPU's peak allocated memory is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = """
import json, sys
from gradflow.cli import main
code = main(sys.argv[1:])
hwm = [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')][0]
import torch
gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else 0.0
print(json.dumps({"code": code, "peak_mib": hwm / 1024, "gpu_peak_mib": gpu}))
"""


def run(model: str, texts: Path, out: Path, limit: int, device: str = "cpu") -> tuple[float, float, float]:
    """(host peak RSS MiB, GPU peak allocated MiB (0 without CUDA), wall s) of one recording in a fresh process."""
    start = time.time()
    cmd = [sys.executable, "-c", CHILD, "record", "--model", model, "--texts", str(texts), "--out", str(out),
           "--limit", str(limit), "--quiet", "--overwrite", "--device", device]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["code"] != 0:
        raise SystemExit(proc.stderr)
    return result["peak_mib"], result["gpu_peak_mib"], time.time() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gradflow-mini-en")
    p.add_argument("--sequences", type=int, default=200, help="windows in the small corpus (10x in the large)")
    p.add_argument("--device", default="cpu", help="torch device for the recordings (default cpu)")
    args = p.parse_args()
    from gradflow.runs.record import default_texts

    sample = Path(default_texts()).read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.txt"
        corpus.write_text(sample * 10, encoding="utf-8")  # the sample repeated: enough windows for both runs
        small, gpu_small, t_small = run(args.model, corpus, Path(tmp) / "small", args.sequences, args.device)
        large, gpu_large, t_large = run(args.model, corpus, Path(tmp) / "large", 10 * args.sequences, args.device)
    print(f"model={args.model}  device={args.device}")
    print(f"{'corpus':<10}{'sequences':>10}{'peak RSS MiB':>14}{'GPU peak MiB':>14}{'wall s':>8}")
    print(f"{'small':<10}{args.sequences:>10}{small:>14.1f}{gpu_small:>14.1f}{t_small:>8.1f}")
    print(f"{'10x':<10}{10 * args.sequences:>10}{large:>14.1f}{gpu_large:>14.1f}{t_large:>8.1f}")
    print(f"peak RSS ratio 10x / 1x: {large / small:.3f} (target <= 1.05)")


if __name__ == "__main__":
    main()
