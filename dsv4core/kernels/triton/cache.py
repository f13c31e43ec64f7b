"""cache_store: ``pool[index[i]] = rows[i]`` (one cast to the pool dtype) for every ``index[i] >= 0``.

One program = (a block of BR source rows, a block of BD columns). A program reads its rows'
destinations from the device (no host read: the launch is capturable) and stores only where the
destination is >= 0, so a skipped row (-1) and every pool row that ``index`` does not name are
never written. The pool is written through its strides (a layer's region of a larger buffer stays
that region); ``rows`` and ``index`` are read through theirs; nothing is copied. Destinations are
distinct (the HAL input check), so no two programs write one element: the pool ends bitwise equal
to the reference's (bf16 and fp32 widen exactly to fp32; the one rounding is round-to-nearest-even).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ._util import cdiv, np2, rne, to_out
from .launch import Tune
from . import predicates
from .registry import implements

#: launch parameters: tuning overrides over the bound backend's launch table (launch.py)
TUNE = Tune(__name__, ("BD", "BR", "num_warps"))


@triton.jit
def _cache_store_kernel(pool_ptr, idx_ptr, rows_ptr, E, D, si, sp_r, sp_c, sr_r, sr_c,
                        BR: tl.constexpr, BD: tl.constexpr, RNE: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = (tl.program_id(1) * BD + tl.arange(0, BD)).to(tl.int64)
    rm = r < E
    dst = tl.load(idx_ptr + r.to(tl.int64) * si, mask=rm, other=-1).to(tl.int64)
    ok = rm & (dst >= 0)
    m = ok[:, None] & (cols < D)[None, :]
    src = r.to(tl.int64)[:, None] * sr_r + cols[None, :] * sr_c
    x = tl.load(rows_ptr + src, mask=m, other=0.0).to(tl.float32)   # bf16 and fp32 are exact in fp32
    dst_off = tl.where(ok, dst, 0)[:, None] * sp_r + cols[None, :] * sp_c
    tl.store(pool_ptr + dst_off, to_out(x, pool_ptr, RNE), mask=m)


@implements("cache_store", supports=predicates.cache_store_supports)
def cache_store(pool, index, rows):
    E, D = rows.shape
    if E == 0 or D == 0 or pool.shape[0] == 0:
        return None
    BD = TUNE.get("BD", min(np2(D), 1024))
    BR = TUNE.get("BR", max(1, min(16, 4096 // BD)))
    _cache_store_kernel[(cdiv(E, BR), cdiv(D, BD))](
        pool, index, rows, E, D, index.stride(0), pool.stride(0), pool.stride(1), rows.stride(0), rows.stride(1),
        BR=BR, BD=BD, RNE=rne(pool), num_warps=TUNE.get("num_warps", 4), **TUNE.options())
    return None
