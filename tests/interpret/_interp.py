"""Run a test script under the Triton interpreter in a fresh Python (TRITON_INTERPRET must be set
before triton is imported, so kernels under test never run in the pytest process itself)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def interpreted_report(script: str, out_dir, name: str, timeout: int = 600) -> dict:
    """Run `script` (python source; it writes a JSON report to the path in sys.argv[1]) under the
    interpreter and return the report; a script that wrote none fails with its output."""
    out = out_dir / f"{name}.json"
    proc = subprocess.run([sys.executable, "-c", script, str(out)], env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, timeout=timeout)
    assert out.exists(), f"{name}: the interpreter script wrote no report:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())
