"""The CUDA plugin's grouped GEMM for packed FP4 expert weights (``fp4_experts.cu``, compiled with
NVRTC, :mod:`.nvrtc`), which moe_experts' gate / up and down GEMMs use through the launch table's
``moe`` entry ``gemm`` (dsv4core.kernels.triton.moe: the routing, the official activation and the
combine stay the portable kernels).

Where it serves (``serves``, shapes and strides only, so a graph-captured step decides the same):
packed FP4 weights [E, R, K / 2] (uint8 or int8 bytes) with UE8M0 scales [E, R, K / 32], R a multiple of 16, K of
128, contiguous and 16-byte aligned; bf16 activations; pair tiles of at most ``MAX_BM`` rows.
Why: the portable decodes spend ~8.5 instructions a code on the CUDA cores; here a lane reads its
weights as 16-byte vectors in the checkpoint layout and decodes a code pair in five instructions
into the MMA fragment (the .cu file's header), so the weights stream at decode batches.
"""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from . import nvrtc

log = logging.getLogger("dsv4core.cuda")

SOURCE = Path(__file__).with_name("fp4_experts.cu")
KERNEL = "fp4_expert_gemm"
#: pair tiles (the routing's BM) up to this many rows: NG = BM / 8 accumulator groups a lane
MAX_BM = 64
WARPS = 4
#: pairs an expert (on average) up to which it serves: H200, Flash shapes, 32 experts, top 6, read
#: flush, before the weight ring: 384 against 595 µs for the portable kernels at T = 64 (12 pairs an
#: expert), 860 against 655 at T = 256 (48)
#: (benchmarks/results/h200/2026-12-03_57288f5/tune/fp4-gemm-flash-no-ring.json)
MAX_PAIRS_PER_EXPERT = 16


#: environment variable: "0" leaves moe_experts to the portable kernels (to compare the two)
OFF_ENV = "DSV4CORE_CUDA_FP4_GEMM"
#: the lowest compute capability the source compiles for (mul.rn.bf16x2)
MIN_CAPABILITY = (9, 0)
_USABLE: dict[int, bool] = {}


def _usable(device: torch.device) -> bool:
    """Whether this device can run the kernel: capability and an NVRTC library (checked once a
    device; when not, the portable kernels serve and the reason is logged once)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _USABLE.get(index)
    if ok is None:
        why = ""
        if os.environ.get(OFF_ENV, "1") == "0":
            why = f"{OFF_ENV}=0"
        elif torch.cuda.get_device_capability(index) < MIN_CAPABILITY:
            why = f"compute capability {torch.cuda.get_device_capability(index)} < {MIN_CAPABILITY}"
        else:
            try:
                nvrtc._lib("nvrtc")
            except nvrtc.NativeKernelError as e:
                why = str(e)
        ok = _USABLE[index] = not why
        if why:
            log.warning("cuda plugin: the FP4 expert GEMM is not used on cuda:%d (%s); the portable "
                        "kernels serve moe_experts", index, why)
    return ok


def _aligned(t: torch.Tensor) -> bool:
    return t.is_contiguous() and t.data_ptr() % 16 == 0


class Fp4ExpertGemm:
    """``serves(w, scale, BM, P)`` and ``__call__(a, rows, w, scale, out, tcum, starts, BM)``: the
    ``gemm`` contract of dsv4core.kernels.triton.moe."""

    def __init__(self):
        self._kernels: dict[tuple[int, int], object] = {}   # (device index, NG) -> loaded function

    def __repr__(self) -> str:   # launch plans and errors name it
        return "cuda.Fp4ExpertGemm"

    def serves(self, w: torch.Tensor, scale: torch.Tensor | None, BM: int, P: int) -> bool:
        if scale is None or w.dtype not in (torch.uint8, torch.int8) or w.dim() != 3 or w.device.type != "cuda":
            return False
        if not _usable(w.device):
            return False
        E, R, half = w.shape
        K = 2 * half
        if scale.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
            return False
        if tuple(scale.shape) != (E, R, K // 32) or R % 16 or K % 128 or BM % 8 or BM > MAX_BM:
            return False
        if P > MAX_PAIRS_PER_EXPERT * E:
            return False
        return _aligned(w) and _aligned(scale)

    def _kernel(self, device: torch.device, ng: int):
        key = (device.index if device.index is not None else torch.cuda.current_device(), ng)
        fn = self._kernels.get(key)
        if fn is None:   # compiled and loaded once a device and NG
            fn = self._kernels[key] = nvrtc.module(SOURCE.read_text(), f"fp4_experts_ng{ng}", device,
                                                   (f"-DNG={ng}",)).kernel(KERNEL)
        return fn

    def __call__(self, a, rows, w, scale, out, tcum, starts, BM: int) -> None:
        """out[r, n] = sum_k a[rows[r] (r when rows is None), k] * W[e(r), n, k] (fp32) for every
        kept sorted row r; a bf16 [*, K] contiguous, out fp32 [P, R]."""
        E, R, half = w.shape
        K = 2 * half
        if a.dtype != torch.bfloat16 or a.shape[-1] != K or not _aligned(a):
            raise ValueError(f"moe_experts (cuda FP4 GEMM): activation must be contiguous 16-byte aligned bf16 "
                             f"[*, {K}], got {a.dtype} {tuple(a.shape)}")
        if out.dtype != torch.float32 or out.shape[-1] != R or not out.is_contiguous():
            raise ValueError(f"moe_experts (cuda FP4 GEMM): out must be contiguous fp32 [P, {R}], "
                             f"got {out.dtype} {tuple(out.shape)}")
        P = out.shape[0]
        if P == 0:
            return
        ng = BM // 8
        fn = self._kernel(a.device, ng)
        s8 = scale.view(torch.uint8)
        rows_arg = rows if rows is not None else tcum   # unused by the kernel then (use_rows 0)
        grid = (-(-P // BM) + min(E, P), R // 16, 1)
        args = [ctypes.c_void_p(w.data_ptr()), ctypes.c_void_p(s8.data_ptr()), ctypes.c_void_p(a.data_ptr()),
                ctypes.c_void_p(rows_arg.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                ctypes.c_void_p(tcum.data_ptr()), ctypes.c_void_p(starts.data_ptr()),
                ctypes.c_int(E), ctypes.c_int(R), ctypes.c_int(K), ctypes.c_int(0 if rows is None else 1)]
        nvrtc.launch(fn, grid, (32 * WARPS, 1, 1), args, KERNEL)


GEMM = Fp4ExpertGemm()
