"""The CUDA launch table of the portable Triton kernels, per compute capability.

What the CUDA plugin launches, per kernel module and key (precedence:
dsv4core.kernels.triton.launch.LaunchTable): a tuning override set on the module's ``TUNE``
first, then the entry below for the device's capability, then the kernel's own default.

* ``sm90`` (H100 / H200) holds the choices measured on an H200 that are not portable: each entry
  names the committed result it came from. Capabilities without an entry (sm80, sm100, ...) take
  the sm90 entries until someone times them on that GPU (add a target here).
* Every key not set here is the kernel's own default. Those are the portable choices the kernel
  modules state, except where a module still says its default was measured on an H200 (the tile
  tables of linear, wo_a, moe, mhc and attention's block sizes): those apply to every plugin that
  leaves them unset (rocm and xpu set their own where they differ).

A callable entry takes the op's arguments (its HAL signature) and returns the keys for that call.
"""
from __future__ import annotations

import torch

from dsv4core.kernels.triton.launch import LaunchTable


def _capability(cc: tuple[int, int]) -> str:
    return f"sm{cc[0]}{cc[1]}"


def _attention_sm90(q, *args, **kwargs) -> dict:
    """sparse_mqa_attention: the hand-pipelined row gather (``pipe`` 1) at T <= 64, the kernel's
    plain loop from T = 128. H200 (benchmarks/results/h200/2026-12-01_2494243/tune/mhc-attention-variants-flash.json):
    14.0 / 16.2 / 17.4 / 20.8 / 60.5 µs at T = 1 / 2 / 4 / 8 / 64 against 14.9 / 18.2 / 20.6 / 24.4
    / 61.8 without it; 206 against 199 at T = 256. Bitwise the same result."""
    return {"pipe": 1 if q.shape[0] <= 64 else 0}


def _wo_a_sm90(o, weight, weight_scale=None) -> dict:
    """wo_a: FP8 e4m3 through fp32 (``fp8`` "via_f32", as linear below), and with block-scaled FP8
    weights at T <= 16 two scale blocks a K step (``NBLK`` 2; H200,
    benchmarks/results/h200/2026-12-01_2494243/tune/linear-wo_a-variants-flash.json: 18.8 µs at T = 1
    against 20.8 with one; at T = 64 one block is faster, 32.1 against 46.7). fp32 operands take
    the kernel's fp32 tiles (no NBLK)."""
    nblk = (weight_scale is not None and o.shape[0] <= 16 and o.dtype != torch.float32
            and weight.dtype != torch.float32)
    return {"fp8": "via_f32", "NBLK": 2} if nblk else {"fp8": "via_f32"}


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
        # split K at decode batches (moe._split_rule, "h200"): FP4 "scaled" gate / up weights at
        # <= 96 pairs Su 2 (105 / 164 / 273 / 387 / 420 µs at T = 1 / 2 / 4 / 8 / 16 against
        # 116-117 / 217-220 / 290-293 / 392-398 / 438-443 unsplit,
        # benchmarks/results/h200/2026-12-02_62140f5/tune/moe_experts-split-k-rule-flash.json); the
        # shared expert Su 2 / Sd 4 (36.0 / 48.5 / 49.8 -> 30.4 / 40.5 / 42.1 µs at T = 1 / 8 / 64,
        # benchmarks/results/h200/2026-12-02_62140f5/tune/moe_experts-split-k-flash.json)
        "moe": {"fp4": "scaled", "fp8": "via_f32", "split": "h200"},
        "linear": {"fp8": "via_f32"},
        "wo_a": _wo_a_sm90,
        "attention": _attention_sm90,
    },
}, fallback="sm90", select=_capability)


def current() -> dict:
    """The entries for device 0's compute capability (read at the first kernel call, never at import)."""
    return TABLES.resolve(torch.cuda.get_device_capability(0))
