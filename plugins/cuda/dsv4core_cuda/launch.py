"""The CUDA launch table of the portable Triton kernels, per compute capability (the type and the
precedence of its values: dsv4core.kernels.triton.launch.LaunchTable).

The kernels' built-in defaults were measured on an H200 (sm90, benchmarks/tune_triton.py), so
the sm90 table keeps them, except for choices that are not portable (a deviation or a speed that
is Hopper's, not the kernel's). Other capabilities use the same values until someone tunes them
on that GPU (add an entry here; a key absent from an entry keeps the default).
"""
from __future__ import annotations

from dsv4core.kernels.triton.launch import LaunchTable


def _capability(cc: tuple[int, int]) -> str:
    return f"sm{cc[0]}{cc[1]}"


TABLES = LaunchTable("cuda", {
    "sm90": {
        # packed FP4 experts through tl.dot_scaled: 33-39 % faster than the kernel's default "join"
        # at T = 1 / 64 (H200, benchmarks/results/h200/2026-12-01_2494243/tune/moe_experts-variants-flash.json). Deviation (Hopper
        # has no microscaled MMA; Triton upcasts and multiplies the scale as a bf16): a group whose
        # scale byte is 0 reads as 0 instead of 2^-127 x its codes, |error| <= 6 * 2^-126 a weight
        # FP8 e4m3 weights reach the MMA's bf16 operand through fp32 ("via_f32"): the same bf16
        # values (bit for bit the same output), one conversion per code pair fewer on sm90, where the
        # direct conversion bounds the FP8 loops (benchmarks/results/sm90-aot/2026-12-01_7374812/aot/sass-fp8-decode-loops.md). H200, read flush
        # (benchmarks/results/h200/2026-12-01_c29f187/tune/fp8-via-f32-flash.json): linear T = 1 / 8 / 64 / 4096 17.6 / 17.9 / 25.1 / 1012
        # -> 14.0 / 14.2 / 20.5 / 859 us; wo_a T = 1 / 8 19.3 / 19.2 -> 16.2 / 16.2; FP8 experts
        # T = 1 / 64 104 / 767 -> 73.4 / 658
        "moe": {"fp4": "scaled", "fp8": "via_f32"},
        "linear": {"fp8": "via_f32"},
        "wo_a": {"fp8": "via_f32"},
    },
}, fallback="sm90", select=_capability)


def current() -> dict:
    """The entries for device 0's compute capability (read at the first kernel call, never at import)."""
    import torch

    return TABLES.resolve(torch.cuda.get_device_capability(0))
