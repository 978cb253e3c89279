"""Peak memory and time to the first batch of `gradflow record` on a one-line file (issue 28).

Writes a file of N MB that is a single line (the committed sample's documents joined by spaces,
repeated), then runs `gradflow record --limit 64 --norms-only` on it with the embedded model in a
fresh process, once for N MB (default 1024) and once for 12 MB, and the committed sample as the
baseline. The child reports its own peak RSS (VmHWM) and the seconds from the corpus job asking for
its batches (reading starts there) to the first masked batch, and the whole command's wall time.
Targets: 1 GB under 1.5 GB peak RSS and first batch under 10 s; 12 MB first batch under 2 s.
``--jsonl-mb N`` adds a ``.jsonl`` file of one record of about N MiB (an ``id`` field, the same
text JSON-escaped, quotes and a ``\n`` escape in every block, in its ``"text"`` field, and a
``meta`` field after it), read through the streaming record decoder (0 leaves it out).
``--device cuda`` records on the GPU (the reader, what this measures, runs on the CPU either way).
Not a test: numbers are printed, never asserted.

    python benchmarks/long_document.py [--mb 1024] [--jsonl-mb 1024] [--model gradflow-mini-en] [--device cpu]
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
import json, sys, time
from gradflow.runs import job
timing = {}
batches = job.CorpusJob.batches
def timed(self):
    timing["asked"] = time.perf_counter()
    for batch in batches(self):
        timing.setdefault("first", time.perf_counter())
        yield batch
job.CorpusJob.batches = timed
from gradflow.cli import main
code = main(sys.argv[1:])
hwm = [int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM')][0]
print(json.dumps({"code": code, "peak_mib": hwm / 1024, "first_batch_s": timing["first"] - timing["asked"]}))
"""


def write_one_line(path: Path, mb: int) -> int:
    """Write a one-line UTF-8 file of ``mb`` MiB (no newline) and return its size in bytes."""
    from gradflow.inputs.corpus import default_texts

    words = " ".join(Path(default_texts()).read_text(encoding="utf-8").split()).encode("utf-8") + b" "
    block = words * max(1, (1 << 20) // len(words) + 1)
    left = mb << 20
    with open(path, "wb") as handle:
        while left > 0:
            handle.write(block[:min(left, len(block))])
            left -= len(block)
    return path.stat().st_size


def write_one_record(path: Path, mb: int) -> int:
    """Write a one-line ``.jsonl`` file: one record whose "text" field is about ``mb`` MiB; its size in bytes."""
    from gradflow.inputs.corpus import default_texts

    words = " ".join(Path(default_texts()).read_text(encoding="utf-8").split())
    text = '"quoted" words\n' + words + " "
    block = json.dumps(text * max(1, (1 << 16) // len(text) + 1), ensure_ascii=False)[1:-1].encode("utf-8")
    with open(path, "wb") as handle:
        handle.write(b'{"id": 1, "text": "')
        for _ in range(max(1, round((mb << 20) / len(block)))):
            handle.write(block)
        handle.write(b'", "meta": {"source": "benchmarks/long_document.py", "blocks": [1, 2, 3]}}')
    return path.stat().st_size


def record(model: str, texts: Path, out: Path, device: str = "cpu") -> dict:
    """Run `gradflow record --limit 64 --norms-only` in a fresh process; its peak RSS, first batch and wall time."""
    cmd = [sys.executable, "-c", CHILD, "record", "--model", model, "--texts", str(texts), "--out", str(out),
           "--limit", "64", "--norms-only", "--quiet", "--overwrite", "--device", device]
    start = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"gradflow record failed on {texts}:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if result["code"] != 0:
        raise SystemExit(proc.stderr[-3000:])
    return {**result, "wall_s": wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=1024, help="size of the large one-line file in MiB (default 1024)")
    p.add_argument("--jsonl-mb", type=int, default=0,
                   help="size of a one-record .jsonl file in MiB (default 0: no .jsonl case)")
    p.add_argument("--small-mb", type=int, default=12, help="size of the small one-line file in MiB (default 12)")
    p.add_argument("--model", default="gradflow-mini-en")
    p.add_argument("--device", default="cpu", help="torch device for the recording (default cpu)")
    args = p.parse_args()
    from gradflow.inputs.corpus import default_texts

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(("sample (baseline)", Path(default_texts()).stat().st_size,
                     record(args.model, Path(default_texts()), Path(tmp) / "base", args.device)))
        for mb in sorted({args.small_mb, args.mb}):
            path = Path(tmp) / f"one_line_{mb}mb.txt"
            size = write_one_line(path, mb)
            rows.append((f"one line, {mb} MiB", size, record(args.model, path, Path(tmp) / f"run{mb}", args.device)))
            path.unlink()
        if args.jsonl_mb > 0:
            path = Path(tmp) / f"one_record_{args.jsonl_mb}mb.jsonl"
            size = write_one_record(path, args.jsonl_mb)
            rows.append((f"jsonl record, {args.jsonl_mb} MiB", size,
                         record(args.model, path, Path(tmp) / "runjsonl", args.device)))
            path.unlink()
    print(f"model={args.model}  device={args.device}  gradflow record --limit 64 --norms-only")
    print(f"{'corpus':<26}{'bytes':>14}{'peak RSS MiB':>14}{'first batch s':>15}{'wall s':>9}")
    for name, size, r in rows:
        print(f"{name:<26}{size:>14}{r['peak_mib']:>14.1f}{r['first_batch_s']:>15.2f}{r['wall_s']:>9.1f}")
    print("targets: 1 GiB peak RSS < 1536 MiB and first batch < 10 s; 12 MiB first batch < 2 s")


if __name__ == "__main__":
    main()
