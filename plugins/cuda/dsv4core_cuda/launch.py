"""CUDA launch tables for the portable Triton kernels, per compute capability (see
dsv4core.kernels.triton.launch).

The kernels' built-in defaults were measured on an H200 (sm90, benchmarks/tune_triton.py), so
the sm90 table is empty: it keeps them. Other capabilities use the same values until someone
tunes them on that GPU (add an entry here; a key absent from an entry keeps the default).
"""
from __future__ import annotations

TABLES: dict[str, dict] = {
    "sm90": {},
}


def table_for(capability: tuple[int, int]) -> dict:
    return TABLES.get(f"sm{capability[0]}{capability[1]}", TABLES["sm90"])


def current() -> dict:
    """The table for device 0 (read at the first kernel call, never at import)."""
    import torch

    return table_for(torch.cuda.get_device_capability(0))
