"""Emulated torch_npu functions and vllm-ascend custom ops (VENDORS.md B.2 schemas), plain torch.

Schemas, limits and numerics as documented by torch_npu 2.14's op docs / meta functions and
vllm-ascend's csrc/torch_binding.cpp and its golden tests. Limits raise as the real op would
(RuntimeError naming the argument). Numerics: fp32 inside, one rounding to the output dtype,
except ``npu_hc_pre_v2``, whose mixes product runs in HF32 with round-toward-zero ("HcPre performs
this matmul in HF32 round-toward-zero mode": both operands truncated to 10 mantissa bits).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

TORCH_NPU = ("npu_rms_norm", "npu_rotary_mul", "npu_transpose_batchmatmul", "npu_grouped_matmul",
             "npu_clipped_swiglu", "npu_sparse_flash_attention")
C_ASCEND = ("npu_hc_pre_v2", "npu_hc_post", "moe_gating_top_k_hash")


def _need(cond, msg):
    if not cond:
        raise RuntimeError(f"[emulated torch_npu] {msg}")


def npu_rms_norm(input, gamma, epsilon=1e-06):
    """-> (y, rstd); gamma.dtype must equal input.dtype; 2-8 dims."""
    _need(input.dtype in (torch.float16, torch.bfloat16, torch.float32), f"input dtype {input.dtype}")
    _need(gamma.dtype == input.dtype, f"gamma dtype {gamma.dtype} != input dtype {input.dtype}")
    _need(2 <= input.dim() <= 8, f"input must have 2-8 dims, got {input.dim()}")
    _need(gamma.shape[-1] == input.shape[-1], "gamma must match the last dim")
    x = input.to(torch.float32)
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon)
    return (x * rstd * gamma.to(torch.float32)).to(input.dtype), rstd


def _rotate(x, mode):
    if mode == "interleave":
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((-b, a), -1).flatten(-2)
    if mode == "half":
        a, b = x.chunk(2, -1)
        return torch.cat((-b, a), -1)
    raise RuntimeError(f"[emulated torch_npu] rotary_mode {mode!r} not emulated")


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    """``input * r1 + rotate(input) * r2``; interleave: 4-D, B*N < 1000, D < 896, r1/r2 layout
    11SD / 1S1D / S11D, same dtype as input."""
    _need(input.dim() == 4, f"input must be 4-D, got {input.dim()}")
    B, S, N, D = input.shape
    _need(r1.shape == r2.shape and r1.dim() == 4, "r1 / r2 must be 4-D and alike")
    _need(r1.dtype == input.dtype and r2.dtype == input.dtype, "r1 / r2 dtype must equal input dtype")
    if rotary_mode == "interleave":
        _need(B * N < 1000, f"interleave needs B*N < 1000 (B*N = {B * N})")
        _need(D < 896, f"interleave needs D < 896 (D = {D})")
    _need(tuple(r1.shape) in ((1, 1, S, D), (1, S, 1, D), (S, 1, 1, D)) or tuple(r1.shape) == (1, 1, N, D),
          f"r1 layout {tuple(r1.shape)} is not 11SD / 1S1D / S11D")
    try:
        r1_, r2_ = torch.broadcast_to(r1, input.shape), torch.broadcast_to(r2, input.shape)
    except RuntimeError as e:
        raise RuntimeError(f"[emulated torch_npu] r1 {tuple(r1.shape)} does not broadcast to input {tuple(input.shape)}") from e
    x = input.to(torch.float32)
    y = x * r1_.to(torch.float32) + _rotate(x, rotary_mode) * r2_.to(torch.float32)
    return y.to(input.dtype)


def npu_transpose_batchmatmul(input, weight, *, bias=None, scale=None, perm_x1=None, perm_x2=None, perm_y=None,
                              batch_split_factor=1):
    """``permute(permute(input, perm_x1) @ permute(weight, perm_x2), perm_y)``, fp32 accumulation."""
    _need(input.dim() == 3 and weight.dim() == 3, "input and weight must be 3-D")
    _need(input.dtype in (torch.float16, torch.bfloat16) and weight.dtype == input.dtype, "fp16/bf16 of one dtype")
    _need(scale is None and bias is None, "bias / scale are not emulated")
    x = input.permute(*(perm_x1 or (0, 1, 2)))
    w = weight.permute(*(perm_x2 or (0, 1, 2)))
    _need(x.shape[0] == w.shape[0] and x.shape[2] == w.shape[1],
          f"batch matmul shapes {tuple(x.shape)} x {tuple(w.shape)} do not chain")
    y = torch.bmm(x.to(torch.float32), w.to(torch.float32)).to(input.dtype)
    return y.permute(*(perm_y or (0, 1, 2))).contiguous()


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, group_list=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, output_dtype=None):
    """Grouped GEMM, the "one x, one stacked weight, split M" form (split_item 2/3, group_type 0):
    x[0] [M, K]; weight[0] [E, K, N]; group_list int64 [E], cumulative row ends (type 0) or
    counts (type 1). -> [out [M, N]] in x's dtype, fp32 accumulation."""
    _need(isinstance(x, (list, tuple)) and isinstance(weight, (list, tuple)), "x and weight are tensor lists")
    _need(len(x) == 1 and len(weight) == 1, "only the single-tensor split-M form is emulated")
    _need(split_item in (2, 3) and group_type == 0, f"split_item {split_item} / group_type {group_type} not emulated")
    a, w = x[0], weight[0]
    _need(a.dim() == 2 and w.dim() == 3 and a.shape[1] == w.shape[1],
          f"x [M, K] and weight [E, K, N] expected, got {tuple(a.shape)} and {tuple(w.shape)}")
    _need(a.dtype in (torch.float16, torch.bfloat16) and w.dtype == a.dtype, "fp16/bf16 of one dtype")
    _need(group_list is not None and group_list.dtype == torch.int64 and group_list.numel() == w.shape[0],
          "group_list must be int64 [E]")
    ends = group_list if group_list_type == 0 else torch.cumsum(group_list, 0)
    _need(bool((ends[1:] >= ends[:-1]).all()) and int(ends[-1]) == a.shape[0], "group_list must end at M")
    out = torch.empty((a.shape[0], w.shape[2]), dtype=a.dtype)
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = (a[start:end].to(torch.float32) @ w[e].to(torch.float32)).to(a.dtype)
        start = end
    return [out]


