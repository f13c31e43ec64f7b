"""The rocm / ascend / xpu plugins on a machine without their hardware or vendor stacks.

* discovery: all three listed, unavailable, each with its precise reason and "not validated on
  hardware"; the other backends unaffected; importing the plugins pulls in no vendor library;
* the static probes, with the platform faked (torch.version.hip / xpu, device counts, Triton's
  backend list, a torch_npu whose import fails the way it does without CANN);
* the ascend glue on CPU tensors under an emulated torch_npu / vllm-ascend (tests/vendor_emul),
  judged by the conformance suite against the fp64 oracle, including its declines;
* the rocm aiter glue under an emulated aiter (hc_pre / hc_post / wo_a), and its version gate.
  (The rocm backend's portable-kernel ops need the Triton interpreter: tests/interpret/test_rocm_xpu_triton.py.)
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import subprocess
import sys

import pytest
import torch

from dsv4core.conformance import run
from dsv4core.hal.validation import NOT_VALIDATED, passed_ops, recorded

from vendor_emul import install_aiter, install_ascend

VENDORS = ("rocm", "ascend", "xpu")


def _cli(capsys, *args):
    """The CLI in this process (discovery is the same code; no second torch import)."""
    from dsv4core.cli import main
    from dsv4core.hal import reset

    reset()
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_backends_lists_vendor_plugins_unavailable_with_reasons(capsys):
    rc, out, err = _cli(capsys, "backends", "--json")
    assert rc == 0, err
    got = {b["name"]: b for b in json.loads(out)}
    want = {"rocm": "not a ROCm build (torch.version.hip is None)",
            "ascend": "torch_npu is not installed",
            "xpu": "not an XPU build (torch.version.xpu is None)"}
    for name, reason in want.items():
        b = got[name]
        assert not b["available"] and reason in b["reason"], b
        assert b["validated"] == NOT_VALIDATED, b
        assert b["ops"], f"{name} registered no ops"
    assert got["reference"]["available"] and got["reference"]["reason"] == ""
    assert "cuda" in got and "CPU-only build" in got["cuda"]["reason"]   # unaffected, own reason
    rc, out, _ = _cli(capsys, "backends")
    assert rc == 0 and "not validated on hardware" in out


def test_plugin_import_and_registration_load_no_vendor_library():
    code = ("import json, sys\n"
            "import dsv4core_rocm, dsv4core_ascend, dsv4core_xpu\n"
            "got = []\n"
            "for m in (dsv4core_rocm, dsv4core_ascend, dsv4core_xpu):\n"
            "    m.dsv4core_register_backends(register=got.append)\n"
            "heavy = [m for m in ('triton', 'aiter', 'torch_npu', 'vllm_ascend') if m in sys.modules]\n"
            "print(json.dumps({'backends': sorted(b.name for b in got), 'imported': heavy}))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["imported"] == [], f"registration imported {out['imported']}"
    assert out["backends"] == ["ascend", "rocm", "xpu"]


def test_ops_cli_names_the_unavailable_backend(capsys):
    rc, out, err = _cli(capsys, "ops", "--backend", "rocm")
    assert rc != 0 and "not a ROCm build" in (err + out)


# ---------------------------------------------------------------------------------------------
# static probes
# ---------------------------------------------------------------------------------------------

def test_rocm_probe(monkeypatch):
    import dsv4core_rocm as r

    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    ok, why = r._available()
    assert not ok and "a CUDA build (CUDA 13.0), not a ROCm build" in why
    monkeypatch.setattr(torch.version, "hip", "7.0.1")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    ok, why = r._available()
    assert not ok and "HIP 7.0.1" in why and "sees no AMD GPU" in why
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    import triton.backends

    monkeypatch.setattr(triton.backends, "backends", {"nvidia": object()})
    ok, why = r._available()
    assert not ok and "no 'amd' backend" in why and "reinstall 'pytorch-triton-rocm'" in why
    monkeypatch.setattr(triton.backends, "backends", {"nvidia": object(), "amd": object()})
    assert r._available() == (True, "")


def test_rocm_arch_from_gcn_name_not_from_hasattr():
    from dsv4core_rocm import arch_of

    assert arch_of("gfx942:sramecc+:xnack-") == "gfx942"
    assert arch_of("gfx950") == "gfx950"
    assert arch_of("gfx90a:sramecc+:xnack-") == "other"
    assert arch_of("NVIDIA H200") == "other"    # CUDA builds have gcnArchName too


def test_xpu_probe(monkeypatch):
    import dsv4core_xpu as x

    monkeypatch.setattr(torch.version, "xpu", "20250101", raising=False)
    monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    ok, why = x._available()
    assert not ok and "sees no Intel GPU" in why
    monkeypatch.setattr(torch.xpu, "is_available", lambda: True)
    import triton.backends

    monkeypatch.setattr(triton.backends, "backends", {"nvidia": object(), "amd": object()})
    ok, why = x._available()
    assert not ok and "no 'intel' backend" in why and "upstream triton replaced the vendor's" in why
    monkeypatch.setattr(triton.backends, "backends", {"intel": object()})
    assert x._available() == (True, "")


class _BrokenTorchNpu(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A torch_npu that is installed but cannot load its CANN libraries (the real message)."""

    MSG = "libhccl.so: cannot open shared object file: No such file or directory"

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "torch_npu" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(self.MSG)


