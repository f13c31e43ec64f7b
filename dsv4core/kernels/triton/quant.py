"""@triton.jit dequantisation helpers shared by the portable kernels (no launch of their own).

``e4m3_to_bf16``: FP8 e4m3fn codes (loaded as uint8) -> bf16 by integer operations, an alternative
to Triton's own ``code.to(tl.bfloat16)`` (in sm90 PTX ``cvt.rn.f16x2.e4m3x2`` then two
``cvt.bf16.f16``). Exact for every code, derived as follows.

e4m3fn: sign s, exponent e (4 bits, bias 7), mantissa m (3 bits); normal (e >= 1) values are
(-1)^s 2^(e-7) (1 + m/8), subnormal (e = 0) values (-1)^s 2^-6 (m/8); codes 0x7F / 0xFF are NaN
(no infinities). bf16: sign, 8 exponent bits (bias 127), 7 mantissa bits.

Place the 7 low code bits at bits 26..20 of a 32-bit word and the sign at bit 31:
``bits = (s << 31) | ((code & 0x7F) << 20)`` (computed as the sign-extended code shifted left by
20 and masked with 0x87F00000). Read as fp32, the exponent field is e and the top three
mantissa bits are m, so a normal code reads (-1)^s 2^(e-127) (1 + m/8) and a subnormal code reads
the fp32 subnormal (-1)^s 2^-126 (m/8): both are the e4m3 value times 2^-120 exactly (the two
formats' subnormals sit at the same place relative to their biases). One fp32 multiply by 2^120
(a power of two, exact: every result is normal, |v| in [2^-9, 448]) restores the value. Its bf16
form is the fp32 word's upper half (3 mantissa bits: the lower half is zero), taken by a shift
rather than a float conversion, so this decode has no conversion instruction at all. Triton's
own path compiles (sm90 SASS from Triton 3.9's ptxas, compiled on CPU) to one F2FP.F16.E4M3 per
code pair and one F2F.BF16.F16 per code; the CUDA guide's throughput table puts conversions at
16 a clock per SM against 64 integer / 128 fp32 operations, so that path may bound a weight
stream (unverified on the H200: the launch sweep decides). This decode costs about 7 integer /
fp32 instructions a code instead (same SASS).

The NaN codes read 480 (above the largest finite e4m3, 448) and are mapped to NaN. The multiply
must keep fp32 subnormal inputs (no flush to zero): Triton emits ``mul.f32``, not
``mul.ftz.f32``, for a plain ``*`` (the same PTX shows it).

Why the 2^-120 is not folded into the block scale instead: the MMA would then multiply bf16
activations by weights 2^120 too small, and every product below 2^-6 in magnitude would leave
the fp32 range of normal numbers (underflow before the scale restores it): not exact.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: 2^120: the gap between the bf16 and e4m3 exponent biases (127 - 7)
_BIAS_GAP = tl.constexpr(2.0 ** 120)
#: the sign bit and the 7 low code bits at 26..20 of the fp32 word
_SIGN_MAG = tl.constexpr(0x87F00000)


@triton.jit
def e4m3_to_bf16(code):
    """uint8 e4m3fn codes -> bf16 values of the same shape (exact; see the module docstring)."""
    # sign-extend the byte, so bit 31 of the shifted word is the sign; keep it and the 7 low bits
    x = code.to(tl.int8, bitcast=True).to(tl.int32).to(tl.uint32, bitcast=True)
    v = ((x << 20) & _SIGN_MAG).to(tl.float32, bitcast=True) * _BIAS_GAP
    v = tl.where(tl.abs(v) > 448.0, float("nan"), v)        # the NaN codes 0x7F / 0xFF read 480
    return (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)   # low half is 0
