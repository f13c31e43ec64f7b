"""@triton.jit dequantisation helpers shared by the portable kernels (no launch of their own).

``e4m3_to_bf16``: FP8 e4m3fn codes (loaded as uint8) -> bf16 by integer operations, an alternative
to Triton's own ``code.to(tl.bfloat16)`` (which on an H200 is ``cvt.rn.f16x2.e4m3x2`` then two
``cvt.bf16.f16``). Exact for every code, derived as follows.

e4m3fn: sign s, exponent e (4 bits, bias 7), mantissa m (3 bits); normal (e >= 1) values are
(-1)^s 2^(e-7) (1 + m/8), subnormal (e = 0) values (-1)^s 2^-6 (m/8); codes 0x7F / 0xFF are NaN
(no infinities). bf16: sign, 8 exponent bits (bias 127), 7 mantissa bits.

Place the 7 low code bits at bits 26..20 of a 32-bit word and the sign at bit 31:
``bits = (s << 31) | ((code & 0x7F) << 20)``. Read as fp32, the exponent field is e and the top three
mantissa bits are m, so a normal code reads (-1)^s 2^(e-127) (1 + m/8) and a subnormal code reads
the fp32 subnormal (-1)^s 2^-126 (m/8): both are the e4m3 value times 2^-120 exactly (the two
formats' subnormals sit at the same place relative to their biases). One fp32 multiply by 2^120
(a power of two, exact: every result is normal, |v| in [2^-9, 448]) restores the value, and the
conversion to bf16 is exact (3 mantissa bits). The NaN codes would read 480, so they are mapped to
an fp32 NaN first. The multiply must keep fp32 subnormal inputs (no flush to zero): Triton emits
``mul.rn.f32``, not ``mul.ftz``, for a plain ``*`` (the H200 PTX of linear's kernel shows it).

Why the 2^-120 is not folded into the block scale instead: the MMA would then multiply bf16
activations by weights 2^120 too small, and every product below 2^-6 in magnitude would leave
the fp32 range of normal numbers (underflow before the scale restores it): not exact.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: 2^120: the gap between the bf16 and e4m3 exponent biases (127 - 7)
_BIAS_GAP = tl.constexpr(2.0 ** 120)


@triton.jit
def e4m3_to_bf16(code):
    """uint8 e4m3fn codes -> bf16 values of the same shape (exact; see the module docstring)."""
    x = code.to(tl.uint32)
    mag = x & 0x7F
    bits = ((x & 0x80) << 24) | (mag << 20)
    bits = tl.where(mag == 0x7F, 0x7FC00000, bits)
    return (bits.to(tl.float32, bitcast=True) * _BIAS_GAP).to(tl.bfloat16)