def test_ascend_probe(monkeypatch):
    import dsv4core_ascend as a

    ok, why = a._available()
    assert not ok and "torch_npu is not installed" in why and "CANN" in why
    monkeypatch.setattr(sys, "meta_path", [_BrokenTorchNpu(), *sys.meta_path])
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    ok, why = a._available()
    assert not ok and f"import torch_npu failed: {_BrokenTorchNpu.MSG}" in why


def test_validation_record(tmp_path):
    assert recorded(tmp_path / "none", "rocm") == NOT_VALIDATED
    rep = {"backend": "rocm", "failed": False, "dsv4core_version": "0.1.0", "hardware": "MI300X (gfx942)",
           "summary": {"rms_norm": {"status": "passed"}, "hc_pre": {"status": "passed"}}}
    (tmp_path / "gfx942.json").write_text(json.dumps(rep))
    (tmp_path / "gfx950.json").write_text(json.dumps(dict(rep, failed=True)))
    line = recorded(tmp_path, "rocm")
    assert line == "validated on hardware: MI300X (gfx942) (dsv4core 0.1.0, 2/2 ops passed)"
    assert recorded(tmp_path, "xpu").startswith(NOT_VALIDATED + " (ignored: gfx942.json: not a conformance")
    rep["summary"]["rope"] = {"status": "not implemented"}
    (tmp_path / "gfx942.json").write_text(json.dumps(rep))
    assert passed_ops(tmp_path, "rocm") == {"rms_norm", "hc_pre"}    # the failing gfx950 record counts for nothing
    assert passed_ops(tmp_path, "xpu") == frozenset() and passed_ops(tmp_path / "none", "rocm") == frozenset()


# ---------------------------------------------------------------------------------------------
# ascend glue under the emulated torch_npu / vllm-ascend
# ---------------------------------------------------------------------------------------------

ASCEND_OPS = ("rms_norm", "rope", "q_norm_rope", "kv_norm_rope", "hc_pre", "hc_post", "wo_a", "moe_route",
              "moe_experts")


def _ascend(monkeypatch, hf32_hc_pre=None, sparse_fa=None, **kw):
    install_ascend(monkeypatch, **kw)
    import dsv4core_ascend

    return dsv4core_ascend.make_backend("cpu", available=lambda: (True, ""), hf32_hc_pre=hf32_hc_pre,
                                        sparse_fa=sparse_fa)


def _by_op(report):
    return {o.op: o for o in report.ops}


def test_ascend_emulated_conformance_small(monkeypatch):
    """Every implemented op passes every case it serves; declines are the documented limits."""
    rep = run(_ascend(monkeypatch), ops=",".join(ASCEND_OPS), shapes="small", dtypes=("float32", "bfloat16"))
    res = _by_op(rep)
    assert not rep.failed, [c.id + ": " + c.message for c in rep.failures()]
    for op in ("rope", "q_norm_rope", "kv_norm_rope", "rms_norm", "wo_a", "hc_post", "moe_route", "moe_experts"):
        assert res[op].count("passed") > 0, op
    # rope family: fp32 and bf16 both served (the glue runs the rotation in fp32, one rounding)
    assert res["rope"].count("declined") == 0
    # declines: wo_a / hc_post / moe_experts are bf16 only, fp8 wo_a and quantised (fp8 / fp4)
    # experts and the official numerics are not wired, T = 0 is left to the reference; hc_pre: H = 256
    # is not 4096 / 7168
    for op in ASCEND_OPS:
        if op == "hc_pre":
            continue
        bad = [c.id for c in res[op].cases if c.status == "declined" and not (
            (c.dtype == "float32" and op in ("wo_a", "hc_post", "moe_experts")) or c.case.startswith("T0")
            or "fp8" in c.tags or (op == "moe_experts" and ("fp8" in c.case or "fp4" in c.case))
            or {"fp8-row", "official", "w8a8"} & set(c.tags))]      # the official numerics: not wired
        assert not bad, bad
    assert res["hc_pre"].count("passed") == 0 and res["hc_pre"].count("declined") == len(res["hc_pre"].cases)


