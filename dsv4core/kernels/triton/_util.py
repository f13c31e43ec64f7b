"""Small helpers shared by the portable Triton kernels (no device work at import)."""
from __future__ import annotations

import os

import torch
import triton

from dsv4core.hal.util import cdiv  # noqa: F401  (re-exported for the kernel modules)


def np2(n: int) -> int:
    """The power of two >= n (1 for n <= 1): ``triton.next_power_of_2``'s value, in plain integer
    arithmetic (that one is a constexpr function, several microseconds a host call; launchers call
    this a few times a launch)."""
    n = int(n)
    return 1 << (n - 1).bit_length() if n > 1 else 1


def c(t: torch.Tensor) -> torch.Tensor:
    """Contiguous view (a no-op for contiguous inputs): non-contiguous inputs are handled, never misread."""
    return t if t.is_contiguous() else t.contiguous()


_PROGRAMS: dict = {}

#: compute units assumed for a device whose properties report none (neither
#: ``multi_processor_count`` nor ``gpu_subslice_count``): a small GPU's count, so that a split sized
#: from it never over-splits; on a larger device it only leaves units idle
FALLBACK_COMPUTE_UNITS = 16


def target_programs(device: torch.device, cpu: int = 16) -> int:
    """Programs that fill the device: 2 per SM of a GPU (from its properties, not a constant);
    ``cpu`` under the interpreter (small keeps it fast and still exercises the split paths)."""
    if device.type == "cpu":
        return cpu
    key = (device.type, device.index)
    n = _PROGRAMS.get(key)
    if n is None:
        # torch.cuda also fronts ROCm builds; XPU reports subslices (its compute-unit groups)
        props = getattr(torch, device.type).get_device_properties(device)
        units = getattr(props, "multi_processor_count", None) or getattr(props, "gpu_subslice_count", None) \
            or FALLBACK_COMPUTE_UNITS
        n = _PROGRAMS[key] = 2 * int(units)
    return n


_SHARED: dict = {}

#: shared memory a block may use, in bytes, from which the prefill tiles measured on an H200 (228
#: KiB a block) are chosen; devices with less keep the smaller tiles (they would not compile there)
BIG_TILE_SHARED = 200 * 1024


def shared_bytes(device: torch.device) -> int:
    """Shared memory one block may use on ``device`` (its properties; 0 when they do not say, and
    under the interpreter: the smaller tiles)."""
    if device.type == "cpu":
        return 0
    key = (device.type, device.index)
    n = _SHARED.get(key)
    if n is None:
        props = getattr(torch, device.type).get_device_properties(device)
        n = _SHARED[key] = int(getattr(props, "shared_memory_per_block_optin", 0) or 0)
    return n


def same_device(device_type: str, *ts) -> bool:
    return all(t is None or (isinstance(t, torch.Tensor) and t.device.type == device_type) for t in ts)


def accurate(t: torch.Tensor) -> bool:
    """Use libdevice (correctly rounded-ish sin/cos) on a GPU; plain tl.sin/cos in the interpreter."""
    return t.device.type != "cpu"


import triton.language as tl  # noqa: E402


@triton.jit
def rne_bf16(y):
    """Round fp32 to the nearest bf16 value (ties to even), kept in fp32. The Triton interpreter's
    fp32->bf16 cast truncates; GPUs round to nearest, so the interpreter path rounds here first."""
    u = y.to(tl.uint32, bitcast=True)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.to(tl.float32, bitcast=True)


@triton.jit
def to_out(y, out_ptr, RNE: tl.constexpr):
    if RNE:
        y = rne_bf16(y)
    return y.to(out_ptr.dtype.element_ty)


def rne(out: torch.Tensor) -> bool:
    """RNE constexpr: True only for bf16 outputs under the interpreter (CPU tensors)."""
    return rne_for(out.device, out.dtype)


def rne_for(device: torch.device, dtype: torch.dtype) -> bool:
    """``rne`` of an output of ``dtype`` on ``device`` (no tensor needed)."""
    return device.type == "cpu" and dtype == torch.bfloat16


def interp(t: torch.Tensor) -> bool:
    """The interpreter's bf16 tl.dot is unreliable: upcast dot operands to fp32 there."""
    return t.device.type == "cpu"


