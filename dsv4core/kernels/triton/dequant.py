"""Quantised weights converted to bf16 once per call, for the GEMMs of many-row calls (prefill).

The GEMM kernels read FP8 and packed FP4 weights in place and convert each weight tile in
registers. That conversion is repeated for every row tile of the call: at T rows and BM-row tiles
each weight is converted ceil(T / BM) times, and on a GPU whose conversion instructions are slower
than its tensor cores the conversions, not the MMAs, bound a prefill GEMM. Past ``dequant_rows``
rows per weight (a launch key of linear, wo_a and moe) the weight is converted once into a bf16
scratch instead and the GEMM reads that, as it reads bf16 weights:

* FP8 e4m3 with UE8M0 (power-of-two) 128 x 128 block scales: code x scale, a bf16 value (exact
  down to 2^-126; below, a bf16 subnormal's step is 2^-133, so within 2^-134 of the value); the GEMM
  then needs no scales. The product with an activation is exact in fp32 either way, so the result
  is the in-register path's up to the order of the fp32 sums;
* FP8 e4m3 with fp32 block scales: the codes only, as bf16 (exact: every e4m3 value is a bf16
  value); the block scales still multiply each block's partial sum in the GEMM;
* packed FP4 e2m1 with one UE8M0 scale per 32 columns: code x 2^(byte - 127), exact in bf16 for
  every scale byte (the smallest value, 0.5 x 2^-127, is a bf16 subnormal; byte 255 is NaN, as in
  the reference): the GEMM then needs no scales at all.

The scratch costs 2 bytes a weight, written once and read by the GEMM; the in-register path reads
0.5-1 byte a weight per row tile. Experts are converted in chunks of at most ``dequant_bytes`` of
scratch, each chunk's GEMM tiles launched after its conversion (moe.py). No host synchronisation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import cdiv, rne_bf16
from .moe_weights import E8M0_MIN_SCALE, FMT_FP4, FMT_FP8, _format, _w_tile
from .predicates import _E8M0

#: the portable default of ``dequant_rows``: None, never convert. Whether converting pays depends on
#: how a device's conversion instructions compare with its tensor cores, and on the GEMM's tiles: on
#: an H200 it lost at and below 1,024 rows for FP8 linear and won from 384 pairs per expert for FP4
#: experts (benchmarks/results/h200/2026-12-03_45d660e/tune/dequant-flash.json), so a plugin's
#: launch table turns it on where it was measured
DEQUANT_ROWS = None
#: the portable default of ``dequant_bytes``: the largest bf16 scratch one call converts into (1 GiB)
DEQUANT_BYTES = 1 << 30


@triton.jit
def _fp4_bf16_kernel(w_ptr, s_ptr, out_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """out [R, C] bf16 = the FP4 weight [R, C / 2] packed bytes (low nibble = even column) times
    its UE8M0 scales [R, C / 32], decoded to fp32 as the GEMMs' "join" read decodes a tile (exact),
    then made bf16 by taking the high half of the bits (exact for these values, subnormals and NaN
    included, whatever a target's fp32 -> bf16 conversion does with subnormals)."""
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = rows < R
    k0 = tl.program_id(1) * BC
    w = _w_tile(w_ptr, s_ptr, 0, rows, rm, k0, C, R, BC, False, 2, True)
    w = (w.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    cols = k0 + tl.arange(0, BC)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], w, mask=rm[:, None] & (cols < C)[None, :])


