"""Manifold-constrained hyper-connections: hc_pre, hc_post, hc_head (SPEC.md section 2).

::

    X [T, n, H] ──flatten──► xf [T, nH] ──rms──► rho ─┐
                    │                                  ▼
                    │            z = rho * (fn @ xf)  [T, (2+n)n]
                    │         ┌──────────┼────────────────┐
                    │      pre [n]     post [n]        comb [n, n] ── Sinkhorn ──► C
                    ▼         │
    y = sum_j pre_j X_j ◄─────┘      (hc_post later: X'_k = post_k o + sum_j C[j,k] X_j)
"""

from __future__ import annotations

import torch

from ..spec import ACT_DTYPES, F32, Case, Dims, Tolerance, compute_dtype, expect, op
from ._cases import TOKENS, dims, noncontig, randn


def _mix_logits(x: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """``rho * (fn @ flatten(x))`` in the compute dtype: [T, M]. The rms only scales the logits."""
    ct = compute_dtype(x)
    xf = x.flatten(1).to(ct)
    rho = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + rms_eps)
    return (xf @ fn.to(ct).T) * rho


def sinkhorn(logits: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    """Row softmax + eps, a column normalisation, then ``iters - 1`` (row, column) pairs."""
    c = torch.softmax(logits, dim=-1) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    return c


def _collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """``y = sum_j pre_j x_j`` accumulated in pre's (fp32/fp64) dtype, cast to x.dtype once."""
    return (pre.unsqueeze(-1) * x.to(pre.dtype)).sum(1).to(x.dtype)


@op(family="mhc", tolerance=Tolerance(
    k=4.0, floor=1e-6, floors={"bfloat16": 2.0 ** -10},
    why="a length-nH dot product per mix logit, then 20 Sinkhorn sweeps that are contractive: a few "
        "fp32 roundings (k 4, floor 1e-6 = ~8 fp32 ulps, small enough that one Sinkhorn sweep too few "
        "or bf16 mixes fail). With bf16 activations the SPEC accuracy contract lets the mixes product "
        "run in TF32/bf16x3, whose error shows up as relative ~2^-10 on post/comb: floor 2^-10 for bf16"))
def hc_pre(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
           rms_eps: float, hc_eps: float, iters: int, post_mult: float = 2.0
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse the n streams into one sublayer input and produce the hc_post coefficients.

    x [T, n, H] act; fn [(2+n)n, nH] f32; scale [3] f32; base [(2+n)n] f32.
    Returns y [T, H] (x.dtype), post [T, n] f32, comb [T, n, n] f32. SPEC.md hc_pre steps 1-5.
    """
    T, n, _ = x.shape
    z = _mix_logits(x, fn, rms_eps)
    s, b = scale.to(z.dtype), base.to(z.dtype)
    pre = torch.sigmoid(s[0] * z[:, :n] + b[:n]) + hc_eps
    post = post_mult * torch.sigmoid(s[1] * z[:, n:2 * n] + b[n:2 * n])
    comb = sinkhorn((s[2] * z[:, 2 * n:] + b[2 * n:]).view(T, n, n), hc_eps, iters)
    return _collapse(x, pre), post, comb


@hc_pre.check
def _(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
    d = Dims("hc_pre").tensor("x", x, ("T", "n", "H"), ACT_DTYPES + (torch.float64,))
    n, H = x.shape[1], x.shape[2]
    d.tensor("fn", fn, ((2 + n) * n, n * H), F32)
    d.tensor("scale", scale, (3,), F32)
    d.tensor("base", base, ((2 + n) * n,), F32)
    expect("hc_pre", "iters", isinstance(iters, int) and iters >= 1, "an int >= 1", iters)


def _hc_params(n, H, gen, device, rows):
    fn = randn((rows, n * H), gen, torch.float32, device, 0.02)
    scale = randn((3,), gen, torch.float32, device, 0.5).abs() + 0.5
    base = randn((rows,), gen, torch.float32, device, 0.5)
    return fn, scale, base


@hc_pre.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    n, H = D["n"], D["H"]
    fn, scale, base = _hc_params(n, H, gen, device, (2 + n) * n)
    common = dict(fn=fn, scale=scale, base=base, rms_eps=1e-6, hc_eps=1e-6, iters=20)
    for T in TOKENS[shapes]:
        yield Case(f"T{T}", dict(x=randn((T, n, H), gen, dtype, device), **common))
    yield Case("n2", dict(x=randn((3, 2, H), gen, dtype, device),
                          **dict(common, **dict(zip(("fn", "scale", "base"), _hc_params(2, H, gen, device, 8)))),
                          ), ("hc_mult",))
    yield Case("large-magnitude", dict(x=randn((4, n, H), gen, dtype, device, 300.0), **common), ("extreme",))
    yield Case("tiny-magnitude", dict(x=randn((4, n, H), gen, dtype, device, 1e-3), **common), ("extreme",))
    # sharp mix logits (std ~3): Sinkhorn is far from converged after 20 sweeps, so the iteration
    # count and the sweep order are visible in comb (one sweep fewer changes comb by ~1e-3)
    sharp = dict(common, fn=fn * 5.0)
    yield Case("sharp-logits", dict(x=randn((9, n, H), gen, dtype, device), **sharp), ("sinkhorn",))
    yield Case("noncontig", dict(x=noncontig(randn((5, n, H), gen, dtype, device)), **sharp), ("noncontig",))
    yield Case("iters1", dict(x=randn((3, n, H), gen, dtype, device), **dict(common, iters=1)), ("sinkhorn",))
    yield Case("post_mult1", dict(x=randn((3, n, H), gen, dtype, device), **dict(common, post_mult=1.0)))
    # eps values that move the result: small inputs (mean square ~1e-4, so rms_eps 1e-3 is 10x it)
    # and hc_eps 0.1 (added to every pre weight and inside every Sinkhorn normalisation)
    yield Case("eps-visible", dict(x=randn((4, n, H), gen, dtype, device, 1e-2),
                                   **dict(common, rms_eps=1e-3, hc_eps=0.1)), ("eps",))


@op(family="mhc", tolerance=Tolerance(
    k=2.0, floor=1e-6,
    why="n+1 products summed per output element in fp32: a couple of roundings"))
def hc_post(o: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand and mix: ``out[:, k] = post[:, k] * o + sum_j comb[:, j, k] * residual[:, j]``.

    The sum runs over comb's FIRST index. o [T, H]; residual [T, n, H]; post [T, n] f32;
    comb [T, n, n] f32. fp32 math, result in residual.dtype.
    """
    ct = torch.promote_types(post.dtype, compute_dtype(residual))
    mixed = torch.einsum("tjk,tjh->tkh", comb.to(ct), residual.to(ct))
    return (post.to(ct).unsqueeze(-1) * o.to(ct).unsqueeze(1) + mixed).to(residual.dtype)


@hc_post.check
def _(o, residual, post, comb):
    d = Dims("hc_post").tensor("residual", residual, ("T", "n", "H"), ACT_DTYPES + (torch.float64,))
    d.tensor("o", o, ("T", "H"), ACT_DTYPES + (torch.float64,))
    d.tensor("post", post, ("T", "n"), F32)
    d.tensor("comb", comb, ("T", "n", "n"), F32)


@hc_post.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    n, H = D["n"], D["H"]
    for T in TOKENS[shapes]:
        # an asymmetric comb (softmax over the LAST index, not doubly stochastic): a transposed comb
        # changes the result by O(1)
        comb = torch.softmax(randn((T, n, n), gen, torch.float32, device, 2.0), -1)
        yield Case(f"T{T}", dict(o=randn((T, H), gen, dtype, device), residual=randn((T, n, H), gen, dtype, device),
                                 post=2 * torch.sigmoid(randn((T, n), gen, torch.float32, device)), comb=comb))
    T = 6
    comb = torch.softmax(randn((T, n, n), gen, torch.float32, device, 2.0), -1)
    yield Case("noncontig", dict(o=noncontig(randn((T, H), gen, dtype, device)),
                                 residual=noncontig(randn((T, n, H), gen, dtype, device)),
                                 post=noncontig(2 * torch.sigmoid(randn((T, n), gen, torch.float32, device))),
                                 comb=comb.transpose(1, 2).contiguous().transpose(1, 2)), ("noncontig",))
    yield Case("large-magnitude", dict(o=randn((3, H), gen, dtype, device, 1e3),
                                       residual=randn((3, n, H), gen, dtype, device, 1e3),
                                       post=2 * torch.sigmoid(randn((3, n), gen, torch.float32, device)),
                                       comb=torch.softmax(randn((3, n, n), gen, torch.float32, device), -1)),
               ("extreme",))


@op(family="mhc", tolerance=Tolerance(
    k=4.0, floor=1e-5,
    why="like hc_pre without Sinkhorn: a length-nH dot product per stream weight, then the collapse"))
def hc_head(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
            rms_eps: float, hc_eps: float) -> torch.Tensor:
    """Final collapse: ``pre_j = sigmoid(scale * rho * (fn @ xf)_j + base_j) + hc_eps``,
    ``y = sum_j pre_j x_j``. x [T, n, H]; fn [n, nH]; scale [1]; base [n]. No Sinkhorn."""
    z = _mix_logits(x, fn, rms_eps)
    pre = torch.sigmoid(scale.to(z.dtype)[0] * z + base.to(z.dtype)) + hc_eps
    return _collapse(x, pre)


@hc_head.check
def _(x, fn, scale, base, rms_eps, hc_eps):
    d = Dims("hc_head").tensor("x", x, ("T", "n", "H"), ACT_DTYPES + (torch.float64,))
    n, H = x.shape[1], x.shape[2]
    d.tensor("fn", fn, (n, n * H), F32)
    d.tensor("scale", scale, (1,), F32)
    d.tensor("base", base, (n,), F32)


@hc_head.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    n, H = D["n"], D["H"]
    fn = randn((n, n * H), gen, torch.float32, device, 0.02)
    for T in TOKENS[shapes]:
        yield Case(f"T{T}", dict(x=randn((T, n, H), gen, dtype, device), fn=fn,
                                 scale=torch.tensor([0.7], device=device), base=randn((n,), gen, torch.float32, device),
                                 rms_eps=1e-6, hc_eps=1e-6))
    yield Case("noncontig-large", dict(x=noncontig(randn((4, n, H), gen, dtype, device, 300.0)), fn=fn * 5,
                                       scale=torch.tensor([1.3], device=device),
                                       base=randn((n,), gen, torch.float32, device), rms_eps=1e-6, hc_eps=1e-6),
               ("noncontig", "extreme"))
    # eps values that move the result (mean square ~1e-4 vs rms_eps 1e-3; hc_eps 0.1 on every weight)
    yield Case("eps-visible", dict(x=randn((3, n, H), gen, dtype, device, 1e-2), fn=fn,
                                   scale=torch.tensor([0.7], device=device), base=randn((n,), gen, torch.float32, device),
                                   rms_eps=1e-3, hc_eps=0.1), ("eps",))
