"""supports predicates of the Triton kernels: pure torch (no triton import), plain bools."""
from __future__ import annotations

import torch

from dsv4core.hal.rowformats import ROPE_DIM, row_bytes
from dsv4core.hal.util import cdiv

ACT_DTYPES = (torch.float32, torch.bfloat16)


def triton_np2(n: int) -> int:
    """The power of two >= n (>= 1) the kernels pad a dimension to (``_util.np2``, without triton)."""
    return 1 << max(int(n) - 1, 0).bit_length()

_FP8 = tuple(d for d in (getattr(torch, "float8_e4m3fn", None),) if d is not None)
_E8M0 = getattr(torch, "float8_e8m0fnu", None)

# ---- norm.py
def rms_norm_supports(x, weight, eps) -> bool:
    if x.dtype not in ACT_DTYPES or x.dim() < 1:
        return False
    if weight is not None:
        if weight.dim() != 1 or weight.shape[0] != x.shape[-1] or weight.dtype not in ACT_DTYPES:
            return False
        if weight.device != x.device:
            return False
    return True


# ---- mhc.py
def hc_post_supports(o, residual, post, comb) -> bool:
    if residual.dim() != 3 or o.dim() != 2 or post.dim() != 2 or comb.dim() != 3:
        return False
    T, n, H = residual.shape
    if o.shape != (T, H) or post.shape != (T, n) or comb.shape != (T, n, n):
        return False
    if residual.dtype not in ACT_DTYPES or o.dtype not in ACT_DTYPES:
        return False
    if post.dtype != torch.float32 or comb.dtype != torch.float32:
        return False
    return 1 <= n <= 16 or T == 0


def hc_pre_supports(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0) -> bool:
    if x.dim() != 3 or x.dtype not in ACT_DTYPES:
        return False
    T, n, H = x.shape
    if not (1 <= n <= 8) or H == 0:
        return False
    M = (2 + n) * n
    if fn.shape != (M, n * H) or fn.dtype != torch.float32:
        return False
    if scale.shape != (3,) or scale.dtype != torch.float32:
        return False
    if base.shape != (M,) or base.dtype != torch.float32:
        return False
    return int(iters) >= 1


def hc_head_supports(x, fn, scale, base, rms_eps, hc_eps) -> bool:
    if x.dim() != 3 or x.dtype not in ACT_DTYPES:
        return False
    T, n, H = x.shape
    if not (1 <= n <= 16) or H == 0:
        return False
    if fn.shape != (n, n * H) or fn.dtype != torch.float32:
        return False
    if scale.numel() != 1 or scale.dtype != torch.float32:
        return False
    return base.shape == (n,) and base.dtype == torch.float32


# ---- rope.py
def _rope_ok(x, positions, inv_freq) -> bool:
    if x.dtype not in ACT_DTYPES or x.dim() < 2:
        return False
    d = x.shape[-1]
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        return False
    dr = 2 * inv_freq.shape[0]
    if dr > d or (d - dr) % 2 != 0 or d > 16384:
        return False
    if positions.dim() != 1 or positions.shape[0] != x.shape[0]:
        return False
    return positions.dtype in (torch.int64, torch.int32)


def rope_supports(x, positions, inv_freq, inverse=False) -> bool:
    return _rope_ok(x, positions, inv_freq)


def q_norm_rope_supports(q, positions, inv_freq, eps) -> bool:
    return q.dim() == 3 and _rope_ok(q, positions, inv_freq)


def kv_norm_rope_supports(kv, weight, positions, inv_freq, eps, nope_quant_block=None) -> bool:
    if kv.dim() != 2 or not _rope_ok(kv, positions, inv_freq):
        return False
    if nope_quant_block is not None:      # the official FP8 row: groups of the padded row tile
        nope = kv.shape[-1] - 2 * inv_freq.shape[0]
        if nope_quant_block not in (32, 64, 128) or nope % nope_quant_block:
            return False
        if triton_np2(kv.shape[-1]) < nope_quant_block:
            return False
    return (weight is not None and weight.dim() == 1 and weight.shape[0] == kv.shape[-1]
            and weight.dtype in ACT_DTYPES)


