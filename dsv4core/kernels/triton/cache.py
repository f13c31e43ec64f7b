"""cache_store: ``pool[index[i]] = rows[i]`` (one cast to the pool dtype) for every ``index[i] >= 0``.

One program = (a block of BR source rows, a block of BD columns). A program reads its rows'
destinations from the device (no host read: the launch is capturable) and stores only where the
destination is >= 0, so a skipped row (-1) and every pool row that ``index`` does not name are
never written. The pool is written through its strides (a layer's region of a larger buffer stays
that region); ``rows`` and ``index`` are read through theirs; nothing is copied. Destinations are
distinct (the HAL input check), so no two programs write one element: the pool ends bitwise equal
to the reference's (bf16 and fp32 widen exactly to fp32; the one rounding is round-to-nearest-even).

``row_format`` "fp8" / "fp4" (``hal.rowformats``): one program per source row encodes it - the
official rule's power-of-two scale per group read off the fp32 bits of ``amax * fl32(1/qmax)``
(``_util.group_scale_exp``, as in the other quantising kernels), the codes rounded to nearest even
by integer arithmetic on the fp32 bits (e4m3) or by comparison with the grid's midpoints (e2m1),
not by a float8 cast (the interpreter's e4m3 cast does not round to nearest) - and writes its
bytes: the same bytes as the reference's. (The codes are computed here rather than read off
``_util.e4m3_rne`` / ``e2m1_rne``'s rounded values, which give other bytes for a NaN - the
interpreter's clamp lets one through - in a group whose scale byte already reads back as NaN.)
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4core.hal.rowformats import ROPE_DIM

from ._util import cdiv, exp2_int, group_scale_exp, np2, rne, rne_for, to_out
from . import _paged
from .launch import Tune
from . import predicates
from .registry import implements

#: launch parameters: tuning overrides over the bound backend's launch table (launch.py)
TUNE = Tune(__name__)   # its keys: launch.TUNING_KEYS


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


@triton.jit
def _e4m3_code(v):
    """The e4m3 byte of fp32 v in [-448, 448], rounded to nearest, ties to even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(v)
    ab = a.to(tl.int32, bitcast=True)
    mant = ab & 0x7FFFFF
    lsb = (mant >> 20) & 1
    rem = mant & 0xFFFFF
    up = ((rem > 0x80000) | ((rem == 0x80000) & (lsb == 1))).to(tl.int32)
    normal = ((((ab >> 23) & 0xFF) - 120) << 3) + (mant >> 20) + up        # (exp - 127 + 7) << 3 | m
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)               # below 2^-6: round(a * 2^9)
    return (tl.where(a < 0.015625, sub, normal) | sign).to(tl.uint8)


@triton.jit
def _e2m1_code(v):
    """The e2m1 code of fp32 v in [-6, 6]: the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6, ties to the even code."""
    a = tl.abs(v)
    i = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a > 1.75).to(tl.int32)
         + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    i += ((a == 0.75) | (a == 1.75) | (a == 3.5)).to(tl.int32)
    return i | ((v.to(tl.int32, bitcast=True) >> 28) & 0x8)


@triton.jit
def _store_fp8_kernel(pool_ptr, idx_ptr, rows_ptr, si, sp_r, sr_r, sr_c,
                      NOPE: tl.constexpr, GP: tl.constexpr, PAD: tl.constexpr, RNE: tl.constexpr):
    """Row e of rows [E, NOPE + 64] -> its FP8 KV row at pool row index[e] (skipped when -1)."""
    e = tl.program_id(0).to(tl.int64)
    dst = tl.load(idx_ptr + e * si).to(tl.int64)
    if dst >= 0:
        G: tl.constexpr = NOPE // 64
        g = tl.arange(0, GP)
        j = tl.arange(0, 64)
        ch = g[:, None] * 64 + j[None, :]
        gm = (g < G)[:, None]
        x = tl.load(rows_ptr + e * sr_r + ch * sr_c, mask=gm, other=0.0).to(tl.float32)
        se = group_scale_exp(tl.max(tl.abs(x), axis=1), 1e-4, 1.0 / 448.0)   # the scale's exponent
        v = tl.minimum(tl.maximum(x * exp2_int(-se)[:, None], -448.0), 448.0)
        out = pool_ptr + dst * sp_r
        tl.store(out + ch, _e4m3_code(v), mask=gm)
        rope_ptr = (out + NOPE).to(tl.pointer_type(tl.bfloat16))
        tl.store(rope_ptr + j, to_out(tl.load(rows_ptr + e * sr_r + (NOPE + j) * sr_c).to(tl.float32), rope_ptr, RNE))
        tl.store(out + NOPE + 128 + g, tl.where(g < G, se + 127, 0).to(tl.uint8), mask=g < PAD)


