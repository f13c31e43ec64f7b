"""The CUDA launch table of the portable Triton kernels, per compute capability.

What the CUDA plugin launches, per kernel module and key (precedence:
dsv4core.kernels.triton.launch.LaunchTable): a tuning override set on the module's ``TUNE``
first, then the entry below for the device's capability, then the kernel's own default.

* ``sm90`` (H100 / H200) holds the choices measured on an H200 that are not portable: each entry
  names the committed result it came from. Capabilities without an entry (sm80, sm100, ...) take
  the sm90 entries until someone times them on that GPU (add a target here).
* Every key not set here is the kernel's own default: the portable choices the kernel modules
  state with their design reason. The tile tables of linear, wo_a and moe (TUNE ``tiles``, a
  function of the call's shapes) are the sm90 functions below; the rocm and xpu tables state
  their own. norm's and rope's row blocks cite an H200 sweep without a committed result: kernel
  defaults until one is measured.

A callable entry takes the op's arguments (its HAL signature) and returns the keys for that call.
"""
from __future__ import annotations

import functools

import torch

from dsv4core.kernels.triton.launch import LaunchTable


def _capability(cc: tuple[int, int]) -> str:
    return f"sm{cc[0]}{cc[1]}"


@functools.lru_cache(maxsize=None)
def _shared_bytes(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).shared_memory_per_block_optin)


def shared_bytes(device: torch.device) -> int:
    """Shared memory one block may use on ``device`` (0 for a tensor that is not on a CUDA GPU:
    the kernels' own tiles)."""
    if device.type != "cuda":
        return 0
    return _shared_bytes(torch.cuda.current_device() if device.index is None else device.index)


#: shared memory a block may use from which the prefill tiles measured on the H200 (227 KiB a
#: block) are taken; a capability with less (sm80, sm86, sm120: 99-163 KiB) keeps the kernel's tiles
BIG_TILE_SHARED = 200 * 1024


def _attention_sm90(q, *args, kv_format=None, **kwargs) -> dict:
    """sparse_mqa_attention (H200, DSV4-Flash shapes):

    * T < 128: 16 heads x 64 rows, 2 stages: 15.2 / 18.5 / 21.0 / 25.0 µs at T = 1 / 2 / 4 / 8,
      smaller row blocks slower (benchmarks/results/h200/2026-12-01_8397775/tune/all-ops-flash.json);
      T >= 128: 32 heads x 32 rows (fewer re-gathers of the same kv rows, 1.4x, same sweep).
    * FP8 rows: 32 rows x 1 stage (two pipelined byte tiles of [64, D] need 245 KiB, over 227):
      21.6 / 44.8 / 237 µs at T = 1 / 8 / 64 against BK 64 x 1 26.7 / 59.9 / 410 and BK 32 x 2
      27.9 / 77.4 / 599 (benchmarks/results/h200/2026-12-02_16080fe/bench/kv-formats-flash.json).
    * fp32 q: 16 x 16 rows, 2 stages (66 KiB; not timed: the fp32 path is for checking).
    * ``pipe`` 1, the hand-pipelined row gather, at T <= 64, the kernel's plain loop from T = 128
      (benchmarks/results/h200/2026-12-01_2494243/tune/mhc-attention-variants-flash.json): 14.0 /
      16.2 / 17.4 / 20.8 / 60.5 µs at T = 1 / 2 / 4 / 8 / 64 against 14.9 / 18.2 / 20.6 / 24.4
      / 61.8 without it; 206 against 199 at T = 256. Bitwise the same result."""
    if len(args) > 4:        # (kv, indices, sink, scale, kv_format)
        kv_format = args[4]
    T, fp8 = q.shape[0], kv_format == "fp8"
    big = T >= 128
    return {"BH": 32 if big else 16, "BK": 16 if q.dtype == torch.float32 else (32 if big or fp8 else 64),
            "num_stages": 1 if fp8 else 2, "pipe": 1 if T <= 64 else 0}


