"""rope, q_norm_rope, kv_norm_rope: one fused pass per row (optional rms norm, then interleaved rope
on the trailing d_r channels), fp32 math, one rounding. cos/sin from libdevice on GPUs."""
from __future__ import annotations

from ._util import no_quant as _no_quant

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._util import accurate, c, np2, cdiv, rne, to_out
from .launch import Tune
from . import predicates
from .registry import implements

#: launch parameters: tuning overrides over the bound backend's launch table (launch.py)
TUNE = Tune(__name__, ("HB", "num_warps", "rowpos_below"))


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, pos_ptr, f_ptr, y_ptr, RPT, D, DS, HALF, eps,
                      NORM: tl.constexpr, HAS_W: tl.constexpr, INVERSE: tl.constexpr,
                      ACCURATE: tl.constexpr, HB: tl.constexpr, BLOCK: tl.constexpr,
                      HP: tl.constexpr, RNE: tl.constexpr, ROWPOS: tl.constexpr, R):
    # default: one program = one token x HB of its rows (heads), cos/sin computed once per token.
    # ROWPOS (few rows per token, e.g. kv [T, d]): HB consecutive rows of any tokens, per-row angles.
    if ROWPOS:
        rows = tl.program_id(0).to(tl.int64) * HB + tl.arange(0, HB)
        hm = rows < R
        base = rows[:, None] * D
    else:
        t = tl.program_id(0).to(tl.int64)
        hr = tl.program_id(1) * HB + tl.arange(0, HB)
        hm = hr < RPT
        base = (t * RPT + hr)[:, None] * D
    cols = tl.arange(0, BLOCK)
    m = hm[:, None] & (cols < D)[None, :]
    j = tl.arange(0, HP)
    jm = j < HALF
    ce = DS + 2 * j
    mj = hm[:, None] & jm[None, :]
    x = tl.load(x_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
    xe = tl.load(x_ptr + base + ce[None, :], mask=mj, other=0.0).to(tl.float32)
    xo = tl.load(x_ptr + base + ce[None, :] + 1, mask=mj, other=0.0).to(tl.float32)
    if NORM:
        r = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps))
        x = x * r[:, None]
        xe = xe * r[:, None]
        xo = xo * r[:, None]
        if HAS_W:
            x = x * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
            xe = xe * tl.load(w_ptr + ce, mask=jm, other=0.0).to(tl.float32)[None, :]
            xo = xo * tl.load(w_ptr + ce + 1, mask=jm, other=0.0).to(tl.float32)[None, :]
    f = tl.load(f_ptr + j, mask=jm, other=0.0)
    if ROWPOS:
        p = tl.load(pos_ptr + rows // RPT, mask=hm, other=0).to(tl.float32)
        ang = p[:, None] * f[None, :]
    else:
        p = tl.load(pos_ptr + t).to(tl.float32)
        ang = (p * f)[None, :]
    if ACCURATE:
        cs = libdevice.cos(ang)
        sn = libdevice.sin(ang)
    else:
        cs = tl.cos(ang)
        sn = tl.sin(ang)
    if INVERSE:
        sn = -sn
    oe = xe * cs - xo * sn
    oo = xe * sn + xo * cs
    tl.store(y_ptr + base + cols[None, :], to_out(x, y_ptr, RNE), mask=m & (cols < DS)[None, :])
    tl.store(y_ptr + base + ce[None, :], to_out(oe, y_ptr, RNE), mask=mj)
    tl.store(y_ptr + base + ce[None, :] + 1, to_out(oo, y_ptr, RNE), mask=mj)


def _launch(x, w, positions, inv_freq, eps, norm, inverse):
    T = x.shape[0]
    D = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    R = x.numel() // D if D > 0 else 0
    if R == 0 or T == 0:
        return y
    x = c(x)
    half = inv_freq.shape[0]
    RPT = R // T
    BLOCK = np2(D)
    rowpos = RPT < TUNE.get("rowpos_below", 8)
    # H200 sweep: 4 rows of 512 per program (2048 elements, 4 warps) is best for q, rope and kv
    if rowpos:
        HB = TUNE.get("HB", max(1, 2048 // BLOCK))
        grid = (cdiv(R, HB),)
    else:
        HB = TUNE.get("HB", min(np2(RPT), max(1, 2048 // BLOCK)))
        grid = (T, cdiv(RPT, HB))
    nw = TUNE.get("num_warps", 4 if HB * BLOCK <= 2048 else 8)
    _norm_rope_kernel[grid](
        x, c(w) if w is not None else x, c(positions), c(inv_freq), y, RPT, D, D - 2 * half, half,
        float(eps), NORM=norm, HAS_W=w is not None, INVERSE=bool(inverse),
        ACCURATE=accurate(x), HB=HB, BLOCK=BLOCK, HP=np2(half), RNE=rne(y), ROWPOS=rowpos, R=R,
        num_warps=nw, **TUNE.options())
    return y


@implements("rope", supports=predicates.rope_supports)
def rope(x, positions, inv_freq, inverse=False):
    return _launch(x, None, positions, inv_freq, 0.0, False, inverse)


@implements("q_norm_rope", supports=predicates.q_norm_rope_supports)
def q_norm_rope(q, positions, inv_freq, eps):
    return _launch(q, None, positions, inv_freq, eps, True, False)


@implements("kv_norm_rope", supports=predicates.kv_norm_rope_supports)
def kv_norm_rope(kv, weight, positions, inv_freq, eps, nope_quant_block=None):
    _no_quant("kv_norm_rope", nope_quant_block=nope_quant_block)
    return _launch(kv, weight, positions, inv_freq, eps, True, False)
