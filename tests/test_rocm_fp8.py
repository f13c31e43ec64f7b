"""The rocm backend's OCP e4m3fn -> e4m3fnuz weight conversion for gfx942 (dsv4core_rocm/fp8.py).

* Both formats decoded to fp64 from their bit-level definitions (written here, independently of
  torch), cross-checked against torch's own float8_e4m3fn / float8_e4m3fnuz on all 256 codes.
* The conversion is exact: for every finite e4m3fn code and fp32 / e8m0 scales (including
  subnormal codes, the largest code and extreme scales), fn(c) * S == fnuz(c') * S' in fp64, with
  no tolerance; the weight's values as e4m3fn are unchanged by the in-place -0 rewrite; declines
  (NaN codes, undoublable scales) leave the weight untouched and name the reason.
* The backend glue on a gfx942-probed plugin: linear / wo_a hand the kernel the fnuz view (a
  stand-in kernel that dequantises whatever it is given, in fp64, must reproduce the fp64 oracle
  exactly); gfx950 passes e4m3fn through; moe_experts declines FP8 experts on gfx942 with its
  reason; the conversion is made once per weight and again after an in-place change.
The real kernels on the fnuz weights run under the Triton interpreter (tests/interpret/test_rocm_xpu_triton.py).
"""
from __future__ import annotations

import math

import pytest
import torch

from dsv4core.hal import Backend, catalogue

import dsv4core_rocm
from dsv4core_rocm import fp8

FN, FNUZ, E8M0 = torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e8m0fnu
CODES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def decode(code: int, bias: int, nan_codes: tuple[int, ...]) -> float:
    """e4m3 code -> fp64: sign bit 7, exponent bits 6-3 (``bias``), mantissa bits 2-0."""
    if code in nan_codes:
        return math.nan
    s, e, m = code >> 7, (code >> 3) & 0xF, code & 7
    mag = 2.0 ** (1 - bias) * (m / 8) if e == 0 else 2.0 ** (e - bias) * (1 + m / 8)
    return -mag if s else mag


def fn64(code):
    return decode(code, 7, (0x7F, 0xFF))      # OCP e4m3fn: S.1111.111 is NaN, 0x80 is -0


def fnuz64(code):
    return decode(code, 8, (0x80,))           # e4m3fnuz: 0x80 is the only NaN, no -0


def _same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_fp64_decoders_match_torch_on_every_code():
    for dt, dec in ((FN, fn64), (FNUZ, fnuz64)):
        got = CODES.view(dt).to(torch.float64).tolist()
        bad = [c for c in range(256) if not _same(got[c], dec(c))]
        assert not bad, (dt, bad)
    assert fn64(0x7E) == 448 and fnuz64(0x7E) == 224 and fnuz64(0x7F) == 240 and fn64(0x01) == 2.0 ** -9


def _scales(dtype, n=2):
    if dtype == torch.float32:
        return torch.tensor([[3.0e-3, 2.0 ** -120], [1.7e38, 1.0]], dtype=torch.float32)[:n, :n]
    return torch.tensor([[0, 1], [127, 253]], dtype=torch.uint8).view(E8M0)[:n, :n]


def _all_finite_codes_weight():
    """A [256, 256] e4m3fn weight holding every finite code (and -0) in each 128 x 128 block."""
    finite = [c for c in range(256) if c not in (0x7F, 0xFF)]
    idx = torch.arange(256 * 256) % len(finite)
    return torch.tensor(finite, dtype=torch.uint8)[idx].reshape(256, 256).view(FN)


def _dequant64(codes_u8, decoder, scale64):
    vals = torch.tensor([decoder(c) for c in range(256)], dtype=torch.float64)[codes_u8.long()]
    return vals * scale64.repeat_interleave(128, 0).repeat_interleave(128, 1)[:vals.shape[0], :vals.shape[1]]


