"""Reference sparse_mqa_attention / compress_pool / indexer_scores / indexer_topk vs fp64 (SPEC.md 2)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _fp64ref import (  # noqa: E402
    F64, FP32_ACC, FP32_RTOL, check, compress_pool64, dense_attn_with_sink64,  # noqa: F401
    dense_mask_from_indices, gen, indexer_scores64, ops, randn, rtol_for, sparse_attn_loop64,
)

ACTS = [torch.float32, torch.bfloat16]
ACT_IDS = ["f32", "bf16"]


# ----------------------------------------------------------------------------- sparse MQA
def make_indices(T, N, K, g, *, n_valid=None, shuffle_sentinels=True):
    """Distinct row indices per query, some -1 sentinels (scattered, not only trailing)."""
    idx = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        nv = n_valid[t] if n_valid is not None else int(torch.randint(1, K + 1, (1,), generator=g))
        nv = min(nv, N, K)
        rows = torch.randperm(N, generator=g)[:nv].to(torch.int32)
        idx[t, :nv] = rows
        if shuffle_sentinels:
            idx[t] = idx[t][torch.randperm(K, generator=g)]
    return idx


def attn_tolerance(q, kv, scale):
    """fp32 logits: error <= FP32_ACC*scale*max(|q|.|kv|); a logit error e changes the softmax output
    by <= 2e*max|kv|; plus fp32 rounding of the weighted sum (FP32_RTOL of max|kv|)."""
    if q.numel() == 0 or kv.numel() == 0:
        return 0.0
    qa = q.to(F64).abs().reshape(-1, q.shape[-1])
    lerr = FP32_ACC * scale * (qa @ kv.to(F64).abs().T).max().item()
    kvmax = kv.to(F64).abs().max().item()
    return (2 * lerr + 4 * FP32_RTOL) * kvmax


SPARSE_CASES = [
    # T, h, d, N, K, q_std, sink_mode
    (3, 64, 512, 300, 160, 1.0, "normal"),    # Flash dims: 64 heads x 512, 128 window + 32 compressed
    (5, 4, 16, 20, 8, 1.0, "normal"),
    (4, 2, 8, 6, 6, 1.0, "normal"),           # K == N: every row
    (4, 4, 16, 30, 10, 1.0, "large_sink"),    # sink dominates -> output ~ 0
    (4, 4, 16, 30, 10, 1.0, "small_sink"),    # sink negligible -> plain softmax
    (3, 4, 64, 40, 12, 40.0, "normal"),       # large logits (needs max subtraction)
    (3, 8, 32, 25, 5, 1.0, "mixed_sink"),     # per-head very different sinks
]


def _sink(h, mode, g):
    if mode == "normal":
        return randn(h, g=g)
    if mode == "large_sink":
        return torch.full((h,), 60.0)
    if mode == "small_sink":
        return torch.full((h,), -60.0)
    return torch.tensor([(-1) ** i * 15.0 * (i % 3) for i in range(h)], dtype=torch.float32)


@pytest.mark.parametrize("dtype", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("T,h,d,N,K,q_std,sink_mode", SPARSE_CASES)
def test_sparse_mqa_attention(ops, dtype, T, h, d, N, K, q_std, sink_mode):
    g = gen(T * 1000 + h * 10 + d + K)
    q = randn(T, h, d, g=g, dtype=dtype, std=q_std)
    kv = randn(N, d, g=g, dtype=dtype)
    idx = make_indices(T, N, K, g)
    idx[0] = -1  # query 0: empty set -> exactly 0
    sink = _sink(h, sink_mode, g)
    scale = d ** -0.5
    out = ops.sparse_mqa_attention(q, kv, idx, sink, scale)
    ref_loop = sparse_attn_loop64(q, kv, idx, sink, scale)
    ref_dense = dense_attn_with_sink64(q, kv, dense_mask_from_indices(idx, N), sink, scale)
    # the two independent fp64 formulas agree to fp64 rounding (guards the test itself)
    check(ref_loop, ref_dense, rtol=1e-10, atol=1e-12, what="fp64 loop vs dense")
    check(out, ref_dense, rtol=rtol_for(dtype), atol=attn_tolerance(q, kv, scale), dtype=dtype,
          what=f"sparse_mqa_attention T{T} h{h} d{d} N{N} K{K} {sink_mode}")
    assert torch.equal(out[0], torch.zeros_like(out[0])), "empty index row must give exactly 0"


def test_sparse_mqa_attention_sink_semantics(ops):
    # one key, logit l: o = e^l kv / (e^l + e^sink); sink is NOT multiplied by scale
    d, scale = 4, 0.5
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    kv = torch.tensor([[2.0, 1.0, -1.0, 0.5]])
    sink = torch.tensor([0.3])
    out = ops.sparse_mqa_attention(q, kv, torch.tensor([[0, -1, -1]], dtype=torch.int32), sink, scale)
    ll = torch.tensor(scale * 2.0, dtype=F64)
    w = torch.exp(ll) / (torch.exp(ll) + torch.exp(torch.tensor(0.3, dtype=F64)))
    check(out, (w * kv.to(F64))[None], rtol=4 * FP32_RTOL, what="sink semantics")
    assert d == q.shape[-1]


def test_sparse_mqa_attention_sentinel_position_irrelevant(ops):
    g = gen(77)
    q, kv = randn(2, 4, 16, g=g), randn(12, 16, g=g)
    sink = randn(4, g=g)
    a = torch.tensor([[3, 7, 1, -1, -1], [0, 11, -1, -1, -1]], dtype=torch.int32)
    b = torch.tensor([[-1, 1, -1, 7, 3], [-1, -1, 11, -1, 0]], dtype=torch.int32)
    oa = ops.sparse_mqa_attention(q, kv, a, sink, 0.25)
    ob = ops.sparse_mqa_attention(q, kv, b, sink, 0.25)
    # same sets -> same result up to fp32 summation order
    check(ob, oa.to(F64), rtol=4 * FP32_RTOL, atol=1e-6, what="sentinel/order invariance")


@pytest.mark.parametrize("dtype", ACTS, ids=ACT_IDS)
def test_sparse_mqa_attention_zero_tokens(ops, dtype):
    q = torch.zeros(0, 64, 512, dtype=dtype)
    kv = torch.zeros(10, 512, dtype=dtype)
    out = ops.sparse_mqa_attention(q, kv, torch.zeros(0, 8, dtype=torch.int32), torch.zeros(64), 512 ** -0.5)
    assert out.shape == (0, 64, 512) and out.dtype == dtype


def test_sparse_mqa_attention_empty_row_lists(ops):
    # K = 0: every query's row set is empty -> exactly 0 (not an error)
    out = ops.sparse_mqa_attention(torch.randn(3, 4, 16), torch.randn(5, 16), torch.zeros(3, 0, dtype=torch.int32),
                                   torch.randn(4), 0.25)
    assert out.shape == (3, 4, 16) and torch.equal(out, torch.zeros(3, 4, 16))
    # an empty row store (N = 0, every index -1, e.g. a request with nothing cached yet) -> 0 too
    out = ops.sparse_mqa_attention(torch.randn(3, 4, 16), torch.randn(0, 16), torch.full((3, 2), -1, dtype=torch.int32),
                                   torch.randn(4), 0.25)
    assert out.shape == (3, 4, 16) and torch.equal(out, torch.zeros(3, 4, 16))


# ----------------------------------------------------------------------------- compress_pool
def pool_tolerance(kv, score, ape):
    """fp32 score+ape (1 ulp of |s|) shifts softmax weights by <= 2^-23*|s| relative; fp32
    exp/normalise/weighted sum: a few ulps; all relative to max|kv|."""
    if kv.numel() == 0:
        return 0.0
    smax = score.to(F64).abs().max().item() + ape.to(F64).abs().max().item()
    return 16 * 2.0**-24 * (1 + smax) * kv.to(F64).abs().max().item()


POOL_CASES = [
    # Wn, m, d', overlap, with_prev
    (2, 128, 512, False, False),  # HCA, Flash
    (3, 4, 512, True, False),     # CSA main compressor, first window ever
    (3, 4, 512, True, True),      # CSA with carried-over A halves
    (4, 4, 128, True, True),      # indexer compressor (d' = 128)
    (4, 3, 5, False, False),
    (3, 2, 3, True, False),
    (2, 2, 3, True, True),
    (1, 4, 8, True, False),       # a single first window: only the B slots count
]


@pytest.mark.parametrize("dtype", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("Wn,m,dp,overlap,with_prev", POOL_CASES)
@pytest.mark.parametrize("score_std", [1.0, 30.0])
def test_compress_pool(ops, dtype, Wn, m, dp, overlap, with_prev, score_std):
    g = gen(Wn * 1000 + m * 10 + dp + int(score_std))
    c = 2 if overlap else 1
    kv = randn(Wn, m, c * dp, g=g, dtype=dtype)
    score = randn(Wn, m, c * dp, g=g, dtype=dtype, std=score_std)
    ape = randn(m, c * dp, g=g, std=0.5)
    prev_kv = randn(m, dp, g=g, dtype=dtype) if with_prev else None
    prev_score = randn(m, dp, g=g, dtype=dtype, std=score_std) if with_prev else None
    if with_prev:
        out = ops.compress_pool(kv, score, ape, overlap, prev_kv, prev_score)
    else:
        out = ops.compress_pool(kv, score, ape, overlap)
    ref = compress_pool64(kv, score, ape, overlap, prev_kv, prev_score)
    check(out, ref, rtol=rtol_for(dtype), atol=pool_tolerance(kv, score, ape), dtype=dtype,
          what=f"compress_pool Wn{Wn} m{m} d'{dp} overlap={overlap} prev={with_prev}")


def test_compress_pool_csa_first_window_ignores_a_slots(ops):
    # first window ever: A slots carry kv 0 / score -inf, so huge A values must have no effect
    g = gen(5)
    m, dp = 4, 6
    kv = randn(1, m, 2 * dp, g=g)
    score = randn(1, m, 2 * dp, g=g)
    kv[..., :dp] = 1e6
    score[..., :dp] = 1e3
    ape = randn(m, 2 * dp, g=g)
    out = ops.compress_pool(kv, score, ape, True)
    b = torch.softmax(score[0, :, dp:].to(F64) + ape[:, dp:].to(F64), dim=0)
    check(out, (b * kv[0, :, dp:].to(F64)).sum(0, keepdim=True), rtol=8 * FP32_RTOL, atol=1e-6,
          what="CSA first window")


@pytest.mark.parametrize("split", [1, 2])
def test_compress_pool_csa_chunked_equals_whole(ops, split):
    # calling on windows [split, Wn) with prev = raw A halves of window split-1 == one call
    g = gen(9 + split)
    Wn, m, dp = 4, 4, 16
    kv, score = randn(Wn, m, 2 * dp, g=g), randn(Wn, m, 2 * dp, g=g, std=3.0)
    ape = randn(m, 2 * dp, g=g)
    whole = ops.compress_pool(kv, score, ape, True)
    tail = ops.compress_pool(kv[split:], score[split:], ape, True, kv[split - 1, :, :dp], score[split - 1, :, :dp])
    check(tail, whole[split:].to(F64), rtol=8 * FP32_RTOL, atol=1e-6, what="chunked CSA")


@pytest.mark.parametrize("overlap", [False, True])
def test_compress_pool_zero_windows(ops, overlap):
    c = 2 if overlap else 1
    out = ops.compress_pool(torch.zeros(0, 4, c * 8, dtype=torch.bfloat16),
                            torch.zeros(0, 4, c * 8, dtype=torch.bfloat16), torch.zeros(4, c * 8), overlap)
    assert out.shape == (0, 8) and out.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- indexer_scores
SCORE_CASES = [
    # nI, dI, N, offsets, lengths
    (64, 128, 300, [0, 0, 40, 300 - 256], [1, 256, 7, 256]),   # Flash indexer 64 x 128
    (16, 32, 20, [0, 5, 5, 0, 12], [3, 15, 0, 20, 8]),         # a query with no keys
    (4, 8, 9, [0, 3], [9, 6]),
]


@pytest.mark.parametrize("dtype", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("nI,dI,N,offsets,lengths", SCORE_CASES)
def test_indexer_scores(ops, dtype, nI, dI, N, offsets, lengths):
    g = gen(nI + dI + N)
    T = len(offsets)
    q = randn(T, nI, dI, g=g, dtype=dtype)
    k = randn(N, dI, g=g, dtype=dtype)
    weights = randn(T, nI, g=g, std=nI ** -0.5)
    k_off = torch.tensor(offsets, dtype=torch.int64)
    k_len = torch.tensor(lengths, dtype=torch.int64)
    scale = dI ** -0.5
    out = ops.indexer_scores(q, k, weights, k_off, k_len, scale)
    ref, bound = indexer_scores64(q, k, weights, k_off, k_len, scale)
    # fp32 output always; fp32 dot (dI) + weighted sum (nI): FP32_ACC of sum |terms|
    check(out, ref, rtol=FP32_RTOL, bound=bound, bound_tol=FP32_ACC, dtype=torch.float32,
          what=f"indexer_scores nI{nI} dI{dI}")


def test_indexer_scores_zero_tokens(ops):
    out = ops.indexer_scores(torch.zeros(0, 64, 128), torch.zeros(5, 128), torch.zeros(0, 64),
                             torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), 128 ** -0.5)
    assert out.shape == (0, 0) and out.dtype == torch.float32


# ----------------------------------------------------------------------------- indexer_topk
def check_topk(idx, scores, k_lengths, topk, *, tie_tol=0.0):
    T, L = scores.shape
    assert idx.shape == (T, topk), idx.shape
    assert idx.dtype == torch.int32, idx.dtype
    s64 = scores.to(F64)
    for t in range(T):
        ln = int(k_lengths[t])
        n_valid = min(topk, ln, L)
        row = idx[t].tolist()
        picks, pad = row[:n_valid], row[n_valid:]
        assert all(p == -1 for p in pad), f"t={t}: slots past the valid count must be -1: {row}"
        assert all(0 <= p < ln for p in picks), f"t={t}: index outside [0,{ln}) (causal threshold): {picks}"
        assert len(set(picks)) == n_valid, f"t={t}: duplicate picks {picks}"
        if n_valid == 0 or n_valid == ln:
            continue
        chosen = torch.tensor(picks)
        mask = torch.ones(ln, dtype=torch.bool)
        mask[chosen] = False
        # true top-k set up to ties: nothing left out scores above anything chosen
        assert s64[t, chosen].min() >= s64[t, :ln][mask].max() - tie_tol, f"t={t}: not the top-k set"


TOPK_CASES = [
    # T, L, topk, lengths(None=random)
    (4, 1024, 512, [1024, 600, 512, 3]),   # Flash index_topk 512
    (6, 40, 8, [40, 0, 1, 7, 8, 9]),       # zero / fewer / exact / more than topk
    (3, 5, 8, [5, 2, 0]),                  # L < topk
    (5, 64, 16, None),
]


@pytest.mark.parametrize("beyond", ["neg_inf", "huge_finite"])
@pytest.mark.parametrize("T,L,topk,lengths", TOPK_CASES)
def test_indexer_topk(ops, T, L, topk, lengths, beyond):
    g = gen(T * L + topk)
    if lengths is None:
        lengths = torch.randint(0, L + 1, (T,), generator=g).tolist()
    k_len = torch.tensor(lengths, dtype=torch.int64)
    scores = randn(T, L, g=g)
    for t, ln in enumerate(lengths):
        # entries at w >= k_lengths[t] are not candidates, whatever their value
        scores[t, ln:] = float("-inf") if beyond == "neg_inf" else 1e30
    idx = ops.indexer_topk(scores, k_len, topk)
    check_topk(idx, scores, k_len, topk)
    # continuous random scores: no ties, so the set must equal fp64 top-k exactly
    for t, ln in enumerate(lengths):
        nv = min(topk, ln)
        want = set(torch.topk(scores[t, :ln].to(F64), nv).indices.tolist()) if nv else set()
        assert set(idx[t, :nv].tolist()) == want


def test_indexer_topk_ties(ops):
    # ReLU-style exact-zero ties: any choice among equal scores is fine, but the set must be top-k
    g = gen(123)
    T, L, topk = 5, 50, 12
    scores = torch.relu(randn(T, L, g=g) - 1.0)  # mostly exact zeros
    k_len = torch.tensor([50, 30, 12, 11, 0])
    for t in range(T):
        scores[t, int(k_len[t]):] = float("-inf")
    idx = ops.indexer_topk(scores, k_len, topk)
    check_topk(idx, scores, k_len, topk, tie_tol=0.0)


def test_indexer_topk_zero_tokens(ops):
    idx = ops.indexer_topk(torch.zeros(0, 0), torch.zeros(0, dtype=torch.int64), 512)
    assert idx.shape == (0, 512) and idx.dtype == torch.int32
