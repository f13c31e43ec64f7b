"""Plain text tables for the command line and the conformance report (no dependencies)."""

from __future__ import annotations

import shutil
import sys
import textwrap
from typing import Any, Sequence


def fit_widths(widths: list[int], headers: Sequence[str], total: int, min_width: int = 12) -> list[int]:
    """Column widths whose table (two spaces between columns) fits `total` characters, made by
    narrowing the widest column first, none below its header or `min_width`; as narrow as that
    allows when nothing fits."""
    w = list(widths)
    floor = [min(x, max(len(h), min_width)) for x, h in zip(w, headers)]
    while sum(w) + 2 * (len(w) - 1) > total:
        i = max(range(len(w)), key=lambda j: w[j] - floor[j])
        if w[i] <= floor[i]:
            break
        w[i] = max(floor[i], w[i] - (sum(w) + 2 * (len(w) - 1) - total))
    return w


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], file=None, width: int | None = None) -> None:
    """A plain left-aligned text table. On a terminal (or with `width`) it fits the width: the
    widest columns are narrowed and their cells wrap onto continuation lines; to a file or a pipe
    every cell stays on one line."""
    file = file or sys.stdout
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    if width is None and getattr(file, "isatty", lambda: False)():
        width = shutil.get_terminal_size((200, 20)).columns - 1
    if width is not None:
        widths = fit_widths(widths, headers, width)
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    print(line.rstrip(), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in cells:
        parts = [textwrap.wrap(c, w) or [""] if len(c) > w else [c] for c, w in zip(r, widths)]
        for k in range(max(len(p) for p in parts)):
            print("  ".join((p[k] if k < len(p) else "").ljust(w) for p, w in zip(parts, widths)).rstrip(),
                  file=file)