# ---- attention.py
def _paged_rows(t, paged):
    """A paged pool (HAL 1.4) as the kernels read it: [B, J, W] of contiguous values -> (2-D shape
    stand-in [B * J, W], ok); a flat pool: ([R, W], ok)."""
    if not paged:
        return t.shape, t.dim() == 2
    if t.dim() != 3:
        return t.shape, False
    ok = t.stride(2) == 1 and t.shape[1] >= 1
    return (t.shape[0] * t.shape[1],) + tuple(t.shape[2:]), ok


def sparse_mqa_attention_supports(q, kv, indices, sink, scale, kv_format=None, kv_paged=False) -> bool:
    if kv_format not in (None, "fp8") or not isinstance(kv_paged, bool):
        return False
    kv_shape, ok = _paged_rows(kv, kv_paged)
    if q.dim() != 3 or not ok or indices.dim() != 2 or sink.dim() != 1:
        return False
    T, NH, D = q.shape
    if q.dtype not in ACT_DTYPES or kv.dtype != (q.dtype if kv_format is None else torch.uint8):
        return False
    if D not in (64, 128, 256, 512):
        return False
    if kv_format is None and kv_shape[1] != D:
        return False
    if kv_format == "fp8" and (D <= ROPE_DIM or kv_shape[1] != row_bytes("fp8", D)):
        return False
    if indices.shape[0] != T or indices.dtype not in (torch.int32, torch.int64):
        return False
    return sink.shape[0] == NH and sink.dtype == torch.float32


# ---- compress.py
def compress_pool_supports(kv, score, ape, overlap, prev_kv=None, prev_score=None) -> bool:
    if kv.dim() != 3 or kv.dtype not in ACT_DTYPES or score.shape != kv.shape:
        return False
    if score.dtype not in ACT_DTYPES:
        return False
    Wn, m, CW = kv.shape
    if m < 1 or m > 1024 or ape.shape != (m, CW) or ape.dtype != torch.float32:
        return False
    cc = 2 if overlap else 1
    if CW % cc:
        return False
    DP = CW // cc
    if overlap and (prev_kv is None) != (prev_score is None):
        return False
    if overlap and prev_kv is not None:
        if prev_kv.shape != (m, DP) or prev_score.shape != (m, DP):
            return False
        if prev_kv.dtype not in ACT_DTYPES + (torch.float32,) or prev_score.dtype not in ACT_DTYPES:
            return False
    return True



def compress_windows_supports(kv, score, overlap) -> bool:
    if kv.dim() != 3 or kv.dtype != torch.float32 or score.dtype != torch.float32 or score.shape != kv.shape:
        return False
    E, S, CW = kv.shape
    if not isinstance(overlap, bool) or S > 1024:     # the S slots of a channel block sit in registers
        return False
    return not overlap or (S % 2 == 0 and CW % 2 == 0)


# ---- cache.py
def cache_store_supports(pool, index, rows, row_format=None, paged=False) -> bool:
    if not isinstance(paged, bool):
        return False
    pool_shape, ok = _paged_rows(pool, paged)
    if not ok or index.dim() != 1 or rows.dim() != 2:
        return False
    if row_format is not None:            # the stored formats: a uint8 pool, rows read by stride
        if row_format not in ("fp8", "fp4") or pool.dtype != torch.uint8 or pool.stride(-1) != 1:
            return False
        if rows.dtype not in ACT_DTYPES or index.dtype not in (torch.int32, torch.int64):
            return False
        D = rows.shape[1]
        ok = D > ROPE_DIM and (D - ROPE_DIM) % 64 == 0 if row_format == "fp8" else D % 32 == 0
        return ok and index.shape[0] == rows.shape[0] and pool_shape[1] == row_bytes(row_format, D)
    if pool.dtype not in ACT_DTYPES or rows.dtype not in ACT_DTYPES or index.dtype not in (torch.int32, torch.int64):
        return False
    return rows.shape == (index.shape[0], pool_shape[1])


