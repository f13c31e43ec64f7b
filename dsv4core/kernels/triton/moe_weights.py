"""How the expert kernels (moe.py) read a weight tile: the format tags of an expert weight, the
FP4 e2m1 decodes ("join": codes and UE8M0 scales decoded to fp32 from their bit patterns;
"scaled": ``tl.dot_scaled`` on the packed bytes), FP8 e4m3 tiles converted to the dot dtype with
their 128x128 block multipliers, and the bf16 halves the down GEMM splits its fp32 activation into.
Device helpers (``@triton.jit``) and the host-side format / launch-key choices; no kernel of its own.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .predicates import _E8M0, _FP8

#: weight format tags of an expert weight (``_format``): plain, FP8 with 128x128 block scales,
#: packed FP4 with per-32-column scales
FMT_PLAIN, FMT_FP8, FMT_FP4 = 0, 1, 2

#: the UE8M0 scale byte 0: 2^-127, an fp32 subnormal
E8M0_MIN_SCALE = tl.constexpr(2.0 ** -127)


@triton.jit
def _fp4_values(b, sb):
    """e2m1 codes ``b`` (int32, 0..15) times UE8M0 scales ``sb`` (int32 bytes) as fp32, built from
    the fp32 bit pattern (exact; the scale byte 0 is 2^-127, a subnormal; byte 255 is NaN, as in
    the reference, for every code: the quiet-NaN bit joins the all-ones exponent)."""
    idx = b & 7
    ex = idx >> 1
    mant = idx & 1
    bits = tl.where(ex == 0, mant * (126 << 23), ((ex + 126) << 23) | (mant << 22)) | ((b & 8) << 28)
    scale = tl.where(sb == 0, E8M0_MIN_SCALE,
                     ((sb << 23) | ((sb == 255).to(tl.int32) << 22)).to(tl.float32, bitcast=True))
    return bits.to(tl.float32, bitcast=True) * scale


@triton.jit
def _fp4_bytes(w_ptr, s_ptr, e, rows, rmask, k0, C, R, BK: tl.constexpr, EVEN: tl.constexpr):
    """The packed bytes [rows, BK/2] (uint8; byte j = columns k0 + 2j (low nibble), k0 + 2j + 1) and
    the UE8M0 scale bytes [rows, BK/32] (uint8) of columns [k0, k0 + BK) of a [E, R, C] FP4 weight."""
    r = e * R + rows
    jj = k0 // 2 + tl.arange(0, BK // 2)
    m = rmask[:, None] & (jj < C // 2)[None, :]
    if EVEN:
        m = rmask[:, None]
    b = tl.load(w_ptr + r[:, None] * (C // 2) + jj[None, :], mask=m, other=0)
    gg = k0 // 32 + tl.arange(0, BK // 32)
    sm = rmask[:, None] & (gg < C // 32)[None, :]
    sb = tl.load(s_ptr + r[:, None] * (C // 32) + gg[None, :], mask=sm, other=127)
    return b.to(tl.uint8, bitcast=True), sb.to(tl.uint8, bitcast=True)


@triton.jit
def _hi_lo(a):
    """fp32 ``a`` as two bf16 halves (a_hi + a_lo carries ~16 mantissa bits of a)."""
    a_hi = a.to(tl.bfloat16)
    return a_hi, (a - a_hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _stack_rows(a, b):
    """[M, K] and [M, K] -> [2M, K] (a's rows first)."""
    return tl.reshape(tl.permute(tl.join(a, b), (2, 0, 1)), (2 * a.shape[0], a.shape[1]))


@triton.jit
def _sum_halves(t, M: tl.constexpr):
    """[2M, N] -> [M, N]: the first M rows plus the last M."""
    top, bot = tl.split(tl.permute(tl.reshape(t, (2, M, t.shape[1])), (1, 2, 0)))
    return top + bot


@triton.jit
def _scaled_dot(a, w_ptr, s_ptr, e, rows, rmask, k0, C, R, acc, BK: tl.constexpr, EVEN: tl.constexpr):
    """FP4 "scaled": acc + a (bf16) @ W^T through tl.dot_scaled, W as its packed bytes (k-packed,
    low nibble first) with the UE8M0 scales as the microscales."""
    b, sb = _fp4_bytes(w_ptr, s_ptr, e, rows, rmask, k0, C, R, BK, EVEN)
    acc = tl.dot_scaled(a, None, "bf16", tl.trans(b), sb, "e2m1", acc)
    return acc


@triton.jit
def _w_tile(w_ptr, s_ptr, e, rows, rmask, k0, C, R, BK: tl.constexpr, EVEN: tl.constexpr,
            FMT: tl.constexpr, IEEE: tl.constexpr, VIA32: tl.constexpr = False):
    """Rows ``rows`` (int64, within expert e) x columns [k0, k0 + BK) of a [E, R, C] expert weight,
    as the dot operand dtype (fp32 under IEEE, else bf16). FP4 ("join"): the packed bytes are read
    as a [rows, BK/2] tile, both nibbles decoded and scaled (exact), then interleaved (low nibble =
    even column); FP8: converted only (its block scale multiplies the block's partial sum).
    (Kept as written before the "scaled" decode, not sharing its ``_fp4_bytes``: the default
    launches compile to the code the last GPU conformance run verified; see aot.py --compare.)"""
    r = e * R + rows
    if FMT == 2:
        jj = k0 // 2 + tl.arange(0, BK // 2)
        m = rmask[:, None] & (jj < C // 2)[None, :]
        if EVEN:
            m = rmask[:, None]
        b = tl.load(w_ptr + r[:, None] * (C // 2) + jj[None, :], mask=m, other=0).to(tl.int32) & 0xFF
        gg = k0 // 32 + tl.arange(0, BK // 32)
        sm = rmask[:, None] & (gg < C // 32)[None, :]
        sb = tl.load(s_ptr + r[:, None] * (C // 32) + gg[None, :], mask=sm, other=127).to(tl.int32) & 0xFF
        sb = tl.reshape(tl.broadcast_to(sb[:, :, None], (rows.shape[0], BK // 32, 16)), (rows.shape[0], BK // 2))
        w = tl.reshape(tl.join(_fp4_values(b & 0xF, sb), _fp4_values(b >> 4, sb)), (rows.shape[0], BK))
    else:
        ks = k0 + tl.arange(0, BK)
        m = rmask[:, None] & (ks < C)[None, :]
        if EVEN:
            m = rmask[:, None]
        w = tl.load(w_ptr + r[:, None] * C + ks[None, :], mask=m, other=0.0)
    if IEEE:
        w = w.to(tl.float32)
    else:
        if VIA32:   # FP8 through fp32 (TUNE fp8 "via_f32": the same bf16 values, as in linear.py)
            w = w.to(tl.float32)
        w = w.to(tl.bfloat16)
    return w


@triton.jit
def _fp8_scale(s_ptr, e, rows, rmask, k0, R, C, E8M0: tl.constexpr):
    """Block multipliers [len(rows)] for rows ``rows`` and the 128-column block holding ``k0``."""
    RB = (R + 127) // 128
    CB = (C + 127) // 128
    idx = (e * RB + rows // 128) * CB + k0 // 128
    if E8M0:
        sv = tl.exp2(tl.load(s_ptr + idx, mask=rmask, other=127).to(tl.float32) - 127.0)
    else:
        sv = tl.load(s_ptr + idx, mask=rmask, other=0.0)
    return sv


def _format(w, scale):
    if scale is None:
        return FMT_PLAIN, w.shape[2], False
    if _FP8 and w.dtype in _FP8:
        return FMT_FP8, w.shape[2], _E8M0 is not None and scale.dtype == _E8M0
    return FMT_FP4, 2 * w.shape[2], True


def _scale_arg(scale, fmt, e8, fallback):
    if scale is None:
        return fallback
    if e8 and scale.dtype != torch.uint8:
        return scale.view(torch.uint8)
    return scale


#: TUNE["fp4"]: how the kernels read FP4 expert weights (a launch key next to the tiles; FP8 is
#: converted to the dot dtype in registers, its block scale on the block's partial sum). Both exact,
#: up to the deviation stated:
#:   "scaled" (the CUDA plugin's choice on sm90): tl.dot_scaled(bf16 activation, packed bytes [BK/2, BN] k-packed low nibble first,
#:       UE8M0 scales [BN, BK/32], "e2m1"). On a GPU without native microscaling (H200) Triton
#:       upcasts to bf16 and multiplies by the scale as a bf16 (byte << 7): byte 0 becomes 0, not
#:       2^-127, so a group with scale byte 0 (and with byte 1 its 0.5 codes, should the bf16
#:       multiply flush subnormals) reads as 0: |error| <= 6 * 2^-126 a weight; byte 255 is NaN as
#:       in the reference (fast_math off). The interpreter keeps 2^-127. It needs bf16 operands:
#:       fp32 activations (the IEEE path) read FP4 as "join". In the down GEMM it stacks a_hi /
#:       a_lo into one [2 BM, BK] operand (the weight read once a step) and sums the two halves of
#:       the [2 BM, BNd] accumulator at the end;
#:   "join" (default): codes and scales decoded to fp32 (a multiply), cast, nibbles interleaved.
#: (H200, benchmarks/results/h200/2026-12-01_2494243/tune/moe_experts-variants-flash.json: "scaled" 128-141 µs vs "join" 210 at T = 1, 623 vs 876
#: at T = 64; the FP4 "split" and FP8 "scaled" decodes lost there and were removed.)
DECODES = ("join", "scaled")
#: TUNE["fp8"]: FP8 weights converted to bf16 directly ("cvt") or through fp32 ("via_f32": the same
#: values): linear's FP8_PATHS (imported by moe.py), which says why


def _decode_keys(fmt: int, f32: bool, fp4: str, fp8: str) -> dict:
    """The SCALED / VIA32 launch keywords of one weight: SCALED for FP4 weights read by "scaled"
    with bf16 activations; VIA32 for FP8 weights read "via_f32", passed only when set (the default
    launch keeps its arguments and code)."""
    keys = {"SCALED": fmt == FMT_FP4 and fp4 == "scaled" and not f32}
    if fmt == FMT_FP8 and fp8 == "via_f32":
        keys["VIA32"] = True
    return keys