def _mhc_sm90(*args, **kwargs) -> dict | None:
    """hc_pre's mixes at prefill (T >= 2048, more than 16 mix columns: its 2n + n^2, not hc_head's
    n), on a device with BIG_TILE_SHARED: 128-token blocks of 64 columns on 8 warps, 4 stages,
    104.8 µs at T = 4096 against 116.3 with the kernel's tiles (H200,
    benchmarks/results/h200/2026-12-01_2494243/tune/mhc-attention-variants-flash.json; from which T
    it pays is not measured: that sweep's T = 256 / 1024 rows). hc_post and other calls: None."""
    x = args[0] if args else kwargs.get("x")
    fn = args[1] if len(args) > 1 else kwargs.get("fn")
    if x is None or fn is None or x.dim() != 3 or fn.dim() != 2:      # hc_post (o, residual, post, comb)
        return None
    if x.shape[0] >= 2048 and fn.shape[0] > 16 and shared_bytes(x.device) >= BIG_TILE_SHARED:
        return {"BT": 128, "BK": 64, "num_warps": 8, "num_stages": 4}
    return None


def _linear_tiles_sm90(M: int, scaled: bool, big: bool = False) -> tuple:
    """linear's tiles (TUNE ``tiles``; linear.linear_tiles' arguments and result), H200, DSV4-Flash
    shapes. bf16: the sweep's tiles (benchmarks/results/h200/2026-12-01_5ccba4d/tune/all-ops-flash-write-flush.json).
    "dot" for FP8 too: the read-flush sweep (benchmarks/results/h200/2026-12-01_8397775/tune/all-ops-flash.json)
    timed "swap" at 17.9 / 18.0 / 29.7 µs at T = 1 / 8 / 64 against dot's 17.8 / 17.8 / 25.0.
    FP8 prefill (M >= 1024, ``big``: the device has the H200's shared memory, _util.BIG_TILE_SHARED):
    "swap", the converted weight tile feeding the MMA from registers, 1004 µs at T = 4096 against
    dot's 1132 (benchmarks/results/h200/2026-12-01_2494243/tune/linear-wo_a-variants-flash.json). With
    "cvt", swap is also 11 % faster at T = 512 (137.6 against 155.5 µs) and even at 1024 / 2048
    (benchmarks/results/h200/2026-12-01_c29f187/tune/fp8-via-f32-flash.json; the threshold stays until
    timed with via_f32, with which swap and dot are even at 4096: 858.7 / 859.4)."""
    if M <= 16:
        return "dot", 16, 64, 128, 4, 3
    if M <= 64:
        return ("dot", 64, 128, 64, 4, 3) if scaled else ("dot", 64, 64, 128, 4, 3)
    if scaled and big and M >= 1024:
        return "swap", 128, 128, 64, 8, 3
    return "dot", 128, 128, 64, 8, 3


def _w8a8_tiles_sm90(M: int, scaled: bool, big: bool = False) -> tuple:
    """linear's tiles for the official W8A8 on FP8 tensor cores (TUNE ``w8a8_tiles``: FP8 x FP8
    MMAs on the activation and weight codes, 128-column K steps, one scale block each), used where
    TUNE ``w8a8`` is "fp8". Not timed: a first choice by the operand bytes (half of bf16's a tile),
    "swap" at T <= 16 so that the FP8 wgmma takes the weight rows as its M side (the "dot" tile
    there compiles to mma.sync with every code converted to f16: SASS counts in
    benchmarks/results/sm90-aot/2026-12-07_488da1e/aot/linear-w8a8-fp8-sass.json)."""
    if M <= 16:
        return "swap", 16, 64, 128, 4, 4
    if M <= 64:
        return "dot", 64, 128, 128, 4, 3
    return "dot", 128, 128, 128, 8, 3


def _wo_a_tiles_sm90(T: int, scaled: bool, big: bool = False) -> tuple:
    """wo_a's tiles (TUNE ``tiles``), H200. bf16: the tiles of wo_a's former own kernel (25.3 / 29.3 µs
    at T = 1 / 64, benchmarks/results/h200/2026-11-29_da152d4/bench/cuda-ops-flash-write-flush.json):
    32-wide N tiles, 8 groups x 32 = 256 programs, no split on a 132-SM GPU. FP8: the same tiles,
    "dot" (benchmarks/results/h200/2026-12-01_8397775/tune/all-ops-flash.json: 21.0 / 20.6 / 32.6 µs at
    T = 1 / 8 / 64; "swap" 27.5 / 27.6 / 52.9). From T = 65 (128 x 128 tiles, 8 warps, 3 stages; bf16
    64-column K steps): not timed in a committed result (those sweeps stop at T = 64; no result file)."""
    if T <= 16:
        return ("dot", 16, 32, 128, 4, 4) if scaled else ("dot", 16, 32, 256, 4, 4)
    if T <= 64:
        return "dot", 64, 32, 128, 4, 4
    return "dot", 128, 128, 128 if scaled else 64, 8, 3