def test_ascend_hc_pre_hf32_finding(monkeypatch):
    """npu_hc_pre_v2's documented HF32 round-toward-zero product, emulated, at DSV4-Flash shapes:
    within the HAL bound on ordinary inputs, outside it (post) on the sharp-logits case. That is
    why the plugin only uses it when DSV4CORE_ASCEND_HF32_HC_PRE=1 (declined by default)."""
    monkeypatch.delenv("DSV4CORE_ASCEND_HF32_HC_PRE", raising=False)
    b = _ascend(monkeypatch)
    rep = run(b, ops="hc_pre", shapes="flash", dtypes="bfloat16")
    assert not rep.failed and _by_op(rep)["hc_pre"].count("passed") == 0          # declined by default
    assert "HF32" in b.impls["hc_pre"].why_not(**next(iter(
        _cases_of("hc_pre", "flash", torch.bfloat16))).kwargs)
    monkeypatch.setenv("DSV4CORE_ASCEND_HF32_HC_PRE", "1")      # read when the backend is made
    rep = run(_ascend(monkeypatch), ops="hc_pre", shapes="flash", dtypes="bfloat16")
    res = _by_op(rep)["hc_pre"]
    failed = {c.case for c in res.cases if c.status == "failed"}
    assert failed == {"sharp-logits"}, [c.id + ": " + c.message for c in res.cases if c.status == "failed"]
    assert res.count("passed") >= 5


def _cases_of(op, shapes, dtype):
    from dsv4core.hal import catalogue

    first = {"sparse_mqa_attention": "q"}.get(op, "x")
    return [c for c in catalogue()[op].sample_cases(shapes, dtype, "cpu", seed=0) if c.kwargs[first].shape[0] > 0]


def test_ascend_flash_shapes(monkeypatch):
    """hc_post / moe_route at the real model dims (H 4096, 256 experts)."""
    rep = run(_ascend(monkeypatch), ops="hc_post,moe_route", shapes="flash", dtypes="float32,bfloat16")
    assert not rep.failed, [c.id + ": " + c.message for c in rep.failures()]
    assert all(o.count("passed") > 0 for o in rep.ops)


def test_ascend_without_vllm_ascend_declines_with_reason(monkeypatch):
    b = _ascend(monkeypatch, with_vllm_ascend=False, hf32_hc_pre=True)
    (case,) = [c for c in _cases_of("hc_pre", "flash", torch.bfloat16)][:1]
    assert not b.impls["hc_pre"].supports(**case.kwargs)
    assert "torch.ops._C_ascend" in b.impls["hc_pre"].why_not(**case.kwargs)
    rep = run(b, ops="hc_post,moe_route", shapes="small", dtypes="bfloat16,float32")
    assert all(o.count("passed") == 0 for o in rep.ops) and not rep.failed


def test_ascend_sparse_attention_opt_in(monkeypatch):
    """npu_sparse_flash_attention (zero rope tensors, K = V, sinks) at DSV4-Flash shapes (h 64,
    d 512, K 640), bf16, under the emulation: every served case within the HAL bound, including
    -1 entries scattered through a row (the glue moves them to the tail, as the op requires; the
    emulation raises otherwise) and queries with no row at all (the glue returns the HAL's 0; the
    emulation returns NaN there, the op's value being undocumented). Declined by default, and
    for shapes the op is locked out of (small: d 64), each with its reason."""
    monkeypatch.delenv("DSV4CORE_ASCEND_SPARSE_FA", raising=False)
    (case,) = [c for c in _cases_of("sparse_mqa_attention", "flash", torch.bfloat16) if c.name == "T5-K640"]
    b = _ascend(monkeypatch)
    assert "DSV4CORE_ASCEND_SPARSE_FA=1" in b.impls["sparse_mqa_attention"].why_not(**case.kwargs)
    b = _ascend(monkeypatch, sparse_fa=True)
    rep = run(b, ops="sparse_mqa_attention", shapes="flash", dtypes="bfloat16")
    res = _by_op(rep)["sparse_mqa_attention"]
    assert not rep.failed, [c.id + ": " + c.message for c in rep.failures()]
    declined = {c.case for c in res.cases if c.status == "declined"}
    # declined: T = 0, the FP8 KV rows (kv_format) and paged pools (kv_paged): not wired to the NPU op
    assert declined == {"T0-K640", "fp8-T1", "fp8-T7", "fp8-scale-sharp", "paged-T1", "paged-T6", "paged-fp8"} and {"scattered-noncontig", "all-masked"} <= {
        c.case for c in res.cases if c.status == "passed"}, declined
    small = [c for c in _cases_of("sparse_mqa_attention", "small", torch.bfloat16)][0]
    assert "head dim is fixed at 512" in b.impls["sparse_mqa_attention"].why_not(**small.kwargs)
    f32 = dict(case.kwargs, q=case.kwargs["q"].float(), kv=case.kwargs["kv"].float())
    assert "bf16" in b.impls["sparse_mqa_attention"].why_not(**f32)


