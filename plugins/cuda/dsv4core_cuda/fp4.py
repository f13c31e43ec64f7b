"""A packed-integer FP4 e2m1 decode for the portable moe kernels' "planes" path (TUNE
``fp4_decode``; contract: dsv4core.kernels.triton.moe.fp4_planes), in PTX for sm90 and later.

Per 32-bit register of four packed bytes: two ``prmt`` spread the bytes into 16-bit lanes; each
nibble's magnitude bits go to bf16 bits 6..8 and its sign to bit 15 (shift / and / or, fused by
ptxas into a few LOP3 / SHF), which is the e2m1 value times 2^-126 (code 1, 0.5, becomes the bf16
subnormal 2^-127); one ``mul.rn.bf16x2`` by 2^126 gives the exact value, a second by the group's
scale 2^(s - 127) (byte 0: the subnormal 2^-127, byte 255: NaN) the exact product: every e2m1
value times a power of two has at most two significant bits, so it is a bf16 value while in
bf16's range (bf16 keeps subnormals in these multiplies). Eight weights take ~22 instructions,
against ~70 for the decode Triton generates from tensor code (sass-sm90-s20-t1-decode-loops.md).
"""
from __future__ import annotations

import triton
import triton.language as tl

# $0 $1: low nibbles of bytes (0, 1), (2, 3); $2 $3: high nibbles; $4: the four bytes; $5 $6: the
# scale factors of bytes (0, 1), (2, 3) as bf16 pairs
_ASM = tl.constexpr("""
{
.reg .b32 z, two, p0, p1, t0, t1;
mov.b32 z, 0;
mov.b32 two, 0x7E807E80;
prmt.b32 p0, $4, z, 0x4140;
prmt.b32 p1, $4, z, 0x4342;
shl.b32 t0, p0, 6;
and.b32 t0, t0, 0x01C001C0;
and.b32 t1, p0, 0x00080008;
shl.b32 t1, t1, 12;
or.b32 t0, t0, t1;
mul.rn.bf16x2 t0, t0, two;
mul.rn.bf16x2 $0, t0, $5;
shl.b32 t0, p1, 6;
and.b32 t0, t0, 0x01C001C0;
and.b32 t1, p1, 0x00080008;
shl.b32 t1, t1, 12;
or.b32 t0, t0, t1;
mul.rn.bf16x2 t0, t0, two;
mul.rn.bf16x2 $1, t0, $6;
shl.b32 t0, p0, 2;
and.b32 t0, t0, 0x01C001C0;
and.b32 t1, p0, 0x00800080;
shl.b32 t1, t1, 8;
or.b32 t0, t0, t1;
mul.rn.bf16x2 t0, t0, two;
mul.rn.bf16x2 $2, t0, $5;
shl.b32 t0, p1, 2;
and.b32 t0, t0, 0x01C001C0;
and.b32 t1, p1, 0x00800080;
shl.b32 t1, t1, 8;
or.b32 t0, t0, t1;
mul.rn.bf16x2 t0, t0, two;
mul.rn.bf16x2 $3, t0, $6;
}
""")


@triton.jit
def fp4_planes_sm90(b, sb):
    """(low, high) nibble planes [R, BK/2] as bf16 from packed bytes ``b`` [R, BK/2] (uint8) and
    their UE8M0 scale bytes ``sb`` [R, BK/32] (uint8)."""
    s = sb.to(tl.int32) & 0xFF
    fbits = tl.where(s == 0, 0x40, tl.where(s == 255, 0x7FC0, s << 7)).to(tl.int16)
    f = fbits.to(tl.bfloat16, bitcast=True)
    f = tl.reshape(tl.broadcast_to(f[:, :, None], (b.shape[0], b.shape[1] // 16, 16)), (b.shape[0], b.shape[1]))
    return tl.inline_asm_elementwise(_ASM, "=r,=r,=r,=r,r,r,r", [b, f], dtype=(tl.bfloat16, tl.bfloat16),
                                     is_pure=True, pack=4)
