"""moe_experts' split K (dsv4core/kernels/triton/moe.py, TUNE "Su" / "Sd"): with the gate / up GEMM
split over H into Su parts (raw partial sums; _moe_act_kernel sums them and applies the SwiGLU) and
the down GEMM split over I into Sd parts (summed by the combine), the selected conformance cases of
the small shapes (H = 256, I = 64) pass the conformance rule (selftest.check_case: kernel error vs
an fp64 evaluation <= k * the reference's error + floor) under the Triton interpreter: fp32 and bf16
activations, fp32 / bf16 / FP8 / FP4 weights (and FP4 "scaled"), dropped slots, the clamp.

The parts (K steps: 32 columns with bf16 activations, 128 with fp32 ones and with FP8 weights):
bf16 Su = 3 over H: 96 / 96 / 64 (a short last part), Sd = 2 over I: 32 / 32 (both nonempty: a
combine that drops a part fails), Sd = 3: 32 / 32 / 0 (an empty part); fp32 Su = 2: 128 / 128,
Su = 3: 128 / 128 / 0, Sd = 2: 64 / 0. The launcher test checks grids, buffers and constexprs (no
split: the launch of before, without the split keywords) and the TUNE checks.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from _interp import interpreted_report  # noqa: E402
from launch_recorder import Recorder  # noqa: E402

_SCRIPT = r"""
import json, sys
import torch
from dsv4core.hal import Backend, catalogue
from dsv4core.kernels.triton import moe
from dsv4core.kernels.triton.registry import register_ops
from dsv4core.kernels.triton.selftest import check_case
from dsv4core.conformance.cases import iter_cases

b = Backend(name="t", device_types=("cpu",))
register_ops(b, "cpu", ["moe_experts"])
spec = catalogue()["moe_experts"]
impl = b.impls["moe_experts"]
# (cases, splits) per activation dtype; the parts each split makes are in the module docstring
picks = {torch.float32: (("skip-negative-ids", "fp8-e8m0-T1"), ({"Su": 2}, {"Su": 3, "Sd": 2})),
         torch.bfloat16: (("clamp-heavy", "fp4-T33", "fp4-w13-fp8-w2-T3"), ({"Su": 3}, {"Sd": 2}, {"Su": 2, "Sd": 3}))}
results = []
for dt, (names, splits) in picks.items():
    cases = [c for c in iter_cases(spec, "small", dt, "cpu", 0) if c.name in names]
    runs = [(split, c) for split in splits for c in cases]
    if dt == torch.bfloat16:
        runs += [({"Su": 3, "Sd": 2, "fp4": "scaled"}, c) for c in cases if c.name.startswith("fp4")]
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
    # fp32: 2 cases x 2 splits; bf16: 3 cases x 3 splits and the 2 FP4 cases with "scaled"
    assert len(rep["cases"]) == 2 * 2 + 3 * 3 + 2
    bad = [c for c in rep["cases"] if c["status"] != "pass"]
    assert not bad, bad


