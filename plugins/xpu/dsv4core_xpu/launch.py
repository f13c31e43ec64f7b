"""The XPU launch table for the portable Triton kernels (see dsv4core.kernels.triton.launch).

Intel GPUs run Triton programs as work-groups of sub-groups; DPAS (the matrix engine) needs
sub-group size 16, so the kernels with ``tl.dot`` (attention, mhc mixes, wo_a, moe, indexer) ask for 16
(Intel's Triton also forces 16 where it lowers a dot to DPAS). ``num_warps`` (sub-groups per
work-group) stays <= 8, far below ``max_num_sub_groups``.

Shared local memory (SLM) per work-group differs per device, so the table's targets are SLM
tiers: a device takes the largest tier within its ``local_mem_size`` (read when the table is
resolved, at the first kernel call); only attention's tile differs between them. Compiled by
triton-xpu 3.3.0b1 (benchmarks/results/xpu-aot/), bf16 attention needs 100,384 B of
SLM with 16 heads x 32 rows, 66,624 B with 16 x 16, 49,680 B with 8 x 16 (fp32, 16 x 16: 65,536 B;
num_stages does not change it there). With 8 heads the dot may leave DPAS for FMA: a device with
less than 66,624 B of SLM gets correctness first, speed later.

The sub-group keyword is ``warp_size`` in current Intel Triton and ``threads_per_warp`` in 3.3;
:func:`current` keeps only the keywords the installed backend accepts. (CUDA's Triton also has a
``warp_size`` option, fixed at 32: a tool running this table on NVIDIA must drop it by name, as
benchmarks/vendor_tables_on_cuda.py does.) Not tuned on hardware:
compile-checked (SPIR-V, where triton-xpu installs) and run on an NVIDIA GPU with the XPU-only
keywords removed.
"""
from __future__ import annotations

from dsv4core.kernels.triton.launch import LaunchTable, is_f32

SUBGROUP_16 = {"warp_size": 16, "threads_per_warp": 16}


#: (SLM bytes needed, bf16 tile) from the largest tile down; see the module docstring
_ATTENTION_BF16 = ((100_384, {"BH": 16, "BK": 32}), (66_624, {"BH": 16, "BK": 16}), (0, {"BH": 8, "BK": 16}))


def _attention_for(slm: int):
    bf16 = next(tile for need, tile in _ATTENTION_BF16 if slm >= need)
    bh_f32 = 16 if slm >= 65_536 else 8

    def entry(*args, **kwargs):
        tile = {"BH": bh_f32, "BK": 16} if is_f32(args, kwargs) else bf16
        # pipe 0 (the kernel's default, stated; not tuned here): the hand-pipelined gather at
        # T <= 64 is the CUDA table's sm90 choice, measured on an H200 only
        return {**tile, "num_stages": 2, "pipe": 0, "launch": SUBGROUP_16}
    return entry


# linear's, wo_a's and moe's tiles (TUNE "tiles"): the tiles these targets ran as the kernels'
# former defaults (compile-checked, run on an NVIDIA GPU without the XPU keywords; not timed on an
# Intel GPU). ``big`` (>= 200 KiB of shared memory a block) is never true here (XPU devices report
# no shared_memory_per_block_optin): the CUDA table's prefill tiles are not taken.


def _linear_tiles(M: int, scaled: bool, big: bool = False) -> tuple:
    """16 x 64 x 128, 4 warps, 3 stages to 16 rows; 64 x 64 x 128 (block-scaled: 64 x 128 x 64) to
    64; 128 x 128 x 64, 8 warps above."""
    if M <= 16:
        return "dot", 16, 64, 128, 4, 3
    if M <= 64:
        return ("dot", 64, 128, 64, 4, 3) if scaled else ("dot", 64, 64, 128, 4, 3)
    return "dot", 128, 128, 64, 8, 3


def _wo_a_tiles(T: int, scaled: bool, big: bool = False) -> tuple:
    """16 x 32 x 256 (block-scaled: x 128), 4 warps, 4 stages to 16 tokens; 64 x 32 x 128 to 64;
    128 x 128 x 64 (block-scaled: x 128), 8 warps, 3 stages above."""
    if T <= 16:
        return ("dot", 16, 32, 128, 4, 4) if scaled else ("dot", 16, 32, 256, 4, 4)
    if T <= 64:
        return "dot", 64, 32, 128, 4, 4
    return "dot", 128, 128, 128 if scaled else 64, 8, 3


def _moe_tiles(P, E, H, I, programs, fp8, plain, scaled, big) -> tuple:
    """Rows and warps: 16 x 4 while an expert holds <= 4 pairs, 64 x 4 to 64 pairs, 128 x 8 above;
    the rest as the entry's keys."""
    BM, nw = (16, 4) if P <= 4 * E else ((64, 4) if P <= 64 * E else (128, 8))
    return BM, 32, 32, 32, nw, 3


def _moe(*args, **kwargs):
    # Su / Sd 1 (the kernel's default, stated; not tuned here): split K at decode batches
    # (moe._split_rule) is the CUDA table's sm90 choice, measured on an H200 only
    return {"BNu": 32, "BNd": 32, "BK": 32, "num_stages": 2 if is_f32(args, kwargs) else 3, "Su": 1, "Sd": 1,
            "tiles": _moe_tiles, "launch": SUBGROUP_16}


def _entries(slm: int) -> dict:
    """The entries for a device with ``slm`` bytes of shared local memory per work-group."""
    return {
        "attention": _attention_for(slm),
        "mhc": {"launch": SUBGROUP_16},
        "linear": {"tiles": _linear_tiles},
        "wo_a": {"NBLK": 1, "tiles": _wo_a_tiles, "launch": SUBGROUP_16},   # NBLK 1: the kernel's default, stated; not tuned here
        "moe": _moe,
        "indexer": {"launch": SUBGROUP_16},   # indexer_scores_rows: one tl.dot per channel chunk
    }


#: SLM bytes at which attention's choice changes (bf16 tiles: _ATTENTION_BF16; fp32 16 heads: 64 KiB)
_TIERS = (100_384, 66_624, 65_536, 0)


def _tier(slm: int) -> str:
    """The target name of a device with ``slm`` bytes of SLM: the largest tier within it."""
    return f"slm{next(t for t in _TIERS if slm >= t)}"


TABLES = LaunchTable("xpu", {f"slm{t}": _entries(t) for t in _TIERS}, select=_tier)


def device_slm(target=None) -> int:
    """``local_mem_size`` of XPU device 0, else the Triton target's, else 64 KiB."""
    import torch

    if getattr(torch, "xpu", None) is not None and torch.xpu.is_available():
        return int(torch.xpu.get_device_properties(0).local_mem_size)
    arch = getattr(target, "arch", None)
    if isinstance(arch, dict) and arch.get("local_mem_size"):
        return int(arch["local_mem_size"])
    return 64 * 1024


def current(accepted=None, slm=None) -> dict:
    """The entries for the current device, with launch keywords restricted to what the current
    Triton target accepts (read at the first kernel call on the device; ``accepted`` / ``slm``
    override, for tests and tools)."""
    from dsv4core.kernels.triton.launch import accepted_options

    target = None
    if accepted is None or slm is None:
        from triton.runtime import driver

        target = driver.active.get_current_target()
    if accepted is None:
        accepted = accepted_options(target)
    return TABLES.resolve(device_slm(target) if slm is None else slm, accepted)