def _moe_tiles_sm90(P: int, E: int, H: int, I: int, programs: int, fp8: bool, plain: bool, scaled: bool,
                    big: bool) -> tuple:
    """moe_experts' tensor-core tiles (TUNE ``tiles``; moe._tiles' arguments and result), H200,
    DSV4-Flash shapes, read flush:

    * by pairs an expert (P <= 4 E / <= 64 E / more): 16 x 64 x 128 (up / down N blocks), 4 warps,
      4 stages; 64 x 64 x 128, 4 warps, 3 stages; 128 x 64 x 128, 8 warps, 3 stages; K steps 64
      (FP8: 128) (benchmarks/results/h200/2026-12-01_5ccba4d/tune/all-ops-flash-write-flush.json);
    * bf16 weights beyond 64 pairs an expert on a device with ``big`` shared memory: 128 x 128 x 256,
      3412 µs at T = 4096 against 4602 for the quantised weights' tile (4357-4500 for the other big
      tiles tried); FP4 "scaled" there: 128-column up blocks, 7055 µs at T = 4096 against 9710 with
      64 and 7289 for "join" (benchmarks/results/h200/2026-12-01_2494243/tune/moe_experts-variants-flash.json);
    * grids under half the target programs (decode over few experts; the shared expert: one) halve
      the N blocks, to floors 32 (up) / 64 (down): 44.5 / 59.3 / 60.2 µs at T = 1 / 8 / 64 with (32, 64)
      against 47.7 / 67.6 / 69.2 with (64, 128) and 50.5 / 60.0 / 59.0 with (16, 64)
      (benchmarks/results/h200/2026-12-01_8397775/tune/all-ops-flash.json);
    * and 128-column K steps there (36.4 / 48.3 µs at T = 1 / 8 against 44.6 / 58.8 with 64,
      benchmarks/results/h200/2026-12-01_9da52e6/tune/moe_experts-shared-flash.json), and for FP4
      "scaled" over at most one program a target slot (127.8 µs at T = 1 against 141.4 with 64; at
      T = 64 the 64 step is faster, 623 against 718: moe_experts-variants-flash.json above);
    * FP4 "scaled": 64-column down blocks while the down grid of 128-column blocks fits the target
      (115.6 µs at T = 1 against 128.6-130.9 with 128; at T = 8 / 32 / 64, where it does not fit, 64
      is 4 % faster to 4 % slower: benchmarks/results/h200/2026-12-01_2d29a67/tune/moe_experts-fp4-decode-flash.json,
      moe_experts-fp4-group-decode-flash.json). Timed with FP4 down weights; a mixed FP4 / FP8 launch takes it too."""
    from triton import cdiv   # here, not at import: the table is built before any kernel module loads

    from dsv4core.kernels.triton.moe_split import few_programs, row_tiles

    if P <= 4 * E:
        cfg = (16, 64, 128, 128 if fp8 else 64, 4, 4)
    elif P <= 64 * E:
        cfg = (64, 64, 128, 128 if fp8 else 64, 4, 3)
    elif plain and big:
        cfg = (128, 128, 256, 64, 8, 3)
    else:
        cfg = (128, 128 if scaled else 64, 128, 128 if fp8 else 64, 8, 3)
    BM, BNu, BNd = cfg[:3]
    tiles = row_tiles(P, E, BM)
    while BNu > 32 and tiles * cdiv(I, BNu) < programs // 2:
        BNu //= 2
    while BNd > 64 and tiles * cdiv(H, BNd) < programs // 2:
        BNd //= 2
    long_k = few_programs(tiles, I, programs) or (scaled and tiles * cdiv(I, BNu) <= programs)
    if scaled and tiles * cdiv(H, BNd) <= programs:
        BNd = min(BNd, 64)
    return (BM, BNu, BNd, 128 if long_k else cfg[3]) + cfg[4:]


