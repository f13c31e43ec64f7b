"""Emulated aiter functions (aiter HEAD e4048607 semantics per VENDORS.md A.2), plain torch.

Limits raise as the real ones do: the HIP mhc kernels are compiled for hc_mult == 4
(``static_assert``) and split the hidden size into 256-wide tiles (vLLM asserts
``hidden_size % 256 == 0``); they read raw, contiguous bf16 / f32 buffers.
"""
from __future__ import annotations

import torch


def _need(cond, msg):
    if not cond:
        raise RuntimeError(f"[emulated aiter] {msg}")


def _check_streams(residual, fn_rows=None, fn=None):
    _need(residual.dim() == 3 and residual.dtype == torch.bfloat16, "residual must be bf16 [m, n, H]")
    _need(residual.is_contiguous(), "residual must be contiguous")
    m, n, H = residual.shape
    _need(n == 4, f"static_assert(hc_mult == 4) failed (hc_mult = {n})")
    _need(H % 256 == 0, f"hc_hidden_size {H} is not a multiple of the 256-wide tile")
    return m, n, H


def _sinkhorn(logits, eps, repeat):
    c = torch.softmax(logits, -1) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(repeat - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    return c


def mhc_pre(residual, fn, hc_scale, hc_base, rms_eps=1e-6, hc_pre_eps=1e-6, hc_sinkhorn_eps=1e-6,
            hc_post_mult_value=1.0, sinkhorn_repeat=20, norm_weight=None, norm_eps=1e-6,
            large_m_splitk=False, is_fn_pack_bf16=0):
    """-> (post_mix [m, n, 1] f32, comb_mix [m, n, n] f32, layer_input [m, H] bf16)."""
    m, n, H = _check_streams(residual)
    mix = 2 * n + n * n
    _need(fn.dtype == torch.float32 and tuple(fn.shape) == (mix, n * H), f"fn must be f32 [{mix}, {n * H}]")
    _need(hc_scale.dtype == torch.float32 and hc_scale.numel() == 3, "hc_scale must be f32 [3]")
    _need(hc_base.dtype == torch.float32 and hc_base.numel() == mix, f"hc_base must be f32 [{mix}]")
    _need(sinkhorn_repeat >= 1, "this emulation covers the hc_pre variant (sinkhorn_repeat >= 1)")
    _need(norm_weight is None, "norm_weight fusion is not emulated")
    x = residual.to(torch.float32).reshape(m, n * H)
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + rms_eps)
    z = (x @ fn.T) * r
    s, b = hc_scale, hc_base
    pre = torch.sigmoid(s[0] * z[:, :n] + b[:n]) + hc_pre_eps
    post = hc_post_mult_value * torch.sigmoid(s[1] * z[:, n:2 * n] + b[n:2 * n])
    comb = _sinkhorn((s[2] * z[:, 2 * n:] + b[2 * n:]).reshape(m, n, n), hc_sinkhorn_eps, sinkhorn_repeat)
    y = (pre[:, :, None] * residual.to(torch.float32)).sum(1).to(torch.bfloat16)
    return post.unsqueeze(-1), comb, y


def mhc_post(out, x, residual, post_layer_mix, comb_res_mix, store_nt=-1):
    """In place: ``out[:, j] = post_j * x + sum_i comb[:, i, j] * residual[:, i]``; returns None."""
    m, n, H = _check_streams(residual)
    _need(out.shape == residual.shape and out.dtype == torch.bfloat16 and out.is_contiguous(),
          "out must be a contiguous bf16 tensor shaped like residual")
    _need(x.dtype == torch.bfloat16 and tuple(x.shape) == (m, H) and x.is_contiguous(), "x must be bf16 [m, H]")
    _need(post_layer_mix.dtype == torch.float32 and tuple(post_layer_mix.shape) == (m, n, 1),
          f"post_layer_mix must be f32 [{m}, {n}, 1]")
    _need(comb_res_mix.dtype == torch.float32 and tuple(comb_res_mix.shape) == (m, n, n),
          f"comb_res_mix must be f32 [{m}, {n}, {n}]")
    r = residual.to(torch.float32)
    res = post_layer_mix * x.to(torch.float32)[:, None, :] + torch.einsum("mij,mih->mjh", comb_res_mix, r)
    out.copy_(res.to(torch.bfloat16))


def batched_gemm_bf16(XQ, WQ, bias=None, dtype=torch.bfloat16, splitK=None, YQ=None, config=None,
                      kernel_type="bandwidth_bound", backend=None):
    """Y[i] = X[i] @ W[i]^T: XQ [B, M, K], WQ [B, N, K] -> [B, M, N], fp32 accumulation."""
    _need(XQ.dim() == 3 and WQ.dim() == 3, "XQ and WQ must be 3-D")
    _need(XQ.dtype in (torch.bfloat16, torch.float16) and WQ.dtype == XQ.dtype, "bf16/fp16 inputs of one dtype")
    _need(XQ.shape[0] == WQ.shape[0] and XQ.shape[2] == WQ.shape[2],
          f"shape mismatch: XQ {tuple(XQ.shape)} vs WQ {tuple(WQ.shape)} (expects WQ [B, N, K])")
    y = torch.bmm(XQ.to(torch.float32), WQ.to(torch.float32).transpose(1, 2))
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(dtype)
