"""moe_experts: routed SwiGLU experts (gate/up GEMM + clamp + SiLU fused, down GEMM + weighted
combine fused), as two grouped GEMMs over (token, slot) pairs sorted by expert.

Host side (torch ops): drop negative ids, sort pairs by expert, build a tile list (expert, first
row, end row) of BM pairs each. Kernel 1 gathers x rows, computes g/u blocks for a tile, applies
``silu(min(g, L)) * clamp(u, -L, L)`` and stores the activation in fp32. Kernel 2 multiplies by W2
(the fp32 activation split into two bf16 halves for bf16 weights, ~16 mantissa bits), scales by the
routing weight and atomically adds into an fp32 [T, H] output (k experts per token), cast once.
Building the tile list syncs with the host (``torch.nonzero``, ``torch.bincount`` on CUDA, and the
tile count that sizes the grid), so this op is not CUDA-graph capturable.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import c, cdiv, interp
from .launch import Tune

#: launch parameters: tuning overrides over the bound backend's launch table (launch.py)
TUNE = Tune(__name__)


@triton.jit
def _moe_up_kernel(x_ptr, tok_ptr, w13_ptr, a_ptr, te_ptr, tr_ptr, tend_ptr, H, I, limit,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                   KSUB: tl.constexpr):
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(te_ptr + tile).to(tl.int64)
    r0 = tl.load(tr_ptr + tile)
    r_end = tl.load(tend_ptr + tile)
    rows = r0 + tl.arange(0, BM)
    rm = rows < r_end
    tok = tl.load(tok_ptr + rows, mask=rm, other=0).to(tl.int64)
    n = nb * BN + tl.arange(0, BN)
    nm = n < I
    kk = tl.arange(0, BK)
    g_rows = (e * 2 * I + n).to(tl.int64)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k1 in range(0, H, BK * KSUB):
        pg = tl.zeros([BM, BN], dtype=tl.float32)
        pu = tl.zeros([BM, BN], dtype=tl.float32)
        for kin in tl.static_range(KSUB):
            ks = k1 + kin * BK + kk
            km = ks < H
            xa = tl.load(x_ptr + tok[:, None] * H + ks[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            wg = tl.load(w13_ptr + g_rows[:, None] * H + ks[None, :], mask=nm[:, None] & km[None, :],
                         other=0.0)
            wu = tl.load(w13_ptr + (g_rows + I)[:, None] * H + ks[None, :], mask=nm[:, None] & km[None, :],
                         other=0.0)
            if IEEE:
                xa = xa.to(tl.float32)
                pg += tl.dot(xa, tl.trans(wg.to(tl.float32)), input_precision="ieee")
                pu += tl.dot(xa, tl.trans(wu.to(tl.float32)), input_precision="ieee")
            else:
                pg = tl.dot(xa, tl.trans(wg), pg)
                pu = tl.dot(xa, tl.trans(wu), pu)
        acc_g += pg  # two-level fp32 accumulation (KSUB blocks, then the running sum)
        acc_u += pu
    g = tl.minimum(acc_g, limit)
    u = tl.minimum(tl.maximum(acc_u, -limit), limit)
    a = g * tl.sigmoid(g) * u
    tl.store(a_ptr + rows.to(tl.int64)[:, None] * I + n[None, :], a, mask=rm[:, None] & nm[None, :])


@triton.jit
def _moe_down_kernel(a_ptr, tok_ptr, wt_ptr, w2_ptr, out_ptr, te_ptr, tr_ptr, tend_ptr, H, I,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
                     KSUB: tl.constexpr):
    tile = tl.program_id(0)
    nb = tl.program_id(1)
    e = tl.load(te_ptr + tile).to(tl.int64)
    r0 = tl.load(tr_ptr + tile)
    r_end = tl.load(tend_ptr + tile)
    rows = r0 + tl.arange(0, BM)
    rm = rows < r_end
    rows64 = rows.to(tl.int64)
    tok = tl.load(tok_ptr + rows, mask=rm, other=0).to(tl.int64)
    wts = tl.load(wt_ptr + rows, mask=rm, other=0.0)
    hc = nb * BN + tl.arange(0, BN)
    hm = hc < H
    w_rows = (e * H + hc).to(tl.int64)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k1 in range(0, I, BK * KSUB):
        part = tl.zeros([BM, BN], dtype=tl.float32)
        for kin in tl.static_range(KSUB):
            ks = k1 + kin * BK + kk
            km = ks < I
            a = tl.load(a_ptr + rows64[:, None] * I + ks[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            w = tl.load(w2_ptr + w_rows[:, None] * I + ks[None, :], mask=hm[:, None] & km[None, :], other=0.0)
            if IEEE:
                part += tl.dot(a, tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                a_hi = a.to(w.dtype)
                a_lo = (a - a_hi.to(tl.float32)).to(w.dtype)
                part = tl.dot(a_hi, tl.trans(w), part)
                part = tl.dot(a_lo, tl.trans(w), part)
        acc += part
    acc = acc * wts[:, None]
    tl.atomic_add(out_ptr + tok[:, None] * H + hc[None, :], acc, mask=rm[:, None] & hm[None, :])


def moe_experts(x, ids, weights, w13, w2, swiglu_limit):
    T, H = x.shape
    E, I2, _ = w13.shape
    I = I2 // 2
    dev = x.device
    out = torch.zeros((T, H), dtype=torch.float32, device=dev)
    if T == 0 or ids.numel() == 0:
        return out.to(x.dtype)
    x, w13, w2 = c(x), c(w13), c(w2)
    k = ids.shape[1]
    flat = ids.reshape(-1).to(torch.int64)
    pair = torch.nonzero((flat >= 0) & (flat < E)).squeeze(1)
    if pair.numel() == 0:
        return out.to(x.dtype)
    eid = flat[pair]
    order = torch.argsort(eid, stable=True)
    pair, eid = pair[order], eid[order]
    tok = (pair // k).to(torch.int32)
    wts = weights.reshape(-1)[pair].to(torch.float32).contiguous()
    P = pair.numel()
    ieee = x.dtype == torch.float32 or interp(x)
    BM = TUNE.get("BM", 16 if P <= 4 * E else 64)
    counts = torch.bincount(eid, minlength=E)
    starts = torch.cumsum(counts, 0) - counts
    tiles = (counts + BM - 1) // BM
    tcum = torch.cumsum(tiles, 0)
    ntiles = int(tcum[-1])  # host sync: the grid size
    te = torch.repeat_interleave(torch.arange(E, device=dev), tiles, output_size=ntiles)
    local = torch.arange(ntiles, device=dev) - (tcum - tiles)[te]
    tr = (starts[te] + local * BM).to(torch.int32)
    tend = (starts[te] + counts[te]).to(torch.int32)
    te = te.to(torch.int32)
    a = torch.empty((P, I), dtype=torch.float32, device=dev)
    # fp32 (ieee) tiles are 2x wider per element and the KSUB sub-blocks are unrolled: smaller tiles,
    # fewer stages, or the kernel needs more shared memory than an H200 has (seen: 288 KiB)
    BN = TUNE.get("BN", 32 if ieee else 64)
    BK = TUNE.get("BK", 32 if ieee else 64)
    nw = TUNE.get("num_warps", 4)
    ns = TUNE.get("num_stages", 2 if ieee else 3)
    _moe_up_kernel[(ntiles, cdiv(I, BN))](x, tok, w13, a, te, tr, tend, H, I, float(swiglu_limit),
                                          BM=BM, BN=BN, BK=BK, IEEE=ieee, KSUB=4 if ieee else 1,
                                          num_warps=nw, num_stages=ns, **TUNE.options())
    _moe_down_kernel[(ntiles, cdiv(H, BN))](a, tok, wts, w2, out, te, tr, tend, H, I,
                                            BM=BM, BN=BN, BK=BK, IEEE=ieee, KSUB=4 if ieee else 1,
                                          num_warps=nw, num_stages=ns, **TUNE.options())
    return out.to(x.dtype)
