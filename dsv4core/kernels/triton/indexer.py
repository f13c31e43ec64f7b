"""indexer_scores_rows, indexer_rotate_quant.

indexer_scores_rows: ``score[t, w] = scale * sum_h weights[t, h] * relu(q[t, h] . k[rows[t, w]])``,
``-inf`` where ``rows[t, w] = -1`` (keys read from a pool by global row index; fp32 accumulation).

One program = (query t, a block of BL key slots). It gathers the BL key rows its slots name (a
-1 slot is masked, never read), computes the [nI, BL] head-by-key dot products with ``tl.dot`` over
chunks of BD channels (fp32 accumulate; fp32 inputs with ieee products, never tf32), then the
ReLU and the weighted sum over heads in registers. The grid is fixed by the shapes (T, L): no host
read of device data, capturable. Every tensor is read through its strides (a key pool may be a
region of a larger buffer).

``k_format="fp4"`` (the FP4 key of ``hal.rowformats``): the gather reads each key's bytes and
decodes them in registers (e2m1 code x its group's UE8M0 scale) into the same [BL, BD] tile; the
decoded values are exact in q's dtype, so the result is that of a plain pool holding them.

indexer_rotate_quant (the official indexer's query / key simulation): per row of d values (a power
of two), the Sylvester-ordered Hadamard rotation as a ``tl.dot`` with ``H`` (built in registers,
``H[k, j] = (-1)^popcount(k & j)``, exact +-1 in any operand dtype) over chunks of BN output
columns (fp32 accumulation; bf16 products on a GPU for bf16 rows, fp32 ieee products otherwise),
scaled by ``d^-0.5`` in fp32, rounded to bfloat16, then FP4 e2m1 fake-quantised per 32 values with
the power-of-two scale of ``hal.quant`` (``_util.e2m1_rne``, ``group_scale_exp``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import c, cdiv, e2m1_rne, exp2_int, group_scale_exp, interpreting, np2, rne_bf16
from . import _paged
from .launch import Tune
from . import predicates
from .registry import implements

#: launch parameters: tuning overrides over the bound backend's launch table (launch.py);
#: BR / BN / rq_warps: indexer_rotate_quant's rows a program, output columns a dot, warps
TUNE = Tune(__name__)   # its keys: launch.TUNING_KEYS


@triton.jit
def _fp4_keys(k_ptr, r, d0, m, KW: tl.constexpr, DI: tl.constexpr):
    """fp32 [BL, 32]: channels d0 .. d0 + 32 (one scale group) of the FP4 keys in rows ``r`` of a
    uint8 pool of KW-byte rows: e2m1 codes two a byte (even channel in the low nibble), then one
    UE8M0 byte per 32 channels."""
    dc = tl.arange(0, 32)
    b = tl.load(k_ptr + r[:, None] * KW + (d0 // 2 + dc // 2)[None, :], mask=m, other=0).to(tl.int32)
    code = tl.where(((dc & 1) == 1)[None, :], b >> 4, b) & 0xF
    i = code & 7                                           # e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6
    pow2 = (((i >> 1) + 126) << 23).to(tl.float32, bitcast=True)          # 2^((i >> 1) - 1)
    mag = tl.where(i < 2, i.to(tl.float32) * 0.5, pow2 * (1.0 + 0.5 * (i & 1).to(tl.float32)))
    v = tl.where((code & 8) != 0, -mag, mag)
    e = tl.load(k_ptr + r * KW + (DI // 2 + d0 // 32), mask=tl.max(m, axis=1) > 0, other=127).to(tl.int32)
    return v * (e << 23).to(tl.float32, bitcast=True)[:, None]


@triton.jit
def _indexer_scores_rows_kernel(q_ptr, k_ptr, w_ptr, rows_ptr, out_ptr, NI, DI, L, scale,
                                sq_t, sq_h, sq_d, sk_n, sk_d, sw_t, sw_h, sr_t, sr_l,
                                NIP: tl.constexpr, BL: tl.constexpr, BD: tl.constexpr,
                                F32: tl.constexpr, INTERP: tl.constexpr, FP4: tl.constexpr,
                                KW: tl.constexpr, DIC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = (tl.program_id(1) * BL + tl.arange(0, BL)).to(tl.int64)
    sm = slot < L
    r = tl.load(rows_ptr + t * sr_t + slot * sr_l, mask=sm, other=-1).to(tl.int64)
    valid = sm & (r >= 0)
    r = tl.where(valid, r, 0)
    heads = tl.arange(0, NIP).to(tl.int64)
    hm = heads < NI
    acc = tl.zeros([NIP, BL], dtype=tl.float32)
    for d0 in range(0, DI, BD):
        dc = d0 + tl.arange(0, BD).to(tl.int64)
        dm = dc < DI
        q = tl.load(q_ptr + t * sq_t + heads[:, None] * sq_h + dc[None, :] * sq_d,
                    mask=hm[:, None] & dm[None, :], other=0.0)
        if FP4:
            k = _fp4_keys(k_ptr, r, d0, valid[:, None] & dm[None, :], KW, DIC).to(q.dtype)   # BD = 32
        else:
            k = tl.load(k_ptr + r[:, None] * sk_n + dc[None, :] * sk_d, mask=valid[:, None] & dm[None, :], other=0.0)
        if F32:
            acc += tl.dot(q, tl.trans(k), input_precision="ieee")
        elif INTERP:   # the interpreter's bf16 dot is unreliable; bf16 products are exact in fp32
            acc += tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(q, tl.trans(k))
    w = tl.load(w_ptr + t * sw_t + heads * sw_h, mask=hm, other=0.0)
    s = tl.sum(w[:, None] * tl.maximum(acc, 0.0), axis=0) * scale
    tl.store(out_ptr + t * L + slot, tl.where(valid, s, float("-inf")), mask=sm)


@implements("indexer_scores_rows", supports=predicates.indexer_scores_rows_supports)
def indexer_scores_rows(q, k, weights, rows, scale, k_format=None, k_paged=False):
    T, NI, DI = q.shape
    L = rows.shape[1]
    out = torch.empty((T, L), dtype=torch.float32, device=q.device)
    if T == 0 or L == 0:
        return out
    if k.shape[0] == 0 or (k_paged and k.shape[1] == 0):   # an empty pool: every row is -1 (the HAL input check)
        return out.fill_(float("-inf"))
    if k_paged:   # HAL 1.4: the keys' offsets in units of U elements, a key "row" U elements (the pool not copied)
        rows, U, _ = _paged.offsets(k, rows)
        ks = (U, k.stride(2))
    else:
        ks = k.stride()
    fp4, it = k_format == "fp4", interpreting(q)
    KW = ks[0] if fp4 else 0
    # the launch but the tensors, strides and scale: planned once per shapes, key format, dtype and
    # the launch parameters in effect (Tune.memo; the interpreter flag read per call)
    grid, kw = TUNE.memo(("scores", T, NI, DI, L, q.dtype, fp4, KW, it),
                         lambda: _scores_plan(T, NI, DI, L, q.dtype == torch.float32, fp4, KW, it))
    _indexer_scores_rows_kernel[grid](
        q, k, weights, rows, out, NI, DI, L, float(scale), *q.stride(), *ks, *weights.stride(),
        *rows.stride(), **kw)
    return out


def _scores_plan(T, NI, DI, L, f32, fp4, KW, it):
    # tl.dot needs every tile dimension >= 16: heads are padded (zero q rows, zero weights)
    NIP = max(16, np2(NI))
    BD = TUNE.get("BD", max(16, min(np2(DI), 64 if f32 else 128)))
    if fp4:
        BD = 32                # one chunk = one FP4 scale group
    BL = TUNE.get("BL", 32 if f32 else 64)
    return (T, cdiv(L, BL)), dict(NIP=NIP, BL=BL, BD=BD, F32=f32, INTERP=it, FP4=fp4, KW=KW, DIC=DI if fp4 else 0,
                                  num_warps=TUNE.get("num_warps", 4), num_stages=TUNE.get("num_stages", 2),
                                  **TUNE.options())


@triton.jit
def _rotate_quant_kernel(x_ptr, y_ptr, R, scale, D: tl.constexpr, BR: tl.constexpr, BN: tl.constexpr,
                         LOWP: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    rm = rows < R
    k = tl.arange(0, D)
    x = tl.load(x_ptr + rows[:, None] * D + k[None, :], mask=rm[:, None], other=0.0)
    if not LOWP:
        x = x.to(tl.float32)
    for j0 in tl.static_range(0, D, BN):
        j = j0 + tl.arange(0, BN)
        p = k[:, None] & j[None, :]          # popcount parity by xor folding (D <= 2^16)
        p = p ^ (p >> 8)
        p = p ^ (p >> 4)
        p = p ^ (p >> 2)
        p = p ^ (p >> 1)
        h = (1 - 2 * (p & 1)).to(x.dtype)
        if LOWP:
            y = tl.dot(x, h)
        else:
            y = tl.dot(x, h, input_precision="ieee")
        y = rne_bf16(y * scale)
        g = tl.reshape(y, (BR, BN // 32, 32))
        e = group_scale_exp(tl.max(tl.abs(g), axis=2), 6.0 * 2.0 ** -126, 1.0 / 6.0)
        q = e2m1_rne(tl.minimum(tl.maximum(g * exp2_int(-e)[:, :, None], -6.0), 6.0))
        out = tl.reshape(q * exp2_int(e)[:, :, None], (BR, BN))
        tl.store(y_ptr + rows[:, None] * D + j[None, :], out.to(y_ptr.dtype.element_ty), mask=rm[:, None])


@implements("indexer_rotate_quant", supports=predicates.indexer_rotate_quant_supports)
def indexer_rotate_quant(x):
    D = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    R = x.numel() // D
    if R == 0:
        return y
    # bf16 rows on a GPU: bf16 products (exact: H is +-1) on the tensor cores; fp32 rows and the
    # interpreter (whose bf16 dot is unreliable): fp32 ieee products
    lowp = x.dtype == torch.bfloat16 and not interpreting(x)
    grid, kw = TUNE.memo(("rotate", R, D, lowp), lambda: _rotate_plan(R, D, lowp))
    _rotate_quant_kernel[grid](c(x), y, R, float(D ** -0.5), **kw)
    return y


def _rotate_plan(R, D, lowp):
    BR = TUNE.get("BR", 32 if D <= 256 else 16)
    BN = TUNE.get("BN", min(D, 64))
    if BN % 32 or D % BN or BR < 16:
        raise ValueError(f"indexer_rotate_quant: TUNE BN={BN} must be a multiple of 32 dividing d={D}, "
                         f"BR={BR} >= 16 (tl.dot)")
    return (cdiv(R, BR),), dict(D=D, BR=BR, BN=BN, LOWP=lowp, num_warps=TUNE.get("rq_warps", 4), **TUNE.options())
