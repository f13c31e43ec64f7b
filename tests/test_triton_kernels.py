"""The portable Triton kernels (dsv4core/kernels/triton) on this CPU machine via the Triton
interpreter, judged like conformance: per output, err_kernel <= k * err_reference + floor against an
fp64 evaluation of the reference (k, floor from each op's Tolerance in dsv4core/hal/ops).

TRITON_INTERPRET must be set before triton is imported, so the kernels run in ONE subprocess
(``python -m dsv4core.kernels.triton.selftest``) and the rest of the suite is unaffected.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from dsv4core.kernels.triton import OPS  # noqa: E402  (cheap: no triton import)


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "selftest.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "dsv4core.kernels.triton.selftest", "--device", "cpu",
                           "--shapes", "small", "--json", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert out.exists(), f"selftest produced no report:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("op", sorted(OPS))
def test_kernel_matches_reference(selftest, op):
    rows = [r for r in selftest["results"] if r["op"] == op]
    assert rows, f"no cases ran for {op}"
    bad = [r for r in rows if r["status"] in ("fail", "error")]
    assert not bad, "\n".join(f"{r['case']} {r['dtype']}: {r.get('detail')}" for r in bad)
    ran = [r for r in rows if r["status"] == "pass"]
    # every op must actually run its kernel on both activation dtypes (not just decline)
    assert {r["dtype"] for r in ran} == {"float32", "bfloat16"}, rows


def _backend(device_type):
    from dsv4core.hal import Backend
    from dsv4core.kernels.triton.registry import register_ops

    b = Backend(name="t", device_types=(device_type,))
    register_ops(b, device_type)
    return b


def test_registration_matches_contract_without_importing_triton():
    code = ("import sys; import dsv4core_cuda, dsv4core.kernels.triton.interpret_plugin as ip\n"
            "from dsv4core.hal import Backend\n"
            "got = []\n"
            "dsv4core_cuda.dsv4core_register_backends(register=got.append)\n"
            "ip.dsv4core_register_backends(register=got.append)\n"
            "assert [b.name for b in got] == ['cuda', 'triton-interpret'], got\n"
            "assert 'triton' not in sys.modules, 'registration imported triton'\n"
            "print(got[0].available()); print(got[1].available())\n")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(__file__), "..", "plugins", "cuda"),
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    if not torch.cuda.is_available():
        assert lines[0].startswith("(False,"), lines
    assert lines[1].startswith("(False,") and "TRITON_INTERPRET" in lines[1], lines


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