def npu_clipped_swiglu(x, *, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True):
    """``A' * sigmoid(alpha * A') * (clamp(B, -L, L) + bias)`` with ``A' = min(A, L)``; A/B the two
    halves of ``dim`` (or even/odd channels if interleaved)."""
    _need(dim in (-1, x.dim() - 1), "only the last dim is emulated")
    xf = x.to(torch.float32)
    a, b = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, -1)
    a = a.clamp(max=limit)
    return (a * torch.sigmoid(alpha * a) * (b.clamp(-limit, limit) + bias)).to(x.dtype)


def npu_sparse_flash_attention(query, key, value, sparse_indices, scale_value, *, block_table=None,
                               actual_seq_lengths_query=None, actual_seq_lengths_kv=None, query_rope=None,
                               key_rope=None, sparse_block_size=1, layout_query="BSND", layout_kv="BSND",
                               sparse_mode=3, pre_tokens=2 ** 63 - 1, next_tokens=2 ** 63 - 1, attention_mode=0,
                               return_softmax_lse=False, sinks=None):
    """-> (out [B, S1, N1, D] bf16, softmax_max, softmax_sum (empty unless return_softmax_lse)).

    ``out = softmax(scale * (q . k + q_rope . k_rope)) . v`` over each query's selected rows
    ``sparse_indices[b, s1, 0, :]`` (-1 = none; valid entries must come first), plus ``sinks[h]``
    as a raw logit in the denominator. Limits (op docs): bf16 / fp16 contiguous inputs, N1 in
    1..128 (powers of two), N2 1, D 512, D_rope 64, attention_mode 2 only (rope tensors required),
    int32 indices. Emulated: layout BSND, sparse_block_size 1, no paging, sparse_mode 0 (all rows)
    or 3 (right-down causal). A query whose first entry is -1 has no row: the docs do not say what
    the op returns there, so the emulation returns NaN (the glue must not depend on it)."""
    _need(layout_query == "BSND" and layout_kv == "BSND", "only the BSND layouts are emulated")
    _need(block_table is None and actual_seq_lengths_query is None and actual_seq_lengths_kv is None,
          "paged / ragged inputs are not emulated")
    _need(sparse_block_size == 1 and sparse_mode in (0, 3), "sparse_block_size 1, sparse_mode 0 / 3 emulated")
    _need(attention_mode == 2, f"attention_mode must be 2 (MLA-absorb), got {attention_mode}")
    _need(query_rope is not None and key_rope is not None, "attention_mode 2 needs query_rope and key_rope")
    ts = (query, key, value, query_rope, key_rope)
    _need(all(t.dtype in (torch.bfloat16, torch.float16) and t.dtype == query.dtype for t in ts),
          "query / key / value / rope must be bf16 or fp16, one dtype")
    _need(all(t.is_contiguous() for t in (*ts, sparse_indices)), "inputs must be contiguous")
    _need(query.dim() == 4 and key.dim() == 4 and value.shape == key.shape, "BSND query / key / value expected")
    B, S1, N1, D = query.shape
    _, S2, N2, _ = key.shape
    _need(N1 in (1, 2, 4, 8, 16, 32, 64, 128), f"query heads must be 1/2/4/.../128 (N1 = {N1})")
    _need(N2 == 1 and D == 512 and key.shape[3] == 512, f"KV_N must be 1 and D 512 (N2 = {N2}, D = {D})")
    _need(tuple(query_rope.shape) == (B, S1, N1, 64) and tuple(key_rope.shape) == (B, S2, 1, 64),
          "query_rope [B, S1, N1, 64] / key_rope [B, S2, 1, 64] expected")
    _need(sparse_indices.dtype == torch.int32 and sparse_indices.dim() == 4
          and tuple(sparse_indices.shape[:3]) == (B, S1, 1), "sparse_indices must be int32 [B, S1, 1, K]")
    idx = sparse_indices[:, :, 0].long()                                      # [B, S1, K]
    valid = idx >= 0
    _need(not bool((valid[..., 1:] & ~valid[..., :-1]).any()), "valid indices must come first in each row")
    _need(bool((idx < S2).all()), "an index is beyond the kv length")
    if sinks is not None:
        _need(sinks.dtype == torch.float32 and tuple(sinks.shape) == (N1,), f"sinks must be f32 [{N1}]")
    b = torch.arange(B)[:, None, None]
    k = key[:, :, 0].float()[b, idx.clamp_min(0)]                              # [B, S1, K, D]
    v = value[:, :, 0].float()[b, idx.clamp_min(0)]
    kr = key_rope[:, :, 0].float()[b, idx.clamp_min(0)]
    logits = (torch.einsum("bshd,bskd->bshk", query.float(), k)
              + torch.einsum("bshd,bskd->bshk", query_rope.float(), kr)) * scale_value
    mask = valid
    if sparse_mode == 3:          # right-down causal: key position <= S2 - S1 + query position
        mask = mask & (idx <= (S2 - S1 + torch.arange(S1))[None, :, None])
    logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
    m = logits.amax(-1)
    if sinks is not None:
        m = torch.maximum(m, sinks[None, None, :])
    p = torch.exp(logits - m[..., None])
    denom = p.sum(-1) + (torch.exp(sinks[None, None, :] - m) if sinks is not None else 0)
    out = torch.einsum("bshk,bskd->bshd", p, v) / denom[..., None]
    out = out.masked_fill(~valid[..., :1, None], float("nan"))                # no row: undocumented
    empty = torch.empty(0, dtype=torch.float32)
    return out.to(torch.bfloat16), empty, empty


