"""moe_experts' FP4 weight decodes (dsv4core/kernels/triton/moe.py, TUNE "fp4"): the "join"
decode (``_fp4_values``) is bit-exact against the reference dequantisation for every (code, scale
byte) pair (byte 255, the reference's NaN, is NaN for every code); both decodes pass the conformance rule (selftest.check_case:
kernel error vs an fp64 evaluation <= k * the reference's error + floor) on packed FP4 experts
with varied scale bytes (0 / 1 / 2: bf16 subnormal weights; zero, negative zero and negative
codes) and on the suite's mixed FP4 / FP8 case, under the Triton interpreter; and the launcher
maps each TUNE value to the kernels' SCALED / BLK constexprs.

Interpreter limits (stated): its bf16 tl.dot is unreliable, so "join" runs its fp32 (IEEE) branch
there; "scaled" runs tl.dot_scaled with bf16 operands (bf16 activations), which the interpreter
implements (keeping scale byte 0 as 2^-127, unlike an H200's upcast: see moe.DECODES). fp32
activations read FP4 as "join" whatever TUNE says (checked by the constexpr test).
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from _interp import interpreted_report  # noqa: E402
from launch_recorder import Recorder  # noqa: E402

_SCRIPT = r"""
import json, sys
import torch
import triton, triton.language as tl
from dsv4core.hal import Backend, catalogue
from dsv4core.hal.quant import E8M0, FP4_E2M1_TABLE, quantize_fp4, scale_to_float32
from dsv4core.kernels.triton import moe
from dsv4core.kernels.triton.registry import register_ops
from dsv4core.kernels.triton.selftest import check_case
from dsv4core.conformance.cases import iter_cases

rep = {}

@triton.jit
def _join(n_ptr, s_ptr, o_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(o_ptr + i, moe._fp4_values(tl.load(n_ptr + i), tl.load(s_ptr + i)))


# every e2m1 code x every UE8M0 byte, bit for bit in fp32 (sign of zero included); every product
# has at most two significant bits, so the kernels' cast of it to bf16 is exact too
code = torch.arange(16, dtype=torch.int32).repeat(256)
byte = torch.arange(256, dtype=torch.int32).repeat_interleave(16)
out = torch.empty(4096, dtype=torch.float32)
_join[(1,)](code, byte, out, N=4096)
ref = torch.tensor(FP4_E2M1_TABLE)[code.long()] * scale_to_float32(byte.to(torch.uint8))  # fp32, exact
ok = ((out == ref) & (torch.signbit(out) == torch.signbit(ref))) | (torch.isnan(out) & torch.isnan(ref))
rep["join_mismatch_bytes"] = sorted(set(byte[~ok].tolist()))
rep["join_bf16_inexact"] = int(((out.bfloat16().float() != out) & ~torch.isnan(out)).sum())
rep["join_subnormals"] = int(((ref != 0) & (ref.abs() < 2.0 ** -126)).sum())
rep["join_byte255"] = [str(v) for v in out[byte == 255].tolist()]

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
for v, dt in (({}, torch.float32), ({}, torch.bfloat16), ({"fp4": "scaled"}, torch.bfloat16)):
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
    assert rep["join_mismatch_bytes"] == []
    assert rep["join_byte255"] == ["nan"] * 16   # codes 0..15: NaN, as the reference
    assert rep["join_bf16_inexact"] == 0
    assert rep["join_subnormals"] > 0             # the table reached bf16 subnormals (scale bytes 0 / 1)
    assert len(rep["cases"]) == 3 * 2
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
    q4d = quantize_fp4(torch.randn(E, H, I, generator=g), 32, E8M0)
    ids, wts = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    for name in ("_moe_align_kernel", "_moe_up_kernel", "_moe_down_kernel", "_moe_combine_kernel"):
        monkeypatch.setattr(moe, name, Recorder())
    # (TUNE, w2 format) -> (up SCALED, up BLK, down SCALED, down BLK) for FP4 w13 with bf16
    # activations; cpu tensors take the IEEE branch (fp32 products), so BLK is set unless "scaled"
    # runs (FP8 always: its block scale). fp32 activations never take "scaled": (False, True) each
    want = {((), "fp8"): (False, True, False, True),
            ((("fp4", "join"),), "fp8"): (False, True, False, True),
            ((("fp4", "scaled"),), "fp8"): (True, False, False, True),
            ((("fp4", "scaled"),), "fp4"): (True, False, True, False)}
    try:
        for (tune, f2), exp in want.items():
            w2, s2 = q8 if f2 == "fp8" else q4d
            for dt in (torch.bfloat16, torch.float32):
                moe.TUNE.clear()
                moe.TUNE.update(dict(tune))
                moe.moe_experts(torch.zeros(2, H, dtype=dt), ids, wts, q4[0], w2, 10.0, q4[1], s2)
                up, down = moe._moe_up_kernel.launches[-1][2], moe._moe_down_kernel.launches[-1][2]
                got = (up["SCALED"], up["BLK"], down["SCALED"], down["BLK"])
                assert got == (exp if dt == torch.bfloat16 else (False, True, False, True)), (tune, f2, dt)
        # TUNE fp8 "via_f32": VIA32 reaches the kernel of each FP8 weight only (absent otherwise)
        for tune, want_via in (({}, (False, False)), ({"fp8": "via_f32"}, (False, True))):
            moe.TUNE.clear()
            moe.TUNE.update(tune)
            moe.moe_experts(torch.zeros(2, H, dtype=torch.bfloat16), ids, wts, q4[0], q8[0], 10.0, q4[1], q8[1])
            up, down = moe._moe_up_kernel.launches[-1][2], moe._moe_down_kernel.launches[-1][2]
            assert ("VIA32" in up, "VIA32" in down) == want_via, tune
        moe.TUNE.clear()
        moe.TUNE.update(fp8="int")
        with pytest.raises(ValueError, match=r"moe_experts: TUNE fp8='int' must be one of \('cvt', 'via_f32'\)"):
            moe.moe_experts(torch.zeros(2, H), ids, wts, q4[0], q8[0], 10.0, q4[1], q8[1])
        for bad in ("interleave", "split"):            # "split" lost on the H200 (docs/perf/moe_experts.md): removed
            moe.TUNE.clear()
            moe.TUNE.update(fp4=bad)
            with pytest.raises(ValueError, match=rf"moe_experts: TUNE fp4='{bad}' must be one of \('join', 'scaled'\)"):
                moe.moe_experts(torch.zeros(2, H), ids, wts, q4[0], q8[0], 10.0, q4[1], q8[1])
    finally:
        moe.TUNE.clear()
