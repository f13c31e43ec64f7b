"""The official activation quantisation rules (`dsv4core.hal.quant.act_quant / fake_quant /
hadamard`) against an independent float64 transcription: bit-exact on 10^5+ random groups and on
the edge cases (zero groups, amax at the clamp, values at +-448 / +-6, subnormal scales, ties)."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4core.hal.quant import act_quant, fake_quant, hadamard, hadamard_matrix

F64 = torch.float64


def _scale64(amax: torch.Tensor, qmax: float, amax_min: float) -> torch.Tensor:
    """2^ceil(log2(fl32(amax * fl32(1/qmax)))) with frexp (float64, exact for float32 inputs)."""
    inv = float(torch.tensor(1.0 / qmax, dtype=torch.float32))
    out = []
    for a in amax.flatten().tolist():
        v = float(torch.tensor(max(a, amax_min) * inv, dtype=F64).to(torch.float32))  # one rounding
        m, e = math.frexp(v)                      # v = m * 2^e, m in [0.5, 1)
        out.append(2.0 ** (e - 1 if m == 0.5 else e))
    return torch.tensor(out, dtype=F64).view(amax.shape)


def _round_grid(y: torch.Tensor, quantum: torch.Tensor) -> torch.Tensor:
    return torch.round(y / quantum) * quantum          # torch.round: half to even


def _e4m3_64(y: torch.Tensor) -> torch.Tensor:
    """Nearest e4m3 value (3 mantissa bits, min normal 2^-6, subnormal step 2^-9), ties to even."""
    a = y.abs()
    e = torch.floor(torch.log2(a.clamp(min=2.0 ** -6)))
    return torch.copysign(_round_grid(a, 2.0 ** (e - 3)), y).clamp(-448, 448)


def _e2m1_64(y: torch.Tensor) -> torch.Tensor:
    a = y.abs()
    q = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0)).to(F64)
    return torch.copysign(_round_grid(a, q), y)


def _fake64(x: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    qmax, amin = (448.0, 1e-4) if fmt == "fp8" else (6.0, 6.0 * 2.0 ** -126)
    amin = float(torch.tensor(amin, dtype=torch.float32))
    g = x.to(F64).unflatten(-1, (-1, block))
    s = _scale64(g.abs().amax(-1), qmax, amin).unsqueeze(-1)
    y = (g / s).clamp(-qmax, qmax)
    y = _e4m3_64(y) if fmt == "fp8" else _e2m1_64(y)
    return (y * s).flatten(-2), s.squeeze(-1)


def _random_groups(n_groups: int, block: int, gen: torch.Generator, dtype) -> torch.Tensor:
    """Groups spanning 2^-40 .. 2^40 in magnitude (random exponent per group), some exact ties."""
    mag = torch.exp2(torch.randint(-40, 40, (n_groups, 1), generator=gen).double())
    x = torch.randn(n_groups, block, generator=gen, dtype=F64) * mag
    return x.to(dtype)


@pytest.mark.parametrize("fmt,block", [("fp8", 128), ("fp8", 64), ("fp4", 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fake_quant_bit_exact_on_random_groups(fmt, block, dtype):
    gen = torch.Generator().manual_seed(7)
    n = 20_000                       # x 6 parameter sets: 1.2 * 10^5 random groups in all
    x = _random_groups(n, block, gen, dtype)
    want, _ = _fake64(x, fmt, block)
    got = fake_quant(x, fmt, block)
    assert got.dtype == dtype
    assert torch.equal(got.to(F64), want.to(dtype).to(F64)), fmt


def test_act_quant_codes_and_scales():
    gen = torch.Generator().manual_seed(1)
    x = _random_groups(2000, 128, gen, torch.bfloat16).view(1000, 256)
    q, s = act_quant(x, 128)
    want, s64 = _fake64(x, "fp8", 128)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (1000, 2)
    assert torch.equal(s.to(F64), s64)
    deq = (q.to(F64).unflatten(-1, (2, 128)) * s.to(F64).unsqueeze(-1)).flatten(-2)
    assert torch.equal(deq, want)
    # the scale is a power of two and no code is clamped beyond +-448
    assert torch.equal(torch.exp2(torch.log2(s)), s) and q.to(torch.float32).abs().max() <= 448


def _edge_rows(fmt: str) -> list[torch.Tensor]:
    qmax = 448.0 if fmt == "fp8" else 6.0
    amin = 1e-4 if fmt == "fp8" else 6.0 * 2.0 ** -126
    B = 32
    rows = [torch.zeros(B),                                           # zero group: smallest scale, zeros
            torch.full((B,), amin), torch.full((B,), amin * 0.5),      # amax at / below the clamp
            torch.tensor([qmax] + [-qmax] * (B - 1)),                 # exactly the format maximum
            torch.tensor([qmax * 2.0 ** -20] * B),                    # power-of-two amax: ceil(log2) exact
            torch.tensor([qmax * 2.0 ** -20 * (1 + 2.0 ** -23)] + [1e-3] * (B - 1)),   # one ulp above
            torch.linspace(-1, 1, B) * 2.0 ** -120,                   # tiny values (subnormal-range scale)
            torch.linspace(-1, 1, B) * 3e38]                          # near float32 max
    # ties: values exactly half-way between two codes, at scale 1 (amax = qmax)
    if fmt == "fp8":
        ties = torch.tensor([448.0, 1.0625, 1.1875, 2.0 ** -7 * 1.5 * 2 ** -2, 17.0, 19.0, 2.0 ** -10, 3 * 2.0 ** -10])
    else:
        ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    rows.append(torch.cat([ties, -ties, ties * 0.5, ties * 0.999])[:B] if len(ties) * 4 >= B
                else torch.cat([ties] * (B // len(ties))))
    return rows


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_fake_quant_edges(fmt):
    x = torch.stack(_edge_rows(fmt)).to(torch.float32)
    want, _ = _fake64(x, fmt, 32)
    got = fake_quant(x, fmt, 32)
    # (near float32's maximum a value rounded up to the next code overflows to inf: the float32
    # kernels of the official inference do the same, so the cast of the fp64 value is the expectation)
    assert torch.equal(got, want.to(torch.float32)), (got - want).abs().max()
    fin = got[got.isfinite().all(-1)]
    assert torch.equal(fake_quant(fin, fmt, 32), fin)           # idempotent: exact dequantised values
    assert torch.equal(got[0], torch.zeros(32))


def test_fake_quant_ties_round_to_even():
    x = torch.tensor([[6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 4])
    assert fake_quant(x, "fp4", 32)[0, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    y = torch.tensor([[448.0, 1.0625, 1.1875, 17.0, 19.0] + [0.0] * 27])
    assert fake_quant(y, "fp8", 32)[0, :5].tolist() == [448.0, 1.0, 1.25, 16.0, 20.0]


@pytest.mark.parametrize("fmt,qmax", [("fp8", 448.0), ("fp4", 6.0)])
def test_scale_is_the_smallest_power_of_two_covering_amax(fmt, qmax):
    """Over every float32 mantissa of one binade (and random exponents): the scale is
    2^ceil(log2(amax / qmax)) computed exactly (frexp on the float64 quotient), so amax / s is in
    (qmax / 2, qmax]; a floor, a round or a non-power-of-two scale fails."""
    from dsv4core.hal.quant import act_scale

    mant = torch.arange(1 << 23, dtype=torch.int32)
    for e in (-13, 0, 7):                                              # above the amax clamps
        amax = ((mant | ((e + 127) << 23)).view(torch.float32))           # [2^e, 2^(e+1))
        got = act_scale(amax, fmt).to(F64)
        m, ex = torch.frexp(amax.to(F64) / qmax)
        want = torch.ldexp(torch.ones_like(m), torch.where(m == 0.5, ex - 1, ex))
        assert torch.equal(got, want), fmt
        r = amax.to(F64) / got
        assert bool(((r <= qmax) & (r > qmax / 2)).all())


def test_sign_of_zero_survives():
    x = torch.tensor([[-0.0, 0.0, -1e-30, 1.0] * 8])
    for fmt in ("fp8", "fp4"):
        y = fake_quant(x, fmt, 32)
        assert torch.equal(torch.signbit(y[0, :3]), torch.tensor([True, False, True])), fmt


def test_bad_block_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of block 128"):
        act_quant(torch.zeros(2, 100), 128)
    with pytest.raises(ValueError, match="fmt"):
        fake_quant(torch.zeros(2, 32), "int8", 32)


def test_hadamard_sylvester_scaled():
    want = torch.tensor([[1.0]], dtype=F64)
    for n in range(1, 8):                               # Sylvester: H_2n = [[H, H], [H, -H]]
        want = torch.cat([torch.cat([want, want], 1), torch.cat([want, -want], 1)], 0)
        assert torch.equal(hadamard_matrix(2 ** n, dtype=F64), want)
    sylvester128 = want
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 128, generator=gen, dtype=F64)
    y = hadamard(x)
    ref = x @ sylvester128.T / math.sqrt(128)
    assert torch.allclose(y, ref, rtol=0, atol=1e-12)
    assert torch.allclose(hadamard(y), x, rtol=0, atol=1e-12)        # orthonormal and symmetric
    xb = x.to(torch.bfloat16)
    # bf16 in: float32 math, one rounding to bf16 (within half a bf16 ulp of the fp64 value)
    got = hadamard(xb).to(F64)
    exact = xb.to(F64) @ sylvester128.T / math.sqrt(128)
    assert ((got - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-30).all()
    with pytest.raises(ValueError, match="power of two"):
        hadamard(torch.zeros(2, 96))
