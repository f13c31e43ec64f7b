"""Backend "triton-interpret": the portable Triton kernels on CPU tensors through the Triton
interpreter, so CI (no GPU) runs the same kernel source the GPUs run.

Available only when ``TRITON_INTERPRET=1`` was set in the environment before this module was
imported (triton reads it at import time). Low priority: ``auto`` never prefers it over a real CPU
backend by accident; select it explicitly (``backend="triton-interpret"``).
"""
from __future__ import annotations

import os

from dsv4core.hal import Backend, HAL_API_VERSION, hookimpl

_INTERPRET_AT_IMPORT = os.environ.get("TRITON_INTERPRET", "") == "1"


def _available():
    if not _INTERPRET_AT_IMPORT:
        return False, "set TRITON_INTERPRET=1 before starting Python to run the Triton kernels on CPU"
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    return True, ""


@hookimpl
def dsv4core_register_backends(register):
    from .registry import register_ops

    b = Backend(name="triton-interpret", version="0.1.0", device_types=("cpu",),
                api_version=HAL_API_VERSION, priority=-10, available=_available,
                description="portable Triton kernels run by the Triton interpreter (testing only)")
    register_ops(b, "cpu")
    register(b)
