"""mHC kernels: hc_post (one pass), hc_pre and hc_head (two launches each).

hc_pre / hc_head:
  1. ``_hc_mix_kernel``: grid (token blocks, K-slices). Each program computes ``fn @ xf`` and
     ``sum(xf^2)`` over its K-slice for its tokens and stores the fp32 partial; split-K spreads the
     1.5 MiB ``fn`` read over all SMs at small T. x stays bf16 (exact) and fn is split into three
     bf16 parts (bf16x3, fp32-accurate; the SPEC 2 hc_pre accuracy contract would allow TF32);
     fp32 activations use ``ieee`` products.
  2. an epilogue kernel per (token, H-block): reduce the partials in slice order, rms, sigmoid /
     Sinkhorn (n x n in registers, recomputed per H-block, it is tiny), collapse
     ``y = sum_j pre_j x_j``.

TUNE keys (benchmarks/tune_triton.py sweeps them): ``target``, the programs the split-K mixes aim
for (fewer, fatter K-slices: a shorter partial reduction in the epilogue); block sizes and warps.

Programmatic dependent launch (Triton's NVIDIA extras) was considered and left out: the portable
kernels use no vendor extras; a plugin-side way to enable it is an open idea.

A one-pass variant (the last program of a token block reducing the partials, behind an arrival
counter, then Sinkhorn and the collapse) was built and timed on the H200
(benchmarks/results/h200/2026-12-01_8397775/tune/all-ops-flash.json): 11.4 / 21.4 / 58.2 / 443 µs for hc_pre at
T = 1 / 8 / 64 / 4096 against these two launches' 11.8 / 12.1 / 17.2 / 115 µs (its serial tail costs
more than the second launch saves), so it was removed; it is in the git history (commit 6100a27).
Removed the same way (benchmarks/results/h200/2026-12-01_2494243/tune/mhc-attention-variants-flash.json; the
code is at commit 2494243): a "vec" epilogue (a program per token block, per-token vectors, the
n x n Sinkhorn as explicit adds, post / comb in their own program column): hc_pre 14.0 / 14.7 /
21.5 / 122.9 µs at T = 1 / 8 / 64 / 4096 against 11.6 / 12.1 / 17.3 / 116.3; and fp32 FMA mixes
below 16 tokens (no MMA tile): the mix kernel 10.6 µs against 5.8 at T = 8.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import c, np2, cdiv, interp, rne, target_programs, to_out
from .launch import Tune
from . import predicates
from .registry import implements

#: programs wanted under the interpreter (CPU); on a GPU: 2 per SM of the device
_CPU_PROGRAMS = 264
#: launch parameters: tuning overrides (benchmarks/tune_triton.py) over the bound backend's launch
#: table (launch.py); the defaults are the kernels' own
TUNE = Tune(__name__)   # its keys: launch.TUNING_KEYS


# --------------------------------------------------------------------------------------------- hc_post
@triton.jit
def _hc_post_kernel(o_ptr, r_ptr, post_ptr, comb_ptr, out_ptr, H,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr,
                    RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    cols = hb * BLOCK + tl.arange(0, BLOCK)
    cm = cols < H
    k = tl.arange(0, NP)
    km = k < N
    o = tl.load(o_ptr + t * H + cols, mask=cm, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + k, mask=km, other=0.0).to(tl.float32)
    acc = post[:, None] * o[None, :]
    for j in tl.static_range(N):
        rj = tl.load(r_ptr + (t * N + j) * H + cols, mask=cm, other=0.0).to(tl.float32)
        cj = tl.load(comb_ptr + t * N * N + j * N + k, mask=km, other=0.0).to(tl.float32)
        acc += cj[:, None] * rj[None, :]
    m = km[:, None] & cm[None, :]
    tl.store(out_ptr + (t * N + k[:, None]) * H + cols[None, :], to_out(acc, out_ptr, RNE), mask=m)


@implements("hc_post", supports=predicates.hc_post_supports)
def hc_post(o, residual, post, comb):
    T, n, H = residual.shape
    out = torch.empty((T, n, H), dtype=residual.dtype, device=residual.device)
    if T == 0 or H == 0:
        return out
    o, residual, post, comb = c(o), c(residual), c(post), c(comb)
    # the launch but the tensors: planned once per shapes, dtype, device and the launch parameters
    # in effect (Tune.memo; the device helpers in the key: aot.device_branch and tests replace them)
    grid, kw = TUNE.memo(("post", T, n, H, out.dtype, out.device, target_programs, rne),
                         lambda: _post_plan(T, n, H, out))
    _hc_post_kernel[grid](o, residual, post, comb, out, H, **kw)
    return out


def _post_plan(T, n, H, out):
    BLOCK = min(1024, np2(H))
    while BLOCK > 128 and T * cdiv(H, BLOCK) < target_programs(out.device, _CPU_PROGRAMS):
        BLOCK //= 2
    BLOCK = TUNE.get("post_BLOCK", BLOCK)
    nw = TUNE.get("post_num_warps", 4 if BLOCK >= 512 else (2 if BLOCK >= 256 else 1))
    return (T, cdiv(H, BLOCK)), dict(N=n, NP=np2(n), BLOCK=BLOCK, RNE=rne(out), num_warps=nw, **TUNE.options())


# -------------------------------------------------------------------------------- mixes product (split-K)
@triton.jit
def _mix_acc(x_ptr, fn_ptr, pt, ps, T, K, M, KSPLIT, BT: tl.constexpr, MP: tl.constexpr,
             BK: tl.constexpr, IEEE: tl.constexpr):
    """(fn @ xf over K-slice ps [BT, MP], sum of xf^2 over it [BT], token offsets, token mask, mix
    columns) for token block pt.

    IEEE (fp32 activations, or the interpreter): true fp32 products. Otherwise x stays bf16 (exact)
    and fn is split into three bf16 parts (hi + mid + lo = 24 mantissa bits): 3 bf16 MMAs with
    exact products and fp32 accumulation, i.e. fp32-accurate (the op is memory-bound anyway)."""
    toks = pt * BT + tl.arange(0, BT)
    tm = toks < T
    toks64 = toks.to(tl.int64)
    ms = tl.arange(0, MP)
    mm = ms < M
    k_lo = ps * KSPLIT
    k_hi = tl.minimum(k_lo + KSPLIT, K)
    acc = tl.zeros([BT, MP], dtype=tl.float32)
    ss = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + tl.arange(0, BK)
        km = ks < k_hi
        xr = tl.load(x_ptr + toks64[:, None] * K + ks[None, :], mask=tm[:, None] & km[None, :], other=0.0,
                     eviction_policy="evict_last")   # re-read by the collapse: keep in L2
        x = xr.to(tl.float32)
        f = tl.load(fn_ptr + ms[:, None] * K + ks[None, :], mask=mm[:, None] & km[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x, tl.trans(f), input_precision="ieee")
        else:
            f_hi = f.to(tl.bfloat16)
            f_r = f - f_hi.to(tl.float32)
            f_mid = f_r.to(tl.bfloat16)
            f_lo = (f_r - f_mid.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(xr, tl.trans(f_hi), acc)
            acc = tl.dot(xr, tl.trans(f_mid), acc)
            acc = tl.dot(xr, tl.trans(f_lo), acc)
        ss += tl.sum(x * x, axis=1)
    return acc, ss, toks64, tm, ms


@triton.jit
def _hc_mix_kernel(x_ptr, fn_ptr, zp_ptr, ssp_ptr, T, K, M, KSPLIT,
                   BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr, IEEE: tl.constexpr):
    ps = tl.program_id(1)
    acc, ss, toks64, tm, ms = _mix_acc(x_ptr, fn_ptr, tl.program_id(0), ps, T, K, M, KSPLIT, BT, MP, BK, IEEE)
    row = ps * T + toks64
    tl.store(zp_ptr + row[:, None] * MP + ms[None, :], acc, mask=tm[:, None])
    tl.store(ssp_ptr + row, ss, mask=tm)


def _mix(x2, fn, M):
    """x2: [T, K] (contiguous, act dtype), fn [M, K] f32 -> (zpart [S, T, MP], sspart [S, T], S, MP)."""
    T, K = x2.shape
    # the launch but the tensors: planned once per shapes, dtype, device and the launch parameters
    # in effect (Tune.memo; the device helpers in the key: aot.device_branch and tests replace them)
    grid, S, MP, KSPLIT, kw = TUNE.memo(("mix", T, K, M, x2.dtype, x2.device, target_programs, interp),
                                        lambda: _mix_plan(T, K, M, x2))
    zp = torch.empty((S, T, MP), dtype=torch.float32, device=x2.device)
    ssp = torch.empty((S, T), dtype=torch.float32, device=x2.device)
    _hc_mix_kernel[grid](x2, fn, zp, ssp, T, K, M, KSPLIT, **kw)
    return zp, ssp, S, MP


def _mix_plan(T, K, M, x2):
    MP = max(16, np2(M))
    # portable tiles: the token block grows with T (16 / 32 / 64) so that split-K still fills the
    # device at small T; 128 columns a K step for up to 32 mix columns, 64 above (bf16x3: three
    # dots per step); 4 warps, 3 stages: <= 48 KiB of shared memory in the sm90 compile (fp32: 64);
    # no device timed. Tuned (prefill) tiles are in the plugins' launch tables
    BT = TUNE.get("BT", 16 if T <= 16 else (32 if T <= 256 else 64))
    BK = TUNE.get("BK", 64 if MP > 32 else 128)
    ntb = cdiv(T, BT)
    nkb = cdiv(K, BK)
    S = max(1, min(nkb, TUNE.get("target", target_programs(x2.device, _CPU_PROGRAMS)) // ntb))
    KSPLIT = cdiv(nkb, S) * BK
    S = cdiv(K, KSPLIT)
    return (ntb, S), S, MP, KSPLIT, dict(BT=BT, BK=BK, MP=MP, IEEE=x2.dtype == torch.float32 or interp(x2),
                                         num_warps=TUNE.get("num_warps", 4), num_stages=TUNE.get("num_stages", 3),
                                         **TUNE.options())


# ------------------------------------------------------------------------------------- hc_pre epilogue
@triton.jit
def _collapse(x_ptr, y_ptr, pre, t, K, H, i, im, hb, HCH, BH: tl.constexpr, RNE: tl.constexpr):
    """y[t, cols] = sum_j pre_j * x[t, j, cols] over this program's H-chunk (fp32 accumulate, one
    rounding): the stream collapse shared by hc_pre and hc_head."""
    h_lo = hb * HCH
    h_hi = tl.minimum(h_lo + HCH, H)
    for h0 in range(h_lo, h_hi, BH):
        cols = h0 + tl.arange(0, BH)
        cm = cols < h_hi
        xs = tl.load(x_ptr + t * K + i[:, None] * H + cols[None, :], mask=im[:, None] & cm[None, :],
                     other=0.0).to(tl.float32)
        y = tl.sum(pre[:, None] * xs, axis=0)
        tl.store(y_ptr + t * H + cols, to_out(y, y_ptr, RNE), mask=cm)


@triton.jit
def _hc_pre_epi_kernel(x_ptr, zp_ptr, ssp_ptr, scale_ptr, base_ptr, y_ptr, post_ptr, comb_ptr,
                       T, H, S, rms_eps, hc_eps, iters, post_mult,
                       N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, BH: tl.constexpr,
                       RNE: tl.constexpr, SP: tl.constexpr, HCH):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    K = N * H
    i = tl.arange(0, NP)
    im = i < N
    m2 = im[:, None] & im[None, :]
    zi2 = i[:, None] * N + i[None, :]
    sp = tl.arange(0, SP)
    spm = sp < S
    rb = (sp * T + t) * MP
    z_pre = tl.sum(tl.load(zp_ptr + rb[:, None] + i[None, :], mask=spm[:, None] & im[None, :], other=0.0), 0)
    z_post = tl.sum(tl.load(zp_ptr + rb[:, None] + N + i[None, :], mask=spm[:, None] & im[None, :],
                            other=0.0), 0)
    Z = tl.sum(tl.load(zp_ptr + rb[:, None, None] + 2 * N + zi2[None, :, :],
                       mask=spm[:, None, None] & m2[None, :, :], other=0.0), 0)
    ss = tl.sum(tl.load(ssp_ptr + sp * T + t, mask=spm, other=0.0), 0)
    rho = tl.div_rn(1.0, tl.sqrt_rn(ss / K + rms_eps))
    s0 = tl.load(scale_ptr)
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    b_pre = tl.load(base_ptr + i, mask=im, other=0.0)
    b_post = tl.load(base_ptr + N + i, mask=im, other=0.0)
    B = tl.load(base_ptr + 2 * N + zi2, mask=m2, other=0.0)
    pre = tl.sigmoid(s0 * (rho * z_pre) + b_pre) + hc_eps
    post = post_mult * tl.sigmoid(s1 * (rho * z_post) + b_post)
    L = s2 * (rho * Z) + B
    L = tl.where(m2, L, float("-inf"))
    mx = tl.max(L, axis=1)
    E = tl.exp(L - mx[:, None])
    E = tl.where(m2, E, 0.0)
    C = E / tl.sum(E, axis=1)[:, None] + hc_eps
    C = tl.where(m2, C, 0.0)
    C = C / (tl.sum(C, axis=0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        C = C / (tl.sum(C, axis=1)[:, None] + hc_eps)
        C = C / (tl.sum(C, axis=0)[None, :] + hc_eps)
    if hb == 0:
        tl.store(post_ptr + t * N + i, post, mask=im)
        tl.store(comb_ptr + t * N * N + zi2, C, mask=m2)
    _collapse(x_ptr, y_ptr, pre, t, K, H, i, im, hb, HCH, BH, RNE)


def _epi_block(T, H, device):
    """(BH, HCH, programs along H): one warp per program (the n x n Sinkhorn reductions stay inside
    a warp: no shared-memory barriers), computed once per (token, H-chunk of HCH columns); enough
    H-chunks that small T still spreads over the SMs; the chunk is collapsed BH columns at a time."""
    BH = min(256, np2(H))
    nch = max(1, min(cdiv(H, BH), cdiv(target_programs(device, _CPU_PROGRAMS), T)))
    nch = TUNE.get("epi_chunks", nch)
    HCH = cdiv(cdiv(H, nch), BH) * BH
    return BH, HCH, cdiv(H, HCH)


@implements("hc_pre", supports=predicates.hc_pre_supports)
def hc_pre(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
    T, n, H = x.shape
    dev = x.device
    y = torch.empty((T, H), dtype=x.dtype, device=dev)
    post = torch.empty((T, n), dtype=torch.float32, device=dev)
    comb = torch.empty((T, n, n), dtype=torch.float32, device=dev)
    if T == 0:
        return y, post, comb
    x = c(x)
    zp, ssp, S, MP = _mix(x.view(T, n * H), c(fn), (2 + n) * n)
    grid, kw = TUNE.memo(("pre", T, n, H, S, MP, y.dtype, dev, target_programs, rne),
                         lambda: _epi_plan(T, n, H, S, MP, y))
    _hc_pre_epi_kernel[grid](x, zp, ssp, c(scale), c(base), y, post, comb, T, H, S, float(rms_eps),
                             float(hc_eps), int(iters), float(post_mult), **kw)
    return y, post, comb


def _epi_plan(T, n, H, S, MP, y):
    """hc_pre's / hc_head's epilogue launch: (grid, keywords)."""
    BH, HCH, nhb = _epi_block(T, H, y.device)
    return (T, nhb), dict(N=n, NP=np2(n), MP=MP, BH=BH, RNE=rne(y), SP=np2(S), HCH=HCH,
                          num_warps=TUNE.get("epi_num_warps", 1), **TUNE.options())


# ------------------------------------------------------------------------------------- hc_head epilogue
@triton.jit
def _hc_head_epi_kernel(x_ptr, zp_ptr, ssp_ptr, scale_ptr, base_ptr, y_ptr,
                        T, H, S, rms_eps, hc_eps,
                        N: tl.constexpr, NP: tl.constexpr, MP: tl.constexpr, BH: tl.constexpr,
                       RNE: tl.constexpr, SP: tl.constexpr, HCH):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    K = N * H
    i = tl.arange(0, NP)
    im = i < N
    sp = tl.arange(0, SP)
    spm = sp < S
    z = tl.sum(tl.load(zp_ptr + ((sp * T + t) * MP)[:, None] + i[None, :], mask=spm[:, None] & im[None, :],
                       other=0.0), 0)
    ss = tl.sum(tl.load(ssp_ptr + sp * T + t, mask=spm, other=0.0), 0)
    rho = tl.div_rn(1.0, tl.sqrt_rn(ss / K + rms_eps))
    s0 = tl.load(scale_ptr)
    b = tl.load(base_ptr + i, mask=im, other=0.0)
    pre = tl.sigmoid(s0 * (rho * z) + b) + hc_eps
    _collapse(x_ptr, y_ptr, pre, t, K, H, i, im, hb, HCH, BH, RNE)


@implements("hc_head", supports=predicates.hc_head_supports)
def hc_head(x, fn, scale, base, rms_eps, hc_eps):
    T, n, H = x.shape
    y = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    x = c(x)
    zp, ssp, S, MP = _mix(x.view(T, n * H), c(fn), n)
    grid, kw = TUNE.memo(("pre", T, n, H, S, MP, y.dtype, y.device, target_programs, rne),
                         lambda: _epi_plan(T, n, H, S, MP, y))
    _hc_head_epi_kernel[grid](x, zp, ssp, c(scale), c(base), y, T, H, S, float(rms_eps), float(hc_eps), **kw)
    return y
