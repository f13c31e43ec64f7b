"""dsv4core backends "cuda" (the portable Triton kernels of dsv4core.kernels.triton on NVIDIA GPUs)
and "cuda-flashinfer" (FlashInfer's mHC kernels for hc_pre / hc_post, :mod:`.flashinfer_mhc`;
priority below "cuda" until measured, selectable with DSV4CORE_OPS).

Cheap to import: neither triton nor any kernel module is imported here; the kernels load on their
first call, and FlashInfer is neither imported nor built before its first call. ``available()`` is
a static platform probe (a CUDA build of torch that sees a device; triton importable), with no
kernel launch. The ops served are those the recorded hardware validation (``validation/``) passed,
plus any named in ``DSV4CORE_CUDA_TRY`` (a candidate kernel being tried on a GPU).
"""
from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from dsv4core.hal import HAL_API_VERSION, Backend, hookimpl
from dsv4core.hal.validation import passed_ops, recorded
from dsv4core.kernels.triton import OPS

from .graphs import CudaGraphCapture

log = logging.getLogger("dsv4core.cuda")

__version__ = "0.1.0"


#: Recorded hardware validation (``<hardware-id>.json``: a passing ``dsv4core conformance --backend
#: cuda --device cuda`` report plus a ``"hardware"`` string; README.md in the folder).
VALIDATION = Path(__file__).parent / "validation"
#: Environment variable naming portable kernels to serve although no recorded report passed them
#: (comma-separated op names), for trying a candidate kernel on a GPU before recording it.
TRY_ENV = "DSV4CORE_CUDA_TRY"
#: The portable kernels this backend serves: those a recorded report passed.
CUDA_OPS = frozenset(OPS) & passed_ops(VALIDATION, "cuda")


#: Official-numerics arguments (HAL 1.2) of validated kernels that the recorded validation did not
#: exercise (the kernels declined those cases when it was recorded): a call setting one is declined
#: here, so the reference serves it, until a record passes it; a kernel tried with ``TRY_ENV``
#: serves them too.
UNVALIDATED_ARGS: dict[str, tuple[str, ...]] = {}   # op -> argument names; none in this version


def unvalidated_gates(tried: frozenset[str] = frozenset()) -> dict:
    """Extra ``supports`` predicates (op -> predicate) declining the calls that set an argument of
    ``UNVALIDATED_ARGS``, for the kernels not in ``tried`` (``tried_args``)."""
    import inspect

    from dsv4core.kernels.triton import predicates

    gates = {}
    for op, names in UNVALIDATED_ARGS.items():
        if op in tried:
            continue
        sig = inspect.signature(getattr(predicates, f"{op}_supports"))

        def gate(*args, _sig=sig, _names=names, **kwargs):
            bound = _sig.bind(*args, **kwargs).arguments
            return all(bound.get(n) is None for n in _names)

        gates[op] = gate
    return gates


def _try_names(env=None) -> frozenset[str]:
    raw = (os.environ if env is None else env).get(TRY_ENV, "")
    names = frozenset(x.strip() for x in raw.split(",") if x.strip())
    unknown = sorted(names - frozenset(OPS))
    if unknown:
        raise ValueError(f"{TRY_ENV}: {', '.join(unknown)} is not a portable kernel; expected a comma list "
                         f"of {', '.join(sorted(OPS))}, got {raw!r}")
    return names


def tried_ops(env=None) -> frozenset[str]:
    """The portable kernels ``DSV4CORE_CUDA_TRY`` asks to serve beyond the validated ones. Raises
    ValueError for a name that is not a portable kernel."""
    return _try_names(env) - CUDA_OPS


def tried_args(env=None) -> frozenset[str]:
    """The validated kernels ``DSV4CORE_CUDA_TRY`` names whose ``UNVALIDATED_ARGS`` it asks to serve."""
    return _try_names(env) & CUDA_OPS & frozenset(UNVALIDATED_ARGS)


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

    tried, args = tried_ops(), tried_args()
    trying = f"; trying, not validated: {', '.join(sorted(tried))} ({TRY_ENV})" if tried else ""
    trying += (f"; trying, not validated: the official-numerics arguments of {', '.join(sorted(args))} "
               f"({TRY_ENV})" if args else "")
    b = Backend(name="cuda", version=__version__, device_types=("cuda",), api_version=HAL_API_VERSION,
                priority=100, available=_available,
                description="portable Triton kernels (dsv4core.kernels.triton) on NVIDIA GPUs; optional "
                            f"providers: {providers.describe()}{trying}",
                graph_capture=CudaGraphCapture(), validated=recorded(VALIDATION, "cuda"))
    register_ops(b, "cuda", launch=current, ops=CUDA_OPS | tried, supports=unvalidated_gates(args))
    register(b)
    try:       # an optional provider that fails to import must not take `cuda` down with it
        from . import flashinfer_mhc
        fi = flashinfer_mhc.make_backend(version=__version__)
    except Exception as e:  # noqa: BLE001 -- reported, the cuda backend stays registered
        log.warning("cuda plugin: the cuda-flashinfer backend is not registered (%s: %s)", type(e).__name__, e)
    else:
        register(fi)
