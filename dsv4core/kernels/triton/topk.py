"""indexer_topk: per query t, the positions of the ``n = min(topk, k_lengths[t])`` largest scores
among its valid entries ``w < k_lengths[t]``; slots ``n..topk-1`` are -1. One program per query,
no host synchronisation, no data-dependent shape: capturable in a device graph.

The selection is exact (no arithmetic on the scores): each score becomes an int32 key with the
same order (``-0.0`` as ``+0.0``; NaN above +inf, as ``torch.topk`` ranks it; entries past
``k_lengths[t]`` below every valid one, a valid -inf above them), the n-th largest key ``tau`` is
found by a radix search (8 passes over the row, 4 bits each: the count of keys ``>=`` each of 16
candidates decides the next digit), and one more pass writes every key ``> tau`` plus the
lowest-position keys ``== tau`` until n are written. So among exactly equal scores the lower
positions win (the spec leaves ties to the implementation); the picks come out in increasing
position order (the spec leaves the order free).

Reads each row 9 times (from cache when it fits); work per row is O(L), independent of topk.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import c, np2
from .launch import Tune
from . import predicates
from .registry import implements

TUNE = Tune(__name__)   # its keys: launch.TUNING_KEYS

_MASKED = tl.constexpr(-2147483648)     # int32 min: below the key of -inf (-2139095041)
_NAN = tl.constexpr(2147483647)         # int32 max: above the key of +inf (2139095040)


@triton.jit
def _keys(row_ptr, o, klen):
    """Order-preserving int32 keys of the scores at positions ``o`` (see the module docstring)."""
    valid = o < klen
    x = tl.load(row_ptr + o, mask=valid, other=0.0)
    x = tl.where(x == 0.0, 0.0, x)                          # -0.0 ties with +0.0
    b = x.to(tl.int32, bitcast=True)
    k = tl.where(b < 0, b ^ 0x7FFFFFFF, b)                 # negative floats: flip the magnitude bits
    k = tl.where(x != x, _NAN, k)
    return tl.where(valid, k, _MASKED)


@triton.jit
def _topk_kernel(s_ptr, len_ptr, out_ptr, L, topk, BLOCK: tl.constexpr, TB: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    row = s_ptr + t * L
    klen = tl.minimum(tl.maximum(tl.load(len_ptr + t).to(tl.int32), 0), L)   # memory safety only
    n = tl.minimum(klen, topk)
    ob = tl.arange(0, BLOCK)
    digit = tl.arange(0, 16).to(tl.int64)
    # radix search for tau = the largest v with #{key >= v} >= n, in the unsigned space
    # u = key + 2^31; invariant #{u >= prefix} >= n (true for prefix 0: n <= L)
    prefix = tl.zeros([], dtype=tl.int64)
    for p in tl.static_range(8):
        shift = 28 - 4 * p
        thr = (prefix + (digit << shift) + _MASKED).to(tl.int32)     # candidates, as int32 keys
        cnt = tl.zeros([16], dtype=tl.int32)
        for start in range(0, L, BLOCK):
            k = _keys(row, start + ob, klen)
            cnt += tl.sum((k[:, None] >= thr[None, :]).to(tl.int32), axis=0)
        # counts fall with the digit and cnt[0] >= n: the next digit is how many of 1..15 keep n
        prefix += tl.sum(((cnt >= n) & (digit >= 1)).to(tl.int64), axis=0) << shift
    tau = (prefix + _MASKED).to(tl.int32)
    # write the keys above tau, then the lowest-position ties, in position order
    above = tl.zeros([], dtype=tl.int32)
    for start in range(0, L, BLOCK):
        k = _keys(row, start + ob, klen)
        above += tl.sum((k > tau).to(tl.int32), axis=0)
    ties_left = n - above
    ties_seen = tl.zeros([], dtype=tl.int32)
    written = tl.zeros([], dtype=tl.int32)
    for start in range(0, L, BLOCK):
        o = start + ob
        k = _keys(row, o, klen)
        tie = (k == tau).to(tl.int32)
        tie_rank = ties_seen + tl.cumsum(tie, axis=0) - tie
        sel = ((k > tau) | ((tie == 1) & (tie_rank < ties_left))).to(tl.int32)
        slot = written + tl.cumsum(sel, axis=0) - sel
        tl.store(out_ptr + t * topk + slot, o, mask=sel == 1)
        ties_seen += tl.sum(tie, axis=0)
        written += tl.sum(sel, axis=0)
    tb = tl.arange(0, TB)
    for start in range(0, topk, TB):
        j = start + tb
        tl.store(out_ptr + t * topk + j, tl.full([TB], -1, tl.int32), mask=(j >= n) & (j < topk))


@implements("indexer_topk", supports=predicates.indexer_topk_supports)
def indexer_topk(scores, k_lengths, topk):
    T, L = scores.shape
    k = int(topk)
    out = torch.empty((T, k), dtype=torch.int32, device=scores.device)
    if T == 0:
        return out
    if L == 0:
        return out.fill_(-1)
    # the keywords depend on L, k and the launch parameters in effect only: planned once per such
    # key (Tune.memo)
    kw = TUNE.memo((L, k), lambda: _plan(L, k))
    _topk_kernel[(T,)](c(scores), c(k_lengths), out, L, k, **kw)
    return out


def _plan(L, k):
    block = min(TUNE.get("BLOCK", 512), max(16, np2(L)))   # a short row: one small block
    return dict(BLOCK=block, TB=min(TUNE.get("TB", 256), max(16, np2(k))), num_warps=TUNE.get("num_warps", 4),
                **TUNE.options())
