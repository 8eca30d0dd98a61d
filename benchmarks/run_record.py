"""Where a benchmark run's results go: one folder per run under benchmarks/results, with a run.json.

``run.json`` holds what benchmarks/results/README.md indexes: the command, the commit, the machine, the
date and the script. A device machine's copy of the tree has no .git, so a command run there passes the
commit in ``EYAS_COMMIT`` (``EYAS_COMMIT=$(git rev-parse --short HEAD)`` in the command line written here).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).with_name("results")


def run_folder(what: str, machine: str) -> Path:
    """The default folder of a run of ``what`` on ``machine`` today: ``results/<date>_<machine>_<what>``."""
    short = "h200" if "H200" in machine else "cpu" if machine.upper().startswith("CPU") else machine.replace(" ", "-").lower()
    return RESULTS / f"{datetime.date.today()}_{short}_{what}"


def git_commit() -> str | None:
    """$EYAS_COMMIT, else the checkout's HEAD, else None."""
    if os.environ.get("EYAS_COMMIT"):
        return os.environ["EYAS_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def write_run_json(folder: Path, machine: str, notes: str = "") -> Path:
    """Write ``folder/run.json`` for the running script's command line."""
    folder.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]), "commit": git_commit(),
              "machine": machine, "date": str(datetime.date.today()), "script": f"benchmarks/{Path(sys.argv[0]).name}",
              "notes": notes}
    path = folder / "run.json"
    path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")
    return path
