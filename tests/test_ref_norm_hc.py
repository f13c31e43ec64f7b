"""Reference rms_norm / hc_pre / hc_post / hc_head against independent fp64 math (SPEC.md 2)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _fp64ref import (  # noqa: E402
    BF16_RTOL, F64, FP32_ACC, FP32_RTOL, check, gen, hc_head64, hc_post64, hc_pre64, ops,  # noqa: F401
    randn, rms_norm64, rtol_for,
)

ACTS = [torch.float32, torch.bfloat16]
ACT_IDS = ["f32", "bf16"]


# ----------------------------------------------------------------------------- rms_norm
@pytest.mark.parametrize("dtype", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("shape,weighted", [
    ((3, 4096), True),        # attn_norm / ffn_norm at Flash H
    ((2, 1024), True),        # q_norm at q_lora_rank
    ((4, 512), True),         # kv_norm at d
    ((2, 64, 512), False),    # per-head q norm, 64 heads x 512
    ((5, 7), True),           # odd small
    ((1, 3, 2, 16), False),   # extra leading dims
    ((0, 512), True),         # zero tokens
])
def test_rms_norm(ops, dtype, shape, weighted):
    g = gen(1)
    x = randn(*shape, g=g, dtype=dtype, std=3.0)
    w = randn(shape[-1], g=g, dtype=torch.float32) if weighted else None
    eps = 1e-6
    out = ops.rms_norm(x, w, eps)
    ref = rms_norm64(x, w, eps)
    # fp32: sum of squares (no cancellation) + sqrt/div/mul -> a few ulps, FP32_RTOL.
    # bf16: one rounding of the fp32 result -> + 2^-8 relative.
    check(out, ref, rtol=rtol_for(dtype), dtype=dtype, what=f"rms_norm{shape}")


def test_rms_norm_eps_matters(ops):
    # tiny inputs: eps dominates mean(x^2); checks eps is added inside the sqrt
    x = torch.full((2, 8), 1e-4, dtype=torch.float32)
    out = ops.rms_norm(x, None, 1e-6)
    ref = rms_norm64(x, None, 1e-6)  # = 1e-4/sqrt(1e-8+1e-6)
    check(out, ref, rtol=FP32_RTOL, what="rms_norm eps")


# ----------------------------------------------------------------------------- mHC
def _hc_params(n, H, g, head=False, zstd=2.0):
    rows = n if head else (2 + n) * n
    # fn rows of norm ~zstd over the flattened nH, so z = rho*(fn@x) is ~N(0, zstd^2)
    fn = randn(rows, n * H, g=g, std=(n * H) ** -0.5 * zstd)
    scale = torch.tensor([0.9] if head else [0.8, 1.1, 1.7], dtype=torch.float32)
    base = randn(rows, g=g, std=0.5)
    return fn, scale, base


def _zbound(x, fn, rms_eps):
    T, n, H = x.shape
    xf = x.to(F64).reshape(T, n * H)
    rho = 1.0 / torch.sqrt((xf * xf).mean(-1) + rms_eps)
    return (rho[:, None] * (xf.abs() @ fn.to(F64).abs().T)).max().item() if T else 0.0


HC_SHAPES = [(3, 4, 4096), (5, 4, 16), (2, 2, 8), (4, 3, 32)]


@pytest.mark.parametrize("dtype", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("T,n,H,iters", [(*s, 20) for s in HC_SHAPES] + [(*s, it) for s in HC_SHAPES[1:] for it in (1, 3)])
def test_hc_pre(ops, dtype, T, n, H, iters):
    g = gen(10 + n + H)
    x = randn(T, n, H, g=g, dtype=dtype, std=2.0)
    fn, scale, base = _hc_params(n, H, g)
    rms_eps, hc_eps = 1e-6, 1e-6
    y, post, comb = ops.hc_pre(x, fn, scale, base, rms_eps, hc_eps, iters, 2.0)
    ry, rpost, rcomb, _ = hc_pre64(x, fn, scale, base, rms_eps, hc_eps, iters, 2.0)
    # z = rho*(fn@x) in fp32: error <= FP32_ACC * rho*(|fn|@|x|) (zb). It reaches post through
    # post_mult*sigmoid' <= 2*1/4 times scale[1], comb through softmax (Lipschitz <= 1 per
    # logit, times scale[2]) and Sinkhorn (n-by-n, well conditioned here: factor <= 4 allowed).
    zerr = FP32_ACC * _zbound(x, fn, rms_eps)
    check(post, rpost, rtol=FP32_RTOL, atol=0.5 * 1.1 * zerr + 1e-7, dtype=torch.float32,
          what="hc_pre.post")
    check(comb, rcomb, rtol=FP32_RTOL * iters, atol=4 * 1.7 * zerr + 1e-7, dtype=torch.float32,
          what="hc_pre.comb")
    # y = sum_j pre_j x_j: pre error <= 1/4*scale[0]*zerr, then fp32 sum of n terms
    bound_y = x.to(F64).abs().sum(dim=1)
    check(y, ry, rtol=rtol_for(dtype), bound=bound_y, bound_tol=0.25 * 0.8 * zerr + 4 * 2.0**-24,
          dtype=dtype, what="hc_pre.y")


@pytest.mark.parametrize("T,n,H", [(4, 4, 4096), (6, 4, 16), (3, 3, 8)])
def test_hc_pre_comb_doubly_stochastic(ops, T, n, H):
    g = gen(20 + H)
    x = randn(T, n, H, g=g, std=1.0)
    # moderate comb logits (|scale*z + base| <~ 3): 20 Sinkhorn rounds converge well below 1e-3.
    # (With logits of +-10 even the exact fp64 Sinkhorn is only ~1e-2 row-stochastic after 20
    # rounds; test_hc_pre covers that regime against fp64.)
    fn, scale, base = _hc_params(n, H, g, zstd=0.7)
    _, post, comb = ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, 2.0)
    assert (comb > 0).all()
    # last step is a column normalisation: colsum = c/(c+eps) -> 1 - O(eps)
    torch.testing.assert_close(comb.sum(dim=-2), torch.ones(T, n), rtol=0, atol=1e-5)
    # 20 Sinkhorn rounds on a positive n x n matrix of moderate dynamic range converge far below 1e-3
    torch.testing.assert_close(comb.sum(dim=-1), torch.ones(T, n), rtol=0, atol=1e-3)
    assert ((post >= 0) & (post <= 2.0)).all()
    # non-trivial: comb is not symmetric (so hc_post's index order is observable)
    assert (comb - comb.transpose(-1, -2)).abs().max() > 1e-3


def test_hc_pre_post_mult(ops):
    g = gen(31)
    x = randn(2, 4, 16, g=g)
    fn, scale, base = _hc_params(4, 16, g)
    _, p2, _ = ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, 2.0)
    _, p3, _ = ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, 3.0)
    check(p3, p2.to(F64) * 1.5, rtol=FP32_RTOL, what="post_mult scaling")
    _, pd, _ = ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20)  # default post_mult = 2
    check(pd, p2.to(F64), rtol=0, what="post_mult default")


@pytest.mark.parametrize("dtype", ACTS, ids=ACT_IDS)
def test_hc_pre_zero_tokens(ops, dtype):
    g = gen(3)
    fn, scale, base = _hc_params(4, 16, g)
    x = torch.zeros(0, 4, 16, dtype=dtype)
    y, post, comb = ops.hc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, 2.0)
    assert y.shape == (0, 16) and y.dtype == dtype
    assert post.shape == (0, 4) and post.dtype == torch.float32
    assert comb.shape == (0, 4, 4) and comb.dtype == torch.float32


@pytest.mark.parametrize("dtype", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("T,n,H", [(3, 4, 4096), (5, 4, 16), (2, 3, 8), (0, 4, 16)])
def test_hc_post(ops, dtype, T, n, H):
    g = gen(40 + H)
    o = randn(T, H, g=g, dtype=dtype)
    res = randn(T, n, H, g=g, dtype=dtype, std=2.0)
    post = torch.rand(T, n, generator=g) * 2
    comb = torch.rand(T, n, n, generator=g)  # deliberately non-symmetric
    out = ops.hc_post(o, res, post, comb)
    ref = hc_post64(o, res, post, comb)
    # fp32 math on n+1 products: error <= few ulps of sum|terms|; bf16 output rounded once
    bound = post.to(F64)[..., None].abs() * o.to(F64)[:, None, :].abs() + torch.einsum(
        "tjk,tjh->tkh", comb.to(F64).abs(), res.to(F64).abs())
    check(out, ref, rtol=rtol_for(dtype), bound=bound, bound_tol=8 * 2.0**-24, dtype=dtype,
          what="hc_post")


def test_hc_post_sums_over_first_comb_index(ops):
    g = gen(50)
    n, H = 4, 8
    o = torch.zeros(1, H)
    res = randn(1, n, H, g=g)
    post = torch.zeros(1, n)
    comb = torch.zeros(1, n, n)
    comb[0, 2, 0] = 1.0  # out[:,0] must be residual[:,2]; the transposed reading gives zeros
    out = ops.hc_post(o, res, post, comb)
    torch.testing.assert_close(out[0, 0], res[0, 2], rtol=0, atol=0)
    torch.testing.assert_close(out[0, 1:], torch.zeros(n - 1, H), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("T,n,H", [(3, 4, 4096), (5, 4, 16), (2, 2, 8), (0, 4, 16)])
def test_hc_head(ops, dtype, T, n, H):
    g = gen(60 + H)
    x = randn(T, n, H, g=g, dtype=dtype, std=2.0)
    fn, scale, base = _hc_params(n, H, g, head=True)
    out = ops.hc_head(x, fn, scale, base, 1e-6, 1e-6)
    ref = hc_head64(x, fn, scale, base, 1e-6, 1e-6)
    zerr = FP32_ACC * _zbound(x, fn, 1e-6)
    bound = x.to(F64).abs().sum(dim=1)
    # pre error <= 1/4*scale*zerr (sigmoid'), then fp32 sum of n products; bf16 rounded once
    check(out, ref, rtol=rtol_for(dtype), bound=bound, bound_tol=0.25 * 0.9 * zerr + 4 * 2.0**-24,
          dtype=dtype, what="hc_head")
