"""The official activation quantisation as a Triton pass (``hal.quant.fake_quant(x, "fp8", block)``):
per row, per ``block`` consecutive columns, ``q * s`` with the power-of-two scale and e4m3 codes of
``hal.quant`` (bit operations: ``_util.e4m3_rne``, ``group_scale_exp``), written in x's dtype (the
values are exact in bf16 and fp32). Used by linear and moe_experts with ``act_block``: the GEMMs
that follow multiply these values (the dequantised FP8 activations) with fp32 accumulation, which
is the W8A8 product up to the order of the fp32 sums. Not an op module: no TUNE of its own."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import cdiv, e4m3_rne, exp2_int, group_scale_exp


@triton.jit
def _fake_quant_fp8_kernel(x_ptr, y_ptr, M, K, sx_m, sx_k, BR: tl.constexpr, BC: tl.constexpr,
                           QB: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
    m = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * sx_m + cols[None, :] * sx_k, mask=m, other=0.0).to(tl.float32)
    g = tl.reshape(x, (BR, BC // QB, QB))
    e = group_scale_exp(tl.max(tl.abs(g), axis=2), 1e-4, 1.0 / 448.0)
    q = e4m3_rne(tl.minimum(tl.maximum(g * exp2_int(-e)[:, :, None], -448.0), 448.0))
    y = tl.reshape(q * exp2_int(e)[:, :, None], (BR, BC))
    tl.store(y_ptr + rows[:, None] * K + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def fake_quant_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, K] (any strides; K a multiple of ``block``, a power of two) -> contiguous [M, K] in
    x's dtype holding the fake-quantised values."""
    M, K = x.shape
    y = torch.empty((M, K), dtype=x.dtype, device=x.device)
    if M == 0 or K == 0:
        return y
    BC = block * (1 << (max(1, min(4, K // block)).bit_length() - 1))   # up to 4 groups a program (masked tail)
    BR = max(1, min(16, 4096 // BC))
    _fake_quant_fp8_kernel[(cdiv(M, BR), cdiv(K, BC))](x, y, M, K, x.stride(0), x.stride(1), BR=BR, BC=BC,
                                                      QB=block, num_warps=4)
    return y
