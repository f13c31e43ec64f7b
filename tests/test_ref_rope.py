"""Reference rope / q_norm_rope / kv_norm_rope against independent fp64 math (SPEC.md 2)."""

from __future__ import annotations

import math
import os
import zlib
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _fp64ref import (  # noqa: E402
    F64, FP32_RTOL, check, gen, main_inv_freq64, ops, randn, rms_norm64,  # noqa: F401
    rtol_for, yarn_inv_freq64,
)

ACTS = [torch.float32, torch.bfloat16]
ACT_IDS = ["f32", "bf16"]

MAIN = main_inv_freq64(64, 10000.0).to(torch.float32)
# DSV4-Flash compress rope: theta 160000, YaRN factor 16, L0 65536, beta_fast 32, beta_slow 1
YARN = yarn_inv_freq64(64, 160000.0, 16.0, 65536, 32.0, 1.0).to(torch.float32)
FREQS = {"main": MAIN, "yarn": YARN}


def test_my_yarn_formula_matches_peers_samples():
    """Guards the test's own reading of the YaRN formula (PEERS.md 4.2 sample values)."""
    d_r, theta, L0 = 64, 160000.0, 65536
    corr = lambda r: d_r * math.log(L0 / (2 * math.pi * r)) / (2 * math.log(theta))  # noqa: E731
    assert max(math.floor(corr(32.0)), 0) == 15 and min(math.ceil(corr(1.0)), d_r - 1) == 25
    y = yarn_inv_freq64(d_r, theta, 16.0, L0, 32.0, 1.0)
    b = main_inv_freq64(d_r, theta)
    for i, v in {0: 1.0, 15: 3.6355e-3, 16: 2.2656e-3, 20: 2.9698e-4, 24: 1.9531e-5,
                 25: 5.3723e-6, 31: 5.6805e-7}.items():
        assert abs(y[i].item() - v) <= 5e-5 * v, (i, y[i].item(), v)
    assert torch.equal(y[:16], b[:16]) and torch.allclose(y[25:], b[25:] / 16, rtol=1e-15)
    # lo == hi case: hi gets +0.001 (no division by zero)
    z = yarn_inv_freq64(8, 10000.0, 4.0, 4096, 2.0, 2.0)
    assert torch.isfinite(z).all()


def rope_ref(x, positions, inv_freq, inverse=False):
    """SPEC: t = fl32(p) * inv_freq[i] (an fp32 product), rotation in exact arithmetic."""
    x64 = x.to(F64).clone()
    d = x.shape[-1]
    half = inv_freq.shape[0]
    d_r = 2 * half
    T = x.shape[0]
    ang32 = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    ang = ang32.to(F64)
    if inverse:
        ang = -ang
    ang = ang.reshape(T, *([1] * (x.dim() - 2)), half)
    c, s = torch.cos(ang), torch.sin(ang)
    a = x64[..., d - d_r::2].clone()
    b = x64[..., d - d_r + 1::2].clone()
    x64[..., d - d_r::2] = a * c - b * s
    x64[..., d - d_r + 1::2] = a * s + b * c
    return x64


def rope_bound(x):
    """Per-element |a|+|b| of the pair (the fp32 cos/sin and fma errors scale with it)."""
    ax = x.to(F64).abs()
    return ax.max() if ax.numel() else torch.tensor(0.0, dtype=F64)


# fp32 cos/sin (<= ~1 ulp each) and the 2-product sum: <= 8 ulps (2^-24) of max|x|
ROPE_ABS = 8 * 2.0**-24

POS_SETS = {
    "small": lambda T, g: torch.arange(T, dtype=torch.int64),
    "random64k": lambda T, g: torch.randint(0, 65536, (T,), generator=g),
    "large1M": lambda T, g: torch.randint(0, 1 << 20, (T,), generator=g),
}


