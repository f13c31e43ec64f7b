"""compress_pool: per-channel softmax over window slots of score + ape, applied to kv (fp32 math).

One program = (window w, a block of BD channels). CSA (overlap) pools window w-1's A halves
(or prev_kv/prev_score for w == 0, or nothing for the first window ever) with window w's B halves.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import c, np2, cdiv, rne, to_out
from .launch import Tune

#: launch parameters: tuning overrides over the bound backend's launch table (launch.py)
TUNE = Tune(__name__)


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


def compress_pool(kv, score, ape, overlap, prev_kv=None, prev_score=None):
    Wn, m, CW = kv.shape
    cc = 2 if overlap else 1
    DP = CW // cc
    out = torch.empty((Wn, DP), dtype=kv.dtype, device=kv.device)
    if Wn == 0 or DP == 0:
        return out
    kv, score, ape = c(kv), c(score), c(ape)
    has_prev = bool(overlap) and prev_kv is not None and prev_score is not None
    MP = np2(m)
    BD = max(16, min(np2(DP), 4096 // (2 * MP) if overlap else 4096 // MP))
    BD = min(TUNE.get("BD", BD), np2(DP))
    _compress_pool_kernel[(Wn, cdiv(DP, BD))](
        kv, score, ape, c(prev_kv) if has_prev else kv, c(prev_score) if has_prev else kv, out, DP,
        M=m, MP=MP, OVERLAP=bool(overlap), HAS_PREV=has_prev, BD=BD, RNE=rne(out), num_warps=TUNE.get("num_warps", 4), **TUNE.options())
    return out
