"""ROCm launch tables for the portable Triton kernels, per arch (see dsv4core.kernels.triton.launch).

Why the H200 defaults are not reused: on CDNA a wavefront is 64 lanes, LDS is 64 KiB per
workgroup on gfx942 (MI300) and 160 KiB on gfx950 (MI355), and ``num_stages`` multiplies LDS use
in AMD's stream pipeliner. Compiled ahead of time for gfx942 (Triton 3.9, CPU), the H200-tuned
attention config (the CUDA sm90 entry), 16 heads x 64 rows x 2 stages, needs 69,632 B of LDS (gfx942
has 65,536) and spills 436-449 VGPRs (benchmarks/results/rocm-aot/2026-12-01_6426706/aot/gfx942-attention-portable-defaults-flash.json);
with the tables below every kernel fits and spills nothing (benchmarks/results/rocm-aot/).

How the entries were chosen: the largest tiles that compile for the arch with LDS within the
limit and zero VGPR/SGPR spills at the DSV4-Flash shapes (``python -m dsv4core.kernels.triton.aot
--target hip:<arch> --backend dsv4core_rocm:aot_backend --device-branch``; tests/test_rocm_aot.py keeps
that true). Compile-checked only: nothing here was timed on AMD hardware, so the AMD-only
keywords are the conservative ones (``waves_per_eu`` 0 = compiler's choice is NOT set, MFMA
16x16 where the kernel's tile is 16 rows). Vendor CI tunes these with timings.

"other" (e.g. gfx90a, gfx1100 RDNA with 32-lane waves): small tiles and one stage, which fit any
64 KiB LDS; no AMD-only keywords (their meaning differs per generation).
"""
from __future__ import annotations

import torch

from dsv4core.kernels.triton.launch import LaunchTable, activation, is_f32

# Entries that depend on the call take (*args, **kwargs) and look only at the activation
# (launch.activation), so they survive changes of the ops' other arguments.


def _attention(bf16_rows: int, bf16_stages: int):
    """sparse_mqa_attention: 16 heads x ``bf16_rows`` kv rows per step for bf16, 16 x 16 with one
    stage for fp32 (whose kv tiles are twice the bytes). MFMA 16x16: the tile has 16 head rows.
    pipe 0 (the kernel's default, stated; not tuned here): the hand-pipelined gather, which the CUDA
    table sets on sm90 at T <= 64, spills 2-7 SGPRs on gfx950 (tests/test_rocm_aot.py)."""
    def entry(*args, **kwargs):
        if is_f32(args, kwargs):
            return {"BH": 16, "BK": 16, "num_stages": 1, "pipe": 0, "launch": {"matrix_instr_nonkdim": 16}}
        return {"BH": 16, "BK": bf16_rows, "num_stages": bf16_stages, "pipe": 0, "launch": {"matrix_instr_nonkdim": 16}}
    return entry


def _moe(bf16_bn: int, stages: int):
    def tiles(P, E, H, I, programs, fp8, plain, scaled, big):
        """moe's tensor-core tiles (TUNE ``tiles``): the rows and warps these arches ran as the
        kernel's former defaults, 16 rows x 4 warps while an expert holds <= 4 pairs, 64 x 4 to 64
        pairs, 128 x 8 above (compile-checked, not timed); the rest as the entry's keys."""
        BM, nw = (16, 4) if P <= 4 * E else ((64, 4) if P <= 64 * E else (128, 8))
        return BM, bf16_bn, bf16_bn, 32, nw, stages

    def entry(*args, **kwargs):
        f32 = is_f32(args, kwargs)
        bn = 32 if f32 else bf16_bn          # the up (gate|up) and down GEMM tiles alike
        # Su / Sd 1 (the kernel's default, stated; not tuned here): split K at decode batches
        # (moe._split_rule) is the CUDA table's sm90 choice, measured on an H200 only
        return {"BNu": bn, "BNd": bn, "BK": 32, "num_stages": 1 if f32 else stages, "Su": 1, "Sd": 1,
                "tiles": tiles}
    return entry


def _fp8(args, kwargs) -> bool:
    """Any one-byte tensor among the arguments: FP8 weights."""
    return any(isinstance(v, torch.Tensor) and v.dtype.itemsize == 1 for v in (*args, *kwargs.values()))


def _gemm_tiles(M: int, scaled: bool, big: bool = False) -> tuple:
    """linear's tiles (TUNE ``tiles``; linear.linear_tiles' arguments): the tiles these arches ran
    as the kernel's former defaults (compile-checked, not timed): 16 x 64 x 128, 4 warps, 3 stages
    to 16 rows; 64 x 64 x 128 (block-scaled: 64 x 128 x 64) to 64; 128 x 128 x 64, 8 warps above.
    ``big`` (>= 200 KiB of shared memory a block) is never true on a ROCm device (MI300X 64 KiB,
    MI355X 160 KiB): the CUDA table's FP8 prefill "swap" tile is not taken."""
    if M <= 16:
        return "dot", 16, 64, 128, 4, 3
    if M <= 64:
        return ("dot", 64, 128, 64, 4, 3) if scaled else ("dot", 64, 64, 128, 4, 3)
    return "dot", 128, 128, 64, 8, 3


