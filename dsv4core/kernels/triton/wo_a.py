"""wo_a: grouped projection out[t,g,r] = sum_d o[t,g,d] w[g,r,d]; bf16/fp32 weights, or fp8 e4m3
weights with 128x128 block dequant multipliers (fp32 or e8m0). fp32 accumulation."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import c, cdiv, interp, rne, to_out
from .launch import Tune
from .predicates import _E8M0

#: launch parameters: tuning overrides over the bound backend's launch table (launch.py)
TUNE = Tune(__name__)


@triton.jit
def _wo_a_kernel(o_ptr, w_ptr, s_ptr, out_ptr, T, G, R, D, RB, DB,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SCALE: tl.constexpr,
                 E8M0: tl.constexpr, F32: tl.constexpr, INTERP: tl.constexpr,
                 RNE: tl.constexpr, KSUB: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    g = tl.program_id(2).to(tl.int64)
    rows = pm * BM + tl.arange(0, BM)
    rm = rows < T
    cols = pn * BN + tl.arange(0, BN)
    cm = cols < R
    kk = tl.arange(0, BK)
    a_base = o_ptr + (rows.to(tl.int64)[:, None] * G + g) * D
    b_base = w_ptr + (g * R + cols.to(tl.int64)[:, None]) * D
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    # KSUB sub-blocks summed into `part` before the running sum: two-level fp32 accumulation
    # (fp32 activations: keeps the rounding of a length-D dot close to cuBLAS's blocked sums)
    for k1 in range(0, D, BK * KSUB):
        part = tl.zeros([BM, BN], dtype=tl.float32)
        for kin in tl.static_range(KSUB):
            k0 = k1 + kin * BK
            ks = k0 + kk
            km = ks < D
            a = tl.load(a_base + ks[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            b = tl.load(b_base + ks[None, :], mask=cm[:, None] & km[None, :], other=0.0)
            if INTERP:
                a = a.to(tl.float32)
            if SCALE:
                if INTERP:
                    b = b.to(tl.float32)
                else:
                    b = b.to(a.dtype)
                if F32 or INTERP:
                    part_k = tl.dot(a, tl.trans(b), input_precision="ieee")
                else:
                    part_k = tl.dot(a, tl.trans(b))
                sidx = (g * RB + cols // 128) * DB + k0 // 128
                if E8M0:
                    sv = tl.load(s_ptr + sidx, mask=cm, other=127).to(tl.float32)
                    sv = tl.exp2(sv - 127.0)
                else:
                    sv = tl.load(s_ptr + sidx, mask=cm, other=0.0)
                part += part_k * sv[None, :]
            else:
                if F32 or INTERP:
                    part += tl.dot(a, tl.trans(b.to(tl.float32)), input_precision="ieee")
                else:
                    part = tl.dot(a, tl.trans(b), part)
        acc += part
    out_off = (rows.to(tl.int64)[:, None] * G + g) * R + cols[None, :]
    tl.store(out_ptr + out_off, to_out(acc, out_ptr, RNE), mask=rm[:, None] & cm[None, :])


@triton.jit
def _wo_a_gemv_kernel(o_ptr, w_ptr, out_ptr, T, G, R, D,
                      TP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RNE: tl.constexpr):
    # decode shapes (a few tokens): plain FMA dot products, the weight streamed once
    pn = tl.program_id(0)
    g = tl.program_id(1).to(tl.int64)
    cols = pn * BN + tl.arange(0, BN)
    cm = cols < R
    toks = tl.arange(0, TP)
    kk = tl.arange(0, BK)
    w_base = w_ptr + (g * R + cols.to(tl.int64)[:, None]) * D
    acc = tl.zeros([TP, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        ks = k0 + kk
        km = ks < D
        w = tl.load(w_base + ks[None, :], mask=cm[:, None] & km[None, :], other=0.0).to(tl.float32)
        for t in tl.static_range(TP):
            a = tl.load(o_ptr + (t * G + g) * D + ks, mask=km & ((kk * 0 + t) < T), other=0.0).to(tl.float32)
            part = tl.sum(w * a[None, :], axis=1)
            acc += tl.where(toks[:, None] == t, part[None, :], 0.0)
    out_off = (toks.to(tl.int64)[:, None] * G + g) * R + cols[None, :]
    tl.store(out_ptr + out_off, to_out(acc, out_ptr, RNE), mask=(toks < T)[:, None] & cm[None, :])


def wo_a(o, weight, weight_scale=None):
    T, G, D = o.shape
    R = weight.shape[1]
    out = torch.empty((T, G, R), dtype=o.dtype, device=o.device)
    if T == 0 or G == 0 or R == 0:
        return out
    o, weight = c(o), c(weight)
    f32 = o.dtype == torch.float32
    scaled = weight_scale is not None
    if TUNE.get("gemv", False) and not scaled and T <= 4:
        BN, BK = TUNE.get("gBN", 32), TUNE.get("gBK", 256)
        _wo_a_gemv_kernel[(cdiv(R, BN), G)](o, weight, out, T, G, R, D, TP=triton.next_power_of_2(T), BN=BN,
                                            BK=BK, RNE=rne(out), num_warps=TUNE.get("num_warps", 4), **TUNE.options())
        return out
    e8 = scaled and _E8M0 is not None and weight_scale.dtype == _E8M0
    s = c(weight_scale) if scaled else o
    if e8:
        s = s.view(torch.uint8)
    if scaled:
        BK = 128 if not f32 else 32
    else:
        BK = 64 if not f32 else 32
    if T <= 16:
        BM, BN, nw, ns = 16, 32, 4, 4
        BK = 256 if not (f32 or scaled) else BK
    elif T <= 64:
        BM, BN, nw, ns = 64, 32, 4, 4
        BK = 128 if not f32 else BK
    else:
        BM, BN, nw, ns = 128, 128, 8, 3
    if f32:
        BM, BN, ns = min(BM, 64), min(BN, 64), 2
    KSUB = 4 if f32 else 1
    if TUNE and not f32:
        BM, BN, BK, nw, ns = (TUNE.get(k, v) for k, v in (("BM", BM), ("BN", BN), ("BK", BK),
                                                           ("num_warps", nw), ("num_stages", ns)))
    if scaled and 128 % BK:
        # one scale per 128 columns of D is read per BK step: a BK step must not straddle scale blocks
        raise ValueError(f"wo_a: BK={BK} must divide 128 with block-scaled weights (TUNE override?)")
    RB, DB = cdiv(R, 128), cdiv(D, 128)
    grid = (cdiv(T, BM), cdiv(R, BN), G)
    _wo_a_kernel[grid](o, weight, s, out, T, G, R, D, RB, DB, BM=BM, BN=BN, BK=BK, SCALE=scaled,
                       E8M0=e8, F32=f32, INTERP=interp(o), RNE=rne(out), KSUB=KSUB, num_warps=nw, num_stages=ns, **TUNE.options())
    return out
