"""dsv4core backends "cuda" (the portable Triton kernels of dsv4core.kernels.triton on NVIDIA GPUs)
and "cuda-flashinfer" (FlashInfer's mHC kernels for hc_pre / hc_post, :mod:`.flashinfer_mhc`;
priority below "cuda" until measured, selectable with DSV4CORE_OPS).

Cheap to import: neither triton nor any kernel module is imported here; the kernels load on their
first call, and FlashInfer is neither imported nor built before its first call. ``available()`` is a static platform probe (a CUDA build of torch that sees a device;
triton importable), with no kernel launch.
"""
from __future__ import annotations

import importlib.util
import logging

from dsv4core.hal import HAL_API_VERSION, Backend, hookimpl
from dsv4core.kernels.triton import OPS

from .graphs import CudaGraphCapture

log = logging.getLogger("dsv4core.cuda")

__version__ = "0.1.0"


#: Portable kernels not (yet) served here, left to the reference until a GPU conformance run
#: confirms them (they still run under triton-interpret). Empty since the H200 run of
#: benchmarks/results/conformance-cuda-h200-candidates.json (moe_route, indexer_topk, cache_store,
#: compress_windows, indexer_scores_rows: all passed at small, flash and pro shapes). A new portable
#: kernel starts here; remove its name once ``dsv4core conformance --backend cuda --device cuda
#: --ops NAME --shapes small,flash,pro`` passes on a GPU (`benchmarks/h200_run.sh cand` does that).
NOT_SERVED = frozenset()
#: The portable kernels this backend serves.
CUDA_OPS = frozenset(OPS) - NOT_SERVED


def _available():
    import torch

    if not getattr(torch.version, "cuda", None):
        hip = getattr(torch.version, "hip", None)
        build = f"a ROCm build (hip {hip})" if hip else "a CPU-only build"
        return False, (f"torch {torch.__version__} is {build}; the cuda backend needs a CUDA build of "
                       f"torch (install it from the PyTorch CUDA wheel index)")
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed (pip install 'dsv4core[cuda]')"
    return True, ""


@hookimpl
def dsv4core_register_backends(register):
    from dsv4core.kernels.triton.registry import register_ops

    from . import providers
    from .launch import current

    b = Backend(name="cuda", version=__version__, device_types=("cuda",), api_version=HAL_API_VERSION,
                priority=100, available=_available,
                description="portable Triton kernels (dsv4core.kernels.triton) on NVIDIA GPUs; optional "
                            f"providers: {providers.describe()}",
                graph_capture=CudaGraphCapture())
    register_ops(b, "cuda", launch=current, ops=CUDA_OPS)
    register(b)
    try:       # an optional provider that fails to import must not take `cuda` down with it
        from . import flashinfer_mhc
        fi = flashinfer_mhc.make_backend(version=__version__)
    except Exception as e:  # noqa: BLE001 -- reported, the cuda backend stays registered
        log.warning("cuda plugin: the cuda-flashinfer backend is not registered (%s: %s)", type(e).__name__, e)
    else:
        register(fi)