# ---- indexer.py
def indexer_scores_rows_supports(q, k, weights, rows, scale, k_format=None, k_paged=False) -> bool:
    if k_format not in (None, "fp4") or not isinstance(k_paged, bool):
        return False
    k_shape, ok = _paged_rows(k, k_paged)
    if q.dim() != 3 or not ok or weights.dim() != 2 or rows.dim() != 2:
        return False
    T, nI, dI = q.shape
    if q.dtype not in ACT_DTYPES:
        return False
    if k_format is None and (k.dtype != q.dtype or k_shape[1] != dI):
        return False
    if k_format == "fp4" and (k.dtype != torch.uint8 or dI % 32 or k_shape[1] != row_bytes("fp4", dI)
                              or k.stride(-1) != 1):
        return False
    if weights.shape != (T, nI) or weights.dtype != torch.float32:
        return False
    if rows.shape[0] != T or rows.dtype not in (torch.int32, torch.int64):
        return False
    return nI <= 128          # the [nI, BL] head-by-key tile sits in registers


def indexer_rotate_quant_supports(x) -> bool:
    if x.dtype not in ACT_DTYPES or x.dim() < 1:
        return False
    d = x.shape[-1]
    return 32 <= d <= 1024 and d & (d - 1) == 0      # a [rows, d] tile and [d, 64] of H in registers


# ---- wo_a.py
def wo_a_supports(o, weight, weight_scale=None) -> bool:
    if o.dim() != 3 or weight.dim() != 3 or o.dtype not in ACT_DTYPES:
        return False
    T, G, D = o.shape
    if weight.shape[0] != G or weight.shape[2] != D:
        return False
    R = weight.shape[1]
    if weight_scale is None:
        return weight.dtype == o.dtype
    if not _FP8 or weight.dtype not in _FP8:
        return False
    if weight_scale.shape != (G, cdiv(R, 128), cdiv(D, 128)):
        return False
    return weight_scale.dtype == torch.float32 or (_E8M0 is not None and weight_scale.dtype == _E8M0)


# ---- topk.py
def indexer_topk_supports(scores, k_lengths, topk) -> bool:
    if scores.dim() != 2 or scores.dtype != torch.float32 or not isinstance(topk, int) or topk < 1:
        return False
    if k_lengths.shape != (scores.shape[0],) or k_lengths.dtype not in (torch.int32, torch.int64):
        return False
    return scores.shape[1] < 2 ** 31 and topk < 2 ** 31     # positions and slots are int32


# ---- route.py
def moe_route_supports(logits, topk, scaling, correction_bias=None, hash_ids=None) -> bool:
    if logits.dim() != 2 or logits.dtype != torch.float32 or not isinstance(topk, int):
        return False
    T, E = logits.shape
    if not (1 <= topk <= min(E, 32)) or E > 8192:
        return False
    if correction_bias is not None and (correction_bias.shape != (E,) or correction_bias.dtype != torch.float32):
        return False
    if hash_ids is not None and (hash_ids.shape != (T, topk) or hash_ids.dtype not in (torch.int32, torch.int64)):
        return False
    return True


# ---- moe.py
_FP4_BYTES = (torch.int8, torch.uint8)
_UE8M0 = tuple(d for d in (_E8M0, torch.uint8) if d is not None)


