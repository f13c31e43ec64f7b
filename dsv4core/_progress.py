"""A progress display on stderr for long CLI runs (checkpoint load, bench).

On a terminal: one status line rewritten in place (``\\r``, the rest of the previous text blanked),
removed by `close()`. Elsewhere (a log file, a pipe) nothing, unless `lines` is set: then a plain
line per update, at most one every `every` seconds plus the final one, and never a carriage
return. Nothing at all is shown for a run shorter than `delay` seconds."""

from __future__ import annotations

import sys
import time


class StatusLine:
    def __init__(self, enabled: bool = True, *, lines: bool = False, stream=None, every: float = 10.0,
                 delay: float = 0.0, clock=time.perf_counter) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = enabled and self.stream is not None and (self.tty or lines)
        self.every, self.delay, self.clock = every, delay, clock
        self.t0 = clock()
        self.last: float | None = None      # when the last plain line was written
        self.width = 0                      # characters of the status line now on the terminal

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def update(self, text: str, final: bool = False) -> None:
        """Show `text` as the current state (`final`: the last update of the run)."""
        if not self.enabled:
            return
        dt = self.elapsed()
        if dt < self.delay and not (final and (self.width or self.last is not None)):
            return
        if self.tty:
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
        else:
            if not final and self.last is not None and dt - self.last < self.every:
                return
            self.stream.write(text + "\n")
            self.last = dt
        self.stream.flush()

    def log(self, text: str) -> None:
        """A line that stays (a result): written on its own line, the status line cleared first."""
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.width = 0
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Remove the status line from the terminal (a log keeps its plain lines)."""
        if self.tty and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0
