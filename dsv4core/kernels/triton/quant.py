"""The official activation quantisation as a Triton pass (``hal.quant.fake_quant(x, "fp8", block)``):
per row, per ``block`` consecutive columns, the power-of-two scale s and e4m3 codes q of
``hal.quant`` (bit operations: ``_util.e4m3_rne``, ``group_scale_exp``). Two outputs, one rule:

* :func:`fake_quant_fp8`: ``q * s`` written in x's dtype (the values are exact in bf16 and fp32).
  Used by linear and moe_experts with ``act_block``: the GEMMs that follow multiply these values
  (the dequantised FP8 activations) with fp32 accumulation, which is the W8A8 product up to the
  order of the fp32 sums.
* :func:`quant_fp8`: the codes as float8_e4m3fn (their bytes built from the float32 bits:
  ``_util.e4m3_bits``, no conversion instruction) and the scales as float32, for a GEMM that runs
  the FP8 x FP8 product on the codes (linear's TUNE ``w8a8`` "fp8").

Not an op module: no TUNE of its own."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import cdiv, e4m3_bits, e4m3_rne, exp2_int, group_scale_exp


@triton.jit
def _fake_quant_fp8_kernel(x_ptr, y_ptr, s_ptr, M, K, sx_m, sx_k, BR: tl.constexpr, BC: tl.constexpr,
                           QB: tl.constexpr, CODES: tl.constexpr = False):
    # CODES: y holds the e4m3 bytes (uint8) and s_ptr [M, K / QB] the float32 scales; else y = q * s
    rows = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    cols = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
    m = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * sx_m + cols[None, :] * sx_k, mask=m, other=0.0).to(tl.float32)
    g = tl.reshape(x, (BR, BC // QB, QB))
    e = group_scale_exp(tl.max(tl.abs(g), axis=2), 1e-4, 1.0 / 448.0)
    q = e4m3_rne(tl.minimum(tl.maximum(g * exp2_int(-e)[:, :, None], -448.0), 448.0))
    if CODES:
        tl.store(y_ptr + rows[:, None] * K + cols[None, :], tl.reshape(e4m3_bits(q), (BR, BC)), mask=m)
        gc = tl.program_id(1).to(tl.int64) * (BC // QB) + tl.arange(0, BC // QB)
        tl.store(s_ptr + rows[:, None] * (K // QB) + gc[None, :], exp2_int(e),
                 mask=(rows < M)[:, None] & (gc < K // QB)[None, :])
    else:
        y = tl.reshape(q * exp2_int(e)[:, :, None], (BR, BC))
        tl.store(y_ptr + rows[:, None] * K + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=m)


def _launch(x, y, s, block, codes):
    M, K = x.shape
    BC = block * (1 << (max(1, min(4, K // block)).bit_length() - 1))   # up to 4 groups a program (masked tail)
    BR = max(1, min(16, 4096 // BC))
    _fake_quant_fp8_kernel[(cdiv(M, BR), cdiv(K, BC))](x, y, s, M, K, x.stride(0), x.stride(1), BR=BR, BC=BC,
                                                      QB=block, CODES=codes, num_warps=4)


def fake_quant_fp8(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, K] (any strides; K a multiple of ``block``, a power of two) -> contiguous [M, K] in
    x's dtype holding the fake-quantised values."""
    M, K = x.shape
    y = torch.empty((M, K), dtype=x.dtype, device=x.device)
    if M and K:
        _launch(x, y, None, block, False)   # no scales: compiles as before they existed
    return y


def quant_fp8(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (any strides; K a multiple of ``block``, a power of two) -> (codes [M, K]
    float8_e4m3fn, scales [M, K / block] float32, powers of two), both contiguous:
    ``codes * scales`` (each scale over its ``block`` columns) is :func:`fake_quant_fp8`'s result."""
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((M, K // block), dtype=torch.float32, device=x.device)
    if M and K:
        _launch(x, q.view(torch.uint8), s, block, True)
    return q, s
