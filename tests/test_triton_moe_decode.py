"""moe_experts' weight decodes (dsv4core/kernels/triton/moe.py, TUNE "fp4" / "fp8"): the integer
FP4 -> bf16 decode of "split" is bit-exact against the reference dequantisation for every
(code, scale byte) pair; every decode variant passes the conformance rule (selftest.check_case:
kernel error vs an fp64 evaluation <= k * the reference's error + floor) on packed FP4 experts
with varied scale bytes (0 / 1 / 2: bf16 subnormal weights; zero, negative zero and negative
codes) and on the suite's mixed FP4 / FP8 case, fp32 and bf16 activations, under the Triton
interpreter; and the launcher maps each TUNE value to the kernels' DEC / BLK constexprs.

Interpreter limits (stated): its bf16 tl.dot is unreliable, so "join" / "split" run their fp32
(IEEE) branch there; "scaled" runs tl.dot_scaled with bf16 operands (bf16 activations), which the
interpreter implements (keeping scale byte 0 as 2^-127, unlike an H200's upcast: see moe.DECODES).
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests._interp import interpreted_report  # noqa: E402
from tests.launch_recorder import Recorder  # noqa: E402

_SCRIPT = r"""
import json, sys
import torch
import triton, triton.language as tl
from dsv4core.hal import Backend, catalogue
from dsv4core.hal.quant import E8M0, FP4_E2M1_TABLE, quantize_fp4, scale_to_float32
from dsv4core.kernels.triton import moe
from dsv4core.kernels.triton.registry import register_ops
from dsv4core.kernels.triton.selftest import check_case
from dsv4core.conformance.runner import iter_cases

rep = {}

