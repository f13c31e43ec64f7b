"""FP8 / FP4 formats: exact dequantisation, nibble order, scale decoding, and the rounding bounds.

Rounding bounds (round-to-nearest into the format, scale s a power of two, or amax/448 for fp32):
* FP8 e4m3: 3 mantissa bits, so for a normal value v = x/s (|v| >= 2^-6) the spacing is
  2^(e-3) with 2^e <= |v|, and the rounding error is at most half of it: |v - q| <= 2^-4 |v|.
  Below 2^-6 (subnormals, spacing 2^-9) the error is at most 2^-10. The scale makes |v| <= 448
  (no clipping). Hence elementwise |x - x_hat| <= max(2^-4 |x|, 2^-10 s).
* FP4 e2m1: values {0, .5, 1, 1.5, 2, 3, 4, 6}; in [1,2), [2,4), [4,6] the spacing is .5, 1, 2,
  i.e. half-spacing <= |v|/4; below 1 the spacing is .5 (error <= .25). The pow2 group scale
  makes |v| <= 6. Hence |x - x_hat| <= max(|x|, s) / 4.
The products q * s are exact in fp32 (a few significant bits times a power of two), so the
dequantised value has no further error before the final cast.
"""

from __future__ import annotations

import pytest
import torch

from dsv4core.hal import quant

E8M0 = torch.float8_e8m0fnu


def fp8_bound(x, s_full):
    return torch.maximum(x.abs() * 2.0 ** -4, s_full * 2.0 ** -10)


def fp4_bound(x, s_full):
    return torch.maximum(x.abs(), s_full) / 4


def test_fp4_table_and_nibble_order():
    # byte 0x7A: low nibble 0xA (-1.0) is element 0, high nibble 0x7 (6.0) element 1
    packed = torch.tensor([[0x7A, 0x81]], dtype=torch.uint8).view(torch.int8)
    vals = quant.unpack_fp4(packed)
    assert vals.tolist() == [[-1.0, 6.0, 0.5, -0.0]]
    assert torch.signbit(vals[0, 3])
    all_codes = torch.arange(16, dtype=torch.uint8)
    got = quant.unpack_fp4((all_codes | (all_codes << 4)).view(torch.int8).reshape(16, 1))
    assert got[:, 0].tolist() == list(quant.FP4_E2M1_TABLE)
    assert got[:, 1].tolist() == list(quant.FP4_E2M1_TABLE)


def test_e8m0_scale_decoding():
    b = torch.tensor([0, 120, 127, 130, 254], dtype=torch.uint8)
    want = [2.0 ** -127, 2.0 ** -7, 1.0, 8.0, 2.0 ** 127]
    assert quant.scale_to_float32(b).tolist() == want
    assert quant.scale_to_float32(b.view(E8M0)).tolist() == want
    assert torch.isnan(quant.scale_to_float32(torch.tensor([255], dtype=torch.uint8).view(E8M0))).all()


def test_fp4_dequant_exact_values():
    # one row, K=64: two groups, scales 2^-1 and 2^3
    codes = torch.arange(64, dtype=torch.uint8) % 16
    packed = (codes[0::2] | (codes[1::2] << 4)).view(torch.int8).reshape(1, 32)
    scale = torch.tensor([[126, 130]], dtype=torch.uint8).view(E8M0)
    out = quant.dequantize_fp4(packed, scale, torch.float32)
    table = torch.tensor(quant.FP4_E2M1_TABLE)
    want = torch.cat([table[codes[:32].long()] * 0.5, table[codes[32:].long()] * 8.0]).reshape(1, 64)
    assert torch.equal(out, want)


def test_fp8_dequant_blocks_and_partial_blocks():
    w = torch.randn(200, 300)
    for sdt in (E8M0, torch.float32):
        q, s = quant.quantize_fp8_block(w, sdt)
        assert q.dtype == torch.float8_e4m3fn and s.dtype == sdt and tuple(s.shape) == (2, 3)
        out = quant.dequantize_fp8(q, s, torch.float32)
        s32 = quant.scale_to_float32(s)
        # exact: every element is its fp8 code times its block's multiplier
        for bi in range(2):
            for bj in range(3):
                blk = (slice(128 * bi, 128 * (bi + 1)), slice(128 * bj, 128 * (bj + 1)))
                assert torch.equal(out[blk], q[blk].to(torch.float32) * s32[bi, bj])
        s_full = s32.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300]
        assert ((out - w).abs() <= fp8_bound(w, s_full)).all()
        # the bound is attained up to a factor 2 (it is not loose)
        assert ((out - w).abs() / fp8_bound(w, s_full)).max() > 0.5


def test_fp8_quant_bf16_output_is_single_rounding():
    w = torch.randn(128, 128)
    q, s = quant.quantize_fp8_block(w, E8M0)
    assert torch.equal(quant.dequantize_fp8(q, s, torch.bfloat16),
                       quant.dequantize_fp8(q, s, torch.float32).to(torch.bfloat16))


@pytest.mark.parametrize("shape", [(64, 128), (3, 8, 64)])
def test_fp4_roundtrip_bound(shape):
    torch.manual_seed(1)
    w = torch.randn(shape) * torch.rand(shape[:-1] + (1,)) * 3
    q, s = quant.quantize_fp4(w)
    assert q.dtype == torch.int8 and tuple(q.shape) == shape[:-1] + (shape[-1] // 2,)
    assert s.dtype == E8M0 and tuple(s.shape) == shape[:-1] + (shape[-1] // 32,)
    out = quant.dequantize_fp4(q, s)
    s_full = quant.scale_to_float32(s).repeat_interleave(32, -1)
    err = (out - w).abs()
    assert (err <= fp4_bound(w, s_full)).all()
    assert (err / fp4_bound(w, s_full)).max() > 0.5
    # quantising the dequantised values is lossless (the grid maps onto itself)
    q2, s2 = quant.quantize_fp4(out)
    assert torch.equal(quant.dequantize_fp4(q2, s2), out)


def test_scale_shape_mismatch_raises():
    q, s = quant.quantize_fp8_block(torch.randn(256, 256))
    with pytest.raises(ValueError, match="scale shape"):
        quant.dequantize_fp8(q, s[:1])
    p, s4 = quant.quantize_fp4(torch.randn(4, 64))
    with pytest.raises(ValueError, match="scale shape"):
        quant.dequantize_fp4(p, s4[:, :1])
