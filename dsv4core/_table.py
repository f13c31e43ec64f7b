"""Plain text tables for the command line and the conformance report (no dependencies)."""

from __future__ import annotations

import sys
from typing import Any, Sequence


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], file=None) -> None:
    """A plain left-aligned text table."""
    file = file or sys.stdout
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line.rstrip(), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=file)
