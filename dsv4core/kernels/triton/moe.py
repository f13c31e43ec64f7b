"""moe_experts: routed SwiGLU experts as two grouped GEMMs over (token, slot) pairs sorted by expert,
then an ordered weighted combine. bf16 / fp32 expert weights, FP8 e4m3 with 128x128 block scales
(fp32 or e8m0), or packed FP4 e2m1 with one UE8M0 scale per 32 columns; each weight is read in
place, dequantised in registers (exactly: e4m3 and scaled e2m1 values are bf16 values); how,
for FP4, is a launch key (``DECODES``: "join" / "scaled"), and for FP8 (``FP8_PATHS``). The
weight-tile reads live in moe_weights.py.

No host synchronisation (CUDA-graph capturable): on the device, pairs are sorted by expert
(stable; dropped slots sort last), giving each expert's first row and a cumulative tile count.
Up to ``ALIGN_MAX_PAIRS`` pairs (decode, small prefill) one single-program kernel builds this
routing (``_moe_align_kernel``); larger batches use torch ops (``_route_torch``: sort,
searchsorted, cumsum, scatter), whose result it reproduces bit for bit. The choice depends on
shapes only. The grid is sized from shapes only, by the upper bound
``ceil(P / BM) + min(E, P)`` on the tile count; a program finds its (expert, tile) by binary
search over the cumulative counts and programs past the real count do no work.

Kernels: (1) gate/up GEMM over the H columns, ``silu(min(g, L)) * clamp(u, -L, L)`` in the
epilogue, fp32 activation stored per pair; (2) down GEMM (the fp32 activation split into two bf16
halves for the tensor cores, ~16 mantissa bits), fp32 result per pair; (3) combine: per token,
``sum_i weights[t, i] * y[pair(t, i)]`` in slot order. No atomics: the result does not depend
on scheduling. Expert ids >= E (which the HAL input check rejects) make that token's output NaN
rather than silently dropping the slot. Split K (TUNE "Su" / "Sd"; by default none, with
TUNE split "h200" where ``_split_rule`` says: FP4 "scaled" decode batches, the shared expert): (1) stores raw gate / up
partial sums, one small kernel (``_moe_act_kernel``) sums them and applies the SwiGLU; (2) stores
partial results and (3) sums them; every sum in a fixed part order.

A plugin's table may supply its own grouped GEMMs for packed FP4 weights under the official
activation (TUNE ``gemm``: an object with ``serves(w, scale, BM, P)`` -- shapes and strides only -- and
``__call__(a, rows, w, scale, out, tcum, starts, BM)`` writing the raw fp32 sums ``out[r, n] =
sum_k a[rows[r] or r, k] * W[e(r), n, k]`` of the kept sorted rows in these tiles); for the GEMMs it
serves the split is off and the down GEMM's input is stored in bf16 (FP8 values: exact).

``act_block`` (the official expert math): x is fake-quantised per token per ``act_block`` columns
first (quant.py); (1) always stores the raw gate / up sums, and ``_moe_act_official_kernel``
rounds them to bf16, applies the SwiGLU and the pair's routing weight (before the down
projection), rounds to bf16 and fake-quantises each ``act_block`` columns to FP8 (the values the
down GEMM multiplies, exact in fp32 and bf16: one bf16 dot a step, no low half); (3) then sums
the pairs' results unweighted.

Many pairs per expert (TUNE ``dequant_rows``, dequant.py): quantised expert weights are converted
to bf16 once per call, in chunks of experts within ``dequant_bytes`` of scratch (the up / down
kernels then launch once a chunk over that chunk's tiles, ``CHUNK``), and read as bf16 weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import (BIG_TILE_SHARED, c, cdiv, e4m3_rne, exp2_int, group_scale_exp, interp, np2, rne, rne_bf16,
                    shared_bytes, target_programs, to_out)
from .launch import Tune
from .linear import FP8_PATHS
# how a weight tile is read: moe_weights.py (``_fp4_values`` stays importable from here)
from .moe_weights import (DECODES, FMT_FP4, FMT_FP8, FMT_PLAIN, _decode_keys, _format, _fp4_values,  # noqa: F401
                          _fp8_scale, _hi_lo, _scale_arg, _scaled_dot, _stack_rows, _sum_halves, _w_tile)
from .moe_split import MAX_SPLIT, SPLIT_FP4_PAIRS, SPLIT_RULES, few_programs, row_tiles, _split_rule  # noqa: F401
from . import dequant, predicates
from .registry import implements

#: launch parameters: tuning overrides (benchmarks/tune_triton.py) over the bound backend's launch
#: table (launch.py); the defaults are the kernels' own
TUNE = Tune(__name__)   # its keys: launch.TUNING_KEYS


@triton.jit
def _tile_of(tcum_ptr, starts_ptr, j, E, LOGE: tl.constexpr, BM: tl.constexpr, E_LO, E_HI, CHUNK: tl.constexpr):
    """(expert, first row, end row, valid) of tile ``j``: the first e with tcum[e] > j. CHUNK: the
    program ids count the tiles of experts [E_LO, E_HI) only (one chunk of converted weights,
    dequant.py): j is offset past the tiles of the experts before E_LO, and valid past those of E_HI."""
    if CHUNK:
        j += tl.where(E_LO > 0, tl.load(tcum_ptr + tl.maximum(E_LO - 1, 0)), 0)
    lo = j * 0
    hi = lo + E
    for _ in tl.static_range(LOGE):
        mid = (lo + hi) // 2
        v = tl.load(tcum_ptr + tl.minimum(mid, E - 1))
        left = v > j
        hi = tl.where(left, mid, hi)
        lo = tl.where(left, lo, mid + 1)
    if CHUNK:
        valid = j < tl.load(tcum_ptr + E_HI - 1)
    else:
        valid = j < tl.load(tcum_ptr + E - 1)
    e = tl.minimum(lo, E - 1)
    t0 = tl.where(e > 0, tl.load(tcum_ptr + tl.maximum(e - 1, 0)), 0)
    r0 = tl.load(starts_ptr + e) + (j - t0) * BM
    r_end = tl.where(valid, tl.load(starts_ptr + e + 1), r0)  # an empty row range past the count
    return e.to(tl.int64), r0, r_end, valid


@triton.jit
def _k_range(valid, C, STEP: tl.constexpr, SPLIT: tl.constexpr):
    """(first column, end column) of this program's K range: all of [0, C) without a split; with
    one, split part program_id(2) of SPLIT parts, each a whole number of STEP-column steps (the
    last parts may be short or empty). Tiles past the real count get an empty range."""
    if SPLIT > 1:
        span = tl.cdiv(tl.cdiv(C, SPLIT), STEP) * STEP
        k_lo = tl.program_id(2) * span
        return k_lo, tl.where(valid, tl.minimum(C, k_lo + span), k_lo)
    else:
        return 0, tl.where(valid, C, 0)


@triton.jit
def _swiglu(g, u, limit):
    """silu(min(g, L)) * clamp(u, -L, L): the epilogue of the gate / up GEMM."""
    g = tl.minimum(g, limit)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    return g * tl.sigmoid(g) * u


@triton.jit
def _moe_act_kernel(p_ptr, a_ptr, I, limit, S: tl.constexpr, BI: tl.constexpr):
    """Split K of the gate / up GEMM: the activation a [pairs, I] from the S partial sums
    [pairs, S, 2 I] (gate then up), summed in part order, then what the up kernel's epilogue
    computes when it holds the whole sum (clamp, SwiGLU). One program a (pair, BI columns)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    m = cols < I
    base = p_ptr + row * (S * 2 * I) + cols
    g = tl.load(base, mask=m, other=0.0)
    u = tl.load(base + I, mask=m, other=0.0)
    for s in tl.static_range(1, S):
        g += tl.load(base + s * 2 * I, mask=m, other=0.0)
        u += tl.load(base + s * 2 * I + I, mask=m, other=0.0)
    a = _swiglu(g, u, limit)
    tl.store(a_ptr + row * I + cols, a, mask=m)