def test_split_k_launches(monkeypatch):
    import torch

    from dsv4core.kernels.triton import moe

    E, H, I, T, k = 4, 256, 64, 3, 2
    g = torch.Generator().manual_seed(0)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    x, ids, wts = torch.randn(T, H, generator=g), torch.randint(0, E, (T, k), generator=g), torch.rand(T, k, generator=g)
    for name in ("_moe_align_kernel", "_moe_up_kernel", "_moe_act_kernel", "_moe_down_kernel", "_moe_combine_kernel"):
        monkeypatch.setattr(moe, name, Recorder())
    split_keys = {"SPLIT", "YS"}
    try:
        for tune, (su, sd) in (({}, (1, 1)), ({"Su": 4}, (4, 1)), ({"Sd": 2}, (1, 2)), ({"Su": 3, "Sd": 5}, (3, 5))):
            moe.TUNE.clear()
            moe.TUNE.update(tune)
            acts = len(moe._moe_act_kernel.launches)
            moe.moe_experts(x, ids, wts, w13, w2, 7.0)
            (ug, ua, ukw), (dg, da, dkw), (cg, ca, ckw) = (getattr(moe, n).launches[-1] for n in
                                                           ("_moe_up_kernel", "_moe_down_kernel", "_moe_combine_kernel"))
            assert len(moe._moe_act_kernel.launches) == acts + (su > 1), tune
            assert len(ug) == (3 if su > 1 else 2) and ug[2:] == ((su,) if su > 1 else ()), (tune, ug)
            assert len(dg) == (3 if sd > 1 else 2) and dg[2:] == ((sd,) if sd > 1 else ()), (tune, dg)
            # up's output: the activation (down's input), or the parts the activation kernel reads;
            # the down results (combine's input)
            assert tuple(ua[4].shape) == ((T * k, su, 2 * I) if su > 1 else (T * k, I)), tune
            assert tuple(da[0].shape) == (T * k, I) and da[3] is ca[0]
            if su > 1:
                ag, aa, akw = moe._moe_act_kernel.launches[-1]
                assert aa[0] is ua[4] and aa[1] is da[0] and aa[3] == 7.0 and akw["S"] == su, tune
                assert ag[0] == T * k and ag[1] * akw["BI"] >= I, tune
            else:
                assert ua[4] is da[0]
            assert tuple(da[3].shape) == ((T * k, sd, H) if sd > 1 else (T * k, H)), tune
            got = {n: kw for n, kw in (("up", ukw), ("down", dkw), ("combine", ckw))}
            assert {k_: v for k_, v in got["up"].items() if k_ in split_keys} == ({"SPLIT": su} if su > 1 else {})
            assert {k_: v for k_, v in got["down"].items() if k_ in split_keys} == ({"SPLIT": sd} if sd > 1 else {})
            assert {k_: v for k_, v in got["combine"].items() if k_ in split_keys} == ({"YS": sd} if sd > 1 else {})
        for bad in (0, 17, 2.0, True, "2"):
            moe.TUNE.clear()
            moe.TUNE.update(Su=bad)
            with pytest.raises(ValueError, match=r"moe_experts: TUNE Su=.* must be an int in \[1, 16\]"):
                moe.moe_experts(x, ids, wts, w13, w2, 7.0)
    finally:
        moe.TUNE.clear()


def _sm90_moe_tiles():
    """The CUDA plugin's sm90 tile function for moe (the tiles the "h200" rule was timed with)."""
    from dsv4core_cuda.launch import TABLES

    return TABLES.resolve((9, 0))["moe"]["tiles"]


def test_default_split_rule():
    """`_split_rule` at Flash dims (H 4096, I 2048, top-6 of 256) with an H200's 264 target programs
    and the CUDA sm90 tiles: the two measured cases split (FP4 "scaled" gate / up at <= 96 pairs: Su 2;
    the shared expert at the small-T tiles: Su 2, Sd 4), everything else does not; TUNE overrides
    either part."""
    from dsv4core.kernels.triton import moe
    from dsv4core.kernels.triton.launch import active

    H, I, progs = 4096, 2048, 264
    tiles = _sm90_moe_tiles()

    def rule(P, E, *, fp8=False, scaled=False, plain=True, ieee=False, H=H, I=I):
        with active({"moe": {"tiles": tiles}}):
            cfg = moe._config(P, E, ieee, False, fp8, H, I, progs, plain=plain, scaled=scaled, big=True)
        return moe._split_rule(P, E, H, I, cfg, progs, ieee, scaled)

    for T in (1, 8, 64):
        assert rule(T, 1) == (2, 4), T                       # the shared expert
    assert rule(256, 1) == (1, 1)                            # BM 128: every split lost
    for T in (1, 2, 4, 8, 16):
        assert rule(6 * T, 256, scaled=True, plain=False) == (2, 1), T
    assert rule(6 * 32, 256, scaled=True, plain=False) == (1, 1)
    for T in (1, 8):
        assert rule(6 * T, 256) == (1, 1) and rule(6 * T, 256, fp8=True, plain=False) == (1, 1), T
    assert rule(1, 1, ieee=True) == (1, 1) and rule(6, 256, scaled=True, ieee=True) == (1, 1)
    # short K: every part keeps >= 4 K steps (the small shapes: H 256, I 64, BK 128 -> no split)
    assert rule(1, 1, H=256, I=64) == (1, 1) and rule(6, 16, scaled=True, plain=False, H=256, I=64) == (1, 1)
    try:
        moe.TUNE.clear()
        moe.TUNE.update(Su=1)
        assert moe._splits((2, 4)) == (1, 4)
        moe.TUNE.update(Sd=2)
        assert moe._splits((2, 4)) == (1, 2)
    finally:
        moe.TUNE.clear()


