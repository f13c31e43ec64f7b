"""dsv4core backend "rocm": AMD Instinct GPUs through a ROCm build of torch.

* Every op the portable Triton kernels implement (dsv4core.kernels.triton), launched with this
  plugin's per-arch launch table (:mod:`.launch`: gfx942 / gfx950 / other).
* aiter where the installed aiter has the op (:mod:`.aiter_ops`): ``hc_pre`` / ``hc_post``
  (``aiter.ops.mhc``, HIP) and bf16 ``wo_a`` at decode on gfx950
  (``aiter.ops.triton.gemm.batched.batched_gemm_bf16``). Each is gated on its module and the aiter
  version; a call aiter cannot serve runs the portable kernel (logged once, version named).
* fp8: gfx942's native fp8 is e4m3fnuz; DSV4 checkpoints are OCP e4m3fn. On gfx942 ``linear`` and
  ``wo_a`` read the e4m3fn weights as e4m3fnuz with doubled block scales, which is exact (derived
  in :mod:`.fp8`; a weight with -0 codes is read from a converted copy, or rewritten
  in place with DSV4CORE_ROCM_FNUZ_IN_PLACE=1; a weight with NaN
  codes is declined); FP8 ``moe_experts`` is declined there (the reference serves it). gfx950
  runs OCP e4m3fn natively.
* Collectives: the HAL's torch.distributed path; on ROCm the "nccl" process-group backend is RCCL.

Status: NOT VALIDATED ON HARDWARE. The glue is tested on CPU against an emulation of the aiter API,
the kernels are compile-checked for gfx942/gfx950 (LDS, spills) and their launch configurations
run on an NVIDIA GPU; correctness on AMD hardware needs a recorded conformance report
(``validation/``, docs/conformance.md "Vendor CI").

Cheap to import: neither triton, aiter nor a kernel module is imported here; the arch is read at
the first kernel call, aiter at the first call of an aiter-served op.
"""
from __future__ import annotations

import functools
from pathlib import Path

from dsv4core.hal import HAL_API_VERSION, Backend, hookimpl
from dsv4core.hal.validation import recorded

__version__ = "0.1.0"
#: torch.distributed process-group backend on ROCm (RCCL answers to "nccl")
DISTRIBUTED_BACKEND = "nccl"
#: archs with their own launch table and the aiter paths
KNOWN_ARCHS = ("gfx942", "gfx950")


def _available():
    import torch

    hip = getattr(torch.version, "hip", None)
    if not hip:
        cuda = getattr(torch.version, "cuda", None)
        build = f"a CUDA build (CUDA {cuda})" if cuda else "a CPU-only build"
        return False, (f"torch {torch.__version__} is {build}, not a ROCm build (torch.version.hip is None); "
                       f"install torch from the PyTorch ROCm wheel index")
    n = torch.cuda.device_count()
    if n == 0:
        return False, f"torch {torch.__version__} (HIP {hip}) sees no AMD GPU (torch.cuda.device_count() == 0)"
    from dsv4core.kernels.triton.registry import triton_backend_problem

    why = triton_backend_problem("amd", "pytorch-triton-rocm", "PyTorch ROCm index")
    return (not why), why


def arch_of(name: str) -> str:
    """``gcnArchName`` (e.g. ``gfx942:sramecc+:xnack-``) -> gfx942 / gfx950 / other."""
    base = (name or "").split(":")[0].strip()
    return base if base in KNOWN_ARCHS else "other"


@functools.lru_cache(maxsize=None)
def device_arch(index: int = 0) -> str:
    """The arch of ROCm device ``index`` (read at first use, never at import)."""
    import torch

    return arch_of(torch.cuda.get_device_properties(index).gcnArchName)


def make_backend(device_type: str = "cuda", arch=None, available=None, launch=None) -> Backend:
    """The rocm Backend. ``device_type`` / ``arch`` / ``available`` / ``launch`` are for tests and
    tools that run the real glue elsewhere: CPU tensors under an emulated aiter, or the launch
    tables on another GPU (``arch``: a callable returning the arch; ``launch``: a table or a
    callable returning one, replacing the per-arch table)."""
    from dsv4core.kernels.triton import OPS
    from dsv4core.kernels.triton.registry import register_ops

    from . import aiter_ops, fp8
    from .launch import TABLES

    get_arch = arch or device_arch
    b = Backend(name="rocm", version=__version__, device_types=(device_type,), api_version=HAL_API_VERSION,
                priority=100, available=available or _available,
                description="portable Triton kernels with per-arch ROCm launch tables, aiter mhc / batched "
                            "GEMM where installed (AMD Instinct)",
                validated=recorded(Path(__file__).parent / "validation", "rocm"))
    kernels = Backend(name="rocm", device_types=(device_type,))
    register_ops(kernels, device_type, launch=launch or (lambda: TABLES.resolve(get_arch())))
    portable = Backend(name="rocm", device_types=(device_type,))
    fp8.add_ops(portable, kernels, get_arch)      # gfx942: e4m3fn weights as e4m3fnuz (or declined)
    aiter_ops.register(b, portable, device_type, get_arch)
    return b


def aot_backend(arch: str) -> Backend:
    """The backend for ``arch`` on CPU tensors with no aiter: what the ahead-of-time compile gate
    (``python -m dsv4core.kernels.triton.aot --backend dsv4core_rocm:aot_backend``) launches."""
    return make_backend("cpu", arch=lambda: arch, available=lambda: (True, ""))


@hookimpl
def dsv4core_register_backends(register):
    register(make_backend())
