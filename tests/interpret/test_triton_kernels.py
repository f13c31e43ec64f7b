"""The portable Triton kernels (dsv4core/kernels/triton) on this CPU machine via the Triton
interpreter, judged by the conformance suite (dsv4core.conformance, shapes "small", float32 and
bfloat16): the "triton-interpret" backend must pass every case of every op it implements.

TRITON_INTERPRET must be set before triton is imported, so the suite runs in ONE subprocess and
the rest of the test session is unaffected. (On a GPU the same check is
``dsv4core conformance --backend cuda --device cuda``; ``python -m dsv4core.kernels.triton.selftest``
is a kernel-level loop judged by the same code, dsv4core.hal.compare.judge.)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from _interp import interpreted_report

pytest.importorskip("triton")

from dsv4core.kernels.triton import OPS  # noqa: E402  (cheap: no triton import)


_CONFORMANCE = """
import json, sys
from dsv4core.conformance import run
from dsv4core.kernels.triton import interpret_plugin
got = []
interpret_plugin.dsv4core_register_backends(register=got.append)
ok, why = got[0].available()
rep = run(got[0], shapes="small", dtypes=("float32", "bfloat16"), device="cpu").as_dict() if ok else None
json.dump({"backends": [b.name for b in got], "available": [ok, why], "report": rep}, open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def conformance(tmp_path_factory):
    out = interpreted_report(_CONFORMANCE, tmp_path_factory.mktemp("triton"), "conformance", timeout=900)
    assert out["backends"] == ["triton-interpret"], out["backends"]
    assert out["available"][0] is True, f"triton-interpret unavailable under TRITON_INTERPRET=1: {out['available'][1]}"
    return out["report"]


@pytest.mark.parametrize("op", sorted(OPS))
def test_kernel_passes_conformance_in_interpreter(conformance, op):
    (res,) = [o for o in conformance["ops"] if o["op"] == op]
    assert res["implemented"], f"{op} not registered"
    bad = [c for c in res.get("cases", []) if c["status"] not in ("passed", "declined")]
    assert not bad and res["failed"] == 0, "\n".join(f"{c['id']}: {c['message']}" for c in bad) or res
    # the kernel must actually run (not just decline) for every dtype the suite ran the op in
    # (both activation dtypes; ops whose inputs are fp32 by contract, such as moe_route and
    # compress_windows, have no bfloat16 case and run once, in float32)
    ran = {c["dtype"] for c in res.get("cases", []) if c["status"] == "passed"}
    assert ran == {c["dtype"] for c in res.get("cases", [])} and "float32" in ran, res
    from dsv4core.conformance.cases import iter_cases
    from dsv4core.hal import catalogue

    if next(iter_cases(catalogue()[op], "small", torch.bfloat16, "cpu", 0), None) is not None:
        assert "bfloat16" in ran, res


def _backend(device_type):
    from dsv4core.hal import Backend
    from dsv4core.kernels.triton.registry import register_ops

    b = Backend(name="t", device_types=(device_type,))
    register_ops(b, device_type)
    return b


def test_registration_matches_contract_without_importing_triton():
    code = ("import json, sys; import dsv4core_cuda, dsv4core.kernels.triton.interpret_plugin as ip\n"
            "got = []\n"
            "dsv4core_cuda.dsv4core_register_backends(register=got.append)\n"
            "ip.dsv4core_register_backends(register=got.append)\n"
            "imported = sorted(m for m in ('triton', 'flashinfer', 'tvm_ffi') if m in sys.modules)\n"
            "print(json.dumps({'backends': [b.name for b in got], 'imported': imported,\n"
            "                  'available': [list(got[0].available()), list(got[-1].available())]}))\n")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "..", "plugins", "cuda"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["backends"] == ["cuda", "cuda-flashinfer", "triton-interpret"], out
    assert out["imported"] == [], f"registration imported {out['imported']}"
    cuda, interp = out["available"]
    if not torch.cuda.is_available():
        assert cuda[0] is False, cuda
    assert interp[0] is False and "TRITON_INTERPRET" in interp[1], interp


def test_predicates_decline_bad_inputs():
    b = _backend("cpu")
    x = torch.randn(3, 8, dtype=torch.float64)
    assert not b.impls["rms_norm"].supports(x, None, 1e-6)                      # fp64: reference only
    assert not b.impls["rms_norm"].supports(torch.randn(3, 8, dtype=torch.float16), None, 1e-6)
    assert b.impls["rms_norm"].supports(torch.randn(3, 8), torch.ones(8), 1e-6)
    assert not b.impls["rms_norm"].supports(torch.randn(3, 8), torch.ones(7), 1e-6)  # shape mismatch
    assert not _backend("cuda").impls["rms_norm"].supports(torch.randn(3, 8), None, 1e-6)  # wrong device
    q, kv = torch.randn(2, 4, 96), torch.randn(10, 96)                              # head dim 96 unsupported
    assert not b.impls["sparse_mqa_attention"].supports(q, kv, torch.zeros(2, 3, dtype=torch.int32),
                                                        torch.zeros(4), 0.1)
    rope = b.impls["rope"].supports
    assert not rope(torch.randn(2, 9), torch.arange(2), torch.ones(4), False)     # odd pass-through width
    # predicates never raise
    assert b.impls["hc_post"].supports(None, None, None, None) is False


def test_predicates_decline_unsupported_weights_and_mixed_devices():
    b = _backend("cpu")
    lin, moe = b.impls["linear"].supports, b.impls["moe_experts"].supports
    x = torch.randn(2, 256)
    w8 = torch.zeros(64, 256, dtype=torch.float8_e4m3fn)
    assert lin(x, torch.randn(64, 256))
    assert lin(x, w8, torch.ones(1, 2))
    assert not lin(x, w8, torch.ones(1, 3))                                       # wrong block grid
    assert not lin(x, w8, torch.ones(1, 2, dtype=torch.float16))                  # scale dtype
    assert not lin(x, torch.randn(64, 256), None, torch.float16)                  # out dtype
    assert not lin(x, torch.randn(64, 256, device="meta"))                       # mixed devices
    E, I, H = 2, 64, 256
    ids, wts = torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1)
    w13, w2 = torch.zeros(E, 2 * I, H // 2, dtype=torch.int8), torch.zeros(E, H, I // 2, dtype=torch.int8)
    s13 = torch.zeros(E, 2 * I, H // 32, dtype=torch.float8_e8m0fnu)
    s2 = torch.zeros(E, H, I // 32, dtype=torch.uint8)
    assert moe(x, ids, wts, w13, w2, 10.0, s13, s2)                               # FP4, e8m0 / raw bytes
    assert not moe(x, ids, wts, w13, w2, 10.0, s13, s2.float())                   # FP4 scales are UE8M0
    assert not moe(x, ids, wts, w13, w2, 10.0, s13, None)                         # bytes without a scale
    assert not moe(x, ids, wts, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, 10.0, s13, s2)


_DIRECT = """
import json, sys
import torch
from dsv4core.hal import catalogue
from dsv4core.kernels.triton import linear, moe
specs = catalogue()
g = torch.Generator().manual_seed(0)
out = {}
def err(got, ref):
    return {"max_abs": float((got - ref).abs().max()), "ref_max": float(ref.abs().max())}
# a weight read through its strides (a transposed view; never copied): same result as contiguous
x, w = torch.randn(5, 256, generator=g), torch.randn(256, 96, generator=g)
out["linear_transposed"] = err(linear.linear(x, w.t()), specs["linear"].reference(x, w.t()))
# the grouped form (G = 3 groups, the wo_a layout) against the wo_a reference
o, wg = torch.randn(4, 3, 256, generator=g), torch.randn(3, 40, 256, generator=g)
out["grouped"] = err(linear.grouped_gemm(o, wg, None, torch.float32), specs["wo_a"].reference(o, wg))
# an expert id >= E (which the HAL input check rejects) poisons that token instead of being dropped
E, I, H = 4, 32, 64
w13, w2 = torch.randn(E, 2 * I, H, generator=g) * 0.1, torch.randn(E, H, I, generator=g) * 0.1
ids = torch.tensor([[0, 1], [2, E]])
y = moe.moe_experts(torch.randn(2, H, generator=g), ids, torch.rand(2, 2, generator=g), w13, w2, 10.0)
out["moe_rows"] = [{"finite": bool(torch.isfinite(r).all()), "nan": bool(torch.isnan(r).all())} for r in y]
json.dump(out, open(sys.argv[1], "w"))
"""


def test_kernels_read_strided_weights_and_poison_out_of_range_experts(tmp_path):
    out = interpreted_report(_DIRECT, tmp_path, "direct", timeout=300)
    # fp32 GEMMs of K = 256 against the fp32 reference: the summation orders differ, each within
    # K * 2**-24 relative of the exact result; 1e-4 of the largest output is that with margin
    for name in ("linear_transposed", "grouped"):
        e = out[name]
        assert e["max_abs"] <= 1e-4 * e["ref_max"], (name, e)
    assert out["moe_rows"] == [{"finite": True, "nan": False}, {"finite": False, "nan": True}], out["moe_rows"]


def test_cuda_plugin_reports_optional_providers_without_importing_them(monkeypatch):
    import importlib.util

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "..", "plugins", "cuda"))
    from dsv4core_cuda import providers

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "deep_gemm" else real(n, *a))
    st = providers.status()
    assert set(st) == {"flashinfer", "deep_gemm"}
    assert st["deep_gemm"].startswith("importable, not wired")
    assert "deep_gemm" not in sys.modules  # found, never imported
