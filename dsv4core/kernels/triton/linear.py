"""linear: ``y = x @ W^T`` with fp32 accumulation, one grouped split-K GEMM kernel for every T.

W is bf16 / fp32, or float8_e4m3fn with 128x128 block dequantisation multipliers (fp32 or e8m0).
The weight is read in place through its strides: never an upcast (or any) copy of it. FP8 codes
are converted to bf16 in registers (exact: every e4m3 value is a bf16 value) and multiplied by
the bf16 activation on the tensor cores; the block scale multiplies each 128-wide partial sum in
fp32, so the result equals the exact dequantisation followed by the fp32 product.

Small T (decode): the weight is streamed once; when the N tiles alone cannot fill the GPU, K is
split over programs (split-K) and a second kernel sums the fp32 partials in a fixed order (one
tree sum over the splits: the result does not depend on scheduling). ``grouped_gemm`` takes G
groups (the ``wo_a`` shape); wo_a keeps its own kernel (wo_a.py) for now: on the H200 this one
measured 29.8 / 32.0 µs at T = 1 / 64 against wo_a.py's 25.3 / 29.3 µs (and 444 vs 468 µs at
T = 4096; see benchmarks/results/cuda-h200-issue10.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import interp, np2, rne, target_programs, to_out
from .launch import Tune
from .predicates import _E8M0, cdiv

#: launch parameters: tuning overrides (benchmarks/tune_triton.py) over the bound backend's launch
#: table (launch.py); the defaults are the kernels' own
TUNE = Tune(__name__)


@triton.jit
def _gemm_kernel(a_ptr, w_ptr, s_ptr, out_ptr, part_ptr,
                 M, N, K, KPS, S, NB, KB,
                 sa_m, sa_g, sa_k, sw_g, sw_n, sw_k, ss_g,
                 G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SCALE: tl.constexpr, E8M0: tl.constexpr, IEEE: tl.constexpr, KSUB: tl.constexpr,
                 EVEN_K: tl.constexpr, SPLIT: tl.constexpr, RNE: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    pz = tl.program_id(2)
    g = (pz // S).to(tl.int64)
    sp = pz % S
    rows = pm * BM + tl.arange(0, BM)
    rm = rows < M
    cols = pn * BN + tl.arange(0, BN)
    cm = cols < N
    kk = tl.arange(0, BK)
    a_base = a_ptr + rows.to(tl.int64)[:, None] * sa_m + g * sa_g
    w_base = w_ptr + g * sw_g + cols.to(tl.int64)[:, None] * sw_n
    k_lo = sp * KPS
    k_hi = tl.minimum(k_lo + KPS, K)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    # one step = KSUB sub-blocks of BK summed into `blk` (with scales: exactly one 128-column block
    # of K, whose multiplier is applied once to the block's sum; fp32 products: a two-level sum)
    for k1 in range(k_lo, k_hi, BK * KSUB):
        blk = tl.zeros([BM, BN], dtype=tl.float32)
        for kin in tl.static_range(KSUB):
            ks = k1 + kin * BK + kk
            if EVEN_K:
                a = tl.load(a_base + ks[None, :] * sa_k, mask=rm[:, None], other=0.0)
                w = tl.load(w_base + ks[None, :] * sw_k, mask=cm[:, None], other=0.0)
            else:
                km = ks < k_hi
                a = tl.load(a_base + ks[None, :] * sa_k, mask=rm[:, None] & km[None, :], other=0.0)
                w = tl.load(w_base + ks[None, :] * sw_k, mask=cm[:, None] & km[None, :], other=0.0)
            if IEEE:
                blk += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            elif SCALE:
                blk = tl.dot(a, tl.trans(w.to(a.dtype)), blk)
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        if SCALE:
            sidx = g * ss_g + (cols // 128) * KB + k1 // 128
            if E8M0:
                sv = tl.exp2(tl.load(s_ptr + sidx, mask=cm, other=127).to(tl.float32) - 127.0)
            else:
                sv = tl.load(s_ptr + sidx, mask=cm, other=0.0)
            acc += blk * sv[None, :]
        elif IEEE:
            acc += blk
    if SPLIT:
        # partials [S, M, G, N] in fp32; _reduce_kernel sums them (a fixed order)
        off = ((sp * M + rows.to(tl.int64))[:, None] * G + g) * N + cols[None, :]
        tl.store(part_ptr + off, acc, mask=rm[:, None] & cm[None, :])
    else:
        off = (rows.to(tl.int64)[:, None] * G + g) * N + cols[None, :]
        tl.store(out_ptr + off, to_out(acc, out_ptr, RNE), mask=rm[:, None] & cm[None, :])


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, R, S, BLOCK: tl.constexpr, SP: tl.constexpr, RNE: tl.constexpr):
    # the S partials of BLOCK outputs loaded at once ([SP, BLOCK], SP = next power of 2 >= S) and
    # summed by one tl.sum: a fixed order for a given S (no dependence on scheduling), and one
    # memory latency instead of S in a row
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < R
    sp = tl.arange(0, SP)
    p = tl.load(part_ptr + sp[:, None].to(tl.int64) * R + offs[None, :], mask=(sp[:, None] < S) & m[None, :], other=0.0)
    tl.store(out_ptr + offs, to_out(tl.sum(p, axis=0), out_ptr, RNE), mask=m)


def _config(M: int, ieee: bool, scaled: bool):
    """(BM, BN, BK, num_warps, num_stages, KSUB) for a row count M (H200 sweep:
    benchmarks/results/tune-issue10-h200-flash-*.json). With block scales BK * KSUB = 128."""
    if ieee:
        # fp32 products (fp32 activations / the interpreter): small tiles, two-level sums
        return min(64, max(16, triton.next_power_of_2(M))), 64, 32, 4, 2, 4
    if M <= 16:
        cfg = (16, 64, 128, 4, 3)
    elif M <= 64:
        cfg = (64, 128, 64, 4, 3) if scaled else (64, 64, 128, 4, 3)
    else:
        cfg = (128, 128, 64, 8, 3)
    if TUNE:
        cfg = tuple(TUNE.get(k, v) for k, v in zip(("BM", "BN", "BK", "num_warps", "num_stages"), cfg))
    BK = cfg[2]
    return cfg + ((128 // BK if 128 % BK == 0 else 0) if scaled else 1,)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, scale, out_dtype: torch.dtype) -> torch.Tensor:
    """``out[m, g, n] = sum_k a[m, g, k] * W[g, n, k] (* block scale)``; a [M, G, K] and w [G, N, K]
    in any strides; scale [G, ceil(N/128), ceil(K/128)] (fp32 / e8m0) or None. Returns [M, G, N]."""
    M, G, K = a.shape
    N = w.shape[1]
    out = torch.empty((M, G, N), dtype=out_dtype, device=a.device)
    if M == 0 or G == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    scaled = scale is not None
    ieee = a.dtype == torch.float32 or w.dtype == torch.float32 or interp(a)
    BM, BN, BK, nw, ns, KSUB = _config(M, ieee, scaled)
    if scaled and BK * KSUB != 128:
        raise ValueError(f"linear: BK={BK} must divide 128 with block-scaled weights (TUNE override?)")
    e8 = scaled and _E8M0 is not None and scale.dtype == _E8M0
    s = scale.contiguous() if scaled else a
    if e8:
        s = s.view(torch.uint8)
    NB, KB = cdiv(N, 128), cdiv(K, 128)
    mt, nt = cdiv(M, BM), cdiv(N, BN)
    # split K when the (M, N, G) tiles alone leave the GPU idle; a split is whole 128-blocks
    step = max(BK * KSUB, 128)  # a multiple of BK * KSUB (128 or 256 here)
    kblocks = cdiv(K, step)
    S = max(1, min(kblocks, TUNE.get("target", target_programs(a.device)) // (mt * nt * G)))
    if TUNE.get("S"):
        S = min(kblocks, TUNE["S"])
    KPS = cdiv(kblocks, S) * step
    S = cdiv(K, KPS)
    part = torch.empty((S, M, G, N), dtype=torch.float32, device=a.device) if S > 1 else out
    grid = (mt, nt, G * S)
    _gemm_kernel[grid](a, w, s, out, part, M, N, K, KPS, S, NB, KB,
                       a.stride(0), a.stride(1), a.stride(2), w.stride(0), w.stride(1), w.stride(2), NB * KB,
                       G=G, BM=BM, BN=BN, BK=BK, SCALE=scaled, E8M0=e8, IEEE=ieee, KSUB=KSUB,
                       EVEN_K=K % KPS == 0 and KPS % (BK * KSUB) == 0, SPLIT=S > 1, RNE=rne(out), num_warps=nw, num_stages=ns, **TUNE.options())
    if S > 1:
        R = M * G * N
        SP = np2(S)
        BLOCK = max(32, min(1024, 8192 // SP))      # <= 8192 partials in flight per program
        _reduce_kernel[(cdiv(R, BLOCK),)](part, out, R, S, BLOCK=BLOCK, SP=SP, RNE=rne(out), num_warps=4, **TUNE.options())
    return out


def linear(x, weight, weight_scale=None, out_dtype=None):
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)  # a view whenever the leading dims allow it; strides are passed through
    out = grouped_gemm(x2.unsqueeze(1), weight.unsqueeze(0), None if weight_scale is None else weight_scale.unsqueeze(0),
                       out_dtype or x.dtype)
    return out.view(*lead, weight.shape[0])
