"""moe_experts' split K (dsv4core/kernels/triton/moe.py, TUNE "Su" / "Sd"): with the gate / up GEMM
split over H into Su parts (raw partial sums, the SwiGLU applied by the down kernel) and the down
GEMM split over I into Sd parts (summed by the combine), every selected conformance case of the
small shapes passes the conformance rule (selftest.check_case: kernel error vs an fp64 evaluation
<= k * the reference's error + floor) under the Triton interpreter, for fp32 and bf16 activations
and bf16 / fp32 / FP8 / FP4 weights (and FP4 "scaled"), dropped slots and the clamp. The splits
make a short last part (Su = 3 over H = 256 in 32-column steps: 96 / 96 / 64) and an empty one
(Sd = 3 over I = 64: 32 / 32 / 0; FP8's 128-column steps over H: 128 / 128 / 0). The launcher test checks grids, buffers and
constexprs (no split: the launch of before, without the split keywords) and the TUNE checks.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests._interp import interpreted_report  # noqa: E402
from tests.launch_recorder import Recorder  # noqa: E402

_SCRIPT = r"""
import json, sys
import torch
from dsv4core.hal import Backend, catalogue
from dsv4core.kernels.triton import moe
from dsv4core.kernels.triton.registry import register_ops
from dsv4core.kernels.triton.selftest import check_case
from dsv4core.conformance.runner import iter_cases

b = Backend(name="t", device_types=("cpu",))
register_ops(b, "cpu", ["moe_experts"])
spec = catalogue()["moe_experts"]
impl = b.impls["moe_experts"]
picks = {torch.float32: ("T33-E8", "skip-negative-ids", "fp8-e8m0-T1", "fp4-T33"),
         torch.bfloat16: ("T1-E8", "clamp-heavy", "fp4-T33", "fp4-w13-fp8-w2-T3")}
results = []
for dt, names in picks.items():
    cases = [c for c in iter_cases(spec, "small", dt, "cpu", 0) if c.name in names]
    runs = [({"Su": 2}, c) for c in cases] + [({"Su": 3, "Sd": 3}, c) for c in cases]
    if dt == torch.bfloat16:
        runs += [({"Su": 3, "Sd": 3, "fp4": "scaled"}, c) for c in cases if c.name.startswith("fp4")]
    for tune, case in runs:
        moe.TUNE.clear()
        moe.TUNE.update(tune)
        r = check_case(spec, impl, case.kwargs, dt)
        moe.TUNE.clear()
        results.append(dict(tune=tune, dtype=str(dt), case=case.name, status=r["status"], detail=r.get("detail", "")))
json.dump({"cases": results}, open(sys.argv[1], "w"))
"""


def test_split_k_passes_the_conformance_rule_in_interpreter(tmp_path):
    rep = interpreted_report(_SCRIPT, tmp_path, "moe_split")
    # 4 cases x 2 splits per dtype, and the 2 FP4 cases with "scaled" at bf16
    assert len(rep["cases"]) == 2 * 4 * 2 + 2
    bad = [c for c in rep["cases"] if c["status"] != "pass"]
    assert not bad, bad


def test_split_k_launches(monkeypatch):
    import torch

    from dsv4core.kernels.triton import moe

    E, H, I, T, k = 4, 256, 64, 3, 2
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    x, ids, wts = torch.randn(T, H, generator=g), torch.randint(0, E, (T, k), generator=g), torch.rand(T, k, generator=g)
    for name in ("_moe_align_kernel", "_moe_up_kernel", "_moe_down_kernel", "_moe_combine_kernel"):
        monkeypatch.setattr(moe, name, Recorder())
    split_keys = {"SPLIT", "SPLIT_IN", "LIMIT", "YS"}
    try:
        for tune, (su, sd) in (({}, (1, 1)), ({"Su": 4}, (4, 1)), ({"Sd": 2}, (1, 2)), ({"Su": 3, "Sd": 5}, (3, 5))):
            moe.TUNE.clear()
            moe.TUNE.update(tune)
            moe.moe_experts(x, ids, wts, w13, w2, 7.0)
            (ug, ua, ukw), (dg, da, dkw), (cg, ca, ckw) = (getattr(moe, n).launches[-1] for n in
                                                           ("_moe_up_kernel", "_moe_down_kernel", "_moe_combine_kernel"))
            assert len(ug) == (3 if su > 1 else 2) and ug[2:] == ((su,) if su > 1 else ()), (tune, ug)
            assert len(dg) == (3 if sd > 1 else 2) and dg[2:] == ((sd,) if sd > 1 else ()), (tune, dg)
            # the activation buffer (up's output, down's input) and the down results (combine's input)
            assert tuple(ua[4].shape) == ((T * k, su, 2 * I) if su > 1 else (T * k, I)), tune
            assert ua[4] is da[0] and da[3] is ca[0]
            assert tuple(da[3].shape) == ((T * k, sd, H) if sd > 1 else (T * k, H)), tune
            got = {n: kw for n, kw in (("up", ukw), ("down", dkw), ("combine", ckw))}
            assert {k_: v for k_, v in got["up"].items() if k_ in split_keys} == ({"SPLIT": su} if su > 1 else {})
            want_down = ({"SPLIT": sd} if sd > 1 else {}) | ({"SPLIT_IN": su, "LIMIT": 7.0} if su > 1 else {})
            assert {k_: v for k_, v in got["down"].items() if k_ in split_keys} == want_down, tune
            assert {k_: v for k_, v in got["combine"].items() if k_ in split_keys} == ({"YS": sd} if sd > 1 else {})
        for bad in (0, 17, 2.0, True, "2"):
            moe.TUNE.clear()
            moe.TUNE.update(Su=bad)
            with pytest.raises(ValueError, match=r"moe_experts: TUNE Su=.* must be an int in \[1, 16\]"):
                moe.moe_experts(x, ids, wts, w13, w2, 7.0)
    finally:
        moe.TUNE.clear()
