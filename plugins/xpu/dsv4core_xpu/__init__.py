"""dsv4core backend "xpu": Intel GPUs (Data Center GPU Max / Arc / Battlemage) through torch's
built-in XPU support, device type ``xpu``.

* Every op the portable Triton kernels implement (dsv4core.kernels.triton), compiled by Intel's
  Triton backend, with this plugin's launch table (:mod:`.launch`).
* fp32 dots stay ``input_precision="ieee"`` (the kernels pass it explicitly; Intel's default is
  tf32, which the HAL's fp32 contract does not allow).
* Collectives: the HAL's torch.distributed path with the "xccl" process-group backend.

Status: NOT VALIDATED ON HARDWARE. The kernels are the source the CUDA backend validates; the XPU
launch configurations ran on an NVIDIA GPU (functional evidence only) and, where triton-xpu
installs, compile to SPIR-V on CPU. Correctness on an Intel GPU needs a recorded conformance
report (``validation/``, docs/conformance.md "Vendor CI").

Cheap to import: no triton or kernel import here.
"""
from __future__ import annotations

from pathlib import Path

from dsv4core.hal import HAL_API_VERSION, Backend, hookimpl
from dsv4core.hal.validation import recorded

__version__ = "0.1.0"
DISTRIBUTED_BACKEND = "xccl"


def _available():
    import torch

    xpu_ver = getattr(torch.version, "xpu", None)
    if not xpu_ver:
        return False, (f"torch {torch.__version__} is not an XPU build (torch.version.xpu is None); install "
                       f"torch from the PyTorch XPU wheel index")
    if not torch.xpu.is_available():
        return False, f"torch {torch.__version__} (XPU {xpu_ver}) sees no Intel GPU (torch.xpu.is_available() is False)"
    from dsv4core.kernels.triton.registry import triton_backend_problem

    why = triton_backend_problem("intel", "pytorch-triton-xpu", "PyTorch XPU index")
    return (not why), why


def make_backend(device_type: str = "xpu", available=None, launch=None) -> Backend:
    """The xpu Backend (``device_type`` / ``available`` / ``launch``: for tests and tools that run
    the kernels elsewhere, e.g. on CPU under the Triton interpreter)."""
    from dsv4core.kernels.triton.registry import register_ops

    from .launch import current

    b = Backend(name="xpu", version=__version__, device_types=(device_type,), api_version=HAL_API_VERSION,
                priority=100, available=available or _available,
                description="portable Triton kernels with an XPU launch table (Intel GPUs)",
                validated=recorded(Path(__file__).parent / "validation", "xpu"))
    register_ops(b, device_type, launch=launch or current)
    return b


def aot_backend(arch: str = "") -> Backend:
    """The backend on CPU tensors, for the ahead-of-time compile to SPIR-V with Intel's Triton
    (``python -m dsv4core.kernels.triton.aot --target xpu --backend dsv4core_xpu:aot_backend``)."""
    return make_backend("cpu", available=lambda: (True, ""))


@hookimpl
def dsv4core_register_backends(register):
    register(make_backend())
