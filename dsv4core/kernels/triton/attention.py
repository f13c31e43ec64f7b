"""sparse_mqa_attention: gathered-row MQA with a per-head sink, split-K (flash-decoding) + combine.

One program = (query t, a block of BH heads, a slice of the index list, "split"). It gathers BK kv
rows at a time (rows with index -1 or out of range are masked, never read; the op's input check
raises on out-of-range indices before any kernel runs), does q.k with fp32 accumulation, an online
softmax, and p@v with p split into two bf16 halves (hi + lo, ~16 mantissa bits) so that bf16
inputs keep close to fp32 accuracy; fp32 inputs use ieee fp32 products. With one split the sink
and normalisation happen in the same kernel; otherwise each split writes fp32 partials (running
max m, sum l, unnormalised acc) and a second launch merges them, the sink entering once there.

The split count comes from the device's SM count and the batch (:func:`plan`), so a decode batch
of 1-8 tokens still fills the GPU. The combine reads every split of a (token, element) block in
one [splits, CB] tile (an earlier combine, one program per head block reading the splits one
after another, made S dependent round trips on 4 SMs at T = 1: 22.9 µs against 15.2 on the H200,
tune-s18-h200-flash-read.json). No atomics: results are bitwise repeatable for a given launch plan.

Variants for the decode batch (issue 10: <= 15 us at T <= 8), chosen through TUNE / a launch table
(keys of :func:`plan`; the defaults run none of them):

- ``pipe`` 1 / 2: the row gather pipelined by hand (next block's indices, or indices and kv rows,
  loaded before the current block is computed); the same arithmetic in the same order.
- ``DV``: a program computes q.k over all D columns but p @ v (and its output) for DV of them, so
  D / DV programs share a (token, head block, split). Meant for ``BH`` 64 (all DSV4 heads of a
  token in one program, Hopper-sized dots: M = 64) with DV 128, which keeps the [64, DV] fp32
  accumulator in registers; a kv row is then read D / DV times per token instead of NH / BH.
- ``pv`` (bf16): how p = p_hi + p_lo meets v. "chain" (default): two dots on one accumulator;
  "apart": the lo dot in its own fp32 sum, added after; "dup": each kv row gathered twice, one dot
  of depth 2 BK (p_hi against one copy, p_lo against the other; q.k then runs on 2 BK columns).
  The last two keep one MMA layout where Triton would give chained dots two (BH = 64 on 8 warps,
  see the kernel).
- ``S`` 1 is the single-launch path (no partials, no combine); ``S`` >= the row blocks gives one
  block per program.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import c, cdiv, interp, rne, target_programs, to_out
from .launch import Tune

_CPU_PROGRAMS = 264  # under the interpreter; on a GPU: 2 per SM of the device
#: launch parameters: tuning overrides (benchmarks/tune_triton.py) over the bound backend's launch
#: table (launch.py); the defaults are the kernels' own
TUNE = Tune(__name__)


@triton.jit
def _smqa_rows(idx_ptr, t, K, N, k0, k_hi, BK: tl.constexpr, DUP: tl.constexpr):
    """Rows k0 .. k0+BK of token t's index list: (row, valid); invalid (-1, >= N, past k_hi) -> row 0.
    DUP: each entry twice (2 BK long: entries k0, k0, k0+1, k0+1, ...)."""
    if DUP:
        ks = k0 + tl.arange(0, 2 * BK) // 2
    else:
        ks = k0 + tl.arange(0, BK)
    idx = tl.load(idx_ptr + t * K + ks, mask=ks < k_hi, other=-1).to(tl.int64)
    valid = (idx >= 0) & (idx < N)
    return tl.where(valid, idx, 0), valid


@triton.jit
def _smqa_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, op_ptr, mp_ptr, lp_ptr,
                 T, NH, N, K, KPS, S, scale,
                 D: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr,
                 PIPE: tl.constexpr, PV: tl.constexpr, F32: tl.constexpr,
                 FINAL: tl.constexpr, INTERP: tl.constexpr, RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1) // (D // DV)
    vb = tl.program_id(1) % (D // DV)         # this program's DV output columns (p @ v); q.k uses all D
    sp = tl.program_id(2)
    heads = hb * BH + tl.arange(0, BH)
    hm = heads < NH
    dc = tl.arange(0, D)
    dv = vb * DV + tl.arange(0, DV)
    q = tl.load(q_ptr + (t * NH + heads[:, None]) * D + dc[None, :], mask=hm[:, None], other=0.0)
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, DV], dtype=tl.float32)
    k_lo = sp * KPS
    k_hi = tl.minimum(k_lo + KPS, K)
    # PIPE (software pipelining by hand; the same arithmetic in the same order, only the loads
    # move): 1 = the next block's indices are loaded one step ahead, so a step's kv gather does not
    # wait for its index load; 2 = the next block's kv rows are gathered too (a register double
    # buffer) before the current block is computed
    if PIPE >= 1:
        rows, valid = _smqa_rows(idx_ptr, t, K, N, k_lo, k_hi, BK, PV == 2)
    if PIPE == 2:
        kv = tl.load(kv_ptr + rows[:, None] * D + dc[None, :], mask=valid[:, None], other=0.0)
    for k0 in range(k_lo, k_hi, BK):
        if PIPE == 0:
            rows, valid = _smqa_rows(idx_ptr, t, K, N, k0, k_hi, BK, PV == 2)
        if PIPE != 2:
            kv = tl.load(kv_ptr + rows[:, None] * D + dc[None, :], mask=valid[:, None], other=0.0)
        if PIPE >= 1:
            rows_n, valid_n = _smqa_rows(idx_ptr, t, K, N, k0 + BK, k_hi, BK, PV == 2)
        if PIPE == 2:
            kv_n = tl.load(kv_ptr + rows_n[:, None] * D + dc[None, :], mask=valid_n[:, None], other=0.0)
        if DV == D:
            vv = kv
        else:
            vv = tl.load(kv_ptr + rows[:, None] * D + dv[None, :], mask=valid[:, None], other=0.0)
        if F32:
            s = tl.dot(q, tl.trans(kv), input_precision="ieee")
        elif INTERP:
            s = tl.dot(q.to(tl.float32), tl.trans(kv.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kv))
        s = s * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        if PV == 2:   # every row twice: its weight counts once
            even = (tl.arange(0, 2 * BK) % 2) == 0
            l_i = l_i * alpha + tl.sum(tl.where(even[None, :], p, 0.0), axis=1)
        else:
            l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if F32:
            acc += tl.dot(p, vv, input_precision="ieee")
        elif INTERP and PV == 0:
            acc += tl.dot(p, vv.to(tl.float32), input_precision="ieee")
        else:
            p_hi = p.to(vv.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(vv.dtype)
            if PV == 2:
                # the kv rows come twice (2k, 2k + 1): one dot of depth 2 BK takes p_hi against
                # the first copy and p_lo against the second, so there is one p @ v dot (one MMA
                # layout) and the [BH, DV] accumulator is not copied between layouts
                a = tl.where(even[None, :], p_hi, p_lo)
                if INTERP:   # the same bf16 operands, their (exact) products in fp32
                    acc = tl.dot(a.to(tl.float32), vv.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, vv, acc)
            elif PV == 1:
                # the lo products in their own fp32 sum, added after: no dot feeds another, so
                # Triton gives both the same MMA layout (a dot->dot chain gets warps along M only,
                # which at BH = 64 on 8 warps swaps the [BH, DV] accumulator between two layouts
                # every step). The 2^8 scaling is exact both ways (powers of two; p_lo <= 2^-7);
                # it keeps Triton from folding the add back into the chain
                # (add(dot(a, b, 0), c) -> dot(a, b, c)).
                lo8 = (p_lo.to(tl.float32) * 256.0).to(vv.dtype)
                if INTERP:   # the same bf16 operands, their (exact) products in fp32
                    lo = tl.dot(lo8.to(tl.float32), vv.to(tl.float32), input_precision="ieee")
                    acc = tl.dot(p_hi.to(tl.float32), vv.to(tl.float32), acc, input_precision="ieee")
                    acc = acc + lo * 0.00390625
                else:
                    acc = tl.dot(p_hi, vv, acc) + tl.dot(lo8, vv) * 0.00390625
            else:
                acc += tl.dot(p_hi, vv)
                acc += tl.dot(p_lo, vv)
        m_i = m_new
        if PIPE >= 1:
            rows = rows_n
            valid = valid_n
        if PIPE == 2:
            kv = kv_n
    if FINAL:
        sink = tl.load(sink_ptr + heads, mask=hm, other=0.0)
        mx = tl.maximum(m_i, sink)
        w = tl.exp(m_i - mx)
        den = l_i * w + tl.exp(sink - mx)
        o = acc * (w / den)[:, None]
        tl.store(o_ptr + (t * NH + heads[:, None]) * D + dv[None, :], to_out(o, o_ptr, RNE),
                 mask=hm[:, None])
    else:
        row = (t * S + sp) * NH + heads
        tl.store(op_ptr + row[:, None] * D + dv[None, :], acc, mask=hm[:, None])
        # every column block of a head computes the same m, l (the same q.k): the first stores them
        if vb == 0:
            tl.store(mp_ptr + row, m_i, mask=hm)
            tl.store(lp_ptr + row, l_i, mask=hm)


@triton.jit
def _smqa_combine_kernel(sink_ptr, o_ptr, op_ptr, mp_ptr, lp_ptr, NH, S,
                         D: tl.constexpr, SP: tl.constexpr, CB: tl.constexpr, RNE: tl.constexpr):
    """Merge the S split partials of token t: one program per CB consecutive (head, column)
    elements of the token's [NH, D] output, all S splits loaded at once as a [SP, CB] tile (one
    round trip, not S), reduced over the split axis in the compiled (fixed) order.

    ``o = sum_s w_s acc_s / (sum_s w_s l_s + exp(sink - mx))`` with ``w_s = exp(m_s - mx)`` and
    ``mx = max(sink, max_s m_s)``: the sink enters once, here. A split without a valid row has
    m = -inf, l = 0, acc = 0, so w = 0 and it adds nothing; a token without any valid row gives
    0 / exp(0) = 0, as the reference does."""
    t = tl.program_id(0).to(tl.int64)
    f = tl.program_id(1) * CB + tl.arange(0, CB)        # flat index into the token's [NH, D]
    fm = f < NH * D
    head = f // D
    sp = tl.arange(0, SP)
    mk = (sp < S)[:, None] & fm[None, :]
    row = (t * S + sp[:, None]) * NH + head[None, :]      # [SP, CB] partial row (t, s, head)
    m = tl.load(mp_ptr + row, mask=mk, other=float("-inf"))
    l = tl.load(lp_ptr + row, mask=mk, other=0.0)
    a = tl.load(op_ptr + row * D + (f % D)[None, :], mask=mk, other=0.0)
    sink = tl.load(sink_ptr + head, mask=fm, other=0.0)
    mx = tl.maximum(tl.max(m, axis=0), sink)
    w = tl.exp(m - mx[None, :])
    den = tl.sum(w * l, axis=0) + tl.exp(sink - mx)
    o = tl.sum(w * a, axis=0) / den
    tl.store(o_ptr + t * (NH * D) + f, to_out(o, o_ptr, RNE), mask=fm)


#: the p @ v forms for bf16 inputs (TUNE key "pv"; the kernel's PV constexpr is the position):
#: two dots on one accumulator (hi then lo), the lo dot apart, one dot over duplicated kv rows
PV_MODES = ("chain", "apart", "dup")

#: most row splits per token (the combine loads all of them at once: a [np2(S), CB] tile)
MAX_SPLITS = 64


def plan(T: int, NH: int, D: int, K: int, f32: bool, device) -> dict:
    """The launch plan for a call: tuning keys (TUNE over the launch table over these defaults)
    and the derived split count. Keys: ``BH`` heads and ``BK`` kv rows per step, ``num_warps``,
    ``num_stages``; ``S`` row splits per token (default: T x ceil(NH / BH) x S programs up to
    ``target``: 1 per SM of the device below T = 128, 2 from there; at least one BK block per
    split, at most MAX_SPLITS splits); ``target``; ``cBLOCK`` elements of the combine's tile
    (S x CB), ``c_num_warps``; ``DV`` output columns per program (D, D/2 or D/4; programs: T x
    ceil(NH / BH) x D / DV x S); ``pipe`` 0 / 1 / 2 and ``pv`` (:data:`PV_MODES`; module docstring)."""
    big = T >= 128
    # T < 128 is latency-bound: one 64-row block per split at most and one program per SM (target
    # / 2) is what the H200 sweep found fastest at T = 1..8 (tune-s18-h200-flash-read.json: 15.2 /
    # 18.5 / 21.0 / 25.0 us against 22.9 / 24.3 / 27.3 / 26.9 for the first path; smaller row
    # blocks or two programs per SM were slower). T >= 128 (DSV4-Flash CSA shape): 32 heads x 32
    # rows (fewer re-gathers of the same kv rows, 1.4x), 2 programs per SM.
    target = TUNE.get("target", target_programs(device, _CPU_PROGRAMS) // (1 if big else 2))
    BH = TUNE.get("BH", 32 if big else 16)
    nhb = cdiv(NH, BH)
    bk = 16 if f32 else (32 if big else 64)
    BK = TUNE.get("BK", bk)
    nkb = cdiv(K, BK)
    DV = TUNE.get("DV", D)
    if DV not in (D, D // 2, D // 4) or DV < 16:
        raise ValueError(f"sparse_mqa_attention: TUNE DV={DV!r} (output columns per program) must be "
                         f"D, D/2 or D/4 and >= 16 with D = {D}")
    S = TUNE.get("S")
    if S is None:
        S = target // (T * nhb * (D // DV))
    S = max(1, min(int(S), nkb, MAX_SPLITS))
    KPS = cdiv(nkb, S) * BK          # rows per split, a whole number of BK blocks
    S = cdiv(K, KPS)
    SP = triton.next_power_of_2(S)
    CB = max(16, min(TUNE.get("cBLOCK", 4096) // SP, triton.next_power_of_2(NH * D)))
    pv = TUNE.get("pv", "chain")
    if pv not in PV_MODES:
        raise ValueError(f"sparse_mqa_attention: TUNE pv={pv!r}; expected one of {', '.join(PV_MODES)}")
    pipe = TUNE.get("pipe", 0)
    if pipe not in (0, 1, 2):
        raise ValueError(f"sparse_mqa_attention: TUNE pipe={pipe!r}; expected 0 (none), 1 (indices one "
                         f"block ahead) or 2 (indices and kv rows one block ahead)")
    return dict(BH=BH, BK=BK, nhb=nhb, S=S, KPS=KPS, SP=SP, CB=CB, DV=DV, pipe=pipe, pv=pv,
                num_warps=TUNE.get("num_warps", 4), num_stages=TUNE.get("num_stages", 2),
                c_num_warps=TUNE.get("c_num_warps", 4))


def sparse_mqa_attention(q, kv, indices, sink, scale):
    T, NH, D = q.shape
    o = torch.empty((T, NH, D), dtype=q.dtype, device=q.device)
    if T == 0 or NH == 0:
        return o
    K = indices.shape[1]
    if K == 0:
        return o.zero_()
    q, kv, indices, sink = c(q), c(kv), c(indices), c(sink)
    N = kv.shape[0]
    f32 = q.dtype == torch.float32
    p = plan(T, NH, D, K, f32, q.device)
    BH, BK, nhb, S, KPS = p["BH"], p["BK"], p["nhb"], p["S"], p["KPS"]
    grid = (T, nhb * (D // p["DV"]))
    # fp32 inputs never split p: the pv forms are the bf16 path's
    pv = 0 if f32 else PV_MODES.index(p["pv"])
    common = dict(D=D, BH=BH, BK=BK, DV=p["DV"], PIPE=p["pipe"], PV=pv, F32=f32, INTERP=interp(q), RNE=rne(o),
                  num_warps=p["num_warps"], num_stages=p["num_stages"], **TUNE.options())
    if S == 1:
        _smqa_kernel[(*grid, 1)](q, kv, indices, sink, o, o, o, o, T, NH, N, K, KPS, 1,
                                 float(scale), FINAL=True, **common)
        return o
    # fp32 partials per (t, split, head): acc [D], running max m, running sum l
    op = torch.empty((T * S * NH, D), dtype=torch.float32, device=q.device)
    mp = torch.empty((T * S * NH,), dtype=torch.float32, device=q.device)
    lp = torch.empty((T * S * NH,), dtype=torch.float32, device=q.device)
    _smqa_kernel[(*grid, S)](q, kv, indices, sink, o, op, mp, lp, T, NH, N, K, KPS, S,
                             float(scale), FINAL=False, **common)
    CB = p["CB"]
    _smqa_combine_kernel[(T, cdiv(NH * D, CB))](sink, o, op, mp, lp, NH, S, D=D, SP=p["SP"], CB=CB,
                                                RNE=rne(o), num_warps=p["c_num_warps"], **TUNE.options())
    return o
