"""A stand-in for a jitted Triton kernel that records launches instead of running them (the
capture-safety tests: launchers run on meta tensors, which hold no data)."""
from __future__ import annotations


class Recorder:
    """``kernel[grid](*args, **kw)`` records ``(grid, args, kw)``; the grid must be plain ints."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            assert all(type(n) is int for n in grid), f"grid {grid!r} is not plain ints (read from a tensor?)"
            self.launches.append((grid, args, kwargs))
        return launch