@triton.jit
def _moe_act_official_kernel(p_ptr, w_ptr, a_ptr, starts_ptr, I, E, limit, S: tl.constexpr, BI: tl.constexpr,
                             QB: tl.constexpr):
    """The official expert activation (act_block): from the S raw gate / up partial sums
    [pairs, S, 2 I] of sorted row ``row`` (summed in part order), g and u rounded to bf16,
    ``h = swiglu(g, u) * w[row]`` (the pair's routing weight), rounded to bf16, then each QB
    columns fake-quantised to FP8 e4m3 with the official power-of-two scale (BI a multiple of QB;
    I a multiple of QB, so masked columns only fill whole groups past I). Rows past the kept pairs
    (``starts[E]``: the dropped slots, sorted last) hold no sums and are skipped."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BI + tl.arange(0, BI)
    m = cols < tl.where(row < tl.load(starts_ptr + E), I, 0)
    base = p_ptr + row * (S * 2 * I) + cols
    g = tl.load(base, mask=m, other=0.0)
    u = tl.load(base + I, mask=m, other=0.0)
    for s in tl.static_range(1, S):
        g += tl.load(base + s * 2 * I, mask=m, other=0.0)
        u += tl.load(base + s * 2 * I + I, mask=m, other=0.0)
    h = rne_bf16(_swiglu(rne_bf16(g), rne_bf16(u), limit) * tl.load(w_ptr + row))
    grp = tl.reshape(h, (BI // QB, QB))
    e = group_scale_exp(tl.max(tl.abs(grp), axis=1), 1e-4, 1.0 / 448.0)
    q = e4m3_rne(tl.minimum(tl.maximum(grp * exp2_int(-e)[:, None], -448.0), 448.0))
    tl.store(a_ptr + row * I + cols, tl.reshape(q * exp2_int(e)[:, None], (BI,)), mask=m)


@triton.jit
def _pair_rows_kernel(inv_ptr, w_ptr, wrow_ptr, P, BP: tl.constexpr):
    """wrow[inv[p]] = w[p]: each sorted row's routing weight (a permutation: no two pairs share a row)."""
    p = tl.program_id(0).to(tl.int64) * BP + tl.arange(0, BP)
    m = p < P
    row = tl.load(inv_ptr + p, mask=m, other=0).to(tl.int64)
    tl.store(wrow_ptr + row, tl.load(w_ptr + p, mask=m, other=0.0), mask=m)


