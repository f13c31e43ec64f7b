"""Where a benchmark script writes its result by default: the layout of benchmarks/results/
(benchmarks/README.md): ``<system>/<date>_<commit>/<kind>/<name>``, the date today (UTC), the commit
the working tree's HEAD (``COMMIT`` in the environment overrides it, e.g. on a machine whose copy of
the tree has no git metadata)."""
from __future__ import annotations

import datetime
import os
import subprocess
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def result_path(system: str, kind: str, name: str) -> Path:
    commit = os.environ.get("COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=RESULTS.parent, text=True,
                                    capture_output=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            commit = "unknown"
    day = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    return RESULTS / system / f"{day}_{commit}" / kind / name
