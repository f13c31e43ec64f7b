"""The rocm and xpu backends' portable-kernel ops with their own launch tables, on CPU through the
Triton interpreter, judged by the conformance suite (shapes "small", fp32 and bf16).

What this checks: the launch-table mechanism (tables reach the kernels, per-arch and per-dtype
entries), that the shared kernel source is correct under each table's tile sizes, and the rocm
dispatch between the emulated aiter and the portable kernel (gfx942: aiter mhc, portable wo_a;
gfx950: aiter mhc and wo_a at decode sizes), and gfx942's FP8 path: the OCP e4m3fn weights of the
linear / wo_a cases reach the real kernels as their e4m3fnuz view with doubled scales
(dsv4core_rocm/fp8.py) and must pass the conformance bound like gfx950's e4m3fn ones. Ops are chosen so that each
distinct tile shape runs once (gfx950's attention tile, 16 x 32, is a power-of-two tile like
gfx942's 16 x 16 and the kernels' default 16 x 64; moe_experts' table tile, 64 x 32, is left to
the AOT gate and the H200 run: the interpreter needs ~17 s for it). What it cannot check: AMD /
Intel code generation (tests/test_rocm_aot.py compiles for gfx942 / gfx950) or anything on the
hardware. One subprocess: TRITON_INTERPRET must be set before triton is imported.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from _pytest.monkeypatch import MonkeyPatch
from vendor_emul import install_aiter
install_aiter(MonkeyPatch())
import dsv4core_rocm, dsv4core_xpu
from dsv4core_rocm import aiter_ops, fp8
converted = []
_to_fnuz = fp8.to_fnuz
fp8.to_fnuz = lambda w, s: converted.append(str(s.dtype)) or _to_fnuz(w, s)
from dsv4core_xpu.launch import current
from dsv4core.conformance import run
aiter_ops.aiter_version = lambda: None
ok = lambda: (True, "")
backends = {
    "rocm-gfx942": dsv4core_rocm.make_backend("cpu", arch=lambda: "gfx942", available=ok),
    "rocm-gfx950": dsv4core_rocm.make_backend("cpu", arch=lambda: "gfx950", available=ok),
    # the interpreter has no target: the XPU-only keywords are dropped, as on the H200 run
    "xpu": dsv4core_xpu.make_backend("cpu", available=ok, launch=lambda: current(accepted=frozenset(), slm=64 * 1024)),
}
ops = json.loads(sys.argv[3])
out = {}
for name, b in backends.items():
    out[name] = run(b, ops=ops[name], shapes="small", dtypes=("float32", "bfloat16"), device="cpu").as_dict()
    out[name]["aiter"] = aiter_ops.status(lambda: name.split("-")[-1]) if name.startswith("rocm") else None
    out[name]["fnuz_conversions"] = list(converted)
    converted.clear()
json.dump(out, open(sys.argv[1], "w"))
"""

#: per backend, the ops whose launch entries differ from the kernels' defaults in what the
#: interpreter sees (tile sizes; it ignores stages and AMD keywords), plus rocm's aiter dispatch
OPS = {"rocm-gfx942": ("sparse_mqa_attention", "wo_a", "linear"),
       "rocm-gfx950": ("wo_a", "hc_pre", "hc_post"),
       "xpu": ("sparse_mqa_attention",)}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("vendor_triton") / "reports.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    tests = str(Path(__file__).parents[1])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(out), tests, json.dumps(OPS)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert out.exists(), f"no report:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("backend,op", [(b, op) for b, ops in OPS.items() for op in ops])
def test_passes_with_vendor_launch_table(reports, backend, op):
    (res,) = [o for o in reports[backend]["ops"] if o["op"] == op]
    bad = [c for c in res["cases"] if c["status"] not in ("passed", "declined")]
    assert not bad, "\n".join(f"{c['id']}: {c['message']}" for c in bad)
    ran = {c["dtype"] for c in res["cases"] if c["status"] == "passed"}
    assert ran == {"float32", "bfloat16"}, res["summary"] if "summary" in res else res["status"]


def test_rocm_fp8_weights_on_gfx942_run_as_fnuz(reports):
    def fp8_status(backend, op):
        (res,) = [o for o in reports[backend]["ops"] if o["op"] == op]
        # (the official W8A8 case with FP8 weights too: its activation pass runs before the weights' GEMM)
        return {c["status"] for c in res["cases"] if "fp8" in c["tags"]}

    for op in ("wo_a", "linear"):
        assert fp8_status("rocm-gfx942", op) == {"passed"}, op
    assert fp8_status("rocm-gfx950", "wo_a") == {"passed"}
    # gfx942 converted every FP8 weight it ran (fp32 and e8m0 scales); gfx950 none
    got = reports["rocm-gfx942"]["fnuz_conversions"]
    assert {"torch.float32", "torch.float8_e8m0fnu"} <= set(got), got
    assert reports["rocm-gfx950"]["fnuz_conversions"] == []


def test_rocm_aiter_paths(reports):
    assert reports["rocm-gfx942"]["aiter"]["hc_pre"] == "aiter aiter.ops.mhc.mhc_pre"
    assert reports["rocm-gfx942"]["aiter"]["wo_a"].startswith("portable (arch gfx942")
    assert reports["rocm-gfx950"]["aiter"]["wo_a"] == "aiter aiter.ops.triton.gemm.batched.batched_gemm_bf16.batched_gemm_bf16"