@triton.jit
def _moe_up_kernel(x_ptr, tok_ptr, w13_ptr, s13_ptr, a_ptr, tcum_ptr, starts_ptr, E, H, I, limit,
                   LOGE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   FMT: tl.constexpr, E8M0: tl.constexpr, IEEE: tl.constexpr, KSUB: tl.constexpr,
                   EVEN: tl.constexpr, SCALED: tl.constexpr, BLK: tl.constexpr, VIA32: tl.constexpr = False,
                   SPLIT: tl.constexpr = 1, RAW: tl.constexpr = False, E_LO=0, E_HI=0, CHUNK: tl.constexpr = False):
    """SCALED: FP4 weights through tl.dot_scaled (bf16 operands whatever IEEE says), else decoded
    by ``_w_tile``; BLK: a step is summed into blk_* first (FP8: its scale). SPLIT > 1: split K
    (program_id(2) = the part); the raw gate / up partial sums go to a_ptr as [pairs, SPLIT, 2 I]
    and ``_moe_act_kernel`` applies the SwiGLU. RAW: the raw sums stored so (SPLIT = 1 too), for
    ``_moe_act_official_kernel``. CHUNK: the tiles of experts [E_LO, E_HI) only, whose weights
    w13 holds from its expert 0 (a chunk of converted weights, dequant.py)."""
    j = tl.program_id(0)
    nb = tl.program_id(1)
    e, r0, r_end, valid = _tile_of(tcum_ptr, starts_ptr, j, E, LOGE, BM, E_LO, E_HI, CHUNK)
    if CHUNK:
        e -= E_LO   # the expert's index in this chunk's weights and scales
    rows = r0 + tl.arange(0, BM)
    rm = rows < r_end
    tok = tl.load(tok_ptr + rows, mask=rm, other=0).to(tl.int64)
    n = nb * BN + tl.arange(0, BN)
    nm = n < I
    n64 = n.to(tl.int64)
    kk = tl.arange(0, BK)
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo, k_end = _k_range(valid, H, BK * KSUB, SPLIT)  # tiles past the real count read nothing
    # a step = KSUB sub-blocks summed into blk_*; FP8: exactly one 128-column scale block
    for k1 in range(k_lo, k_end, BK * KSUB):
        blk_g = tl.zeros([BM, BN], dtype=tl.float32)
        blk_u = tl.zeros([BM, BN], dtype=tl.float32)
        for kin in tl.static_range(KSUB):
            k0 = k1 + kin * BK
            ks = k0 + kk
            xm = rm[:, None] & (ks < H)[None, :]
            if EVEN:
                xm = rm[:, None]
            xa = tl.load(x_ptr + tok[:, None] * H + ks[None, :], mask=xm, other=0.0)
            if SCALED:
                xa = xa.to(tl.bfloat16)
                acc_g = _scaled_dot(xa, w13_ptr, s13_ptr, e, n64, nm, k0, H, 2 * I, acc_g, BK, EVEN)
                acc_u = _scaled_dot(xa, w13_ptr, s13_ptr, e, n64 + I, nm, k0, H, 2 * I, acc_u, BK, EVEN)
            else:
                wg = _w_tile(w13_ptr, s13_ptr, e, n64, nm, k0, H, 2 * I, BK, EVEN, FMT, IEEE, VIA32)
                wu = _w_tile(w13_ptr, s13_ptr, e, n64 + I, nm, k0, H, 2 * I, BK, EVEN, FMT, IEEE, VIA32)
                if IEEE:
                    xa = xa.to(tl.float32)
                    blk_g += tl.dot(xa, tl.trans(wg), input_precision="ieee")
                    blk_u += tl.dot(xa, tl.trans(wu), input_precision="ieee")
                elif FMT == 1:
                    xa = xa.to(tl.bfloat16)
                    blk_g = tl.dot(xa, tl.trans(wg), blk_g)
                    blk_u = tl.dot(xa, tl.trans(wu), blk_u)
                else:
                    xa = xa.to(tl.bfloat16)
                    acc_g = tl.dot(xa, tl.trans(wg), acc_g)
                    acc_u = tl.dot(xa, tl.trans(wu), acc_u)
        if FMT == 1:
            acc_g += blk_g * _fp8_scale(s13_ptr, e, n64, nm, k1, 2 * I, H, E8M0)[None, :]
            acc_u += blk_u * _fp8_scale(s13_ptr, e, n64 + I, nm, k1, 2 * I, H, E8M0)[None, :]
        elif BLK:
            acc_g += blk_g  # two-level fp32 accumulation (KSUB blocks, then the running sum)
            acc_u += blk_u
    if SPLIT > 1 or RAW:
        part = a_ptr + rows.to(tl.int64)[:, None] * (SPLIT * 2 * I) + tl.program_id(2) * 2 * I + n[None, :]
        tl.store(part, acc_g, mask=rm[:, None] & nm[None, :])
        tl.store(part + I, acc_u, mask=rm[:, None] & nm[None, :])
    else:
        a = _swiglu(acc_g, acc_u, limit)
        tl.store(a_ptr + rows.to(tl.int64)[:, None] * I + n[None, :], a, mask=rm[:, None] & nm[None, :])


