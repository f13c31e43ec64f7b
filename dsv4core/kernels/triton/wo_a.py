"""wo_a: grouped projection out[t,g,r] = sum_d o[t,g,d] w[g,r,d]; bf16/fp32 weights, or fp8 e4m3
weights with 128x128 block dequant multipliers (fp32 or e8m0). fp32 accumulation.

Served by linear's grouped split-K GEMM (linear.py: one kernel, its inner-product modes and its
split rule) with wo_a's own launch defaults (:func:`wo_a_tiles`) and TUNE (same keys)."""
from __future__ import annotations

from .launch import Tune
from .linear import grouped_gemm
from . import predicates
from .registry import implements

#: launch parameters: tuning overrides over the bound backend's launch table (launch.py); keys as
#: linear's (launch.GEMM_KEYS)
TUNE = Tune(__name__)


def wo_a_tiles(T: int, scaled: bool, big: bool = False) -> tuple:
    """(mode, BM, BN, BK, num_warps, num_stages[, NBLK]) for T tokens. bf16: the tiles of wo_a's former own
    kernel (H200: 25.3 / 29.3 µs at T = 1 / 64, benchmarks/results/h200/2026-11-29_da152d4/bench/cuda-ops-flash-write-flush.json):
    32-row tiles, 8 groups x 32 = 256 programs, no split on a 132-SM GPU. FP8: the same tiles, "dot"
    (H200, benchmarks/results/h200/2026-12-01_8397775/tune/all-ops-flash.json: 21.0 / 20.6 / 32.6 µs at T = 1 / 8 / 64; "swap" 27.5 /
    27.6 / 52.9)."""
    if T <= 16:
        # FP8: one scale block a K step (NBLK 1, linear's default: the smallest K step, fewest live
        # registers); two a step were faster on an H200 at T <= 16, set by the CUDA plugin's table
        return ("dot", 16, 32, 128, 4, 4) if scaled else ("dot", 16, 32, 256, 4, 4)
    if T <= 64:
        return "dot", 64, 32, 128, 4, 4
    return "dot", 128, 128, 128 if scaled else 64, 8, 3


@implements("wo_a", supports=predicates.wo_a_supports)
def wo_a(o, weight, weight_scale=None):
    return grouped_gemm(o, weight, weight_scale, o.dtype, tune=TUNE, tiles=wo_a_tiles, op="wo_a")
