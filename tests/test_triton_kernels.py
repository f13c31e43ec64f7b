"""The portable Triton kernels (dsv4core/kernels/triton) on this CPU machine via the Triton
interpreter, judged by the conformance suite (dsv4core.conformance, shapes "small", float32 and
bfloat16): the "triton-interpret" backend must pass every case of every op it implements.

TRITON_INTERPRET must be set before triton is imported, so the suite runs in ONE subprocess and
the rest of the test session is unaffected. (On a GPU the same check is
``dsv4core conformance --backend cuda --device cuda``; ``python -m dsv4core.kernels.triton.selftest``
is a stricter developer check without the conformance suite's output-rounding allowance.)
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


_CONFORMANCE = """
import json, sys
from dsv4core.conformance import run
from dsv4core.kernels.triton import interpret_plugin
got = []
interpret_plugin.dsv4core_register_backends(register=got.append)
ok, why = got[0].available()
assert ok, why
rep = run(got[0], shapes="small", dtypes=("float32", "bfloat16"), device="cpu")
json.dump(rep.as_dict(), open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def conformance(tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "conformance.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _CONFORMANCE, str(out)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert out.exists(), f"conformance produced no report:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("op", sorted(OPS))
def test_kernel_passes_conformance_in_interpreter(conformance, op):
    (res,) = [o for o in conformance["ops"] if o["op"] == op]
    assert res["implemented"], f"{op} not registered"
    bad = [c for c in res.get("cases", []) if c["status"] not in ("passed", "declined")]
    assert not bad and res["failed"] == 0, "\n".join(f"{c['id']}: {c['message']}" for c in bad) or res
    # the kernel must actually run (not just decline) for both activation dtypes
    ran = {c["dtype"] for c in res.get("cases", []) if c["status"] == "passed"}
    assert ran == {"float32", "bfloat16"}, res


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
