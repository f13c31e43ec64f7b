"""The ascend backend's op glue: argument order, layouts and limits of each vendor call.

Each op has a limit check (``_<op>_limits`` -> "" or the reason it is declined), and the call.
``supports`` = the tensors are on the backend's device, the vendor function exists, the limits
hold; ``why_not`` says which failed. Vendor functions are looked up at call time (torch_npu from
``sys.modules`` / import; vllm-ascend's from ``torch.ops._C_ascend``), never at plugin import.

Numerics: the glue keeps the HAL's "fp32 math, one rounding" where the vendor op allows it (rope
and the norms run in fp32 and are cast once). Where the vendor op rounds differently by design
(``npu_hc_pre_v2``'s HF32 mixes product, the bf16 hand-off between grouped GEMMs) that is the
vendor's numeric; the conformance suite judges it (docs/conformance.md, emulated results).
"""
from __future__ import annotations

import importlib
import os
import sys
import weakref

import torch

from dsv4core.hal import catalogue

_HALF_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
MAX_EXPERTS = 2048          # npu_moe_gating_top_k / moe_gating_top_k_hash
HC_PRE_HIDDEN = (4096, 7168)
#: npu_hc_pre_v2 multiplies in HF32 with round-toward-zero; under the emulation that is outside
#: the HAL's bf16 hc_pre bound (1.6x on the sharp-logits case, docs/conformance.md), so it serves
#: only when this is set to "1" (e.g. by vendor CI calibrating it on hardware)
HC_PRE_ENV = "DSV4CORE_ASCEND_HF32_HC_PRE"
#: npu_sparse_flash_attention (torch_npu 2.14; op docs): query heads N1, head dim D, rope dim
SFA_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)
SFA_D = 512
SFA_ROPE = 64
#: its DSV4 mapping (zero rope tensors, K = V, sinks) is read from the docs, not run on an NPU:
#: it serves sparse_mqa_attention only when this is set to "1" (vendor CI validating it)
SFA_ENV = "DSV4CORE_ASCEND_SPARSE_FA"
ROTARY_MAX_HEADS = 1000     # npu_rotary_mul interleave: B * N < 1000
ROTARY_MAX_DIM = 896        # ... and D < 896


# ---------------------------------------------------------------------------------------------
# finding the vendor functions
# ---------------------------------------------------------------------------------------------

def _torch_npu():
    mod = sys.modules.get("torch_npu")
    if mod is None:
        mod = importlib.import_module("torch_npu")
    return mod


_lib_loaded = [False]


def _c_ascend(name: str):
    """vllm-ascend's ``torch.ops._C_ascend.<name>`` or None (loads DSV4CORE_ASCEND_OPS_LIB once)."""
    if not _lib_loaded[0]:
        _lib_loaded[0] = True
        path = os.environ.get("DSV4CORE_ASCEND_OPS_LIB")
        if path:
            torch.ops.load_library(path)
    try:
        return getattr(torch.ops._C_ascend, name)
    except (AttributeError, RuntimeError):
        return None


def _npu_fn(name: str):
    try:
        return getattr(_torch_npu(), name, None)
    except Exception:  # noqa: BLE001 - torch_npu not importable: declined with the reason elsewhere
        return None


# ---------------------------------------------------------------------------------------------
# limits (VENDORS.md B.2): "" = the vendor call serves it, else why not
# ---------------------------------------------------------------------------------------------

def _rms_norm_limits(x, weight, eps):
    if x.dtype not in _HALF_FLOATS:
        return f"npu_rms_norm takes fp16/bf16/fp32, got {x.dtype}"
    if weight is not None and weight.dtype not in _HALF_FLOATS:
        return f"weight dtype {weight.dtype}"
    if x.dim() > 8:
        return f"npu_rms_norm takes 1-8 dims, got {x.dim()}"
    return ""


def _rope_limits(x, positions, inv_freq, inverse=False):
    if x.dtype not in _HALF_FLOATS or x.dim() < 2:
        return f"x must be fp16/bf16/fp32 with >= 2 dims (got {x.dtype}, {x.dim()} dims)"
    heads = x[0].numel() // x.shape[-1] if x.shape[0] else 1
    if heads >= ROTARY_MAX_HEADS:
        return f"npu_rotary_mul interleave needs B*N < {ROTARY_MAX_HEADS} (N = {heads} rows per token)"
    if 2 * inv_freq.shape[0] >= ROTARY_MAX_DIM:
        return f"npu_rotary_mul interleave needs D < {ROTARY_MAX_DIM} (d_r = {2 * inv_freq.shape[0]})"
    return ""