@pytest.mark.parametrize("scale_dtype", [torch.float32, E8M0])
def test_conversion_is_exact(scale_dtype):
    w = _all_finite_codes_weight()
    s = _scales(scale_dtype)
    before = w.view(torch.uint8).clone()
    assert int((before == 0x80).sum()) > 0                                  # -0 codes present
    want = _dequant64(before, fn64, s.to(torch.float64))
    wz, s2 = fp8.to_fnuz(w, s)
    assert wz.dtype == FNUZ and s2.dtype == s.dtype
    got = _dequant64(wz.view(torch.uint8), fnuz64, s2.to(torch.float64))
    assert not got.isnan().any() and torch.equal(got, want)                 # exact, every element
    # -0 codes present: a converted copy; the caller's weight is not written (bitwise)
    assert wz.data_ptr() != w.data_ptr() and torch.equal(w.view(torch.uint8), before)
    # without -0 codes: the same bytes, a view
    w2 = torch.where(before == 0x80, torch.zeros_like(before), before).view(FN)
    wz2, _ = fp8.to_fnuz(w2, s)
    assert wz2.data_ptr() == w2.data_ptr() and wz2.dtype == FNUZ


def test_in_place_rewrite_only_when_asked_and_never_on_the_cpu(monkeypatch):
    """DSV4CORE_ROCM_FNUZ_IN_PLACE=1 rewrites -0 codes to +0 in the weight (no copy) on an
    accelerator; a CPU weight (possibly a read-only mapping) is copied even then."""
    w = torch.zeros(4, 4, dtype=torch.uint8)
    w[0, 0], w[1, 1] = 0x80, 0x38
    before = w.clone()
    w = w.view(FN)
    monkeypatch.setenv(fp8.IN_PLACE_ENV, "1")
    wz, _ = fp8.to_fnuz(w, torch.ones(1, 1))
    assert wz.data_ptr() != w.data_ptr() and torch.equal(w.view(torch.uint8), before)     # CPU: copied
    monkeypatch.setattr(fp8, "_in_place_allowed", lambda t: True)                          # as on a GPU
    wz, s2 = fp8.to_fnuz(w, torch.ones(1, 1))
    after = w.view(torch.uint8)
    assert wz.data_ptr() == w.data_ptr() and after[0, 0] == 0 and after[1, 1] == 0x38
    assert torch.equal(w.to(torch.float64), before.view(FN).to(torch.float64))             # same values
    assert torch.equal(wz.to(torch.float64) * s2.double(), w.to(torch.float64))


@pytest.mark.parametrize("what,weight_codes,scale,reason", [
    ("nan weight", [0x7F], torch.ones(1, 1), "NaN codes"),
    ("nan weight (negative)", [0xFF], torch.ones(1, 1), "NaN codes"),
    ("e8m0 2^127", [0x38], torch.tensor([[254]], dtype=torch.uint8).view(E8M0), "2^127"),
    ("fp32 overflow", [0x38], torch.tensor([[2.0 ** 127]]), "overflows"),
])
def test_conversion_declines_and_leaves_the_weight(what, weight_codes, scale, reason):
    w = torch.full((4, 4), 0x80, dtype=torch.uint8)
    w[0, : len(weight_codes)] = torch.tensor(weight_codes, dtype=torch.uint8)
    w = w.view(FN)
    before = w.view(torch.uint8).clone()
    why = fp8.to_fnuz(w, scale)
    assert isinstance(why, str) and reason in why, why
    assert torch.equal(w.view(torch.uint8), before)                         # untouched (-0 codes kept)


def test_e8m0_nan_scale_stays_nan_and_fp32_doubles():
    s = torch.tensor([[255, 3]], dtype=torch.uint8).view(E8M0)
    assert fp8.doubled_scale(s).view(torch.uint8).tolist() == [[255, 4]]
    f = torch.tensor([[1.5, -2.0 ** -149, float("inf")]])
    assert fp8.doubled_scale(f).tolist() == [[3.0, -2.0 ** -148, float("inf")]]


# ---------------------------------------------------------------------------------------------
# the glue on a gfx942-probed backend, with a stand-in for the portable kernels
# ---------------------------------------------------------------------------------------------