@triton.jit
def _store_fp4_kernel(pool_ptr, idx_ptr, rows_ptr, si, sp_r, sr_r, sr_c, D: tl.constexpr, GP: tl.constexpr):
    """Row e of rows [E, D] -> its FP4 key at pool row index[e] (skipped when -1)."""
    e = tl.program_id(0).to(tl.int64)
    dst = tl.load(idx_ptr + e * si).to(tl.int64)
    if dst >= 0:
        G: tl.constexpr = D // 32
        g = tl.arange(0, GP)
        j = tl.arange(0, 16)
        pair = g[:, None] * 16 + j[None, :]                 # byte j of group g: channels 2 pair, 2 pair + 1
        gm = (g < G)[:, None]
        lo = tl.load(rows_ptr + e * sr_r + (2 * pair) * sr_c, mask=gm, other=0.0).to(tl.float32)
        hi = tl.load(rows_ptr + e * sr_r + (2 * pair + 1) * sr_c, mask=gm, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))
        se = group_scale_exp(amax, 6.0 * 2.0 ** -126, 1.0 / 6.0)
        inv = exp2_int(-se)
        clo = _e2m1_code(tl.minimum(tl.maximum(lo * inv[:, None], -6.0), 6.0))
        chi = _e2m1_code(tl.minimum(tl.maximum(hi * inv[:, None], -6.0), 6.0))
        out = pool_ptr + dst * sp_r
        tl.store(out + pair, (clo | (chi << 4)).to(tl.uint8), mask=gm)
        tl.store(out + D // 2 + g, (se + 127).to(tl.uint8), mask=g < G)


def _format_plan(row_format, D, device):
    if row_format == "fp8":
        G = (D - ROPE_DIM) // 64
        return dict(NOPE=D - ROPE_DIM, GP=np2(max(G, -(-G // 8) * 8)), PAD=-(-G // 8) * 8,
                    RNE=rne_for(device, torch.bfloat16),   # the rope channels' rounding
                    num_warps=TUNE.get("num_warps", 4))
    return dict(D=D, GP=np2(D // 32), num_warps=TUNE.get("num_warps", 4))


def _store_format(pool, index, rows, row_format, sp_r):
    E, D = rows.shape
    if E == 0 or pool.shape[0] == 0:
        return None
    args = (pool, index, rows, index.stride(0), sp_r, rows.stride(0), rows.stride(1))
    dev = pool.device
    kw = TUNE.memo(("format", row_format == "fp8", D, dev, rne_for), lambda: _format_plan(row_format, D, dev))
    (_store_fp8_kernel if row_format == "fp8" else _store_fp4_kernel)[(E,)](*args, **kw)
    return None


def _plan(E, D, pool):
    BD = TUNE.get("BD", min(np2(D), 1024))
    BR = TUNE.get("BR", max(1, min(16, 4096 // BD)))
    return (cdiv(E, BR), cdiv(D, BD)), dict(BR=BR, BD=BD, RNE=rne(pool), num_warps=TUNE.get("num_warps", 4),
                                            **TUNE.options())


@implements("cache_store", supports=predicates.cache_store_supports)
def cache_store(pool, index, rows, row_format=None, paged=False):
    if paged and pool.shape[1] == 0:
        return None
    # a paged pool (HAL 1.4): the destinations' offsets in U-element rows, the flat kernels as they are
    index, sp_r, _ = _paged.offsets(pool, index) if paged else (index, pool.stride(0), 0)
    if row_format is not None:
        return _store_format(pool, index, rows, row_format, sp_r)
    E, D = rows.shape
    if E == 0 or D == 0 or pool.shape[0] == 0:
        return None
    # the launch but the tensors and strides: planned once per (E, D, pool dtype and device) and the
    # launch parameters in effect (Tune.memo; ``rne`` in the key: aot.device_branch replaces it)
    grid, kw = TUNE.memo(("flat", E, D, pool.dtype, pool.device, rne), lambda: _plan(E, D, pool))
    _cache_store_kernel[grid](
        pool, index, rows, E, D, index.stride(0), sp_r, pool.stride(-1), rows.stride(0), rows.stride(1), **kw)
    return None