def _q_norm_rope_limits(q, positions, inv_freq, eps):
    return _rope_limits(q, positions, inv_freq)


def _kv_norm_rope_limits(kv, weight, positions, inv_freq, eps, nope_quant_block=None):
    if nope_quant_block is not None:
        return "the official FP8 KV row (nope_quant_block) is not wired to the NPU ops here"
    return _rope_limits(kv, positions, inv_freq)


def _hc_pre_limits(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
    if x.dim() != 3 or x.dtype != torch.bfloat16:
        return f"npu_hc_pre_v2 takes bf16 x [T, 4, D] (got {x.dtype}, {tuple(x.shape)})"
    T, n, H = x.shape
    if n != 4:
        return f"npu_hc_pre_v2 needs hc_mult == 4 (n = {n})"
    if H not in HC_PRE_HIDDEN:
        return f"npu_hc_pre_v2 needs D in {HC_PRE_HIDDEN} (H = {H})"
    if T == 0:
        return "T = 0"
    if fn.dtype != torch.float32 or scale.dtype != torch.float32 or base.dtype != torch.float32:
        return "npu_hc_pre_v2 needs float32 hc_fn / hc_scale / hc_base"
    if float(post_mult) != 2.0:
        return f"npu_hc_pre_v2 has post_mult 2.0 built in (got {post_mult})"
    return ""


def _hc_pre_not_opted_in(*args, **kwargs):
    return (f"npu_hc_pre_v2's HF32 round-toward-zero mixes product is outside the hc_pre accuracy "
            f"contract (emulated finding, docs/vendor-ci.md); set {HC_PRE_ENV}=1 to use it")


def _sparse_mqa_attention_limits(q, kv, indices, sink, scale, kv_format=None, kv_paged=False):
    if kv_format is not None:
        return "stored KV row formats (kv_format) are not wired to the NPU ops here"
    if kv_paged:
        return "paged kv pools (kv_paged) are not wired to the NPU ops here"
    if q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
        return f"npu_sparse_flash_attention's output is bf16: served for bf16 q / kv (got {q.dtype}, {kv.dtype})"
    if q.dim() != 3 or kv.dim() != 2 or indices.dim() != 2:
        return "q [T, h, d], kv [N, d], indices [T, K] expected"
    T, h, d = q.shape
    if d != SFA_D:
        return f"npu_sparse_flash_attention's head dim is fixed at {SFA_D} (d = {d})"
    if h not in SFA_HEADS:
        return f"npu_sparse_flash_attention takes 1-128 query heads, a power of two (h = {h})"
    if T == 0 or indices.shape[1] == 0 or kv.shape[0] == 0:
        return "no query, no row or an empty kv"
    if sink.dtype != torch.float32:
        return f"sink must be float32 (got {sink.dtype})"
    return ""


def _sfa_not_opted_in(*args, **kwargs):
    return (f"npu_sparse_flash_attention is built for DSV3.2's MLA-absorb layout (D 512 plus a separate "
            f"64-wide rope); DSV4 maps to it with zero rope tensors, K = V and its sinks, which is not "
            f"validated on hardware yet (docs/vendor-ci.md); set {SFA_ENV}=1 to use it")


def _hc_post_limits(o, residual, post, comb):
    if residual.dim() != 3 or residual.dtype != torch.bfloat16 or o.dtype != torch.bfloat16:
        return f"npu_hc_post takes bf16 (residual {residual.dtype}, o {o.dtype})"
    if residual.shape[1] != 4:
        return f"npu_hc_post needs hc_mult == 4 (n = {residual.shape[1]})"
    if residual.shape[0] == 0:
        return "T = 0"
    if post.dtype != torch.float32 or comb.dtype != torch.float32:
        return "npu_hc_post needs float32 post / comb"
    return ""


def _wo_a_limits(o, weight, weight_scale=None):
    if weight_scale is not None:
        return "fp8 weights (npu_transpose_quant_batchmatmul with mx scales is A5-only; not wired)"
    if o.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return f"npu_transpose_batchmatmul path is bf16 (o {o.dtype}, weight {weight.dtype})"
    return ""


def _moe_route_limits(logits, topk, scaling, correction_bias=None, hash_ids=None):
    if logits.dtype != torch.float32 or logits.dim() != 2:
        return "logits must be float32 [T, E]"
    if logits.shape[1] > MAX_EXPERTS:
        return f"moe_gating_top_k_hash takes <= {MAX_EXPERTS} experts (E = {logits.shape[1]})"
    if logits.shape[0] == 0:
        return "T = 0"
    return ""


def _moe_experts_limits(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None, act_block=None):
    if act_block is not None:
        return "the official W8A8 expert math (act_block) is not wired to npu_grouped_matmul here"
    if w13_scale is not None or w2_scale is not None:
        return "quantised experts (FP8 / FP4 + scales) are not wired to npu_grouped_matmul here"
    if x.dtype != torch.bfloat16 or w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
        return f"npu_grouped_matmul path is bf16 (x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype})"
    if x.shape[0] == 0 or ids.numel() == 0:
        return "no tokens"
    return ""


# ---------------------------------------------------------------------------------------------
# the calls
# ---------------------------------------------------------------------------------------------

def rms_norm(x, weight, eps):
    """npu_rms_norm needs gamma.dtype == x.dtype: with a weight of another dtype (bf16 x, fp32
    weight) both go in as fp32 and the result is cast once, as the HAL specifies."""
    x2 = x if x.dim() >= 2 else x.unsqueeze(0)
    if weight is not None and weight.dtype != x.dtype:
        return _rms_f32(x2.to(torch.float32), weight, eps).to(x.dtype).reshape(x.shape)
    gamma = weight if weight is not None else torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    return _torch_npu().npu_rms_norm(x2, gamma, float(eps))[0].reshape(x.shape)


def _interleaved_tables(positions, inv_freq, inverse, device):
    """cos/sin [T, d_r] repeated per pair ([c0, c0, c1, c1, ...]) in fp32: the angle is
    fl32(p) * inv_freq_i, as the HAL says; inverse rope negates sin."""
    ang = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    cos, sin = ang.cos(), ang.sin()
    if inverse:
        sin = -sin
    return cos.repeat_interleave(2, -1).to(device), sin.repeat_interleave(2, -1).to(device)


def _rotate_tail(xf, positions, inv_freq, inverse):
    """Rotate the trailing d_r channels of fp32 ``xf`` [T, ..., d] with npu_rotary_mul."""
    T, d = xf.shape[0], xf.shape[-1]
    dr = 2 * inv_freq.shape[0]
    tail = xf[..., d - dr:].reshape(1, T, -1, dr).contiguous()          # BSND: B 1, S T, N heads
    cos, sin = _interleaved_tables(positions, inv_freq, inverse, xf.device)
    rot = _torch_npu().npu_rotary_mul(tail, cos.view(1, T, 1, dr), sin.view(1, T, 1, dr),
                                      rotary_mode="interleave")
    return torch.cat((xf[..., :d - dr], rot.reshape(*xf.shape[:-1], dr)), -1)


def _rms_f32(xf, weight, eps):
    gamma = (weight.to(torch.float32) if weight is not None
             else torch.ones(xf.shape[-1], dtype=torch.float32, device=xf.device))
    return _torch_npu().npu_rms_norm(xf, gamma, float(eps))[0]


def rope(x, positions, inv_freq, inverse=False):
    if x.shape[0] == 0:
        return x.clone()
    return _rotate_tail(x.to(torch.float32), positions, inv_freq, inverse).to(x.dtype)


def q_norm_rope(q, positions, inv_freq, eps):
    if q.shape[0] == 0:
        return q.clone()
    return _rotate_tail(_rms_f32(q.to(torch.float32), None, eps), positions, inv_freq, False).to(q.dtype)


def kv_norm_rope(kv, weight, positions, inv_freq, eps, nope_quant_block=None):
    if kv.shape[0] == 0:
        return kv.clone()
    return _rotate_tail(_rms_f32(kv.to(torch.float32), weight, eps), positions, inv_freq, False).to(kv.dtype)


def sparse_mqa_attention(q, kv, indices, sink, scale, kv_format=None, kv_paged=False):
    """npu_sparse_flash_attention in BSND layout (B 1, S = T queries / N kv rows, KV_N 1):

    * K = V: the kv rows go in as key and value (value=None needs a newer CANN);
    * the op's MLA rope part (query_rope . key_rope, D_rope 64) is zeros, so the logits are
      ``scale * q . kv`` as the HAL specifies (attention_mode 2 requires the rope tensors);
    * indices: the op wants each row's valid entries first and -1 at the tail; the HAL allows -1
      anywhere, so each row is stably partitioned (order within a softmax does not matter);
    * sparse_mode 0 (no causal mask: the row lists are the mask), sparse_block_size 1 (a row each);
    * sink: the op's ``sinks`` (one raw logit per head in the softmax denominator) [read, unverified];
    * a query with no valid row gets the HAL's 0 (what the op returns there is not documented)."""
    npu = _torch_npu()
    T, h, d = q.shape
    N = kv.shape[0]
    idx = indices.to(torch.int32)
    idx = idx.gather(1, torch.argsort((idx < 0).to(torch.int32), dim=1, stable=True)).contiguous()
    key = kv.contiguous().view(1, N, 1, d)
    out = npu.npu_sparse_flash_attention(
        q.contiguous().view(1, T, h, d), key, key, idx.view(1, T, 1, idx.shape[1]), float(scale),
        query_rope=torch.zeros((1, T, h, SFA_ROPE), dtype=q.dtype, device=q.device),
        key_rope=torch.zeros((1, N, 1, SFA_ROPE), dtype=q.dtype, device=q.device),
        sparse_block_size=1, layout_query="BSND", layout_kv="BSND", sparse_mode=0, attention_mode=2,
        sinks=sink.contiguous())[0]
    return out.reshape(T, h, d).masked_fill((idx[:, 0] < 0)[:, None, None], 0)


def hc_pre(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
    y, post, comb = _c_ascend("npu_hc_pre_v2")(x.contiguous(), fn.contiguous(), scale.contiguous(),
                                                base.contiguous(), 4, int(iters), float(rms_eps), float(hc_eps))
    return y, post, comb


def hc_post(o, residual, post, comb):
    # vllm-ascend calls it with a leading batch dim: [1, T, ...]
    out = _c_ascend("npu_hc_post")(o.contiguous()[None], residual.contiguous()[None],
                                   post.contiguous()[None], comb.contiguous()[None])
    return out[0]


class _Transposed:
    """Weights in the vendor's layout, made once per weight tensor (and again only if it changes
    in place): wo_a [G, R, D] -> [G, D, R]; w13 [E, 2I, H] -> [E, H, 2I]; w2 [E, H, I] -> [E, I, H]."""

    def __init__(self):
        self._cache: dict[int, tuple] = {}    # id(weight) -> (weakref, version, transposed)

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        hit = self._cache.get(id(w))
        if hit is not None and hit[0]() is w and hit[1] == w._version:
            return hit[2]
        t = w.transpose(1, 2).contiguous()
        if hit is None or hit[0]() is not w:
            weakref.finalize(w, self._cache.pop, id(w), None)
        self._cache[id(w)] = (weakref.ref(w), w._version, t)
        return t


_transposed = _Transposed()


def wo_a(o, weight, weight_scale=None):
    if o.shape[0] == 0:
        return torch.empty((0, o.shape[1], weight.shape[1]), dtype=o.dtype, device=o.device)
    return _torch_npu().npu_transpose_batchmatmul(o.contiguous(), _transposed(weight), perm_x1=(1, 0, 2),
                                                  perm_x2=(0, 1, 2), perm_y=(1, 0, 2))


def moe_route(logits, topk, scaling, correction_bias=None, hash_ids=None):
    T, E = logits.shape
    if hash_ids is not None:
        # the vendor's hash routing reads tid2eid[input_ids[t]]: our per-token ids ARE that table
        input_ids = torch.arange(T, dtype=torch.int64, device=logits.device)
        tid2eid = hash_ids.to(torch.int32).contiguous()
    else:
        input_ids = tid2eid = None
    # norm_type 2 = sqrt(softplus); renorm 0 (the op rejects others): renormalised here, with the
    # HAL's 1e-20, and the scaling applied after it (routed_scaling_factor 1 inside the op)
    y, ids, _ = _c_ascend("moe_gating_top_k_hash")(
        logits.contiguous(), int(topk), correction_bias, input_ids, tid2eid, 1, 1, 1.0, 1e-20, 0, 0, 2, False)
    y = y.to(torch.float32)
    return y / (y.sum(-1, keepdim=True) + 1e-20) * float(scaling), ids.to(torch.int32)


def moe_experts(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None, act_block=None):
    """Token-expert pairs sorted by expert (torch), two grouped GEMMs around npu_clipped_swiglu,
    then the weighted combine in fp32 (torch).

    Layouts: npu_grouped_matmul takes the stacked weight as [E, K, N] (in, out), the transpose of
    the HAL's [E, 2I, H] / [E, H, I] (made once per weight, as vllm-ascend does after loading)
    [unverified on hardware]. DSV4's clamped SwiGLU is npu_clipped_swiglu with alpha 1, bias 0,
    interleaved False (gate = first half). The vendor's npu_moe_init_routing_v2 /
    npu_moe_finalize_routing would replace the torch permutation and combine; their schemas are
    not wired here."""
    npu = _torch_npu()
    T, H = x.shape
    E = w13.shape[0]
    k = ids.shape[1]
    flat = ids.reshape(-1).to(torch.int64)
    pair = torch.nonzero(flat >= 0).squeeze(1)
    out = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    if pair.numel() == 0:
        return out.to(x.dtype)
    order = torch.argsort(flat[pair], stable=True)
    pair = pair[order]
    tok = pair // k
    counts = torch.bincount(flat[pair], minlength=E)
    group_list = torch.cumsum(counts, 0).to(torch.int64)         # group_list_type 0: cumulative ends
    xs = x[tok].contiguous()
    (gu,) = npu.npu_grouped_matmul([xs], [_transposed(w13)], group_list=group_list, split_item=2,
                                   group_type=0, group_list_type=0)
    h = npu.npu_clipped_swiglu(gu, dim=-1, alpha=1.0, limit=float(swiglu_limit), bias=0.0, interleaved=False)
    (down,) = npu.npu_grouped_matmul([h], [_transposed(w2)], group_list=group_list, split_item=2,
                                     group_type=0, group_list_type=0)
    wts = weights.reshape(-1)[pair].to(torch.float32)
    out.index_add_(0, tok, down.to(torch.float32) * wts[:, None])
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------------------------

#: op -> (glue, limits, vendor functions it needs: ("npu", name) or ("_C_ascend", name))
TABLE = {
    "rms_norm": (rms_norm, _rms_norm_limits, (("npu", "npu_rms_norm"),)),
    "rope": (rope, _rope_limits, (("npu", "npu_rotary_mul"),)),
    "q_norm_rope": (q_norm_rope, _q_norm_rope_limits, (("npu", "npu_rms_norm"), ("npu", "npu_rotary_mul"))),
    "kv_norm_rope": (kv_norm_rope, _kv_norm_rope_limits, (("npu", "npu_rms_norm"), ("npu", "npu_rotary_mul"))),
    "hc_pre": (hc_pre, _hc_pre_limits, (("_C_ascend", "npu_hc_pre_v2"),)),
    "hc_post": (hc_post, _hc_post_limits, (("_C_ascend", "npu_hc_post"),)),
    "sparse_mqa_attention": (sparse_mqa_attention, _sparse_mqa_attention_limits,
                             (("npu", "npu_sparse_flash_attention"),)),
    "wo_a": (wo_a, _wo_a_limits, (("npu", "npu_transpose_batchmatmul"),)),
    "moe_route": (moe_route, _moe_route_limits, (("_C_ascend", "moe_gating_top_k_hash"),)),
    "moe_experts": (moe_experts, _moe_experts_limits,
                    (("npu", "npu_grouped_matmul"), ("npu", "npu_clipped_swiglu"))),
}


def _missing(needs) -> str:
    for ns, name in needs:
        found = _npu_fn(name) if ns == "npu" else _c_ascend(name)
        if found is None:
            where = "torch_npu" if ns == "npu" else "torch.ops._C_ascend (vllm-ascend custom ops; see DSV4CORE_ASCEND_OPS_LIB)"
            return f"{where} has no {name}"
    return ""


def _why(op, device_type, limits, needs, args, kwargs) -> str:
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.device.type != device_type:
            return f"a tensor is on {v.device.type!r}, not {device_type!r}"
    try:
        why = limits(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a malformed call declines
        return f"inputs not understood ({type(e).__name__}: {e})"
    return why or _missing(needs)


#: ops served only when opted in (op -> environment variable, why it is declined otherwise)
OPT_IN = {"hc_pre": (HC_PRE_ENV, _hc_pre_not_opted_in),
          "sparse_mqa_attention": (SFA_ENV, _sfa_not_opted_in)}


def register(backend, device_type: str, opt_in: dict[str, bool] | None = None) -> None:
    """Add the TABLE's ops. ``opt_in``: op -> serve it (the OPT_IN ops; default per op: its
    environment variable == "1", read here, once)."""
    opt_in = opt_in or {}
    specs = catalogue()
    for op, (glue, limits, needs) in TABLE.items():
        sig = specs[op].signature
        if op in OPT_IN:
            env, declined = OPT_IN[op]
            on = opt_in.get(op)
            if not (os.environ.get(env) == "1" if on is None else on):
                limits = declined

        def why_not(*args, _op=op, _l=limits, _n=needs, **kwargs):
            return _why(_op, device_type, _l, _n, args, kwargs)

        def supports(*args, _w=why_not, **kwargs):
            return not _w(*args, **kwargs)

        for f in (why_not, supports):
            f.__signature__ = sig
        backend.add(op, glue, supports=supports, why_not=why_not)


__all__ = ["TABLE", "register"]
