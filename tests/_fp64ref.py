"""Independent float64 evaluations of the SPEC.md op math, for tests/test_ref_*.py.

Written from /work/shared/docs/SPEC.md section 2 only; nothing here imports or copies
dsv4core code. Everything is computed in float64 with plain loops / einsum.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

F64 = torch.float64
_RATIO_LOG = os.environ.get("DSV4_TEST_RATIO_LOG")  # debug aid: log worst err/tol per check

# ---------------------------------------------------------------------------
# Tolerances (each with its reason)
# ---------------------------------------------------------------------------
# bf16 has an 8-bit significand: rounding an fp32 result once to bf16 is off by at most half an
# ulp = 2^-8 relative.  The spec allows exactly one rounding, so bf16 outputs get rtol 2^-8
# (plus whatever the fp32 computation before that rounding may contribute).
BF16_RTOL = 2.0**-8
# fp32 single-rounding elementwise math (norms, rotations, sigmoid, softmax of O(1) values)
# vs fp64: a handful of fp32 ulps (2^-24 ~ 6e-8 each) -> 2e-6 relative.
FP32_RTOL = 2e-6
# fp32 accumulation of a dot product / sum of many terms vs fp64: the rounding error is a few
# ulps (2^-24) of the sum of |terms| (random-walk for blocked/pairwise sums); 1e-6 = ~16 ulps
# of sum|terms| is the bound used with `bound` tensors below.
FP32_ACC = 1e-6


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, g: torch.Generator, dtype=torch.float32, std: float = 1.0) -> torch.Tensor:
    gdt = F64 if dtype == F64 else torch.float32
    return (torch.randn(*shape, generator=g, dtype=gdt) * std).to(dtype)


def rand(*shape, g, lo=0.0, hi=1.0, dtype=torch.float32):
    return (torch.rand(*shape, generator=g, dtype=F64) * (hi - lo) + lo).to(dtype)


# ---------------------------------------------------------------------------
# Comparison helper
# ---------------------------------------------------------------------------
def check(out: torch.Tensor, ref: torch.Tensor, *, rtol: float, atol: float = 0.0,
          bound: torch.Tensor | None = None, bound_tol: float = 0.0,
          dtype: torch.dtype | None = None, what: str = "") -> None:
    """|out - ref| <= atol + rtol*|ref| + bound_tol*bound elementwise; infinities must match."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != expected {tuple(ref.shape)}"
    if dtype is not None:
        assert out.dtype == dtype, f"{what}: dtype {out.dtype} != expected {dtype}"
    if out.numel() == 0:
        return
    o = out.detach().to(F64)
    r = ref.to(F64)
    assert not torch.isnan(o).any(), f"{what}: NaN in output"
    inf_r = torch.isinf(r)
    assert torch.equal(torch.isinf(o), inf_r), f"{what}: infinity pattern differs"
    assert torch.equal(o[inf_r], r[inf_r]), f"{what}: infinity signs differ"
    fin = ~inf_r
    err = (o - r).abs()[fin]
    tol = atol + rtol * r.abs()[fin]
    if bound is not None:
        tol = tol + bound_tol * bound.to(F64).expand_as(r)[fin]
    bad = err > tol
    if _RATIO_LOG:
        with open(_RATIO_LOG, "a") as f:
            f.write(f"{(err / tol.clamp_min(1e-300)).max().item():.3g}\t{out.dtype}\t{what}\n")
    if bad.any():
        ratio = (err / tol.clamp_min(1e-300)).max().item()
        i = int(torch.argmax(err - tol))
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{err.numel()} elements out of tolerance; "
            f"max err {err.max().item():.3e}, worst err/tol {ratio:.3g}, at flat {i}: "
            f"got {o[fin][i].item():.9g} want {r[fin][i].item():.9g} tol {tol[i].item():.3e}")


def rtol_for(dtype: torch.dtype) -> float:
    """Elementwise relative tolerance for one final rounding to `dtype` after fp32 math."""
    return BF16_RTOL + FP32_RTOL if dtype == torch.bfloat16 else FP32_RTOL


# ---------------------------------------------------------------------------
# Binding
# ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def ops():
    from dsv4core.hal import bind

    return bind(device="cpu", backend="reference", policy="strict")


# ---------------------------------------------------------------------------
# fp64 formulas (SPEC.md section 2)
# ---------------------------------------------------------------------------
def rms_norm64(x, weight, eps):
    x = x.to(F64)
    ms = (x * x).mean(dim=-1, keepdim=True)
    y = x / torch.sqrt(ms + eps)
    if weight is not None:
        y = y * weight.to(F64)
    return y


