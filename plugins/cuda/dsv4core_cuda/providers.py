"""Optional CUDA libraries the ``cuda`` backend is meant to use where they are installed.

Not wired yet: no op is served by them. ``status()`` says, without importing them, whether each
is importable, so ``dsv4core backends`` shows it. Why not wired (issue 10): neither is installed
on the H200 machine this project measures on; FlashInfer's mHC kernels are JIT-only (nvcc +
apache-tvm-ffi) and DeepGEMM's SM90 kernels need its CUTLASS headers and a C++ build against the
local torch, so an adapter could not be run, checked by the conformance suite, or timed beside
the Triton kernels within that session. Each entry: the import name, then the ops it would serve.
"""
from __future__ import annotations

import importlib.util

PROVIDERS = {
    "flashinfer": ("flashinfer", "hc_post / hc_pre via mhc_post / mhc_pre_big_fuse (hc_mult 4)"),
    "deep_gemm": ("deep_gemm", "linear / wo_a via its SM90 FP8 GEMM and einsum"),
}


def status() -> dict[str, str]:
    """name -> one line: importable or not, and that it serves no op yet."""
    out = {}
    for name, (module, ops) in PROVIDERS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        out[name] = (f"importable, not wired (would serve {ops})" if found
                     else f"not installed (would serve {ops})")
    return out


def describe() -> str:
    return "; ".join(f"{k}: {v}" for k, v in status().items())