def interpreting(t: torch.Tensor) -> bool:
    """``t`` is a CPU tensor AND the Triton interpreter runs the kernels (TRITON_INTERPRET=1).
    Unlike :func:`interp`, False in an ahead-of-time compile of CPU tensors (aot.py), which then
    compiles the branch a GPU runs."""
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "") == "1"


# ---- the official quantisation rules (dsv4core.hal.quant), bit-exact on every target: the scales
# and the roundings are integer operations on the float32 bits, so neither a device's fp8 / fp4
# conversion instructions nor an approximate division enter (the interpreter runs them as written)

@triton.jit
def ceil_pow2_exp(v):
    """ceil(log2(v)) for positive normal float32 ``v``, read off its bits (int32): the exponent,
    plus one when a mantissa bit is set (``hal.quant._ceil_pow2``)."""
    u = v.to(tl.int32, bitcast=True)
    return ((u >> 23) & 0xFF) - 127 + ((u & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def exp2_int(e):
    """2^e as float32 for int32 ``e`` in [-126, 127] (exact: built from the bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_int(t):
    """Non-negative float32 ``t`` < 2^22 rounded to an integer, ties to even (one float32 rounding
    at the unit step of 2^23; a fused multiply-add into it rounds the same way)."""
    return (t + 8388608.0) - 8388608.0


@triton.jit
def e4m3_bits(q):
    """Exact e4m3fn values ``q`` (float32, |q| <= 448, e.g. from :func:`e4m3_rne`) -> their
    e4m3fn bytes (uint8), from the float32 bits: normal (|q| >= 2^-6) exponent rebiased 127 -> 7
    and the top three mantissa bits; subnormal ``|q| * 2^9`` (an integer 0..7); sign bit 7."""
    u = q.to(tl.uint32, bitcast=True)
    w = u & 0x7FFFFFFF
    a = w.to(tl.float32, bitcast=True)
    normal = (((w >> 23) - 120) << 3) | ((w >> 20) & 7)
    b = tl.where(a < 0.015625, (a * 512.0).to(tl.uint32), normal) | ((u >> 24) & 0x80)
    return b.to(tl.uint8)


@triton.jit
def e4m3_rne(v):
    """float32 values with |v| <= 448 rounded to the nearest e4m3fn value (ties to even), kept in
    float32, sign kept. Normal range (|v| >= 2^-6): the mantissa rounded to 3 bits on the bits (a
    carry moves the exponent up, as it must); subnormal range: multiples of 2^-9 (``|v| * 2^9``,
    exact, rounded to an integer)."""
    u = v.to(tl.uint32, bitcast=True)
    sign = u & 0x80000000
    w = u & 0x7FFFFFFF
    w = (w + 0x7FFFF + ((w >> 20) & 1)) & 0xFFF00000
    a = (u & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    r = tl.where(a < 0.015625, _round_int(a * 512.0) * 0.001953125, w.to(tl.float32, bitcast=True))
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def e2m1_rne(v):
    """float32 values with |v| <= 6 rounded to the nearest e2m1 value {0, 0.5, 1, 1.5, 2, 3, 4, 6}
    (ties to the even code), kept in float32, sign kept: for |v| >= 1 the grid is a 1-bit mantissa
    (rounded on the bits, as in ``e4m3_rne``), below 1 multiples of 0.5 (ties to even: 0.25 -> 0,
    0.75 -> 1, the even codes)."""
    u = v.to(tl.uint32, bitcast=True)
    sign = u & 0x80000000
    w = u & 0x7FFFFFFF
    w = (w + 0x1FFFFF + ((w >> 22) & 1)) & 0xFFC00000
    a = (u & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    r = tl.where(a < 1.0, _round_int(a * 2.0) * 0.5, w.to(tl.float32, bitcast=True))
    return (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def group_scale_exp(amax, AMAX_MIN: tl.constexpr, QMAX_INV: tl.constexpr):
    """The exponent of the official power-of-two scale of group maxima ``amax`` (float32):
    ``ceil(log2(fl(max(amax, AMAX_MIN) * fl(QMAX_INV))))`` (``hal.quant.act_scale``)."""
    return ceil_pow2_exp(tl.maximum(amax, AMAX_MIN) * QMAX_INV)
