"""compress_pool and compress_windows: per-channel softmax over window slots, applied to kv (fp32 math).

compress_pool: one program = (window w, a block of BD channels); the score is score + ape. CSA
(overlap) pools window w-1's A halves (or prev_kv/prev_score for w == 0, or nothing for the first
window ever) with window w's B halves.

compress_windows: the windows come gathered (one row of S slots per entry, position bias already
added, masked slots scored -inf), so one program = (entry e, a block of BD channels) and entries
of different requests batch into one launch. CSA: slots [0, m) contribute their A halves, slots
[m, 2m) their B halves. A channel whose slots are all masked pools to 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import c, np2, cdiv, rne, to_out
from .launch import Tune
from . import predicates
from .registry import implements

#: launch parameters: tuning overrides over the bound backend's launch table (launch.py)
TUNE = Tune(__name__)   # its keys: launch.TUNING_KEYS


@triton.jit
def _compress_pool_kernel(kv_ptr, sc_ptr, ape_ptr, pkv_ptr, psc_ptr, out_ptr, DP,
                          M: tl.constexpr, MP: tl.constexpr, OVERLAP: tl.constexpr,
                          HAS_PREV: tl.constexpr, BD: tl.constexpr,
                          RNE: tl.constexpr):
    w = tl.program_id(0).to(tl.int64)
    db = tl.program_id(1)
    ch = db * BD + tl.arange(0, BD)
    cm = ch < DP
    sl = tl.arange(0, MP)
    sm = sl < M
    m2 = sm[:, None] & cm[None, :]
    if OVERLAP:
        CW = 2 * DP
    else:
        CW = DP
    # B slots (or the only slots when not overlapping): window w, channels [CW - DP, CW)
    off_b = (w * M + sl[:, None]) * CW + (CW - DP) + ch[None, :]
    kvb = tl.load(kv_ptr + off_b, mask=m2, other=0.0).to(tl.float32)
    scb = tl.load(sc_ptr + off_b, mask=m2, other=0.0).to(tl.float32)
    scb += tl.load(ape_ptr + sl[:, None] * CW + (CW - DP) + ch[None, :], mask=m2, other=0.0)
    scb = tl.where(m2, scb, float("-inf"))
    mx = tl.max(scb, axis=0)
    if OVERLAP:
        ape_a = tl.load(ape_ptr + sl[:, None] * CW + ch[None, :], mask=m2, other=0.0)
        wv = tl.zeros([MP], dtype=tl.int64) + w
        cur = (wv > 0)[:, None]
        first = (wv == 0)[:, None]
        off_a = ((w - 1) * M + sl[:, None]) * CW + ch[None, :]
        kva = tl.load(kv_ptr + off_a, mask=m2 & cur, other=0.0).to(tl.float32)
        sca = tl.load(sc_ptr + off_a, mask=m2 & cur, other=0.0).to(tl.float32)
        if HAS_PREV:
            off_p = sl[:, None] * DP + ch[None, :]
            kvp = tl.load(pkv_ptr + off_p, mask=m2 & first, other=0.0).to(tl.float32)
            scp = tl.load(psc_ptr + off_p, mask=m2 & first, other=0.0).to(tl.float32)
            kva = tl.where(cur, kva, kvp)
            sca = tl.where(cur, sca, scp)
            a_ok = m2
        else:
            a_ok = m2 & cur
        sca = tl.where(a_ok, sca + ape_a, float("-inf"))
        kva = tl.where(a_ok, kva, 0.0)
        mx = tl.maximum(mx, tl.max(sca, axis=0))
        ea = tl.exp(sca - mx[None, :])
        eb = tl.exp(scb - mx[None, :])
        den = tl.sum(ea, axis=0) + tl.sum(eb, axis=0)
        num = tl.sum(ea * kva, axis=0) + tl.sum(eb * kvb, axis=0)
    else:
        eb = tl.exp(scb - mx[None, :])
        den = tl.sum(eb, axis=0)
        num = tl.sum(eb * kvb, axis=0)
    tl.store(out_ptr + w * DP + ch, to_out(num / den, out_ptr, RNE), mask=cm)


@implements("compress_pool", supports=predicates.compress_pool_supports)
def compress_pool(kv, score, ape, overlap, prev_kv=None, prev_score=None):
    Wn, m, CW = kv.shape
    cc = 2 if overlap else 1
    DP = CW // cc
    out = torch.empty((Wn, DP), dtype=kv.dtype, device=kv.device)
    if Wn == 0 or DP == 0:
        return out
    kv, score, ape = c(kv), c(score), c(ape)
    has_prev = bool(overlap) and prev_kv is not None and prev_score is not None
    # the launch but the tensors: planned once per shapes, flags, dtype, device and the launch
    # parameters in effect (Tune.memo; ``rne`` in the key: aot.device_branch replaces it)
    grid, kw = TUNE.memo(("pool", Wn, m, DP, bool(overlap), has_prev, out.dtype, out.device, rne),
                         lambda: _pool_plan(Wn, m, DP, bool(overlap), has_prev, out))
    _compress_pool_kernel[grid](
        kv, score, ape, c(prev_kv) if has_prev else kv, c(prev_score) if has_prev else kv, out, DP, **kw)
    return out


def _pool_plan(Wn, m, DP, overlap, has_prev, out):
    MP = np2(m)
    BD = max(16, min(np2(DP), 4096 // (2 * MP) if overlap else 4096 // MP))
    BD = min(TUNE.get("BD", BD), np2(DP))
    return (Wn, cdiv(DP, BD)), dict(M=m, MP=MP, OVERLAP=overlap, HAS_PREV=has_prev, BD=BD, RNE=rne(out),
                                    num_warps=TUNE.get("num_warps", 4), **TUNE.options())


@triton.jit
def _compress_windows_kernel(kv_ptr, sc_ptr, out_ptr, S, M, DP, skv_e, skv_s, skv_c, ssc_e, ssc_s, ssc_c,
                             SP: tl.constexpr, OVERLAP: tl.constexpr, BD: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    ch = (tl.program_id(1) * BD + tl.arange(0, BD)).to(tl.int64)
    sl = tl.arange(0, SP).to(tl.int64)
    m2 = (sl < S)[:, None] & (ch < DP)[None, :]
    if OVERLAP:   # slots [0, M): the previous window's A halves; [M, 2M): the own window's B halves
        col = ch[None, :] + tl.where(sl >= M, DP, 0)[:, None]
    else:
        col = ch[None, :] + tl.zeros([SP], dtype=tl.int64)[:, None]
    kv = tl.load(kv_ptr + e * skv_e + sl[:, None] * skv_s + col * skv_c, mask=m2, other=0.0)
    s = tl.load(sc_ptr + e * ssc_e + sl[:, None] * ssc_s + col * ssc_c, mask=m2, other=float("-inf"))
    mx = tl.max(s, axis=0)
    mx = tl.where((mx > float("-inf")) & (mx < float("inf")), mx, 0.0)   # an all-masked channel pools to 0
    p = tl.exp(s - mx[None, :])
    den = tl.sum(p, axis=0)
    num = tl.sum(p * kv, axis=0)
    out = tl.where(den > 0, num / tl.where(den > 0, den, 1.0), 0.0)
    tl.store(out_ptr + e * DP + ch, out, mask=ch < DP)


@implements("compress_windows", supports=predicates.compress_windows_supports)
def compress_windows(kv, score, overlap):
    """One program per (entry, block of BD channels): the S slots of each channel in registers,
    one max / exp / sum pass (fp32 in, fp32 out). Inputs are read through their strides."""
    E, S, CW = kv.shape
    DP = CW // 2 if overlap else CW
    out = torch.empty((E, DP), dtype=torch.float32, device=kv.device)
    if E == 0 or DP == 0:
        return out
    if S == 0:
        return out.zero_()
    grid, kw = TUNE.memo(("windows", E, S, DP, bool(overlap)), lambda: _windows_plan(E, S, DP, bool(overlap)))
    _compress_windows_kernel[grid](kv, score, out, S, S // 2, DP, *kv.stride(), *score.stride(), **kw)
    return out


def _windows_plan(E, S, DP, overlap):
    SP = np2(S)
    BD = min(TUNE.get("windows_BD", max(16, 4096 // SP)), np2(DP))
    return (E, cdiv(DP, BD)), dict(SP=SP, OVERLAP=overlap, BD=BD, num_warps=TUNE.get("windows_num_warps", 4),
                                   **TUNE.options())
