"""The XPU launch table for the portable Triton kernels (see dsv4core.kernels.triton.launch).

Intel GPUs run Triton programs as work-groups of sub-groups; DPAS (the matrix engine) needs
sub-group size 16, so the kernels with ``tl.dot`` (attention, mhc mixes, wo_a, moe) ask for 16
(Intel's Triton also forces 16 where it lowers a dot to DPAS). Shared local memory is 64-128 KiB
per work-group depending on the device [unverified per device]: attention's tiles are sized to
stay near 40 KiB (16 heads x 32 rows x 512 channels, 2 stages). ``num_warps`` (sub-groups per
work-group) stays <= 8, far below ``max_num_sub_groups``.

The sub-group keyword is ``warp_size`` in current Intel Triton and ``threads_per_warp`` in 3.3;
:func:`resolve` keeps only the keywords the installed backend accepts. (CUDA's Triton also has a
``warp_size`` option, fixed at 32: a tool running this table on NVIDIA must drop it by name, as
benchmarks/vendor_tables_on_cuda.py does.) Not tuned on hardware:
compile-checked (SPIR-V, where triton-xpu installs) and run on an NVIDIA GPU with the XPU-only
keywords removed.
"""
from __future__ import annotations

from dsv4core.kernels.triton.launch import is_f32

SUBGROUP_16 = {"warp_size": 16, "threads_per_warp": 16}


def _attention(*args, **kwargs):
    return {"BH": 16, "BK": 16 if is_f32(args, kwargs) else 32, "num_stages": 2, "launch": SUBGROUP_16}


def _moe(*args, **kwargs):
    return {"BN": 32, "BK": 32, "num_stages": 2 if is_f32(args, kwargs) else 3, "launch": SUBGROUP_16}


TABLE = {
    "attention": _attention,
    "mhc": {"launch": SUBGROUP_16},
    "wo_a": {"launch": SUBGROUP_16},
    "moe": _moe,
}


def resolve(accepted=None) -> dict:
    """TABLE with launch keywords restricted to what the current Triton target accepts (read at
    the first kernel call on the device; ``accepted`` overrides, for tests and tools)."""
    from dsv4core.kernels.triton.launch import accepted_options, for_target

    if accepted is None:
        from triton.runtime import driver

        accepted = accepted_options(driver.active.get_current_target())
    return for_target(TABLE, accepted)
