"""moe_route: ``s = sqrt(softplus(logits))``; ids = top-k of ``s + bias`` (the bias only selects)
or the given hash ids; weights = ``s[ids] / (sum s[ids] + 1e-20) * scaling``. One program per
token, the E scores in registers; the top-k is k rounds of (max, lowest index holding it, mask),
so exact ties go to the lower expert id (the spec accepts either). No host synchronisation.

Accuracy does not depend on the target's math library. ``tl.exp`` on fp32 is lowered by Triton
(NVIDIA and AMD) to ``exp2(fl32(x * log2 e))``: the rounding of that product alone is a relative
error up to ``|x| * 2^-24`` in ``exp(x)`` (5e-6 at the logits near -86.5 of the renorm-eps case,
2.6e-6 after the sqrt: 1.12x the conformance bound, measured on an H200). So ``exp`` here is
computed with adds and multiplies only (:func:`_exp`), the divisions are correctly rounded
(``div_rn``) and the sqrt too (``sqrt_rn``). The interpreter's ``tl.exp`` is numpy's (accurate),
which is why CPU runs never showed it; tests/interpret/test_triton_route_topk.py runs the kernel with the
GPU lowering of ``tl.exp`` emulated.

softplus follows torch (``x`` above 20, else ``log1p(exp(x))``), with log1p computed as
``log(u) * y / (u - 1)``, ``u = 1 + y`` (accurate to a few ulp; ``y`` itself when ``u == 1``).
Below -20, ``s = exp(x / 2)`` (``log1p(e^x) = e^x`` to 5e-10 relative there), which keeps tiny
scores exact down to logits of -174 (the fp32 reference's ``softplus`` underflows below -87);
below that ``s = 0``. Hash ids outside [0, E) (which the HAL input check rejects) give NaN
weights for that token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import c, np2
from . import predicates
from .registry import implements

# exp(x) = 2^n * exp(r), r = x - n ln2 with ln2 split Cody-Waite style: LN2_HI has 9 significant
# bits, so n * LN2_HI is exact for |n| < 2^15 and x - n * LN2_HI is exact (Sterbenz)
_LOG2E = tl.constexpr(1.4426950408889634)
_LN2_HI = tl.constexpr(0.693359375)
_LN2_LO = tl.constexpr(-2.1219444005469057e-04)
_C2 = tl.constexpr(1.0 / 2)
_C3 = tl.constexpr(1.0 / 6)
_C4 = tl.constexpr(1.0 / 24)
_C5 = tl.constexpr(1.0 / 120)
_C6 = tl.constexpr(1.0 / 720)
_C7 = tl.constexpr(1.0 / 5040)


@triton.jit
def _exp(x):
    """exp(x) in fp32 for x in [-87, 88] (normal results) to about 1 ulp, from adds and multiplies:
    ``n = round(x / ln2)``, ``|r| <= ln2 / 2``, ``exp(r)`` by its degree-7 Taylor polynomial
    (truncation < 5.2e-9 relative), ``2^n`` built from its exponent bits. FMA contraction only
    makes the steps more exact. The caller keeps x in range (NaN propagates)."""
    n = tl.floor(x * _LOG2E + 0.5)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = 1.0 + r * (1.0 + r * (_C2 + r * (_C3 + r * (_C4 + r * (_C5 + r * (_C6 + r * _C7))))))
    ni = tl.where(n == n, n, 0.0).to(tl.int32)                        # NaN: p is NaN already
    two_n = ((ni + 127) << 23).to(tl.float32, bitcast=True)
    return p * two_n


@triton.jit
def _sqrt_softplus(x):
    xm = tl.where(x < -20.0, -20.0, tl.where(x > 20.0, 20.0, x))     # NaN stays NaN
    y = _exp(xm)
    u = 1.0 + y
    d = tl.where(u == 1.0, 1.0, u - 1.0)
    l1p = tl.where(u == 1.0, y, tl.log(u) * tl.div_rn(y, d))
    mid = tl.sqrt_rn(tl.where(x > 20.0, x, l1p))
    h = tl.where(x < -20.0, 0.5 * x, -10.0)                         # the branch below -20 only
    low = tl.where(h < -87.0, 0.0, _exp(tl.where(h < -87.0, -87.0, h)))
    return tl.where(x < -20.0, low, mid)


@triton.jit
def _route_kernel(lg_ptr, bias_ptr, hid_ptr, w_ptr, id_ptr, E, scaling,
                  K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, HAS_BIAS: tl.constexpr,
                  HASH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    kc = tl.arange(0, KP)
    km = kc < K
    if HASH:
        ids = tl.load(hid_ptr + t * K + kc, mask=km, other=0).to(tl.int64)
        ok = (ids >= 0) & (ids < E)
        xi = tl.load(lg_ptr + t * E + tl.where(ok, ids, 0), mask=km, other=0.0)
        wi = tl.where(ok, _sqrt_softplus(xi), float("nan"))
    else:
        ec = tl.arange(0, EP)
        em = ec < E
        s = _sqrt_softplus(tl.load(lg_ptr + t * E + ec, mask=em, other=0.0))
        key = s
        if HAS_BIAS:
            key = s + tl.load(bias_ptr + ec, mask=em, other=0.0)
        key = tl.where(em, key, float("-inf"))
        ids = tl.zeros([KP], dtype=tl.int64)
        wi = tl.zeros([KP], dtype=tl.float32)
        for i in tl.static_range(K):
            mx = tl.max(key, axis=0)
            idx = tl.minimum(tl.min(tl.where(key == mx, ec, EP), axis=0), E - 1)
            si = tl.sum(tl.where(ec == idx, s, 0.0), axis=0)
            ids = tl.where(kc == i, idx, ids)
            wi = tl.where(kc == i, si, wi)
            key = tl.where(ec == idx, float("-inf"), key)
    den = tl.sum(tl.where(km, wi, 0.0), axis=0) + 1e-20
    tl.store(w_ptr + t * K + kc, tl.div_rn(wi, den) * scaling, mask=km)
    tl.store(id_ptr + t * K + kc, ids.to(tl.int32), mask=km)


@implements("moe_route", supports=predicates.moe_route_supports)
def moe_route(logits, topk, scaling, correction_bias=None, hash_ids=None):
    T, E = logits.shape
    k = int(topk)
    w = torch.empty((T, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, k), dtype=torch.int32, device=logits.device)
    if T == 0:
        return w, ids
    lg = c(logits)
    hashed = hash_ids is not None
    bias = c(correction_bias) if correction_bias is not None and not hashed else lg
    hid = c(hash_ids) if hashed else ids
    _route_kernel[(T,)](lg, bias, hid, w, ids, E, float(scaling), K=k, KP=np2(k), EP=np2(E),
                        HAS_BIAS=correction_bias is not None and not hashed, HASH=hashed, num_warps=4)
    return w, ids