def test_ascend_wo_a_weight_transposed_once(monkeypatch):
    e = install_ascend(monkeypatch)
    import dsv4core_ascend.ops as ops

    calls = []
    real = e.npu_transpose_batchmatmul
    monkeypatch.setattr(sys.modules["torch_npu"], "npu_transpose_batchmatmul",
                        lambda x, w, **kw: calls.append(w) or real(x, w, **kw))
    o = torch.randn(3, 2, 64).bfloat16()
    w = torch.randn(2, 16, 64).bfloat16()
    ops.wo_a(o, w)
    ops.wo_a(o, w)
    assert calls[0] is calls[1] and calls[0].shape == (2, 64, 16)    # [G, D, R], made once
    w.mul_(2)                                                        # changed in place: redone
    y = ops.wo_a(o, w)
    assert calls[2] is not calls[0]
    torch.testing.assert_close(y.float(), torch.einsum("tgd,grd->tgr", o.float(), w.float()), rtol=2 ** -7, atol=0)


# ---------------------------------------------------------------------------------------------
# rocm aiter glue under the emulated aiter (ops aiter serves; the rest needs the interpreter)
# ---------------------------------------------------------------------------------------------

def _rocm(monkeypatch, arch="gfx950", version=None, **kw):
    install_aiter(monkeypatch, **kw)
    import dsv4core_rocm
    from dsv4core_rocm import aiter_ops

    for vf in (aiter_ops.MHC_PRE, aiter_ops.MHC_POST, aiter_ops.BATCHED_GEMM_BF16):
        monkeypatch.setattr(vf, "_fn", None)
        monkeypatch.setattr(vf, "_why", None)
    monkeypatch.setattr(aiter_ops, "aiter_version", lambda: version)
    return dsv4core_rocm.make_backend("cpu", arch=lambda: arch, available=lambda: (True, ""))


def _aiter_only(backend):
    """The backend's aiter-served ops with the portable fallback removed (no interpreter here):
    a call aiter declines is reported as declined."""
    from dsv4core.hal import Backend
    from dsv4core_rocm import aiter_ops

    b = Backend(name="rocm-aiter-only", device_types=("cpu",))
    for op in ("hc_pre", "hc_post", "wo_a"):
        def supports(*args, _op=op, **kwargs):
            return not aiter_ops.why_not_vendor(_op, lambda: "gfx950", "cpu", *args, **kwargs)
        supports.__signature__ = backend.impls[op].supports.__signature__
        b.add(op, backend.impls[op].fn, supports=supports)
    return b


def test_rocm_aiter_glue_emulated(monkeypatch):
    b = _aiter_only(_rocm(monkeypatch, arch="gfx950"))
    for shapes, ops in (("small", "hc_pre,hc_post,wo_a"), ("flash", "hc_post")):
        rep = run(b, shapes=shapes, dtypes="bfloat16", ops=ops)
        assert not rep.failed, [c.id + ": " + c.message for c in rep.failures()]
        res = _by_op(rep)
        assert all(res[op].count("passed") >= 3 for op in res), {o: res[o].count("passed") for o in res}
        # declines: n = 2 streams, T = 0, T > 64 for wo_a (the portable kernel takes those)
        for o in res.values():
            for c in o.cases:
                if c.status == "declined":
                    assert c.case.startswith(("n2", "T0", "T64")) or {"hc_mult", "fp8"} & set(c.tags), c.id