@triton.jit
def _moe_down_kernel(a_ptr, w2_ptr, s2_ptr, y_ptr, tcum_ptr, starts_ptr, E, H, I,
                     LOGE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     FMT: tl.constexpr, E8M0: tl.constexpr, IEEE: tl.constexpr, KSUB: tl.constexpr,
                     EVEN: tl.constexpr, SCALED: tl.constexpr, BLK: tl.constexpr, VIA32: tl.constexpr = False,
                     SPLIT: tl.constexpr = 1, HILO: tl.constexpr = True, E_LO=0, E_HI=0, CHUNK: tl.constexpr = False):
    """Each weight tile is decoded once a step: off IEEE its two dots (a_hi, a_lo) share it, and
    under SCALED (FP4 "scaled") the halves are stacked into one [2 BM, BK] operand of a single
    tl.dot_scaled (the [2 BM, BN] accumulator's halves are summed at the end). SPLIT > 1: split K
    over I, the partial results to y_ptr as [pairs, SPLIT, H] (the combine sums them). HILO False:
    the activation is exact in bf16 (the official one, FP8 values), one dot a step, no a_lo.
    CHUNK: as in the up kernel."""
    j = tl.program_id(0)
    nb = tl.program_id(1)
    e, r0, r_end, valid = _tile_of(tcum_ptr, starts_ptr, j, E, LOGE, BM, E_LO, E_HI, CHUNK)
    if CHUNK:
        e -= E_LO   # the expert's index in this chunk's weights and scales
    rows = r0 + tl.arange(0, BM)
    rm = rows < r_end
    rows64 = rows.to(tl.int64)
    hc = nb * BN + tl.arange(0, BN)
    hm = hc < H
    hc64 = hc.to(tl.int64)
    kk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    if SCALED and HILO:
        acc2 = tl.zeros([2 * BM, BN], dtype=tl.float32)   # rows (a_hi; a_lo)
    k_lo, k_end = _k_range(valid, I, BK * KSUB, SPLIT)
    for k1 in range(k_lo, k_end, BK * KSUB):
        blk = tl.zeros([BM, BN], dtype=tl.float32)
        for kin in tl.static_range(KSUB):
            k0 = k1 + kin * BK
            ks = k0 + kk
            am = rm[:, None] & (ks < I)[None, :]
            if EVEN:
                am = rm[:, None]
            a = tl.load(a_ptr + rows64[:, None] * I + ks[None, :], mask=am, other=0.0)
            if SCALED and not HILO:
                acc = _scaled_dot(a.to(tl.bfloat16), w2_ptr, s2_ptr, e, hc64, hm, k0, I, H, acc, BK, EVEN)
            elif SCALED:
                a_hi, a_lo = _hi_lo(a)
                acc2 = _scaled_dot(_stack_rows(a_hi, a_lo), w2_ptr, s2_ptr, e, hc64, hm, k0, I, H, acc2, BK, EVEN)
            else:
                w = _w_tile(w2_ptr, s2_ptr, e, hc64, hm, k0, I, H, BK, EVEN, FMT, IEEE, VIA32)
                if IEEE:
                    blk += tl.dot(a, tl.trans(w), input_precision="ieee")
                elif not HILO:
                    if FMT == 1:
                        blk = tl.dot(a.to(tl.bfloat16), tl.trans(w), blk)
                    else:
                        acc = tl.dot(a.to(tl.bfloat16), tl.trans(w), acc)
                else:
                    a_hi = a.to(tl.bfloat16)
                    a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
                    if FMT == 1:
                        blk = tl.dot(a_hi, tl.trans(w), blk)
                        blk = tl.dot(a_lo, tl.trans(w), blk)
                    else:
                        acc = tl.dot(a_hi, tl.trans(w), acc)
                        acc = tl.dot(a_lo, tl.trans(w), acc)
        if FMT == 1:
            acc += blk * _fp8_scale(s2_ptr, e, hc64, hm, k1, H, I, E8M0)[None, :]
        elif BLK:
            acc += blk
    if SCALED and HILO:
        acc = _sum_halves(acc2, BM)
    if SPLIT > 1:
        tl.store(y_ptr + rows64[:, None] * (SPLIT * H) + tl.program_id(2) * H + hc[None, :], acc,
                 mask=rm[:, None] & hm[None, :])
    else:
        tl.store(y_ptr + rows64[:, None] * H + hc[None, :], acc, mask=rm[:, None] & hm[None, :])