def _dequant_any(weight, scale):
    """fp64 dequantisation of ``weight`` (e4m3fn OR e4m3fnuz, decoded by torch) with 128 x 128 scales."""
    s = scale.to(torch.float64)
    for dim in range(-2, 0):
        s = s.repeat_interleave(128, dim).narrow(dim, 0, weight.shape[dim])
    return weight.to(torch.float64) * s


def _stand_in_backend(arch, seen):
    """fp8.add_ops over a 'portable' backend whose linear / wo_a / moe_experts compute in fp64
    from whatever weight dtype they receive (recorded in ``seen``)."""
    specs = catalogue()
    kernels = Backend(name="stand-in", device_types=("cpu",))

    def linear(x, weight, weight_scale=None, out_dtype=None, act_block=None):
        assert act_block is None, "the stand-in computes the exact numerics only"
        seen.append(weight.dtype)
        w = weight.to(torch.float64) if weight_scale is None else _dequant_any(weight, weight_scale)
        return x.to(torch.float64) @ w.T

    def wo_a(o, weight, weight_scale=None):
        seen.append(weight.dtype)
        w = weight.to(torch.float64) if weight_scale is None else _dequant_any(weight, weight_scale)
        return torch.einsum("tgd,grd->tgr", o.to(torch.float64), w)

    def moe_experts(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None, act_block=None):
        raise AssertionError("FP8 experts must be declined on gfx942, not run")

    for name, f in (("linear", linear), ("wo_a", wo_a), ("moe_experts", moe_experts)):
        def ok(*args, **kwargs):
            return True
        ok.__signature__ = specs[name].signature
        kernels.add(name, f, supports=ok, capturable=True, native_quantized=True)
    b = Backend(name="rocm", device_types=("cpu",))
    fp8.add_ops(b, kernels, lambda: arch)
    return b