def test_rocm_aiter_gates(monkeypatch):
    from dsv4core_rocm import aiter_ops

    b = _rocm(monkeypatch, arch="gfx950", version="0.1.7.post2.dev18")
    (case,) = [c for c in _cases_of("hc_pre", "small", torch.bfloat16) if c.name == "T7"]
    why = aiter_ops.why_not_vendor("hc_pre", lambda: "gfx950", "cpu", **case.kwargs)
    assert why == "aiter 0.1.7.post2.dev18 is older than 0.1.11, the first with aiter.ops.mhc.mhc_pre"
    assert aiter_ops.status(lambda: "gfx950")["hc_pre"].startswith("portable (aiter 0.1.7")
    _rocm(monkeypatch, arch="gfx942", version="0.1.20")
    assert "arch gfx942" in aiter_ops.why_not_vendor("wo_a", lambda: "gfx942", "cpu", torch.zeros(2, 2, 8).bfloat16(),
                                                     torch.zeros(2, 4, 8).bfloat16())
    _rocm(monkeypatch, arch="gfx950", version=None, with_mhc=False)
    why = aiter_ops.why_not_vendor("hc_post", lambda: "gfx950", "cpu", *[case.kwargs["x"][:, 0],
                                   case.kwargs["x"], torch.zeros(7, 4), torch.zeros(7, 4, 4)])
    assert "import aiter.ops.mhc failed" in why
    assert b.impls["hc_pre"].why_not is not None


def test_extras_never_replace_the_vendor_triton_or_torch():
    import re
    import tomllib
    from pathlib import Path

    meta = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    extras = meta["optional-dependencies"]
    names = {x: {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in reqs} for x, reqs in extras.items()}
    for vendor in VENDORS:
        # upstream triton would overwrite pytorch-triton-rocm / -xpu; torch-npu breaks `import torch`
        # without CANN; PyPI's amd-aiter has no DSV4 op and needs ROCm to import
        assert not names[vendor] & {"triton", "torch", "torch-npu", "amd-aiter"}, (vendor, names[vendor])
    # the test dependencies exist without triton (for ROCm / XPU machines); [dev] adds upstream
    # triton on top (CPU CI's interpreter and AOT gate), so `pip install -e ".[dev]"` still has it
    assert not names["test"] & {"triton", "torch", "torch-npu", "amd-aiter"}, names["test"]
    assert names["dev"] == {"dsv4core", "triton"} and "dsv4core[test]" in extras["dev"], extras["dev"]
    assert {"pytest", "transformers"} <= names["test"]
    assert any(r.split(">")[0].split("=")[0].strip() == "numpy" for r in meta["dependencies"])
    eps = meta["entry-points"]["dsv4core.backends"]
    assert {eps[v] for v in VENDORS} == {f"dsv4core_{v}" for v in VENDORS}


def test_rocm_keeps_the_portable_kernels_declarations():
    """The rocm backend re-adds the portable ops: their capturable / native_quantized
    declarations must survive (else FP8 weights would be dequantised and graphs refused);
    the aiter-fronted ops read quantised weights as the portable ones do but are not declared
    capturable."""
    import dsv4core_rocm

    b = dsv4core_rocm.make_backend("cpu", arch=lambda: "gfx950", available=lambda: (True, ""))
    fronted = {"hc_pre", "hc_post", "wo_a"}
    for op, impl in b.impls.items():
        assert impl.native_quantized, op
        assert impl.capturable == (op not in fronted), op


def test_rocm_aiter_gate_evaluated_once_per_call(monkeypatch):
    """The HAL calls supports() then fn(): the aiter gate (arch, limits, library) runs once, in fn."""
    from dsv4core_rocm import aiter_ops

    b = _rocm(monkeypatch, arch="gfx950")
    gates, vendor = [], []
    real_gate, real_pre = aiter_ops.why_not_vendor, sys.modules["aiter.ops.mhc"].mhc_pre
    monkeypatch.setattr(aiter_ops, "why_not_vendor", lambda *a, **k: gates.append(a[0]) or real_gate(*a, **k))
    monkeypatch.setattr(sys.modules["aiter.ops.mhc"], "mhc_pre", lambda *a, **k: vendor.append(1) or real_pre(*a, **k))
    (case,) = [c for c in _cases_of("hc_pre", "small", torch.bfloat16) if c.name == "T7"]
    impl = b.impls["hc_pre"]
    assert impl.supports(**case.kwargs)
    y, post, comb = impl.fn(**case.kwargs)
    assert gates == ["hc_pre"] and vendor == [1]
    from dsv4core.hal import catalogue

    ref = catalogue()["hc_pre"].reference(**{k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point()
                                              else v for k, v in case.kwargs.items()})
    # y is bf16 (one rounding of an fp32 sum): within 2 bf16 ulps of the fp64 value
    torch.testing.assert_close(y.double(), ref[0], rtol=2 ** -7, atol=1e-6)
    torch.testing.assert_close(post.double(), ref[1], rtol=1e-5, atol=1e-6)
