"""Tests that run Triton kernels under the Triton interpreter (TRITON_INTERPRET=1).

Each file runs its kernels in a fresh Python (``_interp.interpreted_report`` or its own
subprocess): the variable must be set before triton is imported, so the kernels never run in the
pytest process. The folder is collected by a pytest invocation of its own (the README's test
command runs ``tests`` without it, then it), so that these slow tests can be run, timed and
selected apart from the rest of the suite.
"""

from __future__ import annotations

import sys
from pathlib import Path

# helpers shared with the rest of the suite (launch_recorder, vendor_emul) live in tests/
_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
