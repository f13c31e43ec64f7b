"""sparse_mqa_attention: gathered-row MQA with a per-head sink, split-K (flash-decoding) + combine.

One program = (query t, a block of BH heads, a slice of the index list). It gathers BK kv rows at a
time (rows with index -1 or out of range are masked, never read), does q.k with fp32 accumulation,
an online softmax, and p@v with p split into two bf16 halves (hi + lo, ~16 mantissa bits) so that
bf16 inputs keep close to fp32 accuracy; fp32 inputs use ieee fp32 products. With one split the
sink and normalisation happen in the same kernel; otherwise a combine kernel merges the splits.
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
def _smqa_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, o_ptr, op_ptr, mp_ptr, lp_ptr,
                 T, NH, N, K, KPS, S, scale,
                 D: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr,
                 FINAL: tl.constexpr, INTERP: tl.constexpr, RNE: tl.constexpr):
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
    for k0 in range(k_lo, k_hi, BK):
        ks = k0 + tl.arange(0, BK)
        km = ks < k_hi
        idx = tl.load(idx_ptr + t * K + ks, mask=km, other=-1).to(tl.int64)
        valid = (idx >= 0) & (idx < N)
        rows = tl.where(valid, idx, 0)
        kv = tl.load(kv_ptr + rows[:, None] * D + dc[None, :], mask=valid[:, None], other=0.0)
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
            p_hi = p.to(kv.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(kv.dtype)
            acc += tl.dot(p_hi, kv)
            acc += tl.dot(p_lo, kv)
        m_i = m_new
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
                         D: tl.constexpr, BH: tl.constexpr, RNE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    heads = hb * BH + tl.arange(0, BH)
    hm = heads < NH
    dc = tl.arange(0, D)
    sink = tl.load(sink_ptr + heads, mask=hm, other=0.0)
    mx = sink
    for s in range(S):
        mx = tl.maximum(mx, tl.load(mp_ptr + (t * S + s) * NH + heads, mask=hm, other=0.0))
    den = tl.exp(sink - mx)
    num = tl.zeros([BH, D], dtype=tl.float32)
    for s in range(S):
        row = (t * S + s) * NH + heads
        w = tl.exp(tl.load(mp_ptr + row, mask=hm, other=float("-inf")) - mx)
        den += w * tl.load(lp_ptr + row, mask=hm, other=0.0)
        num += w[:, None] * tl.load(op_ptr + row[:, None] * D + dc[None, :], mask=hm[:, None],
                                    other=0.0)
    o = num / den[:, None]
    tl.store(o_ptr + (t * NH + heads[:, None]) * D + dc[None, :], to_out(o, o_ptr, RNE),
             mask=hm[:, None])


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
    # measured on an H200 (benchmarks/tune_triton.py, DSV4-Flash CSA shape): small T: 16 heads x 64
    # rows per step; T >= 128: 32 heads x 32 rows (fewer re-gathers of the same kv rows, 1.4x)
    big = T >= 128
    BH = TUNE.get("BH", 32 if big else 16)
    BK = TUNE.get("BK", 16 if f32 else (32 if big else 64))
    nw = TUNE.get("num_warps", 4)
    ns = TUNE.get("num_stages", 2)
    nhb = cdiv(NH, BH)
    nkb = cdiv(K, BK)
    S = max(1, min(nkb, TUNE.get("target", target_programs(q.device, _CPU_PROGRAMS)) // (T * nhb)))
    KPS = cdiv(nkb, S) * BK
    S = cdiv(K, KPS)
    if S == 1:
        _smqa_kernel[(T, nhb, 1)](q, kv, indices, sink, o, o, o, o, T, NH, N, K, KPS, 1,
                                  float(scale), D=D, BH=BH, BK=BK, F32=f32, FINAL=True, INTERP=interp(q), RNE=rne(o),
                                  num_warps=nw, num_stages=ns, **TUNE.options())
        return o
    op = torch.empty((T * S * NH, D), dtype=torch.float32, device=q.device)
    mp = torch.empty((T * S * NH,), dtype=torch.float32, device=q.device)
    lp = torch.empty((T * S * NH,), dtype=torch.float32, device=q.device)
    _smqa_kernel[(T, nhb, S)](q, kv, indices, sink, o, op, mp, lp, T, NH, N, K, KPS, S,
                              float(scale), D=D, BH=BH, BK=BK, F32=f32, FINAL=False, INTERP=interp(q), RNE=rne(o),
                              num_warps=nw, num_stages=ns, **TUNE.options())
    _smqa_combine_kernel[(T, nhb)](sink, o, op, mp, lp, NH, S, D=D, BH=BH, RNE=rne(o), num_warps=4, **TUNE.options())
    return o