@triton.jit
def _moe_combine_kernel(y_ptr, inv_ptr, ids_ptr, wts_ptr, out_ptr, H, K, E,
                        BH: tl.constexpr, RNE: tl.constexpr, YS: tl.constexpr = 1, WEIGHTED: tl.constexpr = True):
    """YS > 1: y holds the down kernel's split-K parts [pairs, YS, H], summed in part order.
    WEIGHTED False: the routing weights are already in y (the official math), summed as they are."""
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    hc = hb * BH + tl.arange(0, BH)
    hm = hc < H
    acc = tl.zeros([BH], dtype=tl.float32)
    bad = t < 0
    for i in range(K):
        eid = tl.load(ids_ptr + t * K + i)
        ok = (eid >= 0) & (eid < E)
        bad = bad | (eid >= E)
        wi = tl.load(wts_ptr + t * K + i)
        row = tl.load(inv_ptr + t * K + i).to(tl.int64)
        # a dropped slot's row (sorted last) holds no result: it is read, then never used
        if YS > 1:
            yv = tl.load(y_ptr + row * (YS * H) + hc, mask=hm, other=0.0)
            for s in tl.static_range(1, YS):
                yv += tl.load(y_ptr + row * (YS * H) + s * H + hc, mask=hm, other=0.0)
        else:
            yv = tl.load(y_ptr + row * H + hc, mask=hm, other=0.0)
        if WEIGHTED:
            acc += tl.where(ok, wi * yv, 0.0)
        else:
            acc += tl.where(ok, yv, 0.0)
    acc = tl.where(bad, float("nan"), acc)
    tl.store(out_ptr + t * H + hc, to_out(acc, out_ptr, RNE), mask=hm)


#: the most (token, slot) pairs ``_moe_align_kernel`` sorts: one program holds the pairs in
#: registers and its bitonic sort costs O(P log^2 P) steps, so past a few thousand pairs the torch
#: ops of ``_route_torch`` (many kernels, each parallel) are as fast; 2048 covers decode up to
#: 341 tokens with 6 routed slots
ALIGN_MAX_PAIRS = 2048
#: ... and at most this many experts + 1 (the dropped bin); more experts take the torch path
ALIGN_MAX_BINS = 1024