@triton.jit
def _decode(n_ptr, s_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    t1, t2, lin, nan = moe._fp4_terms(tl.load(s_ptr + i))
    tl.store(o_ptr + i, moe._fp4_bf16(tl.load(n_ptr + i), t1, t2, lin, nan).to(tl.int16, bitcast=True))


# every e2m1 code x every UE8M0 byte, bit for bit (sign of zero included; NaN where the reference is)
code = torch.arange(16, dtype=torch.int32).repeat(256)
byte = torch.arange(256, dtype=torch.int32).repeat_interleave(16)
out = torch.empty(4096, dtype=torch.int16)
_decode[(1,)](code, byte, out, N=4096)
ref = torch.tensor(FP4_E2M1_TABLE)[code.long()] * scale_to_float32(byte.to(torch.uint8))  # fp32, exact


def mismatches(o):
    got = o.view(torch.bfloat16).float()
    ok = ((got == ref) & (torch.signbit(got) == torch.signbit(ref))) | (torch.isnan(got) & torch.isnan(ref))
    return sorted(set(byte[~ok].tolist()))


rep["decode_mismatches"] = mismatches(out)
rep["decode_subnormals"] = int(((ref != 0) & (ref.abs() < 2.0 ** -126)).sum())


@triton.jit
def _halves(w_ptr, s_ptr, lo_ptr, hi_ptr, C, R: tl.constexpr, BK: tl.constexpr):
    rows = tl.arange(0, R).to(tl.int64)
    lo, hi = moe._fp4_halves(w_ptr, s_ptr, 0, rows, rows < R, 0, C, R, BK, True, False)
    o = rows[:, None] * (BK // 2) + tl.arange(0, BK // 2)[None, :]
    tl.store(lo_ptr + o, lo.to(tl.int16, bitcast=True))
    tl.store(hi_ptr + o, hi.to(tl.int16, bitcast=True))


# the tile decode as wired in the kernels (per-group terms broadcast to the bytes): random bytes
# with random scale bytes, then with bytes 0 / 1 among them, bit for bit vs dequantize_fp4
from dsv4core.hal.quant import dequantize_fp4
hal = []
for low in (False, True):
    R, BK = 16, 64
    wq = torch.randint(0, 256, (1, R, BK // 2), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    sq = torch.randint(2, 255, (1, R, BK // 32), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    if low:
        sq[0, :4, 0] = torch.tensor([0, 1, 0, 1])
    wq, sq = wq.to(torch.uint8), sq.to(torch.uint8)
    lo, hi = torch.empty(R, BK // 2, dtype=torch.int16), torch.empty(R, BK // 2, dtype=torch.int16)
    _halves[(1,)](wq, sq, lo, hi, BK, R=R, BK=BK)
    d = dequantize_fp4(wq[0], sq[0])
    got = torch.stack((lo.view(torch.bfloat16).float(), hi.view(torch.bfloat16).float()), -1).reshape(R, BK)
    ok = ((got == d) & (torch.signbit(got) == torch.signbit(d))) | (torch.isnan(got) & torch.isnan(d))
    hal.append(int((~ok).sum()))
rep["halves_mismatches"] = hal

b = Backend(name="t", device_types=("cpu",))
register_ops(b, "cpu", ["moe_experts"])
spec = catalogue()["moe_experts"]
impl = b.impls["moe_experts"]
g = torch.Generator().manual_seed(3)
E, H, I, T, k = 3, 64, 64, 5, 2


def fp4(rows, cols):
    w, s = quantize_fp4(torch.randn(E, rows, cols, generator=g) * cols ** -0.5, 32, E8M0)
    u = s.view(torch.uint8).clone()
    # varied scale bytes around the quantiser's, and three groups of (sub)normal-edge scales
    u += torch.randint(-6, 7, u.shape, generator=g).to(torch.uint8)
    u.view(-1)[:3] = torch.tensor([0, 1, 2], dtype=torch.uint8)
    wb = w.view(torch.uint8).clone()
    wb.view(-1)[::7] &= 0xF0     # zero low nibbles (code 0)
    wb.view(-1)[3::11] = 0x88    # negative zeros (code 8)
    return wb.view(torch.int8), u.view(E8M0)


(w13, s13), (w2, s2) = fp4(2 * I, H), fp4(H, I)
ids = torch.randint(0, E, (T, k), generator=g)
ids[1, 1] = -1
custom = dict(x=None, ids=ids, weights=torch.rand(T, k, generator=g), w13=w13, w2=w2, swiglu_limit=10.0,
              w13_scale=s13, w2_scale=s2)
suite = {c.name: c for c in iter_cases(spec, "small", torch.float32, "cpu", 0)}
suite16 = {c.name: c for c in iter_cases(spec, "small", torch.bfloat16, "cpu", 0)}
results = []
for v in ({"fp4": "split"}, {"fp4": "scaled", "fp8": "scaled"}):
    for dt in (torch.float32, torch.bfloat16):
        kw = dict(custom, x=torch.randn(T, H, generator=g).to(dt) * 3)
        mixed = (suite if dt == torch.float32 else suite16)["fp4-w13-fp8-w2-T3"].kwargs
        for name, case in (("fp4-varied-scales", kw), ("fp4-w13-fp8-w2-T3", mixed)):
            moe.TUNE.clear()
            moe.TUNE.update(v)
            r = check_case(spec, impl, case, dt)
            moe.TUNE.clear()
            results.append(dict(variant=v, dtype=str(dt), case=name, status=r["status"], detail=r.get("detail", "")))
rep["cases"] = results
json.dump(rep, open(sys.argv[1], "w"))
"""


def test_decode_variants_pass_the_conformance_rule_in_interpreter(tmp_path):
    rep = interpreted_report(_SCRIPT, tmp_path, "moe_decode")
    assert rep["decode_mismatches"] == []
    assert rep["halves_mismatches"] == [0, 0]
    assert rep["decode_subnormals"] > 0           # the table reached bf16 subnormals (scale bytes 0 / 1)
    assert len(rep["cases"]) == 2 * 2 * 2
    bad = [c for c in rep["cases"] if c["status"] != "pass"]
    assert not bad, bad


def test_decode_tune_keys_select_the_kernel_constexprs(monkeypatch):
    import torch

    from dsv4core.hal.quant import E8M0, quantize_fp4, quantize_fp8_block
    from dsv4core.kernels.triton import moe

    E, H, I = 2, 128, 128
    g = torch.Generator().manual_seed(0)
    q4 = quantize_fp4(torch.randn(E, 2 * I, H, generator=g), 32, E8M0)
    q8 = quantize_fp8_block(torch.randn(E, H, I, generator=g), E8M0, 128, pow2=True)
    ids, wts = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    for name in ("_moe_align_kernel", "_moe_up_kernel", "_moe_down_kernel", "_moe_combine_kernel"):
        monkeypatch.setattr(moe, name, Recorder())
    # (TUNE, activation dtype) -> (up DEC, up BLK, down DEC, down BLK) for FP4 w13 and FP8 w2; cpu
    # tensors take the IEEE branch (fp32 products), so BLK is set unless "scaled" runs
    want = {(("fp4", "join"),): (0, True, 0, True),
            (("fp4", "split"),): (1, True, 0, True),
            (("fp4", "scaled"), ("fp8", "scaled")): (2, False, 2, True),
            (("fp8", "cvt"),): (0, True, 0, True)}
    try:
        for tune, (d13, b13, d2, b2) in want.items():
            for dt in (torch.bfloat16, torch.float32):
                moe.TUNE.clear()
                moe.TUNE.update(dict(tune))
                moe.moe_experts(torch.zeros(2, H, dtype=dt), ids, wts, q4[0], q8[0], 10.0, q4[1], q8[1])
                up, down = moe._moe_up_kernel.launches[-1][2], moe._moe_down_kernel.launches[-1][2]
                if dt == torch.float32 and d13 == 2:        # fp32 activations: "scaled" reads FP4 as split,
                    exp = (1, True, 0, True)                # FP8 as cvt
                else:
                    exp = (d13, b13, d2, b2)
                assert (up["DEC"], up["BLK"], down["DEC"], down["BLK"]) == exp, (tune, dt)
        moe.TUNE.clear()
        moe.TUNE.update(fp4="interleave")
        with pytest.raises(ValueError, match=r"moe_experts: TUNE fp4='interleave' must be one of"):
            moe.moe_experts(torch.zeros(2, H), ids, wts, q4[0], q8[0], 10.0, q4[1], q8[1])
    finally:
        moe.TUNE.clear()
