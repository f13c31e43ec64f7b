"""wo_a: grouped projection out[t,g,r] = sum_d o[t,g,d] w[g,r,d]; bf16/fp32 weights, or fp8 e4m3
weights with 128x128 block dequant multipliers (fp32 or e8m0). fp32 accumulation.

Served by linear's grouped split-K GEMM (linear.py: one kernel, its inner-product modes and its
split rule) with linear's portable tiles (:func:`linear.linear_tiles`: the same GEMM and shared-memory bound;
the group axis adds programs, so no tile is sized for it) and its own TUNE (same keys)."""
from __future__ import annotations

from .launch import Tune
from .linear import grouped_gemm, linear_tiles
from . import predicates
from .registry import implements

#: launch parameters: tuning overrides over the bound backend's launch table (launch.py); keys as
#: linear's (launch.GEMM_KEYS)
TUNE = Tune(__name__)


@implements("wo_a", supports=predicates.wo_a_supports)
def wo_a(o, weight, weight_scale=None):
    return grouped_gemm(o, weight, weight_scale, o.dtype, tune=TUNE, tiles=linear_tiles, op="wo_a")