def main_inv_freq64(d_r: int, theta: float) -> torch.Tensor:
    return torch.tensor([theta ** (-2.0 * i / d_r) for i in range(d_r // 2)], dtype=F64)


def yarn_inv_freq64(d_r: int, theta: float, factor: float, L0: int, beta_fast: float,
                    beta_slow: float) -> torch.Tensor:
    base = main_inv_freq64(d_r, theta)

    def corr(r):
        return d_r * math.log(L0 / (2 * math.pi * r)) / (2 * math.log(theta))

    lo = max(math.floor(corr(beta_fast)), 0)
    hi = min(math.ceil(corr(beta_slow)), d_r - 1)
    if lo == hi:
        hi += 0.001
    out = []
    for i in range(d_r // 2):
        ramp = min(max((i - lo) / (hi - lo), 0.0), 1.0)
        out.append(base[i].item() * (1 - ramp) + (base[i].item() / factor) * ramp)
    return torch.tensor(out, dtype=F64)


def rope64(x, positions, inv_freq, inverse=False):
    """Rotate the trailing d_r = 2*len(inv_freq) channels in interleaved pairs, in fp64.

    The angle is p * omega with omega the fp32 inv_freq value (exact product in fp64)."""
    x = x.to(F64).clone()
    d = x.shape[-1]
    half = inv_freq.shape[0]
    d_r = 2 * half
    T = x.shape[0]
    ang = positions.to(F64)[:, None] * inv_freq.to(F64)[None, :]  # [T, half]
    if inverse:
        ang = -ang
    ang = ang.reshape(T, *([1] * (x.dim() - 2)), half)
    c, s = torch.cos(ang), torch.sin(ang)
    a = x[..., d - d_r::2].clone()
    b = x[..., d - d_r + 1::2].clone()
    x[..., d - d_r::2] = a * c - b * s
    x[..., d - d_r + 1::2] = a * s + b * c
    return x


def rope_atol(x, positions, inv_freq):
    """fp32 rounding of the angle (|angle| * 2^-24 absolute) and fp32 cos/sin, times |x|."""
    if x.numel() == 0 or positions.numel() == 0:
        return 0.0
    max_ang = positions.abs().max().item() * inv_freq.abs().max().item()
    return 4 * x.to(F64).abs().max().item() * (max_ang * 2.0**-24 + 2.0**-23)


def sinkhorn64(logits, hc_eps, iters):
    """logits [T,n,n]; row softmax over k, +eps, col-normalise, then iters-1 x (row, col)."""
    C = torch.softmax(logits, dim=-1) + hc_eps
    C = C / (C.sum(dim=-2, keepdim=True) + hc_eps)  # colsum_k = sum_j C[j,k]
    for _ in range(iters - 1):
        C = C / (C.sum(dim=-1, keepdim=True) + hc_eps)
        C = C / (C.sum(dim=-2, keepdim=True) + hc_eps)
    return C


def hc_pre64(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
    T, n, H = x.shape
    x64 = x.to(F64)
    xf = x64.reshape(T, n * H)
    rho = 1.0 / torch.sqrt((xf * xf).mean(dim=-1) + rms_eps)
    fn64, s, b = fn.to(F64), scale.to(F64), base.to(F64)
    z = rho[:, None] * torch.einsum("tc,oc->to", xf, fn64)
    pre = torch.sigmoid(s[0] * z[:, :n] + b[:n]) + hc_eps
    post = post_mult * torch.sigmoid(s[1] * z[:, n:2 * n] + b[n:2 * n])
    Z = z[:, 2 * n:].reshape(T, n, n)
    B = b[2 * n:].reshape(n, n)
    comb = sinkhorn64(s[2] * Z + B, hc_eps, iters)
    y = torch.zeros(T, H, dtype=F64)
    for j in range(n):
        y += pre[:, j:j + 1] * x64[:, j]
    return y, post, comb, z


def hc_head64(x, fn, scale, base, rms_eps, hc_eps):
    T, n, H = x.shape
    x64 = x.to(F64)
    xf = x64.reshape(T, n * H)
    rho = 1.0 / torch.sqrt((xf * xf).mean(dim=-1) + rms_eps)
    z = rho[:, None] * torch.einsum("tc,oc->to", xf, fn.to(F64))
    pre = torch.sigmoid(scale.to(F64)[0] * z + base.to(F64)) + hc_eps
    y = torch.zeros(T, H, dtype=F64)
    for j in range(n):
        y += pre[:, j:j + 1] * x64[:, j]
    return y


def hc_post64(o, residual, post, comb):
    T, n, H = residual.shape
    out = torch.zeros(T, n, H, dtype=F64)
    o64, r64, p64, c64 = o.to(F64), residual.to(F64), post.to(F64), comb.to(F64)
    for k in range(n):
        out[:, k] = p64[:, k:k + 1] * o64
        for j in range(n):
            out[:, k] += c64[:, j, k:k + 1] * r64[:, j]
    return out


def sparse_attn_loop64(q, kv, indices, sink, scale):
    """Literal SPEC formula: per query t and head h, over S_t = {indices[t,u] >= 0}."""
    T, h, d = q.shape
    q64, kv64, s64 = q.to(F64), kv.to(F64), sink.to(F64)
    out = torch.zeros(T, h, d, dtype=F64)
    for t in range(T):
        rows = [int(i) for i in indices[t].tolist() if i >= 0]
        if not rows:
            continue
        K = kv64[rows]  # [S, d]
        logits = scale * (q64[t] @ K.T)  # [h, S]
        m = torch.maximum(logits.max(dim=-1).values, s64)  # stabiliser incl. the sink
        e = torch.exp(logits - m[:, None])
        den = e.sum(dim=-1) + torch.exp(s64 - m)
        out[t] = (e @ K) / den[:, None]
    return out


def dense_mask_from_indices(indices, N):
    T = indices.shape[0]
    mask = torch.zeros(T, N, dtype=torch.bool)
    for t in range(T):
        for u in indices[t].tolist():
            if u >= 0:
                mask[t, u] = True
    return mask


def dense_attn_with_sink64(q, kv, mask, sink, scale):
    """Dense attention over all N rows, masked, with the sink as an extra logit column."""
    T, h, d = q.shape
    logits = scale * torch.einsum("thd,nd->thn", q.to(F64), kv.to(F64))
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    sink_col = sink.to(F64)[None, :, None].expand(T, h, 1)
    p = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thn,nd->thd", p, kv.to(F64))


def compress_pool64(kv, score, ape, overlap, prev_kv=None, prev_score=None):
    Wn, m, cd = kv.shape
    c = 2 if overlap else 1
    dp = cd // c
    kv64, sc64, ape64 = kv.to(F64), score.to(F64), ape.to(F64)
    out = torch.zeros(Wn, dp, dtype=F64)
    for w in range(Wn):
        if not overlap:
            v = kv64[w]
            s = sc64[w] + ape64
        else:
            if w == 0:
                if prev_kv is None:
                    av = torch.zeros(m, dp, dtype=F64)
                    as_ = torch.full((m, dp), float("-inf"), dtype=F64)
                else:
                    av = prev_kv.to(F64)
                    as_ = prev_score.to(F64) + ape64[:, :dp]
            else:
                av = kv64[w - 1, :, :dp]
                as_ = sc64[w - 1, :, :dp] + ape64[:, :dp]
            bv = kv64[w, :, dp:]
            bs = sc64[w, :, dp:] + ape64[:, dp:]
            v = torch.cat([av, bv], dim=0)
            s = torch.cat([as_, bs], dim=0)
        a = torch.softmax(s, dim=0)  # per channel, over slots
        out[w] = (a * v).sum(dim=0)
    return out


def indexer_scores64(q, k, weights, k_offsets, k_lengths, scale):
    T = q.shape[0]
    L = int(k_lengths.max()) if T else 0
    out = torch.full((T, L), float("-inf"), dtype=F64)
    bound = torch.zeros(T, L, dtype=F64)
    q64, k64, w64 = q.to(F64), k.to(F64), weights.to(F64)
    for t in range(T):
        off, ln = int(k_offsets[t]), int(k_lengths[t])
        keys = k64[off:off + ln]  # [ln, dI]
        logits = q64[t] @ keys.T  # [nI, ln]
        out[t, :ln] = (w64[t][:, None] * torch.relu(logits)).sum(dim=0) * scale
        bound[t, :ln] = (w64[t].abs()[:, None] * (q64[t].abs() @ keys.abs().T)).sum(0) * abs(scale)
    return out, bound


def dequant_blocks64(w, scale, block=128):
    """W[i,j] = Wq[i,j] * S[i//128, j//128] over the last two dims."""
    w64 = w.to(F64)
    if scale is None:
        return w64
    s64 = scale.float().to(F64)  # float() handles float8_e8m0fnu
    N, K = w64.shape[-2], w64.shape[-1]
    s_full = s64.repeat_interleave(block, dim=-2)[..., :N, :].repeat_interleave(block, dim=-1)[..., :K]
    return w64 * s_full


def softplus64(x):
    x = x.to(F64)
    return torch.where(x > 0, x + torch.log1p(torch.exp(-x)), torch.log1p(torch.exp(x)))


def swiglu64(g, u, L):
    g = torch.clamp(g, max=L)
    u = torch.clamp(u, min=-L, max=L)
    return g * torch.sigmoid(g) * u
