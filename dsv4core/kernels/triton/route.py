"""moe_route: ``s = sqrt(softplus(logits))``; ids = top-k of ``s + bias`` (the bias only selects)
or the given hash ids; weights = ``s[ids] / (sum s[ids] + 1e-20) * scaling``. One program per
token, the E scores in registers; the top-k is k rounds of (max, lowest index holding it, mask),
so exact ties go to the lower expert id (the spec accepts either). No host synchronisation.

softplus follows torch (``x`` above 20, else ``log1p(exp(x))``), with log1p computed as
``log(u) * y / (u - 1)``, ``u = 1 + y`` (accurate to a few ulp; ``y`` itself when ``u == 1``), so
tiny scores (logits near -87) keep their value. Hash ids outside [0, E) (which the HAL input
check rejects) give NaN weights for that token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import c, np2


@triton.jit
def _sqrt_softplus(x):
    y = tl.exp(x)
    u = 1.0 + y
    d = tl.where(u == 1.0, 1.0, u - 1.0)
    l1p = tl.where(u == 1.0, y, tl.log(u) * (y / d))
    return tl.sqrt_rn(tl.where(x > 20.0, x, l1p))


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
    tl.store(w_ptr + t * K + kc, wi / den * scaling, mask=km)
    tl.store(id_ptr + t * K + kc, ids.to(tl.int32), mask=km)


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
