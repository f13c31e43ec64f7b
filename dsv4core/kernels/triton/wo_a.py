"""wo_a: grouped projection out[t,g,r] = sum_d o[t,g,d] w[g,r,d]; bf16/fp32 weights, or fp8 e4m3
weights with 128x128 block dequant multipliers (fp32 or e8m0). fp32 accumulation.

Served by the grouped split-K GEMM of ``linear`` (one kernel for both ops; see linear.py)."""
from __future__ import annotations

from .linear import grouped_gemm


def wo_a(o, weight, weight_scale=None):
    return grouped_gemm(o, weight, weight_scale, o.dtype)