def _fp8_weight(n, k, seed):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 3).to(FN)
    w.view(torch.uint8)[0, :7] = 0x80                     # some -0 codes
    s = torch.rand(-(-n // 128), -(-k // 128), generator=g) * 1e-2 + 1e-3
    return w, s


def test_gfx942_linear_and_wo_a_get_the_fnuz_view_and_match_the_fp64_oracle():
    seen = []
    b = _stand_in_backend("gfx942", seen)
    w, s = _fp8_weight(200, 300, 0)
    x = torch.randn(5, 300, dtype=torch.float64)
    want = x @ _dequant_any(w, s).T                          # before any conversion: the e4m3fn reading
    lin = b.impls["linear"]
    assert lin.supports(x, w, s) and lin.why_not(x, w, s) == ""
    assert torch.equal(lin.fn(x, w, s), want) and seen == [FNUZ]
    assert torch.equal(lin.fn(x, weight=w, weight_scale=s), want)          # keyword form too
    wg = w[:128].reshape(2, 64, 300).contiguous()
    sg = torch.rand(2, 1, 3) + 0.5
    o = torch.randn(3, 2, 300, dtype=torch.float64)
    want_g = torch.einsum("tgd,grd->tgr", o, _dequant_any(wg, sg))
    assert torch.equal(b.impls["wo_a"].fn(o, wg, sg), want_g) and seen[-1] == FNUZ
    # bf16 weights (no scale) pass through untouched
    wb = torch.randn(8, 300).bfloat16()
    b.impls["linear"].fn(x, wb)
    assert seen[-1] == torch.bfloat16


def test_gfx950_passes_e4m3fn_through():
    seen = []
    b = _stand_in_backend("gfx950", seen)
    w, s = _fp8_weight(128, 128, 1)
    raw = w.view(torch.uint8).clone()
    b.impls["linear"].fn(torch.randn(2, 128, dtype=torch.float64), w, s)
    assert seen == [FN] and torch.equal(w.view(torch.uint8), raw)        # no conversion, no rewrite


def test_gfx942_declines_with_reasons():
    b = _stand_in_backend("gfx942", [])
    w = torch.zeros(128, 128, dtype=torch.uint8)
    w[3, 3] = 0x7F
    w = w.view(FN)
    x = torch.randn(2, 128, dtype=torch.float64)
    lin = b.impls["linear"]
    assert not lin.supports(x, w, torch.ones(1, 1))
    assert "gfx942 (e4m3fnuz hardware)" in lin.why_not(x, w, torch.ones(1, 1))
    with pytest.raises(ValueError, match="linear: the rocm backend cannot run this e4m3fn weight on gfx942"):
        lin.fn(x, w, torch.ones(1, 1))
    moe = b.impls["moe_experts"]
    args = (torch.randn(2, 128).bfloat16(), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1),
            torch.zeros(1, 256, 128, dtype=FN), torch.zeros(1, 128, 128, dtype=FN), 7.0,
            torch.ones(1, 2, 1), torch.ones(1, 1, 1))
    assert not moe.supports(*args) and moe.why_not(*args) == fp8.MOE_DECLINE
    assert _stand_in_backend("gfx950", []).impls["moe_experts"].supports(*args)


def test_conversion_made_once_per_weight_and_redone_after_an_in_place_change(monkeypatch):
    calls = []
    real = fp8.to_fnuz
    monkeypatch.setattr(fp8, "to_fnuz", lambda w, s: calls.append(1) or real(w, s))
    b = _stand_in_backend("gfx942", [])
    w, s = _fp8_weight(128, 128, 2)
    x = torch.randn(2, 128, dtype=torch.float64)
    lin = b.impls["linear"]
    for _ in range(3):
        assert lin.supports(x, w, s)
        lin.fn(x, w, s)
    assert len(calls) == 1
    s.mul_(2)                                           # the scale changed in place: converted again
    torch.testing.assert_close(lin.fn(x, w, s), x @ _dequant_any(w, s).T, rtol=0, atol=0)
    assert len(calls) == 2


def test_real_backend_wires_it():
    """The rocm backend's own linear / wo_a / moe_experts carry the gfx942 handling (their
    declarations kept); the reason reaches why_not."""
    b = dsv4core_rocm.make_backend("cpu", arch=lambda: "gfx942", available=lambda: (True, ""))
    w = torch.zeros(128, 128, dtype=torch.uint8)
    w[0, 0] = 0xFF
    args = (torch.randn(2, 128).bfloat16(), w.view(FN), torch.ones(1, 1))
    assert not b.impls["linear"].supports(*args) and "NaN codes" in b.impls["linear"].why_not(*args)
    assert b.impls["linear"].capturable and b.impls["linear"].native_quantized


def test_fnuz_only_where_kernels_read_it(monkeypatch):
    """A ROCm GPU or the CPU (interpreter) reads e4m3fnuz; an NVIDIA GPU running the gfx942 launch
    table (benchmarks/vendor_tables_on_cuda.py) does not, so its e4m3fn weights pass through."""
    gpu = torch.empty(1, device="meta")          # stands for a non-CPU tensor here
    monkeypatch.setattr(torch.version, "hip", None)
    assert fp8._fnuz_device(torch.empty(1)) and not fp8._fnuz_device(gpu)
    monkeypatch.setattr(torch.version, "hip", "7.0.1")
    assert fp8._fnuz_device(gpu)


def test_a_weight_that_cannot_be_written_is_converted_as_a_copy(monkeypatch):
    """If the opted-in in-place -0 rewrite raises (a storage torch refuses to write), the
    conversion uses an e4m3fnuz copy instead: still exact, the weight untouched."""
    w = torch.zeros(4, 4, dtype=torch.uint8)
    w[0, 0], w[1, 1] = 0x80, 0x38
    w = w.view(FN)

    def refuse(self, *a, **k):
        raise RuntimeError("not writable")

    monkeypatch.setattr(fp8, "_in_place_allowed", lambda t: True)
    monkeypatch.setattr(torch.Tensor, "masked_fill_", refuse)
    wz, s2 = fp8.to_fnuz(w, torch.ones(1, 1))
    assert w.view(torch.uint8)[0, 0] == 0x80 and wz.data_ptr() != w.data_ptr()       # untouched, copied
    assert torch.equal(wz.to(torch.float64) * s2.double(), w.to(torch.float64))
