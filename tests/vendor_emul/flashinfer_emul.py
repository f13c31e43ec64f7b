"""Emulated FlashInfer mHC module (the raw tvm-ffi functions of flashinfer-python 0.7.2.post1's
``data/csrc/mhc/mhc_post.cu`` / ``mhc_pre_big_fuse.cu``), plain torch.

Written from those sources' documented semantics: argument order, in-place outputs, the checks
that raise (CHECK_INPUT_AND_TYPE: contiguous, dtype; hc 4; ``H % 8`` for the pre kernel; shapes),
the 16-byte alignment the vector loads need, and the math in fp32 in the kernels' order:
``rstd = rsqrt(sum(x^2) / K + rms_eps)`` over the raw bf16 streams; sigmoid gates with
``pre_eps`` added and ``post_mult`` multiplied; softmax rows + eps, a column normalisation, then
``repeat - 1`` (row, column) pairs, each ``/ (sum + eps)``; ``comb[old, new]`` with the OLD index
summed in ``mhc_post``. Nothing here is read from dsv4core's reference.
"""
from __future__ import annotations

import torch


class EmulatedError(RuntimeError):
    pass


def _need(cond, msg):
    if not cond:
        raise EmulatedError(f"[emulated flashinfer mhc] {msg}")


def _input(t, dtype, name):
    _need(t.dtype == dtype, f"Inconsistency of Tensor type: {name}")
    _need(t.is_contiguous(), f"{name} must be contiguous")


def _aligned(t, name):
    _need(t.data_ptr() % 16 == 0, f"{name}: ld.global.v4 needs a 16-byte aligned address")


def mhc_post(out, x, residual, post_layer_mix, comb_res_mix):
    for t, dt, name in ((out, torch.bfloat16, "out"), (x, torch.bfloat16, "x"), (residual, torch.bfloat16, "residual"),
                        (post_layer_mix, torch.float32, "post_layer_mix"), (comb_res_mix, torch.float32, "comb_res_mix")):
        _input(t, dt, name)
    _need(x.dim() == 2 and residual.dim() == 3 and post_layer_mix.dim() == 2 and comb_res_mix.dim() == 3
          and out.dim() == 3, "wrong ranks")
    T, hc, H = residual.shape
    _need(hc == 4, "residual.shape[1] / HC must be 4")
    _need(tuple(x.shape) == (T, H) and tuple(post_layer_mix.shape) == (T, 4) and tuple(comb_res_mix.shape) == (T, 4, 4)
          and tuple(out.shape) == (T, 4, H), "shapes")
    if T == 0:
        return
    if H % 8 == 0:
        for t, name in ((x, "x"), (residual, "residual"), (out, "out")):
            _aligned(t, name)
    xf, r = x.float(), residual.float()
    for new in range(4):
        acc = xf * post_layer_mix[:, new:new + 1]
        for old in range(4):
            acc = acc + r[:, old] * comb_res_mix[:, old, new:new + 1]
        out[:, new] = acc.to(torch.bfloat16)


def mhc_pre_big_fuse_with_prenorm(post_mix, comb_mix, layer_input, dot_mix, residual, mhc_scale, mhc_base,
                                  rms_eps, mhc_pre_eps, mhc_sinkhorn_eps, mhc_post_mult_value, sinkhorn_repeat,
                                  block_size):
    for t, dt, name in ((post_mix, torch.float32, "post_mix"), (comb_mix, torch.float32, "comb_mix"),
                        (layer_input, torch.bfloat16, "layer_input"), (dot_mix, torch.float32, "dot_mix"),
                        (residual, torch.bfloat16, "residual"), (mhc_scale, torch.float32, "mhc_scale"),
                        (mhc_base, torch.float32, "mhc_base")):
        _input(t, dt, name)
    for v, name in ((rms_eps, "rms_eps"), (mhc_pre_eps, "mhc_pre_eps"), (mhc_sinkhorn_eps, "mhc_sinkhorn_eps"),
                    (mhc_post_mult_value, "mhc_post_mult_value")):
        _need(isinstance(v, float), f"{name} is a double argument, got {type(v).__name__}")
    _need(isinstance(sinkhorn_repeat, int) and isinstance(block_size, int), "int64 arguments")
    T, hc, H = residual.shape
    _need(hc == 4, "residual.shape[1] / HC must be 4")
    _need(H > 0 and H % 8 == 0, "hidden size must be divisible by 8")
    _need(tuple(mhc_scale.shape) == (3,) and tuple(mhc_base.shape) == (24,), "mhc_scale [3], mhc_base [24]")
    _need(tuple(dot_mix.shape) == (T, 24), "dot_mix.shape must be [T, 24]")
    _need(tuple(post_mix.shape) == (T, 4) and tuple(comb_mix.shape) == (T, 4, 4) and tuple(layer_input.shape) == (T, H),
          "output shapes")
    _need(sinkhorn_repeat >= 1, "sinkhorn_repeat must be >= 1")
    if T == 0:
        return
    _aligned(residual, "residual")
    _aligned(layer_input, "layer_input")
    r = residual.float()
    rstd = torch.rsqrt(r.square().sum((1, 2)) / float(4 * H) + rms_eps)[:, None]
    s0, s1, s2 = mhc_scale[0], mhc_scale[1], mhc_scale[2]
    pre = 1.0 / (1.0 + torch.exp(-(dot_mix[:, 0:4] * rstd * s0 + mhc_base[0:4]))) + mhc_pre_eps
    post_mix.copy_(1.0 / (1.0 + torch.exp(-(dot_mix[:, 4:8] * rstd * s1 + mhc_base[4:8]))) * mhc_post_mult_value)
    cm = (dot_mix[:, 8:] * rstd * s2 + mhc_base[8:]).view(T, 4, 4)        # [t, row j, col k]
    cm = torch.exp(cm - cm.amax(-1, keepdim=True))
    cm = cm / cm.sum(-1, keepdim=True) + mhc_sinkhorn_eps
    cm = cm / (cm.sum(1, keepdim=True) + mhc_sinkhorn_eps)                # column sums (over rows j)
    for _ in range(1, sinkhorn_repeat):
        cm = cm / (cm.sum(-1, keepdim=True) + mhc_sinkhorn_eps)
        cm = cm / (cm.sum(1, keepdim=True) + mhc_sinkhorn_eps)
    comb_mix.copy_(cm)
    acc = torch.zeros((T, H), dtype=torch.float32)
    for j in range(4):
        acc = acc + pre[:, j:j + 1] * r[:, j]
    layer_input.copy_(acc.to(torch.bfloat16))


class Module:
    """What ``flashinfer.mhc.get_mhc_module()`` / ``tvm_ffi.load_module`` return: attribute access."""
    mhc_post = staticmethod(mhc_post)
    mhc_pre_big_fuse_with_prenorm = staticmethod(mhc_pre_big_fuse_with_prenorm)