@pytest.mark.parametrize("dtype", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("freq", ["main", "yarn"])
@pytest.mark.parametrize("shape", [(5, 512), (3, 64, 512), (4, 64, 128), (6, 2, 3, 64), (7, 16), (0, 512),
                                   (0, 64, 512)])
@pytest.mark.parametrize("inverse", [False, True], ids=["fwd", "inv"])
@pytest.mark.parametrize("pos", ["small", "random64k", "large1M"])
def test_rope(ops, dtype, freq, shape, inverse, pos):
    g = gen(zlib.crc32(repr((shape, freq, pos, inverse)).encode()))
    inv_freq = FREQS[freq]
    if shape[-1] < 64:
        inv_freq = main_inv_freq64(shape[-1] // 2, 10000.0).to(torch.float32)[: shape[-1] // 4]
    x = randn(*shape, g=g, dtype=dtype)
    positions = POS_SETS[pos](shape[0], g)
    out = ops.rope(x, positions, inv_freq, inverse=inverse)
    ref = rope_ref(x, positions, inv_freq, inverse=inverse)
    check(out, ref, rtol=rtol_for(dtype), atol=ROPE_ABS * float(rope_bound(x)), dtype=dtype,
          what=f"rope{shape} {freq} inverse={inverse} pos={pos}")
    # channels before the trailing d_r pass through bit-exactly
    d_r = 2 * inv_freq.shape[0]
    assert torch.equal(out[..., : shape[-1] - d_r], x[..., : shape[-1] - d_r])


@pytest.mark.parametrize("freq", ["main", "yarn"])
def test_rope_inverse_undoes_and_preserves_norm(ops, freq):
    g = gen(7)
    inv_freq = FREQS[freq]
    x = randn(9, 4, 512, g=g)
    positions = torch.randint(0, 1 << 20, (9,), generator=g)
    y = ops.rope(x, positions, inv_freq)
    back = ops.rope(y, positions, inv_freq, inverse=True)
    # two fp32 rotations: ~2x the single-rotation error, relative to max|x|
    check(back, x.to(F64), rtol=2 * FP32_RTOL, atol=2 * ROPE_ABS * float(x.abs().max()),
          what="rope inverse(rope(x))")
    # rotation preserves the norm of every pair (hence of the rope slice and of the vector)
    pairs_x = x[..., -64:].to(F64).reshape(9, 4, 32, 2).norm(dim=-1)
    pairs_y = y[..., -64:].to(F64).reshape(9, 4, 32, 2).norm(dim=-1)
    check(pairs_y, pairs_x, rtol=4 * 2.0**-24, atol=ROPE_ABS * float(x.abs().max()),
          what="rope pair norms")
    # and it is a real rotation (not identity) for p > 0
    assert (y - x).abs().max() > 1e-2


def test_rope_interleaved_pairs_position_one(ops):
    # p = 1, main freqs: pair i of the trailing slice rotates by omega_i; check (2i, 2i+1) pairing
    d = 8
    inv_freq = torch.tensor([1.0, 0.5], dtype=torch.float32)  # d_r = 4, channels 4..7
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 1.0, 0.0, 0.0, 1.0]])
    out = ops.rope(x, torch.tensor([1]), inv_freq)
    c0, s0, c1, s1 = math.cos(1.0), math.sin(1.0), math.cos(0.5), math.sin(0.5)
    want = torch.tensor([[1.0, 2.0, 3.0, 4.0, c0, s0, -s1, c1]], dtype=F64)
    check(out, want, rtol=0, atol=4 * 2.0**-24, what="interleaved pairing")
    assert d == x.shape[-1]


@pytest.mark.parametrize("dtype", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("freq", ["main", "yarn"])
@pytest.mark.parametrize("T,h,d", [(3, 64, 512), (5, 4, 128), (2, 2, 64), (0, 64, 512)])
def test_q_norm_rope(ops, dtype, freq, T, h, d):
    g = gen(T * 100 + h + d)
    inv_freq = FREQS[freq]
    q = randn(T, h, d, g=g, dtype=dtype, std=5.0)
    positions = torch.randint(0, 200000, (T,), generator=g)
    eps = 1e-6
    out = ops.q_norm_rope(q, positions, inv_freq, eps)
    # per-head unweighted rms in exact arithmetic, then the spec rotation; ONE final rounding
    normed = rms_norm64(q, None, eps)
    ref = rope_ref(normed, positions, inv_freq)
    # normed |values| <= sqrt(d); fp32 norm (few ulps) + rotation (ROPE_ABS of max|normed|)
    check(out, ref, rtol=rtol_for(dtype) + FP32_RTOL,
          atol=ROPE_ABS * float(normed.abs().max()) if T else 0.0, dtype=dtype,
          what=f"q_norm_rope[{T},{h},{d}] {freq}")


@pytest.mark.parametrize("dtype", ACTS, ids=ACT_IDS)
@pytest.mark.parametrize("freq", ["main", "yarn"])
@pytest.mark.parametrize("T,d", [(4, 512), (3, 128), (6, 64), (0, 512)])
def test_kv_norm_rope(ops, dtype, freq, T, d):
    g = gen(T * 10 + d)
    inv_freq = FREQS[freq]
    kv = randn(T, d, g=g, dtype=dtype, std=3.0)
    weight = randn(d, g=g, dtype=torch.float32)
    positions = torch.randint(0, 200000, (T,), generator=g)
    eps = 1e-6
    out = ops.kv_norm_rope(kv, weight, positions, inv_freq, eps)
    normed = rms_norm64(kv, weight, eps)
    ref = rope_ref(normed, positions, inv_freq)
    check(out, ref, rtol=rtol_for(dtype) + FP32_RTOL,
          atol=ROPE_ABS * float(normed.abs().max()) if T else 0.0, dtype=dtype,
          what=f"kv_norm_rope[{T},{d}] {freq}")
