"""Optional CUDA libraries beside the ``cuda`` backend's Triton kernels, and what became of each.

``status()`` says, without importing or building anything, where each stands; ``dsv4core
backends`` shows it in the ``cuda`` row.

FlashInfer (wired): backend ``cuda-flashinfer`` (:mod:`.flashinfer_mhc`) serves ``hc_pre`` /
``hc_post`` through FlashInfer's mHC kernels (hc_mult 4, bf16) when ``flashinfer`` is installed,
or when ``DSV4CORE_FLASHINFER_SRC`` points at their sources (built once with nvcc through
apache-tvm-ffi). Its priority is below ``cuda`` until measured; ``DSV4CORE_OPS`` selects it.

DeepGEMM (not wired; behind its availability check only). Checked against the GitHub snapshot
deepseek-ai/DeepGEMM 54e2261 (2026-06-23):

* The PyPI ``deep-gemm`` 1.0.0 is the Feb-2025 Python wrapper (19 KB sdist) without CUDA headers
  or the DSV4-era APIs: it cannot run anything.
* The real one needs its C++ extension ``deep_gemm._C`` (``csrc/python_api.cpp``, a torch
  CUDAExtension with pybind11, C++20) built against the local torch, plus two git submodules the
  snapshot lacks: CUTLASS >= 4.0 (``cute`` + ``cutlass`` headers, which the kernels include at JIT
  time; FlashInfer's wheel carries a copy of 822 files / 25.7 MiB whose CUTLASS version is not
  pinned against DeepGEMM's submodule f3fde58) and ``{fmt}`` (553ec11, no carried source). The
  extension build and then one nvcc JIT compile per kernel configuration do not fit one short GPU
  call beside everything else, and nothing of it could be checked here (no GPU, no nvcc).
* Numerics: its SM90 FP8 GEMM and ``fp8_einsum('bhr,hdr->bhd')`` take FP8 *activations* with
  per-token 1x128 scales. The HAL's ``linear`` / ``wo_a`` with FP8 weights keep the activations in
  bf16 and dequantise the weights exactly (SPEC.md), so an FP8 DeepGEMM call would change the
  math (e4m3 rounding of x, ~2^-4 relative per element) and fail conformance by construction;
  serving it needs an activation-quantised op in the SPEC first. Only its bf16 paths
  (``bf16_gemm_nt``, bf16 ``einsum('bhr,hdr->bhd')``) compute the HAL's math.

Each entry below: the import name, then the ops it serves or would serve.
"""
from __future__ import annotations

PROVIDERS = {
    "flashinfer": ("flashinfer", "hc_post / hc_pre via mhc_post / mhc_pre_big_fuse (hc_mult 4)"),
    "deep_gemm": ("deep_gemm", "linear / wo_a via its SM90 FP8 GEMM and einsum"),
}


def status() -> dict[str, str]:
    """name -> one line: where the provider stands (nothing imported, nothing built)."""
    from . import flashinfer_mhc

    out = {}
    for name, (module, ops) in PROVIDERS.items():
        if name == "flashinfer":
            kind, where = flashinfer_mhc.origin()
            how = {"package": "installed", "source": f"sources at {where}, built on first use"}.get(kind)
            out[name] = (f"backend {flashinfer_mhc.NAME!r} ({how}; serves {ops})" if how
                         else f"backend {flashinfer_mhc.NAME!r} not usable: {where}")
        else:
            out[name] = (f"importable, not wired (would serve {ops}; see providers.py)" if flashinfer_mhc.found(module)
                         else f"not installed (would serve {ops})")
    return out


def describe() -> str:
    return "; ".join(f"{k}: {v}" for k, v in status().items())