def test_default_split_reaches_the_launches(monkeypatch):
    """moe_experts launches no split by default and what `_split_rule` picks with TUNE split "h200"
    (the CUDA sm90 table's), on a GPU-like path (not IEEE, an H200's 264
    target programs; meta tensors, kernels recorded): Flash dims, the shared expert at T = 1 -> up
    grid x 2 parts, down grid x 4 and the activation kernel; FP4 "scaled" routed experts at T = 1 ->
    up x 2, down unsplit; bf16 routed experts -> no split (the launch of before)."""
    import torch

    from dsv4core.kernels.triton import moe

    for name in ("_moe_align_kernel", "_moe_up_kernel", "_moe_act_kernel", "_moe_down_kernel", "_moe_combine_kernel"):
        monkeypatch.setattr(moe, name, Recorder())
    monkeypatch.setattr(moe, "interp", lambda t: False)
    monkeypatch.setattr(moe, "target_programs", lambda dev, *a: 264)
    monkeypatch.setattr(moe, "shared_bytes", lambda dev: 232448)
    H, I, meta = 4096, 2048, torch.device("meta")
    x = torch.empty(1, H, dtype=torch.bfloat16, device=meta)

    def launch(E, k, fmt):
        ids = torch.empty(1, k, dtype=torch.int64, device=meta)
        wts = torch.empty(1, k, device=meta)
        if fmt == "fp4":
            w13, w2 = (torch.empty(E, 2 * I, H // 2, dtype=torch.int8, device=meta),
                       torch.empty(E, H, I // 2, dtype=torch.int8, device=meta))
            s13, s2 = (torch.empty(E, 2 * I, H // 32, dtype=torch.uint8, device=meta),
                       torch.empty(E, H, I // 32, dtype=torch.uint8, device=meta))
        else:
            w13, w2 = (torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=meta),
                       torch.empty(E, H, I, dtype=torch.bfloat16, device=meta))
            s13 = s2 = None
        acts = len(moe._moe_act_kernel.launches)
        moe.moe_experts(x, ids, wts, w13, w2, 10.0, s13, s2)
        (ug, _, ukw), (dg, _, dkw) = moe._moe_up_kernel.launches[-1], moe._moe_down_kernel.launches[-1]
        return ug[2:], dg[2:], ukw.get("SPLIT", 1), dkw.get("SPLIT", 1), len(moe._moe_act_kernel.launches) - acts

    try:
        moe.TUNE.clear()
        assert launch(1, 1, "bf16") == ((), (), 1, 1, 0)           # the portable default: unsplit
        moe.TUNE.update(split="h200", tiles=_sm90_moe_tiles())     # the CUDA sm90 table's rule and tiles
        assert launch(1, 1, "bf16") == ((2,), (4,), 2, 4, 1)        # the shared expert
        assert launch(256, 6, "bf16") == ((), (), 1, 1, 0)         # bf16 routed experts: unsplit
        moe.TUNE.update(fp4="scaled")                              # the CUDA sm90 table's FP4 decode
        assert launch(256, 6, "fp4") == ((2,), (), 2, 1, 1)
        moe.TUNE.update(Su=1)                                      # TUNE overrides the rule
        assert launch(256, 6, "fp4") == ((), (), 1, 1, 0)
    finally:
        moe.TUNE.clear()