# ---- vllm-ascend custom ops (torch.ops._C_ascend)

def _hf32_rtz(t):
    """Truncate fp32 to HF32 (10 explicit mantissa bits), rounding toward zero."""
    return (t.contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


def npu_hc_pre_v2(x, hc_fn, hc_scale, hc_base, hc_mult, hc_sinkhorn_iters, norm_eps, hc_eps):
    """-> (y [T, D] bf16, post [T, 4] f32, comb [T, 4, 4] f32); x bf16 [T, 4, D] or [B, S, 4, D]."""
    _need(x.dtype == torch.bfloat16 and x.dim() in (3, 4), "x must be bf16 [T, 4, D] or [B, S, 4, D]")
    _need(hc_mult == 4 and x.shape[-2] == 4, f"hc_mult must be 4 (got {hc_mult}, x {tuple(x.shape)})")
    D = x.shape[-1]
    _need(D in (4096, 7168), f"D must be 4096 or 7168 (got {D})")
    mix = 2 * 4 + 4 * 4
    _need(hc_fn.dtype == torch.float32 and tuple(hc_fn.shape) == (mix, 4 * D), f"hc_fn must be f32 [24, {4 * D}]")
    _need(hc_scale.dtype == torch.float32 and hc_scale.numel() == 3, "hc_scale must be f32 [3]")
    _need(hc_base.dtype == torch.float32 and hc_base.numel() == mix, "hc_base must be f32 [24]")
    lead = x.shape[:-2]
    xs = x.reshape(-1, 4, D)
    xf = xs.to(torch.float32).reshape(xs.shape[0], 4 * D)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm_eps)
    z = (_hf32_rtz(xf) @ _hf32_rtz(hc_fn).T) * rstd
    s, b = hc_scale, hc_base
    pre = torch.sigmoid(s[0] * z[:, :4] + b[:4]) + hc_eps
    post = 2.0 * torch.sigmoid(s[1] * z[:, 4:8] + b[4:8])
    c = torch.softmax((s[2] * z[:, 8:] + b[8:]).reshape(-1, 4, 4), -1) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(hc_sinkhorn_iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    y = (pre[:, :, None] * xs.to(torch.float32)).sum(1).to(torch.bfloat16)
    return y.reshape(*lead, D), post.reshape(*lead, 4), c.reshape(*lead, 4, 4)


def npu_hc_post(x, residual, post, comb):
    """x [B, S, D], residual [B, S, 4, D] bf16; post [B, S, 4], comb [B, S, 4, 4] f32 ->
    ``out[..., k, :] = post_k * x + sum_j comb[..., j, k] * residual[..., j, :]`` bf16."""
    _need(residual.dim() == 4 and x.dim() == 3, "x [B, S, D] and residual [B, S, 4, D] expected")
    _need(x.dtype == torch.bfloat16 and residual.dtype == torch.bfloat16, "x / residual must be bf16")
    _need(residual.shape[2] == 4, f"hc_mult must be 4 (residual {tuple(residual.shape)})")
    _need(post.dtype == torch.float32 and comb.dtype == torch.float32, "post / comb must be f32")
    _need(tuple(post.shape) == tuple(residual.shape[:3]) and tuple(comb.shape) == (*residual.shape[:3], 4),
          "post [B, S, 4] / comb [B, S, 4, 4] expected")
    r = residual.to(torch.float32)
    out = post[..., None] * x.to(torch.float32)[:, :, None, :] + torch.einsum("bsjk,bsjd->bskd", comb, r)
    return out.to(torch.bfloat16)


def moe_gating_top_k_hash(x, k, bias, input_ids, tid2eid, k_group, group_count, routed_scaling_factor, eps,
                          group_select_mode, renorm, norm_type, out_flag):
    """-> (y [T, k] f32, expert_idx [T, k] int32, norm_out [T, E] f32). norm_type 0 softmax,
    1 sigmoid, 2 sqrt(softplus); selection by norm_out + bias (top-k) or tid2eid[input_ids];
    y = norm_out[expert_idx] * routed_scaling_factor (renorm must be 0)."""
    _need(x.dim() == 2 and x.dtype == torch.float32, "x must be f32 [T, E]")
    T, E = x.shape
    _need(E <= 2048, f"at most 2048 experts (E = {E})")
    _need(renorm == 0, f"renorm must be 0 (got {renorm})")
    _need(k_group == 1 and group_count == 1, "grouped selection is not emulated")
    if norm_type == 0:
        s = torch.softmax(x, -1)
    elif norm_type == 1:
        s = torch.sigmoid(x)
    elif norm_type == 2:
        s = torch.sqrt(F.softplus(x))
    else:
        raise RuntimeError(f"[emulated torch_npu] norm_type {norm_type}")
    if tid2eid is not None:
        _need(input_ids is not None and input_ids.shape == (T,), "input_ids [T] needed with tid2eid")
        _need(tid2eid.dim() == 2 and tid2eid.shape[1] == k, f"tid2eid must be [vocab, {k}]")
        ids = tid2eid[input_ids.long()].long()
    else:
        key = s if bias is None else s + bias.to(torch.float32)
        ids = key.topk(k, dim=-1).indices
    y = s.gather(-1, ids) * routed_scaling_factor
    return y, ids.to(torch.int32), s
