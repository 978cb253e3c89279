"""Run ``gradflow demo`` with this checkout and with an earlier git revision; compare the tables byte for byte.

    python -m analyses.maintenance.check_demo_identity [--base-rev 1f731dc] [--limit N]

The earlier revision is checked out into a temporary git worktree and run with the same
interpreter (its ``src/`` first on ``PYTHONPATH``). Prints one line per table and exits 1 if any
``channels.csv`` or ``sublayers.csv`` differs. Used for issue 13 (behaviour-preserving redesign).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TABLES = ("channels.csv", "sublayers.csv")


def run_demo(src: Path, out: Path, limit: int | None) -> None:
    env = {**os.environ, "PYTHONPATH": str(src), "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "gradflow", "demo", "--out", str(out), "--quiet"]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    subprocess.run(cmd, check=True, env=env, cwd=src.parent)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-rev", default="1f731dc", help="revision to compare with (default: before issue 13)")
    parser.add_argument("--limit", type=int, default=None, help="sequences per run (default: the whole sample)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = tmp / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base_rev], check=True, cwd=REPO,
                       capture_output=True)
        try:
            run_demo(base / "src", tmp / "before", args.limit)
            run_demo(REPO / "src", tmp / "after", args.limit)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, capture_output=True)
        differ = 0
        for run in sorted(p.name for p in (tmp / "before").iterdir() if (p / TABLES[0]).exists()):
            for name in TABLES:
                same = (tmp / "before" / run / name).read_bytes() == (tmp / "after" / run / name).read_bytes()
                differ += not same
                print(f"{run}/{name}: {'identical' if same else 'DIFFERENT'}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
