"""Paged pools (HAL 1.4) for the pool kernels: a ``[B, J, W]`` pool (any strides) read and written
as a pool of U-element rows, U the largest power of two (<= 64) that divides both strides.

``offsets(pool, index)`` turns flat row indices into those rows' offsets in units of U, on the
device (no host read: capturable), -1 kept: ``((i // J) * stride(0) + (i % J) * stride(1)) / U``.
A kernel then addresses row ``offset`` at ``offset * U`` elements from the pool's first element,
exactly as it addresses a flat pool of row stride U: the kernels are the flat ones, the pool is
not copied, and the loads keep the alignment the strides give.
"""
from __future__ import annotations

from math import gcd

import torch


def offsets(pool: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(int64 offsets shaped like ``index``, U, an exclusive bound of the offsets)."""
    i = index.long()
    J, s0, s1 = pool.shape[1], pool.stride(0), pool.stride(1)
    g = gcd(s0, s1)
    U = min(g & -g, 64) if g else 64
    off = torch.where(i >= 0, ((i // J) * s0 + (i % J) * s1) // U, -1)
    return off, U, ((pool.shape[0] - 1) * s0 + (J - 1) * s1) // U + 1