def fp4_to_bf16(w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A packed FP4 weight [..., R, C / 2] (uint8 / int8 bytes, contiguous) with its UE8M0 scales
    [..., R, C / 32] (bytes) as a bf16 tensor [..., R, C] (written into ``out`` when given: a
    contiguous bf16 tensor of at least that many elements, e.g. a reused scratch)."""
    C = 2 * w.shape[-1]
    R = w.numel() // max(1, w.shape[-1])
    shape = tuple(w.shape[:-1]) + (C,)
    if out is None:
        out = torch.empty(shape, dtype=torch.bfloat16, device=w.device)
    else:
        out = out.reshape(-1)[:R * C].view(shape)
    if R == 0 or C == 0:
        return out
    if scale.dtype != torch.uint8 and scale.element_size() == 1:
        scale = scale.view(torch.uint8)   # UE8M0 read as its bytes
    BC = min(256, triton.next_power_of_2(C))
    BR = max(1, 4096 // BC)
    _fp4_bf16_kernel[(cdiv(R, BR), cdiv(C, BC))](w, scale, out, R, C, BR=BR, BC=BC, num_warps=4)
    return out


@triton.jit
def _fp8_bf16_kernel(w_ptr, s_ptr, out_ptr, R, C, sw_g, sw_r, sw_c, RB, CB, BR: tl.constexpr, BC: tl.constexpr):
    """out [G, R, C] bf16 = FP8 e4m3 codes w [G, R, C] (any strides) times their UE8M0 block
    scales s [G, RB, CB] (bytes; block 128 x 128; BR, BC divide 128): code x 2^(byte - 127) in fp32
    (exact), rounded to bf16 (exact but below 2^-126, where a bf16 subnormal's step is 2^-133)."""
    g = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    w = tl.load(w_ptr + g * sw_g + rows[:, None] * sw_r + cols[None, :] * sw_c, mask=m, other=0.0).to(tl.float32)
    sb = tl.load(s_ptr + (g * RB + tl.program_id(0) * BR // 128) * CB + tl.program_id(1) * BC // 128).to(tl.int32)
    sb = sb & 0xFF
    scale = tl.where(sb == 0, E8M0_MIN_SCALE, ((sb << 23) | ((sb == 255).to(tl.int32) << 22)).to(tl.float32, bitcast=True))
    v = rne_bf16(w * scale)
    v = (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    tl.store(out_ptr + (g * R + rows[:, None]) * C + cols[None, :], v, mask=m)


def fp8_to_bf16(w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 e4m3 weight [..., R, C] (any strides; one leading group dim at most) with UE8M0 block
    scales [..., ceil(R/128), ceil(C/128)] as bf16 values (contiguous; into ``out`` when given)."""
    w3 = w.reshape(-1, *w.shape[-2:]) if w.dim() != 3 else w
    G, R, C = w3.shape
    s3 = scale.reshape(G, *scale.shape[-2:])
    if s3.dtype != torch.uint8:
        s3 = s3.view(torch.uint8)
    if out is None:
        out = torch.empty(w.shape, dtype=torch.bfloat16, device=w.device)
    else:
        out = out.reshape(-1)[:w.numel()].view(w.shape)
    if w.numel() == 0:
        return out
    BC = 128 if C > 64 else 64
    BR = 32
    _fp8_bf16_kernel[(cdiv(R, BR), cdiv(C, BC), G)](w3, s3.contiguous(), out, R, C, w3.stride(0), w3.stride(1),
                                                    w3.stride(2), s3.shape[1], s3.shape[2], BR=BR, BC=BC,
                                                    num_warps=4)
    return out


def fp8_codes(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """FP8 e4m3 codes as bf16 (the same values; the block scales stay with the GEMM), into ``out``
    when given (contiguous bf16 scratch of at least ``w.numel()`` elements; w then contiguous)."""
    if out is None:
        return w.to(torch.bfloat16)
    return out.reshape(-1)[:w.numel()].view(w.shape).copy_(w)


def expert_chunks(E: int, weight_elems: int, budget: int) -> int:
    """Experts a chunk holds so that its bf16 scratch (``weight_elems`` values an expert, the larger
    of the two expert weights) stays within ``budget`` bytes: at least one."""
    return max(1, min(E, budget // max(1, 2 * weight_elems)))


def wanted(tune, op: str, rows: int, weights: int = 1) -> bool:
    """Whether a call of ``op`` with ``rows`` rows over ``weights`` weights (moe: pairs over
    experts) converts its quantised weights: ``rows >= dequant_rows * weights``; TUNE /
    launch-table key ``dequant_rows`` (None: never; default :data:`DEQUANT_ROWS`, never)."""
    n = tune.get("dequant_rows", DEQUANT_ROWS)
    if n is None:
        return False
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{op}: TUNE dequant_rows={n!r} must be None or an int >= 0")
    return rows >= n * weights


def budget(tune, op: str) -> int:
    """The scratch bytes a call may convert into: TUNE key ``dequant_bytes`` (default
    :data:`DEQUANT_BYTES`)."""
    n = tune.get("dequant_bytes", DEQUANT_BYTES)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{op}: TUNE dequant_bytes={n!r} must be an int >= 1")
    return n


def expert_weights(w: torch.Tensor, scale, e0: int, e1: int, scratch: torch.Tensor):
    """(weight, scale) of experts [e0, e1) of a [E, R, C] expert weight as the GEMM reads them
    once converted into ``scratch``: packed FP4 -> bf16 values, no scale; FP8 -> bf16 codes with
    the experts' block scales; a plain weight: its experts as they are (views)."""
    fmt = _format(w, scale)[0]
    if fmt == FMT_FP4:
        return fp4_to_bf16(w[e0:e1], scale[e0:e1], scratch), None
    if fmt == FMT_FP8 and foldable(scale):
        return fp8_to_bf16(w[e0:e1], scale[e0:e1], scratch), None
    if fmt == FMT_FP8:
        return fp8_codes(w[e0:e1], scratch), scale[e0:e1]
    return w[e0:e1], None


def foldable(scale) -> bool:
    """Whether FP8 block scales fold into the bf16 values (UE8M0: powers of two, so code x scale
    is a bf16 value); fp32 scales stay with the GEMM (the codes converted only)."""
    return scale is not None and _E8M0 is not None and scale.dtype == _E8M0
