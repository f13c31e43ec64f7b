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

Variants selected by TUNE keys (defaults: the above; benchmarks/tune_triton.py sweeps them):

* ``epi="vec"``: :func:`_hc_vec_epi_kernel`. A program owns BT tokens (``vBT``) and every
  per-token value is a [BT] vector; the n x n Sinkhorn is a tuple of n*n vectors whose row and
  column sums are explicit adds (no tl.sum, no shuffles: a dependent chain of adds and
  divisions only). Program column 0 computes post / comb; the other columns only collapse
  (``vBH`` columns each, their x loads issued first), so the collapse never waits on the
  Sinkhorn. ``v_rev``: collapse the last columns first (at large T those x lines are the mix
  kernel's last reads, still in L2).
* ``target``: programs the split-K mixes aims for (fewer, fatter K-slices: a shorter partial
  reduction in the epilogue); ``mix_fma`` (T < 16): fp32 FMA mixes, no 16-token MMA tile.

Programmatic dependent launch (Triton's NVIDIA extras) was considered and left out: the portable
kernels use no vendor extras; a plugin-side way to enable it is an open idea.

A one-pass variant (the last program of a token block reducing the partials, behind an arrival
counter, then Sinkhorn and the collapse) was built and timed on the H200 (session 18,
benchmarks/results/tune-s18-h200-flash-read.json): 11.4 / 21.4 / 58.2 / 443 µs for hc_pre at
T = 1 / 8 / 64 / 4096 against these two launches' 11.8 / 12.1 / 17.2 / 115 µs (its serial tail costs
more than the second launch saves), so it was removed; it is in the git history (commit 6100a27).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import c, np2, cdiv, interp, rne, target_programs, to_out
from .launch import Tune

#: programs wanted under the interpreter (CPU); on a GPU: 2 per SM of the device
_CPU_PROGRAMS = 264
#: launch parameters: tuning overrides (benchmarks/tune_triton.py) over the bound backend's launch
#: table (launch.py); the defaults are the kernels' own
TUNE = Tune(__name__)


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


def hc_post(o, residual, post, comb):
    T, n, H = residual.shape
    out = torch.empty((T, n, H), dtype=residual.dtype, device=residual.device)
    if T == 0 or H == 0:
        return out
    o, residual, post, comb = c(o), c(residual), c(post), c(comb)
    BLOCK = min(1024, np2(H))
    while BLOCK > 128 and T * cdiv(H, BLOCK) < target_programs(o.device, _CPU_PROGRAMS):
        BLOCK //= 2
    BLOCK = TUNE.get("post_BLOCK", BLOCK)
    nw = TUNE.get("post_num_warps", 4 if BLOCK >= 512 else (2 if BLOCK >= 256 else 1))
    _hc_post_kernel[(T, cdiv(H, BLOCK))](o, residual, post, comb, out, H, N=n, NP=np2(n),
                                         BLOCK=BLOCK, RNE=rne(out), num_warps=nw, **TUNE.options())
    return out


# -------------------------------------------------------------------------------- mixes product (split-K)
@triton.jit
def _mix_acc(x_ptr, fn_ptr, pt, ps, T, K, M, KSPLIT, BT: tl.constexpr, MP: tl.constexpr,
             BK: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr):
    """(fn @ xf over K-slice ps [BT, MP], sum of xf^2 over it [BT], token offsets, token mask, mix
    columns) for token block pt.

    DOT with IEEE (fp32 activations, or the interpreter): true fp32 products. DOT otherwise: x stays
    bf16 (exact) and fn is split into three bf16 parts (hi + mid + lo = 24 mantissa bits): 3 bf16
    MMAs with exact products and fp32 accumulation, i.e. fp32-accurate (the op is memory-bound
    anyway). Not DOT (fewer than 16 tokens, below an MMA tile): fp32 products on the vector units."""
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
        if DOT:
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
        else:
            acc += tl.sum(x[:, None, :] * f[None, :, :], axis=2)
        ss += tl.sum(x * x, axis=1)
    return acc, ss, toks64, tm, ms


@triton.jit
def _hc_mix_kernel(x_ptr, fn_ptr, zp_ptr, ssp_ptr, T, K, M, KSPLIT,
                   BT: tl.constexpr, BK: tl.constexpr, MP: tl.constexpr, IEEE: tl.constexpr,
                   DOT: tl.constexpr):
    ps = tl.program_id(1)
    acc, ss, toks64, tm, ms = _mix_acc(x_ptr, fn_ptr, tl.program_id(0), ps, T, K, M, KSPLIT, BT, MP, BK, DOT, IEEE)
    row = ps * T + toks64
    tl.store(zp_ptr + row[:, None] * MP + ms[None, :], acc, mask=tm[:, None])
    tl.store(ssp_ptr + row, ss, mask=tm)


def _mix(x2, fn, M):
    """x2: [T, K] (contiguous, act dtype), fn [M, K] f32 -> (zpart [S, T, MP], sspart [S, T], S, MP).

    TUNE ``mix_fma`` (T < 16 only): fp32 products on the vector units (exact fp32, no MMA tile of
    16 tokens to fill), token block np2(T) by default."""
    T, K = x2.shape
    MP = max(16, np2(M))
    dot = not (TUNE.get("mix_fma", False) and T < 16)
    BT = TUNE.get("BT", (16 if T <= 16 else (32 if T <= 256 else 64)) if dot else np2(T))
    BK = TUNE.get("BK", (128 if MP <= 32 else 64) if dot else max(16, 4096 // (BT * MP)))
    ntb = cdiv(T, BT)
    nkb = cdiv(K, BK)
    S = max(1, min(nkb, TUNE.get("target", target_programs(x2.device, _CPU_PROGRAMS)) // ntb))
    KSPLIT = cdiv(nkb, S) * BK
    S = cdiv(K, KSPLIT)
    zp = torch.empty((S, T, MP), dtype=torch.float32, device=x2.device)
    ssp = torch.empty((S, T), dtype=torch.float32, device=x2.device)
    _hc_mix_kernel[(ntb, S)](x2, fn, zp, ssp, T, K, M, KSPLIT, BT=BT, BK=BK, MP=MP,
                             IEEE=x2.dtype == torch.float32 or interp(x2), DOT=dot,
                             num_warps=TUNE.get("num_warps", 4), num_stages=TUNE.get("num_stages", 3), **TUNE.options())
    return zp, ssp, S, MP


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


# ------------------------------------------------------- the "vec" epilogue (TUNE epi="vec"): per-token vectors
# A program owns a block of BT tokens; every per-token quantity is a [BT] vector (a thread owns
# its tokens' values), the n x n matrix is a tuple of n*n such vectors and its row / column sums
# are explicit adds in index order: no cross-thread reductions, no shuffles in the Sinkhorn chain.
# Grid (token blocks, 1 + H-blocks): program column 0 computes post and the Sinkhorn (comb), the
# others collapse one BH-column block each, their x loads issued first (they depend on nothing).
@triton.jit
def _vec_partials(zp_ptr, ssp_ptr, toks64, tm, T, S, M0: tl.constexpr, M1: tl.constexpr,
                  MP: tl.constexpr, SP: tl.constexpr):
    """(mix columns M0..M1-1 summed over the S slices: a tuple of [BT] vectors, sum of xf^2 [BT])."""
    sp = tl.arange(0, SP)
    rows = sp[:, None] * T + toks64[None, :]
    msk = (sp < S)[:, None] & tm[None, :]
    z = ()
    for m in tl.static_range(M0, M1):
        z = z + (tl.sum(tl.load(zp_ptr + rows * MP + m, mask=msk, other=0.0), axis=0),)
    ss = tl.sum(tl.load(ssp_ptr + rows, mask=msk, other=0.0), axis=0)
    return z, ss


@triton.jit
def _vec_rownorm(C, hc_eps, N: tl.constexpr):
    """C[j, k] / (sum_k C[j, k] + hc_eps) on a row-major tuple of N*N vectors."""
    R = ()
    for j in tl.static_range(N):
        s = C[j * N]
        for k in tl.static_range(1, N):
            s = s + C[j * N + k]
        d = s + hc_eps
        for k in tl.static_range(N):
            R = R + (C[j * N + k] / d,)
    return R


@triton.jit
def _vec_colnorm(C, hc_eps, N: tl.constexpr):
    """C[j, k] / (sum_j C[j, k] + hc_eps) on a row-major tuple of N*N vectors."""
    D = ()
    for k in tl.static_range(N):
        s = C[k]
        for j in tl.static_range(1, N):
            s = s + C[j * N + k]
        D = D + (s + hc_eps,)
    R = ()
    for j in tl.static_range(N):
        for k in tl.static_range(N):
            R = R + (C[j * N + k] / D[k],)
    return R


@triton.jit
def _vec_sinkhorn(L, hc_eps, N: tl.constexpr, ITERS: tl.constexpr):
    """SPEC hc_pre step 4 on a row-major tuple of N*N logit vectors: row softmax (max-subtracted)
    + hc_eps, a column normalisation, then ITERS - 1 (row, column) pairs (unrolled)."""
    C = ()
    for j in tl.static_range(N):
        mx = L[j * N]
        for k in tl.static_range(1, N):
            mx = tl.maximum(mx, L[j * N + k])
        E = ()
        for k in tl.static_range(N):
            E = E + (tl.exp(L[j * N + k] - mx),)
        s = E[0]
        for k in tl.static_range(1, N):
            s = s + E[k]
        for k in tl.static_range(N):
            C = C + (E[k] / s + hc_eps,)
    C = _vec_colnorm(C, hc_eps, N)
    for _ in tl.static_range(ITERS - 1):
        C = _vec_rownorm(C, hc_eps, N)
        C = _vec_colnorm(C, hc_eps, N)
    return C


@triton.jit
def _vec_collapse(x_ptr, zp_ptr, ssp_ptr, scale_ptr, base_ptr, y_ptr, toks64, tm, hb, T, H, S, rms_eps, hc_eps,
                  N: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr, SP: tl.constexpr,
                  RNE: tl.constexpr):
    """y[toks, BH-block hb] = sum_j pre_j x_j (fp32 accumulate in j order, one rounding)."""
    K = N * H
    cols = hb * BH + tl.arange(0, BH)
    xm = tm[:, None] & (cols < H)[None, :]
    xs = ()
    for j in tl.static_range(N):
        xs = xs + (tl.load(x_ptr + toks64[:, None] * K + j * H + cols[None, :], mask=xm, other=0.0),)
    z, ss = _vec_partials(zp_ptr, ssp_ptr, toks64, tm, T, S, 0, N, MP, SP)
    rho = tl.div_rn(1.0, tl.sqrt_rn(ss / K + rms_eps))
    s0 = tl.load(scale_ptr)
    y = tl.zeros([BT, BH], dtype=tl.float32)
    for j in tl.static_range(N):
        pre = tl.sigmoid(s0 * (rho * z[j]) + tl.load(base_ptr + j)) + hc_eps
        y += pre[:, None] * xs[j].to(tl.float32)
    tl.store(y_ptr + toks64[:, None] * H + cols[None, :], to_out(y, y_ptr, RNE), mask=xm)


@triton.jit
def _vec_post_comb(zp_ptr, ssp_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, toks64, tm, T, H, S,
                   rms_eps, hc_eps, post_mult, N: tl.constexpr, MP: tl.constexpr, SP: tl.constexpr,
                   ITERS: tl.constexpr):
    """post[toks] and comb[toks] = Sinkhorn of the comb logits (SPEC hc_pre steps 3-4)."""
    z, ss = _vec_partials(zp_ptr, ssp_ptr, toks64, tm, T, S, N, (2 + N) * N, MP, SP)
    rho = tl.div_rn(1.0, tl.sqrt_rn(ss / (N * H) + rms_eps))
    s1 = tl.load(scale_ptr + 1)
    s2 = tl.load(scale_ptr + 2)
    for j in tl.static_range(N):
        post = post_mult * tl.sigmoid(s1 * (rho * z[j]) + tl.load(base_ptr + N + j))
        tl.store(post_ptr + toks64 * N + j, post, mask=tm)
    L = ()
    for e in tl.static_range(N * N):
        L = L + (s2 * (rho * z[N + e]) + tl.load(base_ptr + 2 * N + e),)
    C = _vec_sinkhorn(L, hc_eps, N, ITERS)
    for e in tl.static_range(N * N):
        tl.store(comb_ptr + toks64 * (N * N) + e, C[e], mask=tm)


@triton.jit
def _hc_vec_epi_kernel(x_ptr, zp_ptr, ssp_ptr, scale_ptr, base_ptr, y_ptr, post_ptr, comb_ptr,
                       T, H, S, rms_eps, hc_eps, post_mult,
                       N: tl.constexpr, MP: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr,
                       SP: tl.constexpr, ITERS: tl.constexpr, HEAD: tl.constexpr, REV: tl.constexpr,
                       RNE: tl.constexpr):
    """hc_head (HEAD): every program collapses. hc_pre: program column 0 computes post / comb,
    column 1 + b collapses H-block b. REV: the H-blocks in reverse order (last columns first)."""
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = toks < T
    toks64 = toks.to(tl.int64)
    hb = tl.program_id(1)
    if REV:
        if HEAD:
            hb = tl.cdiv(H, BH) - 1 - hb
        else:
            hb = tl.where(hb == 0, 0, tl.cdiv(H, BH) + 1 - hb)
    if HEAD:
        _vec_collapse(x_ptr, zp_ptr, ssp_ptr, scale_ptr, base_ptr, y_ptr, toks64, tm, hb, T, H, S, rms_eps,
                      hc_eps, N, MP, BT, BH, SP, RNE)
    else:
        if hb == 0:
            _vec_post_comb(zp_ptr, ssp_ptr, scale_ptr, base_ptr, post_ptr, comb_ptr, toks64, tm, T, H, S,
                           rms_eps, hc_eps, post_mult, N, MP, SP, ITERS)
        else:
            _vec_collapse(x_ptr, zp_ptr, ssp_ptr, scale_ptr, base_ptr, y_ptr, toks64, tm, hb - 1, T, H, S,
                          rms_eps, hc_eps, N, MP, BT, BH, SP, RNE)


def _vec_epi(x, zp, ssp, S, MP, scale, base, y, post, comb, rms_eps, hc_eps, iters, post_mult, head):
    """Launch the vec epilogue. TUNE keys: ``vBT`` (tokens a program, default 1 up to T = 64,
    else 32), ``vBH`` (collapse columns a program), ``v_num_warps``, ``v_rev`` (collapse the
    H-blocks last-first: at large T the mix kernel's last reads, the ends of its K-slices, are
    the x lines still in L2)."""
    T, n, H = x.shape
    BT = TUNE.get("vBT", 1 if T <= 64 else 32)
    BH = TUNE.get("vBH", min(256, np2(H)))
    nw = TUNE.get("v_num_warps", max(1, min(8, BT * BH // 1024)))
    grid = (cdiv(T, BT), cdiv(H, BH) + (0 if head else 1))
    _hc_vec_epi_kernel[grid](x, zp, ssp, scale, base, y, post, comb, T, H, S, float(rms_eps), float(hc_eps),
                             float(post_mult), N=n, MP=MP, BT=BT, BH=BH, SP=np2(S), ITERS=int(iters),
                             HEAD=head, REV=bool(TUNE.get("v_rev", False)), RNE=rne(y), num_warps=nw, **TUNE.options())


def _epi_kind() -> str:
    kind = TUNE.get("epi", "tile")
    if kind not in ("tile", "vec"):
        raise ValueError(f"hc_pre / hc_head: TUNE epi={kind!r}, expected 'tile' or 'vec'")
    return kind


def hc_pre(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
    T, n, H = x.shape
    dev = x.device
    y = torch.empty((T, H), dtype=x.dtype, device=dev)
    post = torch.empty((T, n), dtype=torch.float32, device=dev)
    comb = torch.empty((T, n, n), dtype=torch.float32, device=dev)
    if T == 0:
        return y, post, comb
    x = c(x)
    epi = _epi_kind()
    zp, ssp, S, MP = _mix(x.view(T, n * H), c(fn), (2 + n) * n)
    if epi == "vec":
        _vec_epi(x, zp, ssp, S, MP, c(scale), c(base), y, post, comb, rms_eps, hc_eps, iters, post_mult, False)
        return y, post, comb
    BH, HCH, nhb = _epi_block(T, H, x.device)
    _hc_pre_epi_kernel[(T, nhb)](x, zp, ssp, c(scale), c(base), y, post, comb,
                                         T, H, S, float(rms_eps), float(hc_eps), int(iters),
                                         float(post_mult), N=n, NP=np2(n), MP=MP, BH=BH, RNE=rne(y), SP=np2(S),
                                         HCH=HCH, num_warps=TUNE.get("epi_num_warps", 1), **TUNE.options())
    return y, post, comb


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


def hc_head(x, fn, scale, base, rms_eps, hc_eps):
    T, n, H = x.shape
    y = torch.empty((T, H), dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    x = c(x)
    epi = _epi_kind()
    zp, ssp, S, MP = _mix(x.view(T, n * H), c(fn), n)
    if epi == "vec":
        _vec_epi(x, zp, ssp, S, MP, c(scale), c(base), y, y, y, rms_eps, hc_eps, 1, 1.0, True)
        return y
    BH, HCH, nhb = _epi_block(T, H, x.device)
    _hc_head_epi_kernel[(T, nhb)](x, zp, ssp, c(scale), c(base), y, T, H, S,
                                          float(rms_eps), float(hc_eps), N=n, NP=np2(n), MP=MP,
                                          BH=BH, RNE=rne(y), SP=np2(S), HCH=HCH,
                                          num_warps=TUNE.get("epi_num_warps", 1), **TUNE.options())
    return y
