"""rope, q_norm_rope, kv_norm_rope: one fused pass per row (optional rms norm, then interleaved rope
on the trailing d_r channels), fp32 math, one rounding. cos/sin from libdevice on GPUs.

kv_norm_rope with ``nope_quant_block`` (the official KV row, ``hal.ops.rope.kv_norm_rope``): the
normed row is rounded to bfloat16, the rope channels are rotated from those values and rounded to
bfloat16 again, and every ``nope_quant_block`` non-rope channels are fake-quantised to FP8 e4m3
with the power-of-two scale of ``hal.quant`` (bit operations: ``_util.e4m3_rne``), in the same pass.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._util import (accurate, c, cdiv, e4m3_rne, exp2_int, group_scale_exp, np2, rne, rne_bf16,
                    to_out)
from .launch import Tune
from . import predicates
from .registry import implements

#: launch parameters: tuning overrides over the bound backend's launch table (launch.py)
TUNE = Tune(__name__)   # its keys: launch.TUNING_KEYS


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, pos_ptr, f_ptr, y_ptr, RPT, D, DS, HALF, eps,
                      NORM: tl.constexpr, HAS_W: tl.constexpr, INVERSE: tl.constexpr,
                      ACCURATE: tl.constexpr, HB: tl.constexpr, BLOCK: tl.constexpr,
                      HP: tl.constexpr, RNE: tl.constexpr, ROWPOS: tl.constexpr, R,
                      QB: tl.constexpr = 0):
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
    if QB > 0:   # the official row: bf16 values; FP8 groups of QB non-rope channels (DS % QB == 0)
        x = rne_bf16(x)
        xe = rne_bf16(xe)
        xo = rne_bf16(xo)
        g = tl.reshape(x, (HB, BLOCK // QB, QB))
        e = group_scale_exp(tl.max(tl.abs(g), axis=2), 1e-4, 1.0 / 448.0)
        q = e4m3_rne(tl.minimum(tl.maximum(g * exp2_int(-e)[:, :, None], -448.0), 448.0))
        x = tl.reshape(q * exp2_int(e)[:, :, None], (HB, BLOCK))
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
    if QB > 0:
        oe = rne_bf16(oe)
        oo = rne_bf16(oo)
    tl.store(y_ptr + base + cols[None, :], to_out(x, y_ptr, RNE), mask=m & (cols < DS)[None, :])
    tl.store(y_ptr + base + ce[None, :], to_out(oe, y_ptr, RNE), mask=mj)
    tl.store(y_ptr + base + ce[None, :] + 1, to_out(oo, y_ptr, RNE), mask=mj)


def _plan(T, D, R, half, norm, has_w, inverse, qb, x, y):
    """_launch's (grid, keywords) for these shapes and flags under the launch parameters in effect."""
    RPT = R // T
    BLOCK = np2(D)
    rowpos = RPT < TUNE.get("rowpos_below", 8)
    # row block: 2048 elements a program (4 rows of 512), 4 warps: 16 values a lane (8 on a 64-lane
    # wavefront) in registers on every target, the token's cos / sin computed once for its rows. No
    # result file: an H200 sweep (measured on one GPU, not committed) found 4 rows of 512 fastest
    # for q, the rope rows and kv
    if rowpos:
        HB = TUNE.get("HB", max(1, 2048 // BLOCK))
        grid = (cdiv(R, HB),)
    else:
        HB = TUNE.get("HB", min(np2(RPT), max(1, 2048 // BLOCK)))
        grid = (T, cdiv(RPT, HB))
    nw = TUNE.get("num_warps", 4 if HB * BLOCK <= 2048 else 8)
    return grid, dict(NORM=norm, HAS_W=has_w, INVERSE=inverse, ACCURATE=accurate(x), HB=HB, BLOCK=BLOCK,
                      HP=np2(half), RNE=rne(y), ROWPOS=rowpos, R=R, QB=qb, num_warps=nw, **TUNE.options())


def _launch(x, w, positions, inv_freq, eps, norm, inverse, quant_block=None):
    T = x.shape[0]
    D = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    R = x.numel() // D if D > 0 else 0
    if R == 0 or T == 0:
        return y
    x = c(x)
    half = inv_freq.shape[0]
    has_w, inverse, qb = w is not None, bool(inverse), int(quant_block or 0)
    # the launch but the tensors and eps depends on these values and the launch parameters only:
    # planned once per such key (Tune.memo; the device helpers in the key: aot.device_branch and
    # tests replace them)
    grid, kw = TUNE.memo(("rope", T, D, R, half, x.dtype, x.device, norm, has_w, inverse, qb, accurate, rne),
                         lambda: _plan(T, D, R, half, norm, has_w, inverse, qb, x, y))
    _norm_rope_kernel[grid](
        x, c(w) if has_w else x, c(positions), c(inv_freq), y, R // T, D, D - 2 * half, half,
        float(eps), **kw)
    return y


@implements("rope", supports=predicates.rope_supports)
def rope(x, positions, inv_freq, inverse=False):
    return _launch(x, None, positions, inv_freq, 0.0, False, inverse)


@implements("q_norm_rope", supports=predicates.q_norm_rope_supports)
def q_norm_rope(q, positions, inv_freq, eps):
    return _launch(q, None, positions, inv_freq, eps, True, False)


@implements("kv_norm_rope", supports=predicates.kv_norm_rope_supports)
def kv_norm_rope(kv, weight, positions, inv_freq, eps, nope_quant_block=None):
    return _launch(kv, weight, positions, inv_freq, eps, True, False, nope_quant_block)
