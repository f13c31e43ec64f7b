"""fp64 evaluation: the contract says compute dtype = promote(input, float32), so float64 inputs are
evaluated in float64 by the reference.  Comparing those outputs with the test's own fp64 formulas at
~1e-12 checks the *formulas* themselves, far below the fp32/bf16 tolerances of the other files
(a wrong epsilon placement, a missing term or a transposed index shows up here even when it is
smaller than fp32 rounding).  Entry point: dsv4core.hal.call (public, validating)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _fp64ref import (  # noqa: E402
    F64, check, compress_pool64, dense_attn_with_sink64, dense_mask_from_indices, dequant_blocks64, gen,
    hc_head64, hc_post64, hc_pre64, indexer_scores64, main_inv_freq64, randn, rms_norm64,
    softplus64, swiglu64, yarn_inv_freq64,
)

# fp64 math vs fp64 math in a different order: rounding ~2^-53 per op; 1e-12 relative leaves
# room for ~10^4 ulps (long sums, Sinkhorn's 40 normalisations, exp of O(10) logits).
RTOL64 = 1e-12
ACC64 = 1e-13  # times sum|terms| for accumulations


def rope_fixed_angle64(x, ang):
    """Rotate the trailing 2*ang.shape[-1] channels (interleaved pairs) by per-token angles [T, d_r/2]."""
    x = x.clone()
    d, half = x.shape[-1], ang.shape[-1]
    ang = ang.reshape(x.shape[0], *([1] * (x.dim() - 2)), half)
    c, s = torch.cos(ang), torch.sin(ang)
    a, b = x[..., d - 2 * half::2].clone(), x[..., d - 2 * half + 1::2].clone()
    x[..., d - 2 * half::2] = a * c - b * s
    x[..., d - 2 * half + 1::2] = a * s + b * c
    return x


def call(name, *args):
    from dsv4core.hal import call as hal_call

    return hal_call(name, *args)


def test_fp64_rms_norm():
    g = gen(1)
    for shape in [(3, 4096), (2, 64, 512), (4, 7)]:
        x, w = randn(*shape, g=g, dtype=F64), randn(shape[-1], g=g, dtype=F64)
        check(call("rms_norm", x, w, 1e-6), rms_norm64(x, w, 1e-6), rtol=RTOL64, dtype=F64, what="rms_norm f64")
        check(call("rms_norm", x, None, 1e-6), rms_norm64(x, None, 1e-6), rtol=RTOL64, dtype=F64,
              what="rms_norm f64 unweighted")


@pytest.mark.parametrize("T,n,H,iters", [(3, 4, 4096, 20), (5, 4, 16, 20), (4, 3, 8, 2)])
def test_fp64_hc(T, n, H, iters):
    g = gen(2 + H)
    x = randn(T, n, H, g=g, dtype=F64, std=2.0)
    fn = randn((2 + n) * n, n * H, g=g, dtype=F64, std=2.0 / (n * H) ** 0.5)
    scale = torch.tensor([0.8, 1.1, 1.7], dtype=F64)
    base = randn((2 + n) * n, g=g, dtype=F64, std=0.5)
    y, post, comb = call("hc_pre", x, fn, scale, base, 1e-6, 1e-6, iters, 2.0)
    ry, rpost, rcomb, _ = hc_pre64(x, fn, scale, base, 1e-6, 1e-6, iters, 2.0)
    check(post, rpost, rtol=RTOL64, atol=1e-14, dtype=F64, what="hc_pre.post f64")
    check(comb, rcomb, rtol=RTOL64, atol=1e-14, dtype=F64, what="hc_pre.comb f64")
    check(y, ry, rtol=RTOL64, bound=x.abs().sum(1), bound_tol=ACC64, dtype=F64, what="hc_pre.y f64")
    o = randn(T, H, g=g, dtype=F64)
    out = call("hc_post", o, x, post, comb)
    check(out, hc_post64(o, x, post, comb), rtol=RTOL64, atol=1e-13 * float(x.abs().max()), dtype=F64,
          what="hc_post f64")
    hfn = randn(n, n * H, g=g, dtype=F64, std=2.0 / (n * H) ** 0.5)
    hs, hb = torch.tensor([0.9], dtype=F64), randn(n, g=g, dtype=F64)
    check(call("hc_head", x, hfn, hs, hb, 1e-6, 1e-6), hc_head64(x, hfn, hs, hb, 1e-6, 1e-6), rtol=RTOL64,
          bound=x.abs().sum(1), bound_tol=ACC64, dtype=F64, what="hc_head f64")


@pytest.mark.parametrize("kind", ["main", "yarn"])
def test_fp64_rope_family(kind):
    g = gen(3)
    # inv_freq is float32 by contract, and SPEC fixes the angle as t = fl32(p) * inv_freq[i] (an fp32
    # product) even here; only the rotation itself is evaluated in fp64. (The reference does exactly
    # this; an exact fp64 angle differs by up to ~65535 * 2^-24 rad at p = 65535.)
    inv = (main_inv_freq64(64, 10000.0) if kind == "main"
           else yarn_inv_freq64(64, 160000.0, 16.0, 65536, 32.0, 1.0)).to(torch.float32)
    T = 4
    pos = torch.tensor([0, 1, 4097, 65535], dtype=torch.int64)
    ang32 = (pos.to(torch.float32)[:, None] * inv[None, :]).to(F64)  # exactly representable in fp64

    def rope64(x, pos, inv, inverse=False):
        # rotation by the fp32 angle, in fp64 (angle passed as "positions" 1 x omega)
        return rope_fixed_angle64(x, -ang32 if inverse else ang32)

    # cos/sin of angles up to 65535 rad in fp64: ~1e-12 abs -> atol 1e-10 * |x|
    for shape in [(T, 512), (T, 64, 512), (T, 8, 128)]:
        x = randn(*shape, g=g, dtype=F64)
        for inverse in (False, True):
            check(call("rope", x, pos, inv, inverse), rope64(x, pos, inv, inverse), rtol=RTOL64,
                  atol=1e-10 * float(x.abs().max()), dtype=F64, what=f"rope f64 {shape} inv={inverse}")
    q = randn(T, 64, 512, g=g, dtype=F64, std=4.0)
    ref = rope64(rms_norm64(q, None, 1e-6), pos, inv)
    check(call("q_norm_rope", q, pos, inv, 1e-6), ref, rtol=RTOL64, atol=1e-10 * float(ref.abs().max()),
          dtype=F64, what="q_norm_rope f64")
    kv, w = randn(T, 512, g=g, dtype=F64), randn(512, g=g, dtype=F64)
    ref = rope64(rms_norm64(kv, w, 1e-6), pos, inv)
    check(call("kv_norm_rope", kv, w, pos, inv, 1e-6), ref, rtol=RTOL64, atol=1e-10 * float(ref.abs().max()),
          dtype=F64, what="kv_norm_rope f64")


def test_fp64_sparse_mqa_attention():
    g = gen(4)
    T, h, d, N, K = 3, 64, 512, 200, 64
    q, kv = randn(T, h, d, g=g, dtype=F64, std=2.0), randn(N, d, g=g, dtype=F64)
    idx = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(1, T):
        nv = 40 + t
        idx[t, :nv] = torch.randperm(N, generator=g)[:nv].to(torch.int32)
        idx[t] = idx[t][torch.randperm(K, generator=g)]
    sink = randn(h, g=g, dtype=F64, std=3.0)
    out = call("sparse_mqa_attention", q, kv, idx, sink, d ** -0.5)
    ref = dense_attn_with_sink64(q, kv, dense_mask_from_indices(idx, N), sink, d ** -0.5)
    check(out, ref, rtol=RTOL64, atol=1e-12 * float(kv.abs().max()), dtype=F64, what="sparse_mqa_attention f64")


@pytest.mark.parametrize("Wn,m,dp,overlap,prev", [(2, 128, 512, False, False), (3, 4, 512, True, False),
                                                 (3, 4, 128, True, True)])
def test_fp64_compress_pool(Wn, m, dp, overlap, prev):
    g = gen(5 + m)
    c = 2 if overlap else 1
    kv, sc = randn(Wn, m, c * dp, g=g, dtype=F64), randn(Wn, m, c * dp, g=g, dtype=F64, std=3.0)
    ape = randn(m, c * dp, g=g, dtype=F64)
    pk = randn(m, dp, g=g, dtype=F64) if prev else None
    ps = randn(m, dp, g=g, dtype=F64) if prev else None
    out = call("compress_pool", kv, sc, ape, overlap, pk, ps) if prev else call("compress_pool", kv, sc, ape, overlap)
    check(out, compress_pool64(kv, sc, ape, overlap, pk, ps), rtol=RTOL64, atol=1e-13 * float(kv.abs().max()),
          dtype=F64, what="compress_pool f64")


def test_fp64_indexer_scores():
    g = gen(6)
    T, nI, dI, N = 3, 64, 128, 300
    q, k, w = randn(T, nI, dI, g=g, dtype=F64), randn(N, dI, g=g, dtype=F64), randn(T, nI, g=g, dtype=F64)
    off, ln = torch.tensor([0, 10, 44]), torch.tensor([256, 1, 200])
    out = call("indexer_scores", q, k, w, off, ln, dI ** -0.5)
    ref, bound = indexer_scores64(q, k, w, off, ln, dI ** -0.5)
    check(out, ref, rtol=RTOL64, bound=bound, bound_tol=ACC64, what="indexer_scores f64")


def test_fp64_linear_and_wo_a():
    g = gen(7)
    x = randn(3, 300, g=g, dtype=F64)
    w = (torch.randn(200, 300, generator=g) * 0.7).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=g) + 0.5
    W = dequant_blocks64(w, s)
    out = call("linear", x, w, s, F64)
    check(out, x @ W.T, rtol=RTOL64, bound=x.abs() @ W.abs().T, bound_tol=ACC64, dtype=F64, what="linear fp8 f64")
    wd = randn(200, 300, g=g, dtype=F64)
    check(call("linear", x, wd), x @ wd.T, rtol=RTOL64, bound=x.abs() @ wd.abs().T, bound_tol=ACC64,
          dtype=F64, what="linear f64")
    o = randn(2, 8, 512, g=g, dtype=F64)
    wa = randn(8, 256, 512, g=g, dtype=F64)
    check(call("wo_a", o, wa), torch.einsum("tgd,grd->tgr", o, wa), rtol=RTOL64,
          bound=torch.einsum("tgd,grd->tgr", o.abs(), wa.abs()), bound_tol=ACC64, dtype=F64, what="wo_a f64")


def test_fp64_moe():
    g = gen(8)
    T, E, k = 4, 256, 6
    logits, bias = randn(T, E, g=g, dtype=F64, std=2.0), randn(E, g=g, dtype=F64, std=0.3)
    w, ids = call("moe_route", logits, k, 1.5, bias)
    s = torch.sqrt(softplus64(logits))
    want_ids = torch.topk(s + bias, k, dim=-1).indices
    assert torch.equal(ids.long().sort(-1).values, want_ids.sort(-1).values)
    sel = torch.gather(s, 1, ids.long())
    check(w, sel / (sel.sum(-1, keepdim=True) + 1e-20) * 1.5, rtol=RTOL64, dtype=F64, what="moe_route f64")
    H, I, E2 = 64, 32, 4
    x = randn(3, H, g=g, dtype=F64, std=3.0)
    w13, w2 = randn(E2, 2 * I, H, g=g, dtype=F64, std=H ** -0.5), randn(E2, H, I, g=g, dtype=F64, std=I ** -0.5)
    eids = torch.tensor([[0, 3], [2, -1], [1, 0]])
    ew = torch.rand(3, 2, generator=g, dtype=F64)
    out = call("moe_experts", x, eids, ew, w13, w2, 1.0)
    ref = torch.zeros(3, H, dtype=F64)
    for t in range(3):
        for i in range(2):
            e = int(eids[t, i])
            if e >= 0:
                ref[t] += ew[t, i] * (w2[e] @ swiglu64(w13[e, :I] @ x[t], w13[e, I:] @ x[t], 1.0))
    check(out, ref, rtol=RTOL64, atol=1e-13 * float(ref.abs().max()), dtype=F64, what="moe_experts f64")


def test_hal_inv_freq_helpers_match_spec_formula():
    """dsv4core.hal.ops.rope's main/YaRN inv_freq helpers vs the test's SPEC formula (incl. floor/ceil
    of lo/hi and the lo == hi nudge)."""
    import dsv4core.hal.ops.rope as rope_mod  # the helpers the model builds its inv_freq with: never skip

    # result may be fp32 (fp32 pow/exp): a few fp32 ulps -> 1e-6 relative
    for d_r, theta in [(64, 10000.0), (64, 160000.0), (32, 50000.0)]:
        check(rope_mod.main_inv_freq(d_r, theta), main_inv_freq64(d_r, theta), rtol=1e-6, what="main_inv_freq")
    for args in [(64, 160000.0, 16.0, 65536, 32.0, 1.0), (64, 10000.0, 4.0, 4096, 32.0, 1.0),
                 (128, 1e6, 40.0, 8192, 64.0, 2.0), (8, 10000.0, 4.0, 4096, 2.0, 2.0)]:
        check(rope_mod.yarn_inv_freq(*args), yarn_inv_freq64(*args), rtol=1e-6, what=f"yarn_inv_freq{args}")