@triton.jit
def _moe_align_kernel(ids_ptr, starts_ptr, tcum_ptr, tok_ptr, inv_ptr, P, K, E,
                      BP: tl.constexpr, EB: tl.constexpr, BM: tl.constexpr):
    """One program: the routing of ``_route_torch`` for P <= BP pairs (BP, EB powers of two,
    EB > E, (E + 1) * BP < 2^31). Key = expert id, E for a dropped slot and for the padding lanes
    p >= P; sorting the distinct composites key * BP + p orders pairs by key, then pair index
    (a stable sort), and puts the padding after every real pair."""
    p = tl.arange(0, BP)
    pm = p < P
    eid = tl.load(ids_ptr + p, mask=pm, other=0)
    key = tl.where(pm & (eid >= 0) & (eid < E), eid, E).to(tl.int32)
    # per-expert counts: every key lies in [0, E] within the EB bins (the GPU lowering reads only
    # the low log2(EB) bits of a value, so none may lie outside); bin E and above are dropped
    e = tl.arange(0, EB)
    counts = tl.where(e < E, tl.histogram(key, EB), 0)
    incl = tl.cumsum(counts, 0)
    tl.store(starts_ptr + e, incl - counts, mask=e <= E)   # exclusive prefix; starts[E] = kept pairs
    tl.store(tcum_ptr + e, tl.cumsum((counts + (BM - 1)) // BM, 0), mask=e < E)
    order = tl.sort(key * BP + p) & (BP - 1)               # sorted position i holds pair order[i]
    tl.store(tok_ptr + p, order // K, mask=pm)
    tl.store(inv_ptr + order, p, mask=pm)


def _route_torch(ids, E: int, BM: int):
    """(starts [E+1], tcum [E], tok [P], inv [P]), int32: pairs (ids flattened, p = t * K + slot)
    sorted stably by expert, dropped slots (ids outside [0, E)) last; starts[e] = first sorted
    row of expert e (starts[E] = kept pairs), tcum = cumsum of ceil(count_e / BM), tok[i] = token
    of sorted row i, inv[p] = sorted row of pair p."""
    dev = ids.device
    K = ids.shape[1]
    P = ids.numel()
    flat = ids.reshape(-1).to(torch.int64)
    key = torch.where((flat >= 0) & (flat < E), flat, E)
    skey, order = torch.sort(key, stable=True)
    starts = torch.searchsorted(skey, torch.arange(E + 1, device=dev)).to(torch.int32)
    counts = starts[1:] - starts[:-1]
    tcum = torch.cumsum(torch.div(counts + (BM - 1), BM, rounding_mode="floor"), 0).to(torch.int32)
    tok = torch.div(order, K, rounding_mode="floor").to(torch.int32)
    inv = torch.empty(P, dtype=torch.int32, device=dev).scatter_(0, order, torch.arange(P, dtype=torch.int32, device=dev))
    return starts, tcum, tok, inv


def _align_fits(P: int, E: int) -> bool:
    # E bounded too: the kernel holds E + 1 histogram bins in one program (and the bounds keep its
    # composite sort keys (E + 1) * BP within int32)
    return P <= ALIGN_MAX_PAIRS and E + 1 <= ALIGN_MAX_BINS


def _route(ids, E: int, BM: int):
    """``_route_torch``'s result; one kernel launch when ``_align_fits`` (shapes only)."""
    K = ids.shape[1]
    P = ids.numel()
    if not _align_fits(P, E):
        return _route_torch(ids, E, BM)
    dev = ids.device
    starts = torch.empty(E + 1, dtype=torch.int32, device=dev)
    tcum = torch.empty(E, dtype=torch.int32, device=dev)
    tok = torch.empty(P, dtype=torch.int32, device=dev)
    inv = torch.empty(P, dtype=torch.int32, device=dev)
    BP = max(16, np2(P))
    _moe_align_kernel[(1,)](c(ids), starts, tcum, tok, inv, P, K, E, BP=BP, EB=max(64, np2(E + 1)), BM=BM,
                            num_warps=4, **TUNE.options())
    return starts, tcum, tok, inv


def _tiles(P: int, E: int, H: int, I: int, programs: int, fp8: bool, plain: bool, scaled: bool,
           big: bool) -> tuple:
    """The portable (BM, BN_up, BN_down, BK, num_warps, num_stages) of the tensor-core path, for P
    pairs over E experts (a plugin's table replaces this function: TUNE ``tiles``, same arguments;
    ``programs``: the split-K target, ``plain``: bf16 weights, ``scaled``: FP4 read by "scaled",
    ``big``: the device has BIG_TILE_SHARED of shared memory a block; unused here).

    Design reason, no device timed: 16-row tiles while an expert holds a few pairs (P <= 4 E: decode,
    the least row padding), 64 above; 64-column N blocks and K steps (FP8: two sub-blocks a 128x128
    scale block, FP4: two 32-column scale groups) on 4 warps, 2 stages: the gate / up kernel's
    (BM + 2 BN) x BK bf16 tiles take 2 x 24 KiB by the tile arithmetic (not compiled without a
    table; the down kernel's two-half activation rows the same), within the 64 KiB a block of the
    smallest targets (gfx942 LDS, an XPU's SLM)."""
    return 16 if P <= 4 * E else 64, 64, 64, 64, 4, 2


def _config(P: int, E: int, ieee: bool, f32: bool, fp8: bool, H: int = 0, I: int = 0, programs: int = 0,
            plain: bool = False, scaled: bool = False, big: bool = False):
    """(BM, BN_up, BN_down, BK, num_warps, num_stages, KSUB): the tensor-core path's tiles from
    TUNE ``tiles`` (a plugin table's function) or :func:`_tiles`, then the TUNE / table keys. With
    FP8 weights BK * KSUB = 128."""
    if ieee:
        # fp32 tiles are 2x wider per element and the KSUB sub-blocks are unrolled: smaller tiles,
        # fewer stages, or the kernel needs more shared memory than an H200 has (seen: 288 KiB)
        cfg = (16 if P <= 4 * E else 32, 32, 32, 32, 4, 2)
    else:
        cfg = tuple(TUNE.get("tiles", _tiles)(P, E, H, I, programs, fp8, plain, scaled, big))
    if TUNE.sets_any():
        cfg = tuple(TUNE.get(k, v) for k, v in zip(("BM", "BNu", "BNd", "BK", "num_warps", "num_stages"), cfg))
    BK = cfg[3]
    ksub = (128 // BK if 128 % BK == 0 else 0) if fp8 else (4 if ieee and f32 else 1)
    return cfg + (ksub,)


def _splits(default: tuple = (1, 1)) -> tuple[int, int]:
    """(Su, Sd): TUNE's where set (validated), else ``default`` (`_split_rule`'s)."""
    out = []
    for key, d in zip(("Su", "Sd"), default):
        v = TUNE.get(key, d)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_SPLIT:
            raise ValueError(f"moe_experts: TUNE {key}={v!r} must be an int in [1, {MAX_SPLIT}]")
        out.append(v)
    return out[0], out[1]


@implements("moe_experts", supports=predicates.moe_experts_supports)
def moe_experts(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None, act_block=None):
    T, H = x.shape
    E = w13.shape[0]
    I = w13.shape[1] // 2
    dev = x.device
    out = torch.empty((T, H), dtype=x.dtype, device=dev)
    K = ids.shape[1]
    P = T * K
    if T == 0:
        return out
    if P == 0 or E == 0 or I == 0:
        return out.zero_()
    x, ids, weights = c(x), c(ids), c(weights)
    if act_block is not None:
        from .quant import fake_quant_fp8

        x = fake_quant_fp8(x, act_block)
    f13, _, e13 = _format(w13, w13_scale)
    f2, _, e2 = _format(w2, w2_scale)
    f32 = x.dtype == torch.float32
    ieee = f32 or interp(x)
    fp4_mode, fp8_mode = TUNE.get("fp4", DECODES[0]), TUNE.get("fp8", FP8_PATHS[0])
    if fp4_mode not in DECODES:
        raise ValueError(f"moe_experts: TUNE fp4={fp4_mode!r} must be one of {DECODES}")
    if fp8_mode not in FP8_PATHS:
        raise ValueError(f"moe_experts: TUNE fp8={fp8_mode!r} must be one of {FP8_PATHS}")
    # many rows per expert: quantised weights converted to bf16 once, in chunks of experts (dequant.py)
    quantised = (f13 != FMT_PLAIN, f2 != FMT_PLAIN)
    deq = any(quantised) and dequant.wanted(TUNE, "moe_experts", P, E)
    chunk, scratch = E, None
    if deq:
        chunk = dequant.expert_chunks(E, 2 * I * H, dequant.budget(TUNE, "moe_experts"))
        scratch = torch.empty(chunk * 2 * I * H, dtype=torch.bfloat16, device=dev)
        # FP4 and UE8M0-scaled FP8: the scales folded in (plain bf16); FP8 with fp32 scales: the codes
        f13, f2 = (FMT_PLAIN if f == FMT_FP4 or (f == FMT_FP8 and dequant.foldable(s)) else f
                   for f, s in ((f13, w13_scale), (f2, w2_scale)))
        fp8_mode = FP8_PATHS[0]
    # bf16 GEMM operands without scales (a folded weight's are)
    plain = all(f == FMT_PLAIN and ((deq and q) or w.dtype == torch.bfloat16)
                for q, f, w in zip(quantised, (f13, f2), (w13, w2)))
    fp8 = f13 == FMT_FP8 or f2 == FMT_FP8
    d13, d2 = _decode_keys(f13, f32, fp4_mode, fp8_mode), _decode_keys(f2, f32, fp4_mode, fp8_mode)
    programs = target_programs(dev)
    scaled, big = d13["SCALED"] or d2["SCALED"], shared_bytes(dev) >= BIG_TILE_SHARED
    cfg = TUNE.memo(("cfg", P, E, ieee, f32, fp8, H, I, programs, plain, scaled, big),   # once per shapes and TUNE
                    lambda: _config(P, E, ieee, f32, fp8, H, I, programs, plain=plain, scaled=scaled, big=big))
    BM, BNu, BNd, BK, nw, ns, KSUB = cfg
    if (fp8 and BK * KSUB != 128) or ((f13 == FMT_FP4 or f2 == FMT_FP4) and BK % 32):
        raise ValueError(f"moe_experts: BK={BK} must divide 128 (FP8) and be a multiple of 32 (FP4) (TUNE override?)")
    rule = TUNE.get("split", SPLIT_RULES[0])
    if rule not in SPLIT_RULES:
        raise ValueError(f"moe_experts: TUNE split={rule!r} must be one of {SPLIT_RULES}")
    Su, Sd = _splits(_split_rule(P, E, H, I, cfg, programs, ieee, bool(d13["SCALED"])) if rule == "h200" else (1, 1))

    # pairs sorted by expert on the device (stable: pair order within an expert); dropped slots last
    starts, tcum, tok, inv = _route(ids, E, BM)

    LOGE = max(1, int(E).bit_length())
    # chunks of experts [e0, e1): one (the call) unless converted weights exceed the scratch budget;
    # a chunk's grid: the upper bound ceil(P / BM) + min(experts, P) on its tiles
    chunks = [(e0, min(E, e0 + chunk)) for e0 in range(0, E, chunk)]

    def weights_of(w, scale, e0, e1):   # (weight, scale) a chunk's GEMM reads
        return dequant.expert_weights(w, scale, e0, e1, scratch) if deq else (w, scale)

    def chunk_args(e0, e1):
        return {"E_LO": e0, "E_HI": e1, "CHUNK": True} if len(chunks) > 1 else {}
    # split K: the up kernel's raw partial sums [P, Su, 2 I] (else straight the activation [P, I]),
    # the down kernel's parts [P, Sd, H]; the split constexprs are passed only when a split is on
    raw = act_block is not None   # the official activation: the raw sums always, then its own kernel
    # a plugin's own FP4 expert GEMMs (TUNE "gemm"), for the official activation's bf16 operands
    gemm = TUNE.get("gemm") if (raw and not deq and len(chunks) == 1 and x.dtype == torch.bfloat16
                                and f13 == FMT_FP4 and f2 == FMT_FP4) else None
    g_up = gemm is not None and gemm.serves(w13, w13_scale, BM, P)
    g_down = gemm is not None and gemm.serves(w2, w2_scale, BM, P)
    Su, Sd = (1 if g_up else Su), (1 if g_down else Sd)
    # the down GEMM's input: FP8 values, exact in bf16 (stored so for the plugin's GEMM)
    a = torch.empty((P, I), dtype=torch.bfloat16 if g_down else torch.float32, device=dev)
    parts = torch.empty((P, Su, 2 * I), dtype=torch.float32, device=dev) if Su > 1 or raw else a
    y = torch.empty((P, Sd, H) if Sd > 1 else (P, H), dtype=torch.float32, device=dev)
    if g_up:   # (one chunk)
        gemm(x, tok, w13, w13_scale, parts.view(P, 2 * I), tcum, starts, BM)
    for e0, e1 in ([] if g_up else chunks):
        w, s = weights_of(w13, w13_scale, e0, e1)
        _moe_up_kernel[(cdiv(P, BM) + min(e1 - e0, P), cdiv(I, BNu)) + ((Su,) if Su > 1 else ())](
            x, tok, w, _scale_arg(s, f13, e13, x), parts, tcum, starts, E, H, I, float(swiglu_limit),
            LOGE=LOGE, BM=BM, BN=BNu, BK=BK, FMT=f13, E8M0=e13, IEEE=ieee, KSUB=KSUB, EVEN=H % (BK * KSUB) == 0,
            BLK=f13 == FMT_FP8 or (ieee and not d13["SCALED"]), num_warps=nw, num_stages=ns, **d13,
            **({"SPLIT": Su} if Su > 1 else {}), **({"RAW": True} if raw else {}), **chunk_args(e0, e1),
            **TUNE.options())
    if raw:
        BI = min(1024, triton.next_power_of_2(I))
        # each sorted row's routing weight (row inv[p] holds pair p), applied before w2
        wrow = torch.empty(P, dtype=torch.float32, device=dev)
        _pair_rows_kernel[(cdiv(P, 1024),)](inv, weights, wrow, P, BP=1024, num_warps=4, **TUNE.options())
        _moe_act_official_kernel[(P, cdiv(I, BI))](parts, wrow, a, starts, I, E, float(swiglu_limit), S=Su, BI=BI,
                                                   QB=act_block, num_warps=4, **TUNE.options())
    elif Su > 1:
        BI = min(1024, triton.next_power_of_2(I))
        _moe_act_kernel[(P, cdiv(I, BI))](parts, a, I, float(swiglu_limit), S=Su, BI=BI, num_warps=4, **TUNE.options())
    if g_down:
        gemm(a, None, w2, w2_scale, y, tcum, starts, BM)
    for e0, e1 in ([] if g_down else chunks):
        w, s = weights_of(w2, w2_scale, e0, e1)
        # the official activation holds FP8 values, exact in bf16: one dot a step (HILO off)
        _moe_down_kernel[(cdiv(P, BM) + min(e1 - e0, P), cdiv(H, BNd)) + ((Sd,) if Sd > 1 else ())](
            a, w, _scale_arg(s, f2, e2, x), y, tcum, starts, E, H, I,
            LOGE=LOGE, BM=BM, BN=BNd, BK=BK, FMT=f2, E8M0=e2, IEEE=ieee, KSUB=KSUB, EVEN=I % (BK * KSUB) == 0,
            BLK=f2 == FMT_FP8 or (ieee and not d2["SCALED"]), num_warps=nw, num_stages=ns, **d2,
            **({"SPLIT": Sd} if Sd > 1 else {}), **({"HILO": False} if raw else {}), **chunk_args(e0, e1),
            **TUNE.options())
    BH = min(1024, triton.next_power_of_2(H))
    _moe_combine_kernel[(T, cdiv(H, BH))](y, inv, ids, weights, out, H, K, E, BH=BH, RNE=rne(out), num_warps=4,
                                          **({"YS": Sd} if Sd > 1 else {}), **({"WEIGHTED": False} if raw else {}),
                                          **TUNE.options())
    return out