def _expert_shape(w, scale, dev):
    """Logical [E, rows, cols] of a contiguous expert weight in a format the kernels read, or None."""
    if w.dim() != 3 or w.device != dev or not w.is_contiguous():
        return None
    E, R, C = w.shape
    if scale is None:
        return (E, R, C) if w.dtype in ACT_DTYPES else None
    if scale.device != dev or not scale.is_contiguous():
        return None
    if _FP8 and w.dtype in _FP8:
        if tuple(scale.shape) != (E, cdiv(R, 128), cdiv(C, 128)):
            return None
        ok = scale.dtype == torch.float32 or (_E8M0 is not None and scale.dtype == _E8M0)
        return (E, R, C) if ok else None
    if w.dtype in _FP4_BYTES and (2 * C) % 32 == 0 and tuple(scale.shape) == (E, R, 2 * C // 32):
        return (E, R, 2 * C) if scale.dtype in _UE8M0 else None
    return None


def moe_experts_supports(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None,
                         act_block=None) -> bool:
    if x.dim() != 2 or ids.dim() != 2 or weights.dim() != 2 or x.dtype not in ACT_DTYPES:
        return False
    T, H = x.shape
    s13 = _expert_shape(w13, w13_scale, x.device)
    s2 = _expert_shape(w2, w2_scale, x.device)
    if s13 is None or s2 is None:
        return False
    E, I2, H2 = s13
    if H2 != H or I2 % 2 or s2 != (E, H, I2 // 2) or E < 1:
        return False
    if act_block is not None and not (_act_block_ok(x, act_block) and (I2 // 2) % act_block == 0):
        return False
    if ids.shape[0] != T or weights.shape != ids.shape or weights.dtype != torch.float32:
        return False
    return ids.dtype in (torch.int32, torch.int64)


# ---- linear.py
def _act_block_ok(x, act_block) -> bool:
    """The official activation quantisation of quant.py: power-of-two groups dividing K."""
    return (isinstance(act_block, int) and 16 <= act_block <= 1024 and act_block & (act_block - 1) == 0
            and x.shape[-1] % act_block == 0)


def _block_scale_ok(weight, weight_scale, lead: tuple) -> bool:
    """weight_scale None with an act-dtype weight, or an fp8 e4m3 weight with its block grid."""
    if weight_scale is None:
        return weight.dtype in ACT_DTYPES
    if not _FP8 or weight.dtype not in _FP8 or weight_scale.device != weight.device:
        return False
    grid = lead + (cdiv(weight.shape[-2], 128), cdiv(weight.shape[-1], 128))
    if tuple(weight_scale.shape) != grid:
        return False
    return weight_scale.dtype == torch.float32 or (_E8M0 is not None and weight_scale.dtype == _E8M0)


def linear_supports(x, weight, weight_scale=None, out_dtype=None, act_block=None) -> bool:
    if act_block is not None and not _act_block_ok(x, act_block):
        return False
    if x.dim() < 1 or x.dtype not in ACT_DTYPES or weight.dim() != 2 or weight.device != x.device:
        return False
    if weight.shape[1] != x.shape[-1]:
        return False
    if out_dtype is not None and out_dtype not in ACT_DTYPES:
        return False
    return _block_scale_ok(weight, weight_scale, ())


#: op -> its predicate: what :func:`registry.register_ops` guards each kernel with. The kernel
#: function names the same predicate in its ``@implements(op, supports=...)`` (checked when the
#: kernel module imports).
SUPPORTS = {
    "rms_norm": rms_norm_supports,
    "hc_post": hc_post_supports,
    "hc_pre": hc_pre_supports,
    "hc_head": hc_head_supports,
    "rope": rope_supports,
    "q_norm_rope": q_norm_rope_supports,
    "kv_norm_rope": kv_norm_rope_supports,
    "sparse_mqa_attention": sparse_mqa_attention_supports,
    "compress_pool": compress_pool_supports,
    "compress_windows": compress_windows_supports,
    "cache_store": cache_store_supports,
    "indexer_scores_rows": indexer_scores_rows_supports,
    "indexer_rotate_quant": indexer_rotate_quant_supports,
    "indexer_topk": indexer_topk_supports,
    "linear": linear_supports,
    "wo_a": wo_a_supports,
    "moe_route": moe_route_supports,
    "moe_experts": moe_experts_supports,
}
