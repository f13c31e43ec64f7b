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
benchmarks/results/h200/2026-12-01_8397775/tune/all-ops-flash.json). No atomics: results are bitwise repeatable for a given launch plan.

``kv_format="fp8"`` (the FP8 KV row of ``hal.rowformats``): the gather reads the row's bytes and
decodes them in registers (e4m3 x its group's UE8M0 scale for the non-rope channels, bf16 for the
rope channels) into the same [BK, D] tile; the decoded values are exact in q's dtype, so the rest
of the kernel, and its result, are those of a plain pool holding the same values.

``S`` = 1 (the plan's choice once T x head blocks fill the GPU, or for one row block) is the
single launch: no partials, no combine.

TUNE ``pipe`` 1: the row gather pipelined by hand, the next block's indices loaded before the
current block is computed; the same arithmetic in the same order (bitwise equal results).
Default 0 (a plain loop whose loads the compiler schedules): the hand pipeline holds the next
block's indices in registers on top of the tile, which is a win or a spill depending on the
target's register file (it spills SGPRs on gfx950); a target that measured it faster sets it in
its plugin's launch table (the CUDA plugin on sm90 at T <= 64).

Removed after the H200 sweep (benchmarks/results/h200/2026-12-01_2494243/tune/mhc-attention-variants-flash.json;
the code is at commit 2494243): a column split of p @ v (``DV``: D / DV programs share a token's
head block and split), p @ v with the lo half of p in its own dot or over duplicated kv rows
(``pv`` "apart" / "dup"), and ``pipe`` 2 (the next block's kv rows gathered ahead too, a register
double buffer). At T = 1 / 2 / 4 / 8 the best of them took 18.8 / 17.3 / 18.6 / 22.8 µs against
pipe 1's 14.0 / 16.2 / 17.4 / 20.8; pipe 2 took 77.4 / 289 µs at T = 64 / 256 against 61.8 / 199.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from dsv4core.hal.rowformats import ROPE_DIM

from ._util import c, cdiv, interp, np2, rne, target_programs, to_out
from . import _paged
from .launch import Tune
from . import predicates
from .registry import implements

_CPU_PROGRAMS = 264  # under the interpreter; on a GPU: 2 per SM of the device
#: launch parameters: tuning overrides (benchmarks/tune_triton.py) over the bound backend's launch
#: table (launch.py); the defaults are the kernels' own
TUNE = Tune(__name__)   # its keys: launch.TUNING_KEYS


@triton.jit
def _smqa_rows(idx_ptr, t, K, N, k0, k_hi, BK: tl.constexpr):
    """Rows k0 .. k0+BK of token t's index list: (row, valid); invalid (-1, >= N, past k_hi) -> row 0."""
    ks = k0 + tl.arange(0, BK)
    idx = tl.load(idx_ptr + t * K + ks, mask=ks < k_hi, other=-1).to(tl.int64)
    valid = (idx >= 0) & (idx < N)
    return tl.where(valid, idx, 0), valid


@triton.jit
def _fp8_kv_rows(kv_ptr, rows, valid, W: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr):
    """fp32 [BK, D]: FP8 KV rows ``rows`` of a uint8 pool of W-byte rows (hal.rowformats "fp8"):
    bytes [0, NOPE) e4m3, [NOPE, NOPE + 2 (D - NOPE)) bf16 rope channels, then one UE8M0 byte per
    64 non-rope channels (2^(b - 127), built from its bits: b >= 1, as every stored scale is)."""
    dc = tl.arange(0, D)
    base = rows[:, None] * W
    nope = (dc < NOPE)[None, :]
    m = valid[:, None] & nope
    b = tl.load(kv_ptr + base + dc[None, :], mask=m, other=0)
    e = tl.load(kv_ptr + base + (NOPE + 2 * (D - NOPE)) + (dc // 64)[None, :], mask=m, other=127)
    scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    v = b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale
    rope_ptr = (kv_ptr + base + NOPE).to(tl.pointer_type(tl.bfloat16))
    r = tl.load(rope_ptr + (dc - NOPE)[None, :], mask=valid[:, None] & (dc >= NOPE)[None, :], other=0.0)
    return tl.where(nope, v, r.to(tl.float32))


@triton.jit
def _smqa_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, op_ptr, mp_ptr, lp_ptr,
                 T, NH, N, K, KPS, S, scale,
                 D: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, PIPE: tl.constexpr,
                 F32: tl.constexpr, FINAL: tl.constexpr, INTERP: tl.constexpr, RNE: tl.constexpr,
                 FP8: tl.constexpr, NOPE: tl.constexpr, W: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    heads = hb * BH + tl.arange(0, BH)
    hm = heads < NH
    dc = tl.arange(0, D)
    q = tl.load(q_ptr + (t * NH + heads[:, None]) * D + dc[None, :], mask=hm[:, None], other=0.0)
    m_i = tl.full([BH], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BH], dtype=tl.float32)
    acc = tl.zeros([BH, D], dtype=tl.float32)
    k_lo = sp * KPS
    k_hi = tl.minimum(k_lo + KPS, K)
    # PIPE 1 (software pipelining by hand; the same arithmetic in the same order, only the loads
    # move): the next block's indices are loaded one step ahead, so a step's kv gather does not
    # wait for its index load
    if PIPE == 1:
        rows, valid = _smqa_rows(idx_ptr, t, K, N, k_lo, k_hi, BK)
    for k0 in range(k_lo, k_hi, BK):
        if PIPE == 0:
            rows, valid = _smqa_rows(idx_ptr, t, K, N, k0, k_hi, BK)
        if FP8:
            kv = _fp8_kv_rows(kv_ptr, rows, valid, W, D, NOPE).to(q.dtype)
        else:
            kv = tl.load(kv_ptr + rows[:, None] * W + dc[None, :], mask=valid[:, None], other=0.0)
        if PIPE == 1:
            rows_n, valid_n = _smqa_rows(idx_ptr, t, K, N, k0 + BK, k_hi, BK)
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
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if F32:
            acc += tl.dot(p, kv, input_precision="ieee")
        elif INTERP:
            acc += tl.dot(p, kv.to(tl.float32), input_precision="ieee")
        else:
            # p = p_hi + p_lo (two bf16 halves), two dots on one accumulator
            p_hi = p.to(kv.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(kv.dtype)
            acc += tl.dot(p_hi, kv)
            acc += tl.dot(p_lo, kv)
        m_i = m_new
        if PIPE == 1:
            rows = rows_n
            valid = valid_n
    if FINAL:
        sink = tl.load(sink_ptr + heads, mask=hm, other=0.0)
        mx = tl.maximum(m_i, sink)
        w = tl.exp(m_i - mx)
        den = l_i * w + tl.exp(sink - mx)
        o = acc * (w / den)[:, None]
        tl.store(o_ptr + (t * NH + heads[:, None]) * D + dc[None, :], to_out(o, o_ptr, RNE),
                 mask=hm[:, None])
    else:
        row = (t * S + sp) * NH + heads
        tl.store(op_ptr + row[:, None] * D + dc[None, :], acc, mask=hm[:, None])
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


#: most row splits per token (the combine loads all of them at once: a [np2(S), CB] tile)
MAX_SPLITS = 64


def plan(T: int, NH: int, D: int, K: int, f32: bool, device, fp8: bool = False) -> dict:
    """The launch plan for a call: tuning keys (TUNE over the launch table over these defaults)
    and the derived split count. Keys: ``BH`` heads and ``BK`` kv rows per step, ``num_warps``,
    ``num_stages``; ``S`` row splits per token (default: T x ceil(NH / BH) x S programs up to
    ``target``: 1 per SM of the device below T = 128, 2 from there; at least one BK block per
    split, at most MAX_SPLITS splits); ``target``; ``cBLOCK`` elements of the combine's tile
    (S x CB), ``c_num_warps``; ``pipe`` 0 / 1 (module docstring)."""
    big = T >= 128
    # split target: below T = 128 the call is latency-bound, so one program per compute unit (each
    # extra split is one more partial the combine waits for); from T = 128, two per compute unit
    target = TUNE.get("target", target_programs(device, _CPU_PROGRAMS) // (1 if big else 2))
    # portable tile: 16 heads x 16 rows (the smallest MMA tile), 2 stages for bf16 rows, 1 for fp32
    # or FP8 rows: <= 64 KiB of shared memory in the sm90 and gfx942 compiles (fp32 q over FP8
    # rows: 65 KiB on sm90); no device timed. Tuned tiles are in the plugins' launch tables
    BH = TUNE.get("BH", 16)
    nhb = cdiv(NH, BH)
    BK = TUNE.get("BK", 16)
    nkb = cdiv(K, BK)
    S = TUNE.get("S")
    if S is None:
        S = target // (T * nhb)
    S = max(1, min(int(S), nkb, MAX_SPLITS))
    KPS = cdiv(nkb, S) * BK          # rows per split, a whole number of BK blocks
    S = cdiv(K, KPS)
    SP = np2(S)
    CB = max(16, min(TUNE.get("cBLOCK", 4096) // SP, np2(NH * D)))
    # pipe 0 by default: the portable loop (module docstring); a plugin's table sets 1 where timed
    pipe = TUNE.get("pipe", 0)
    if pipe not in (0, 1):
        raise ValueError(f"sparse_mqa_attention: TUNE pipe={pipe!r}; expected 0 (none) or 1 (indices one "
                         f"block ahead)")
    return dict(BH=BH, BK=BK, nhb=nhb, S=S, KPS=KPS, SP=SP, CB=CB, pipe=pipe,
                num_warps=TUNE.get("num_warps", 4), num_stages=TUNE.get("num_stages", 1 if fp8 or f32 else 2),
                c_num_warps=TUNE.get("c_num_warps", 4))


@implements("sparse_mqa_attention", supports=predicates.sparse_mqa_attention_supports)
def sparse_mqa_attention(q, kv, indices, sink, scale, kv_format=None, kv_paged=False):
    T, NH, D = q.shape
    o = torch.empty((T, NH, D), dtype=q.dtype, device=q.device)
    if T == 0 or NH == 0:
        return o
    K = indices.shape[1]
    if K == 0:
        return o.zero_()
    q, sink = c(q), c(sink)
    if kv_paged:
        indices, U, N = _paged.offsets(kv, indices)   # the kernel reads U-element rows; kv not copied
    else:
        kv, indices = c(kv), c(indices)
        N = kv.shape[0]
    fp8 = kv_format == "fp8"
    W = U if kv_paged else kv.shape[1]
    # the launch but the tensors and sizes read per call: planned once per shapes, dtype, device,
    # row format and the launch parameters in effect (Tune.memo; the device helpers in the key:
    # aot.device_branch and tests replace them)
    S, KPS, grid, common, comb = TUNE.memo((T, NH, D, K, W, q.dtype, q.device, fp8, target_programs, interp, rne),
                                           lambda: _launch_plan(T, NH, D, K, W, fp8, q, o))
    if S == 1:
        _smqa_kernel[grid](q, kv, indices, sink, o, o, o, o, T, NH, N, K, KPS, 1,
                           float(scale), FINAL=True, **common)
        return o
    # fp32 partials per (t, split, head): acc [D], running max m, running sum l
    op = torch.empty((T * S * NH, D), dtype=torch.float32, device=q.device)
    mp = torch.empty((T * S * NH,), dtype=torch.float32, device=q.device)
    lp = torch.empty((T * S * NH,), dtype=torch.float32, device=q.device)
    _smqa_kernel[grid](q, kv, indices, sink, o, op, mp, lp, T, NH, N, K, KPS, S,
                       float(scale), FINAL=False, **common)
    _smqa_combine_kernel[comb[0]](sink, o, op, mp, lp, NH, S, **comb[1])
    return o


def _launch_plan(T, NH, D, K, W, fp8, q, o):
    """sparse_mqa_attention's launch: (S, KPS, grid, the kernel's keywords, the combine's (grid,
    keywords))."""
    f32 = q.dtype == torch.float32
    p = plan(T, NH, D, K, f32, q.device, fp8)
    S, CB = p["S"], p["CB"]
    common = dict(D=D, BH=p["BH"], BK=p["BK"], PIPE=p["pipe"], F32=f32, INTERP=interp(q), RNE=rne(o),
                  FP8=fp8, NOPE=D - ROPE_DIM if fp8 else D, W=W,
                  num_warps=p["num_warps"], num_stages=p["num_stages"], **TUNE.options())
    comb = ((T, cdiv(NH * D, CB)), dict(D=D, SP=p["SP"], CB=CB, RNE=rne(o), num_warps=p["c_num_warps"],
                                        **TUNE.options()))
    return S, p["KPS"], (T, p["nhb"], S), common, comb
