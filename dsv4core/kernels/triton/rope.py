"""rope, q_norm_rope, kv_norm_rope: one fused pass per row (optional rms norm, then interleaved rope
on the trailing d_r channels), fp32 math, one rounding. cos/sin from libdevice on GPUs."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ._util import accurate, c, np2, cdiv, rne, to_out


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, pos_ptr, f_ptr, y_ptr, R, RPT, D, DR_START, eps,
                      NORM: tl.constexpr, HAS_W: tl.constexpr, INVERSE: tl.constexpr,
                      ACCURATE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                      RNE: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = rows < R
    rows64 = rows.to(tl.int64)
    base = rows64[:, None] * D
    cols = tl.arange(0, BLOCK)
    cm = cols < D
    m = rmask[:, None] & cm[None, :]
    is_rope = (cols >= DR_START) & cm
    pcols = cols ^ 1
    x = tl.load(x_ptr + base + cols[None, :], mask=m, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + base + pcols[None, :], mask=rmask[:, None] & is_rope[None, :],
                 other=0.0).to(tl.float32)
    if NORM:
        ss = tl.sum(x * x, axis=1)
        r = tl.div_rn(1.0, tl.sqrt_rn(ss / D + eps))
        x = x * r[:, None]
        xp = xp * r[:, None]
        if HAS_W:
            w = tl.load(w_ptr + cols, mask=cm, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + pcols, mask=is_rope, other=0.0).to(tl.float32)
            x = x * w[None, :]
            xp = xp * wp[None, :]
    tok = rows64 // RPT
    p = tl.load(pos_ptr + tok, mask=rmask, other=0).to(tl.float32)
    fi = tl.where(is_rope, (cols - DR_START) // 2, 0)
    f = tl.load(f_ptr + fi, mask=is_rope, other=0.0)
    ang = p[:, None] * f[None, :]
    if ACCURATE:
        cs = libdevice.cos(ang)
        sn = libdevice.sin(ang)
    else:
        cs = tl.cos(ang)
        sn = tl.sin(ang)
    if INVERSE:
        sn = -sn
    sgn = tl.where((cols % 2) == 0, -1.0, 1.0)
    rot = x * cs + (sgn[None, :] * xp) * sn
    out = tl.where(is_rope[None, :], rot, x)
    tl.store(y_ptr + base + cols[None, :], to_out(out, y_ptr, RNE), mask=m)


def _launch(x, w, positions, inv_freq, eps, norm, inverse):
    T = x.shape[0]
    D = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    R = x.numel() // D if D > 0 else 0
    if R == 0 or T == 0:
        return y
    x = c(x)
    dr = 2 * inv_freq.shape[0]
    BLOCK = np2(D)
    ROWS = max(1, min(16, 2048 // BLOCK))
    nw = 4 if ROWS * BLOCK <= 2048 else 8
    _norm_rope_kernel[(cdiv(R, ROWS),)](
        x, c(w) if w is not None else x, c(positions), c(inv_freq), y, R, R // T, D, D - dr,
        float(eps), NORM=norm, HAS_W=w is not None, INVERSE=bool(inverse),
        ACCURATE=accurate(x), ROWS=ROWS, BLOCK=BLOCK, RNE=rne(y), num_warps=nw)
    return y


def rope(x, positions, inv_freq, inverse=False):
    return _launch(x, None, positions, inv_freq, 0.0, False, inverse)


def q_norm_rope(q, positions, inv_freq, eps):
    return _launch(q, None, positions, inv_freq, eps, True, False)


def kv_norm_rope(kv, weight, positions, inv_freq, eps):
    return _launch(kv, weight, positions, inv_freq, eps, True, False)