def _linear(fp8_tiles: dict, fp8_rows: dict | None = None):
    """linear: :func:`_gemm_tiles`, with FP8 weights ``fp8_tiles`` over them, and above 64 rows
    also ``fp8_rows``. The 16 x 64 x 128 x
    3-stage FP8 tile spills SGPRs in its masked-K specialisation (EVEN_K false: 63 on
    gfx942, 148 on gfx950; device-branch compile, benchmarks/results/rocm-aot/2026-12-01_a6ae32f/aot/device-branch-flash.json).
    EVEN_K follows the split-K factor, i.e. the device's CU count, not only K % 128, so the entry
    covers every FP8 call. Above 64 rows the 128 x 128 x 64 tile holds its FP8 weight tile
    converted to bf16, 32 KiB a stage: 3 stages need 96 KiB of LDS, over gfx942's 64."""
    def entry(*args, **kwargs):
        x = activation(args, kwargs)
        fp8 = x is not None and x.dtype != torch.float32 and _fp8(args, kwargs)
        rows = fp8_rows if fp8 and fp8_rows and x.numel() > 64 * x.shape[-1] else {}
        return {"tiles": _gemm_tiles, **(fp8_tiles if fp8 else {}), **rows}
    return entry


def _wo_a(*args, **kwargs):
    o = activation(args, kwargs)
    if o is None or o.dtype == torch.float32:
        return {}
    fp8 = _fp8(args, kwargs)
    # NBLK 1 (the kernel's default, stated; not tuned here): two FP8 scale blocks a step at T <= 16
    # are the CUDA table's sm90 choice, measured on an H200 only. Every tile key is set here (mode:
    # the kernel's "dot"), so the kernel's tile function's values are all overridden
    return {"BM": 16 if o.shape[0] <= 16 else 64, "BN": 32, "BK": 128 if fp8 else 64, "num_warps": 4,
            "num_stages": 2, "NBLK": 1}


def _indexer(f32_stages: int):
    """indexer_scores_rows: the kernel's tiles (bf16: 64 keys x 128 channels, fp32: 32 x 64, heads
    padded to >= 16), with ``f32_stages`` pipeline stages for fp32 (gfx950: 2 stages spill 24 SGPRs
    on a strided q)."""
    def entry(*args, **kwargs):
        return {"num_stages": f32_stages if is_f32(args, kwargs) else 2}
    return entry


# cache (cache_store) and compress (compress_pool, compress_windows) have no entry: no tl.dot and no
# pipelined loop; the kernels' own tiles use <= 8 KiB of LDS and spill nothing on gfx942 / gfx950
# (benchmarks/results/rocm-aot/*/aot/<arch>-pool-ops-flash.json, with the indexer entries below).
TABLES = LaunchTable("rocm", {
    "gfx942": {
        "attention": _attention(16, 2),     # 32 KiB LDS; BK 32 spills SGPRs
        "mhc": {"num_stages": 1, "BK": 64},  # hc_pre's mixes: BK 128 (3 bf16 dots) spills 5-13 SGPRs
        "linear": _linear({"BK": 64}, {"num_stages": 2}),   # 2 x 32 KiB of LDS above 64 rows
        "moe": _moe(64, 1),
        "wo_a": _wo_a,
        "indexer": _indexer(2),             # bf16 32 KiB LDS, fp32 24 KiB
    },
    "gfx950": {
        "attention": _attention(32, 1),     # 64 KiB; BK 32 x 2 stages spills SGPRs, BK 64 x 2 needs 132 KiB and spills 400 VGPRs
        "mhc": {"num_stages": 2},
        "linear": _linear({"BK": 32, "num_stages": 2}),   # FP8 BK 64 still spills 87-91 SGPRs
        "moe": _moe(64, 2),
        "wo_a": _wo_a,
        "indexer": _indexer(1),             # bf16 65 KiB LDS; fp32 16 KiB
    },
    "other": {
        "attention": lambda *args, **kwargs: {"BH": 16, "BK": 16, "num_stages": 1, "pipe": 0},
        "mhc": {"num_stages": 1},
        "linear": {"tiles": _gemm_tiles},
        "moe": _moe(32, 1),
        "wo_a": _wo_a,
        "indexer": lambda *args, **kwargs: {"num_stages": 1},
    },
}, fallback="other")
