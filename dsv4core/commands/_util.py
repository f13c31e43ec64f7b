"""Small helpers shared by CLI subcommands: tables and JSON output."""

from __future__ import annotations

import json
import sys
from typing import Any

from dsv4core._table import print_table  # noqa: F401  (re-exported for the commands)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