def _wo_a_sm90(o, weight, weight_scale=None) -> dict:
    """wo_a: FP8 e4m3 through fp32 (``fp8`` "via_f32", as linear below), and with block-scaled FP8
    weights at T <= 16 two scale blocks a K step (``NBLK`` 2; H200,
    benchmarks/results/h200/2026-12-01_2494243/tune/linear-wo_a-variants-flash.json: 18.8 µs at T = 1
    against 20.8 with one; at T = 64 one block is faster, 32.1 against 46.7). fp32 operands take
    the kernel's fp32 tiles (no NBLK). Tiles: _wo_a_tiles_sm90."""
    nblk = (weight_scale is not None and o.shape[0] <= 16 and o.dtype != torch.float32
            and weight.dtype != torch.float32)
    return {"fp8": "via_f32", "NBLK": 2, "dequant_rows": DEQUANT_GEMM_ROWS, "tiles": _wo_a_tiles_sm90} if nblk else \
        {"fp8": "via_f32", "dequant_rows": DEQUANT_GEMM_ROWS, "tiles": _wo_a_tiles_sm90}


#: quantised weights converted to bf16 once per call (kernels/triton/dequant.py) from this many rows:
#: H200, Flash shapes, FP8 codes converted (benchmarks/results/h200/2026-12-03_45d660e/tune/dequant-flash.json):
#: linear 734 against 855 µs unconverted at T = 4096, but 272 against 229 at 1024 and slower below;
#: wo_a 657 against 871 at 4096, 173 against 124 at 512
DEQUANT_GEMM_ROWS = 4096
#: ... and from this many (token, slot) pairs per expert (FP4 experts, 32 experts, top 6, same file):
#: 2,561 against 3,824 µs at T = 2048 (384 pairs an expert), 4,088 / 7,112 at 4096, 7,227 / 13,459 at
#: 8192; 1,351 against 1,181 at T = 512 (96 an expert)
DEQUANT_EXPERT_ROWS = 384


def _fp4_gemm():
    from .fp4_experts import GEMM   # no kernel compiled or loaded here: on its first call

    return GEMM


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
        # tiles: _moe_tiles_sm90 / _linear_tiles_sm90 (their docstrings: the results they came from)
        # gemm: packed FP4 experts under the official activation through the plugin's own grouped
        # GEMM (fp4_experts.cu; where it serves: fp4_experts.py)
        "moe": {"fp4": "scaled", "fp8": "via_f32", "split": "h200", "dequant_rows": DEQUANT_EXPERT_ROWS,
                "tiles": _moe_tiles_sm90, "gemm": _fp4_gemm()},
        # chain: fp32 logits (the lm_head, T = 1 / 8 / 64, K = 4,096 and 7,168) with MMA chains of
        # 64 K columns err 3.1e-7 - 4.5e-7 of max |y| at 94 - 103 % of the weight-streaming floor;
        # 16 / 32 columns 4.3e-7 - 9.3e-7 at 44 - 90 %; one chain over K 4.8e-6 - 1.0e-5 (the lm_head
        # cases' bounds 1.7e-6 - 5.7e-6): benchmarks/results/h200/2026-12-03_1570b6f/bench/lm-head-chains-{flash,pro}.json
        # w8a8_tiles: the tiles of the official W8A8 as an FP8 x FP8 MMA (linear.W8A8_PATHS), which
        # is not switched on here ("w8a8": "fp8") until a GPU conformance run and `tune_triton.py
        # --set w8a8` on this GPU have judged and timed it; the kernel's "values" path serves
        "linear": {"fp8": "via_f32", "dequant_rows": DEQUANT_GEMM_ROWS, "tiles": _linear_tiles_sm90, "chain": 64,
                   "w8a8_tiles": _w8a8_tiles_sm90},
        "wo_a": _wo_a_sm90,
        "attention": _attention_sm90,
        "mhc": _mhc_sm90,
    },
}, fallback="sm90", select=_capability)


def current() -> dict:
    """The entries for device 0's compute capability (read at the first kernel call, never at import)."""
    return TABLES.resolve(torch.cuda.get_device_capability(0))
