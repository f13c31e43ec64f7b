"""The cuda plugin's FlashInfer provider (backend ``cuda-flashinfer``) on a machine without a GPU.

* discovery and the static probe: listed, unavailable with the reason, serving no op; each missing
  piece (package, source folder, tvm-ffi, nvcc) named;
* the glue (argument mapping onto FlashInfer's raw mHC functions) under an emulated FlashInfer
  (tests/vendor_emul/flashinfer_emul.py, written from the .cu sources), judged by the conformance
  suite against the fp64 oracle, with its declines; the same glue through an emulated
  ``flashinfer`` package; a mis-wired mapping fails;
* a failing nvcc build: reported once (why_not, a warning), never retried, and the call served by
  the next backend.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import sys

import pytest
import torch

from dsv4core.conformance import run
from dsv4core.hal import bind, catalogue, discover, reset
from dsv4core.hal.discovery import _status_for

from vendor_emul import flashinfer_emul, install_flashinfer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "plugins", "cuda"))
from dsv4core_cuda import flashinfer_mhc as fim  # noqa: E402
from dsv4core_cuda import providers  # noqa: E402


def _backend(kernels):
    """The provider's backend on CPU tensors (the emulation runs anywhere)."""
    return fim.make_backend(kernels, device_type="cpu", available_fn=lambda: (True, ""))


def _emulated(module=None):
    return fim.Kernels(loader=lambda: module or flashinfer_emul.Module())


@pytest.fixture
def inject():
    reset()
    status = discover()

    def add(b):
        status[b.name] = _status_for(b, "test")

    yield add
    reset()


# ---------------------------------------------------------------------------------------------
# discovery / probe
# ---------------------------------------------------------------------------------------------

def test_discovered_unavailable_and_serving_nothing(capsys, monkeypatch):
    from dsv4core.cli import main

    monkeypatch.delenv(fim.SRC_ENV, raising=False)
    reset()
    assert main(["backends", "--json"]) == 0
    got = {b["name"]: b for b in json.loads(capsys.readouterr().out)}
    b = got[fim.NAME]
    assert not b["available"] and "CPU-only build" in b["reason"], b
    assert b["ops"] == ["hc_post", "hc_pre"] and b["priority"] < got["cuda"]["priority"]
    assert "flashinfer:" in discover()["cuda"].backend.description
    table = bind("cuda")
    assert {table.bindings[op].backend for op in ("hc_pre", "hc_post")} == {"reference"}
    with pytest.raises(Exception, match="cuda-flashinfer.*not available: torch .* CPU-only build"):
        bind("cuda", ops={"hc_pre": fim.NAME})
    assert "flashinfer" not in sys.modules and "tvm_ffi" not in sys.modules
    reset()


def test_probe_names_each_missing_piece(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    have = {"flashinfer": False, "tvm_ffi": False}
    monkeypatch.setattr(fim, "found", lambda n: have.get(n, False))
    monkeypatch.delenv(fim.SRC_ENV, raising=False)
    ok, why = fim.available()
    assert not ok and "flashinfer is not installed and DSV4CORE_FLASHINFER_SRC is not set" in why
    assert "fetch_flashinfer_mhc.py" in why
    assert "not usable" in providers.status()["flashinfer"]
    monkeypatch.setenv(fim.SRC_ENV, str(tmp_path / "nowhere"))
    assert "is not a directory" in fim.available()[1]
    monkeypatch.setenv(fim.SRC_ENV, str(tmp_path))
    assert "lacks csrc/mhc/mhc_post.cu" in fim.available()[1]
    _fake_sources(tmp_path)
    assert "apache-tvm-ffi is not installed" in fim.available()[1]
    have["tvm_ffi"] = True
    monkeypatch.setattr(fim, "_nvcc", lambda: None)
    assert "nvcc was not found" in fim.available()[1]
    monkeypatch.setattr(fim, "_nvcc", lambda: "/usr/bin/true")
    assert fim.available() == (True, "")
    assert "built on first use" in providers.status()["flashinfer"]
    have["flashinfer"] = True
    assert fim.origin() == ("package", "")


# ---------------------------------------------------------------------------------------------
# the glue under the emulated FlashInfer, judged by the conformance suite
# ---------------------------------------------------------------------------------------------

def _ops(report):
    return {o.op: o for o in report.ops}


def test_glue_passes_conformance_and_declines_what_flashinfer_cannot_run():
    report = run(_backend(_emulated()), ops="hc_pre,hc_post", shapes="small", dtypes="bfloat16,float32")
    assert not report.failed, [c.id + ": " + c.message for c in report.failures()]
    ops = _ops(report)
    for op in ("hc_pre", "hc_post"):
        bf16 = [c for c in ops[op].cases if c.dtype == "bfloat16"]
        f32 = [c for c in ops[op].cases if c.dtype == "float32"]
        assert f32 and all(c.status == "declined" and "bf16" in c.message for c in f32), op
        passed = [c.case for c in bf16 if c.status == "passed"]
        assert {"T0", "T1", "T7", "T33", "noncontig", "large-magnitude"} <= set(passed), (op, passed)
    pre = {c.case: c for c in ops["hc_pre"].cases if c.dtype == "bfloat16"}
    # the cases that make eps placement, the Sinkhorn count / order and post_mult visible all ran
    assert {"eps-visible", "iters1", "sharp-logits", "post_mult1"} <= {k for k, c in pre.items() if c.status == "passed"}
    assert pre["n2"].status == "declined" and "hc_mult 4" in pre["n2"].message


def test_hc_pre_mix_gemm_in_token_chunks_passes_conformance(monkeypatch):
    # the fp32 copy of x for the mix GEMM is made a few rows at a time (T = 4096 would be 256 MiB
    # whole): with a 1-byte budget every row is its own chunk
    monkeypatch.setattr(fim, "MIX_CHUNK_BYTES", 1)
    report = run(_backend(_emulated()), ops="hc_pre", shapes="small", dtypes="bfloat16")
    assert not report.failed, [c.id + ": " + c.message for c in report.failures()]
    passed = {c.case for c in _ops(report)["hc_pre"].cases if c.status == "passed"}
    assert {"T7", "T33", "noncontig"} <= passed, passed


def test_declines_unsupported_inputs():
    specs = catalogue()
    b = _backend(_emulated())
    case = next(c for c in specs["hc_pre"].sample_cases("small", torch.bfloat16, "cpu", 0)
                if c.name == "T7")
    kw = dict(case.kwargs)
    sup, why = b.impls["hc_pre"].supports, b.impls["hc_pre"].why_not
    assert sup(**kw)
    for change, text in ((dict(rms_eps=0.0), "eps > 0"), (dict(hc_eps=-1e-6), "eps > 0"),
                         (dict(x=kw["x"].float()), "bf16"), (dict(x=kw["x"][..., :250]), "H % 8"),
                         (dict(fn=kw["fn"].double()), "fn must be float32")):
        bad = dict(kw, **change)
        assert not sup(**bad) and text in why(**bad), (change, why(**bad))
    post = next(c for c in specs["hc_post"].sample_cases("small", torch.bfloat16, "cpu", 0)
                if c.name == "T7").kwargs
    assert b.impls["hc_post"].supports(**post)
    meta = dict(post, o=post["o"].to("meta"))
    assert not b.impls["hc_post"].supports(**meta) and "one 'cpu' device" in b.impls["hc_post"].why_not(**meta)


def test_the_installed_package_path_uses_flashinfer_mhc(monkeypatch):
    install_flashinfer(monkeypatch)
    assert fim.origin() == ("package", "")
    k = fim.Kernels()
    report = run(_backend(k), ops="hc_pre,hc_post", shapes="small", dtypes="bfloat16")
    assert not report.failed and all(o.count("passed") >= 6 for o in report.ops)
    assert k.origin == "flashinfer package"


def test_a_flashinfer_without_the_mhc_module_is_reported(monkeypatch, caplog):
    install_flashinfer(monkeypatch, with_get_module=False)
    monkeypatch.delenv(fim.SRC_ENV, raising=False)
    k = fim.Kernels()
    with caplog.at_level(logging.WARNING, "dsv4core.cuda"):
        mod, why = k.get()
    assert mod is None and "has no mhc.get_mhc_module" in why and "0.7.2.post1" in why
    assert "run on the next backend" in caplog.text


class _Miswired:
    """The emulated module with one convention broken, as a wrong mapping would break it."""

    def __init__(self, what):
        self.what = what

    def mhc_post(self, out, x, residual, post, comb):
        if self.what == "comb-transposed":
            comb = comb.transpose(1, 2).contiguous()
        flashinfer_emul.mhc_post(out, x, residual, post, comb)

    def mhc_pre_big_fuse_with_prenorm(self, *args):
        args = list(args)
        if self.what == "flashinfer-default-post-mult":
            args[10] = 1.0
        if self.what == "rms-scaled-logits-twice":
            r = args[4].float()
            args[3] = args[3] * torch.rsqrt(r.square().mean((1, 2)) + args[7])[:, None]
        flashinfer_emul.mhc_pre_big_fuse_with_prenorm(*args)


@pytest.mark.parametrize("what,op", [("comb-transposed", "hc_post"), ("flashinfer-default-post-mult", "hc_pre"),
                                     ("rms-scaled-logits-twice", "hc_pre")])
def test_a_miswired_mapping_fails_conformance(what, op):
    report = run(_backend(_emulated(_Miswired(what))), ops=op, shapes="small", dtypes="bfloat16")
    assert _ops(report)[op].status == "failed", what


# ---------------------------------------------------------------------------------------------
# building from sources
# ---------------------------------------------------------------------------------------------

def _fake_sources(root):
    for f in fim.SOURCES + fim.HEADERS:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_text(f"// {f}\n")


def _fake_nvcc(tmp_path, body):
    home = tmp_path / "cuda"
    (home / "bin").mkdir(parents=True)
    nvcc = home / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n"
                    "if [ \"$1\" = --version ]; then echo 'Cuda compilation tools, release 13.0'; exit 0; fi\n"
                    f"echo call >> {tmp_path / 'calls'}\n{body}\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return home


def _source_setup(monkeypatch, tmp_path, body):
    src = tmp_path / "src"
    _fake_sources(src)
    monkeypatch.setenv(fim.SRC_ENV, str(src))
    monkeypatch.setenv(fim.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv("CUDA_HOME", str(_fake_nvcc(tmp_path, body)))
    monkeypatch.setattr(fim, "found", lambda n: n == "tvm_ffi")
    monkeypatch.setattr(fim, "_tvm_ffi_paths", lambda: ([str(tmp_path)], str(tmp_path)))
    monkeypatch.setattr(fim, "_arch", lambda index=0: "90")


def test_build_failure_is_reported_once_and_the_call_falls_back(monkeypatch, tmp_path, inject, caplog, capsys):
    _source_setup(monkeypatch, tmp_path, "echo 'mhc_post.cu(12): error: boom' >&2; exit 2")
    inject(_backend(fim.Kernels()))
    specs = catalogue()
    kw = next(c for c in specs["hc_post"].sample_cases("small", torch.bfloat16, "cpu", 1)
              if c.name == "T7").kwargs
    with caplog.at_level(logging.WARNING):
        table = bind("cpu", backend="reference", ops={"hc_post": fim.NAME})
        got = table.hc_post(**kw)
        table.hc_post(**kw)
    torch.testing.assert_close(got, specs["hc_post"].reference(**kw), rtol=0, atol=0)   # the reference served it
    b = table.bindings["hc_post"]
    assert b.backend == fim.NAME and b.runtime_fallbacks == 2
    assert "nvcc exited with status 2" in caplog.text and "error: boom" in caplog.text
    assert "declined a call" in caplog.text and "next: 'reference'" in caplog.text
    assert (tmp_path / "calls").read_text().count("call") == 2          # the two compiles once, never retried
    assert "building FlashInfer's mHC kernels for sm_90" in capsys.readouterr().err
    assert list((tmp_path / "cache").glob("*/build.log"))


def test_build_command_and_cache(monkeypatch, tmp_path):
    # a "compiler" that writes the output file: the command line and the cache are what is tested
    _source_setup(monkeypatch, tmp_path, 'while [ $# -gt 1 ]; do shift; done; echo so > "$1"')
    msgs = []
    lib = fim.build(os.environ[fim.SRC_ENV], progress=msgs.append)
    assert lib.is_file() and lib.name == "flashinfer_mhc.so" and "sm90-" in lib.parent.name
    log_text = (lib.parent / "build.log").read_text()
    for flag in ("-O3", "-use_fast_math", "-gencode=arch=compute_90,code=sm_90", "-ltvm_ffi", "mhc_post.cu",
                 "mhc_pre_big_fuse.cu", f"-I{os.environ[fim.SRC_ENV]}/include", "-shared"):
        assert flag in log_text, flag
    assert not list(lib.parent.glob("*.o")) and not list(lib.parent.glob("*.tmp"))
    assert len(msgs) == 2 and msgs[1].startswith("built ")
    assert fim.build(os.environ[fim.SRC_ENV], progress=msgs.append) == lib and len(msgs) == 2   # cached
    assert (tmp_path / "calls").read_text().count("call") == 3        # two compiles and a link, once
    (tmp_path / "src" / fim.SOURCES[0]).write_text("// changed\n")
    assert fim.build(os.environ[fim.SRC_ENV], progress=msgs.append) != lib                       # new key


# ---------------------------------------------------------------------------------------------
# dsv4core bench times a provider beside the backend
# ---------------------------------------------------------------------------------------------

def test_bench_times_the_provider_beside_the_backend(inject, monkeypatch):
    from dsv4core import bench

    # the ceilings are not what is tested here (a CPU bf16 8192^2-class matmul is slow)
    monkeypatch.setattr(bench, "measure_ceilings", lambda device, timer: {"copy_GBps": 10.0, "bf16_mm_TFLOPs": 0.1})
    inject(_backend(_emulated()))
    assert fim.NAME in bench.peer_backends("reference", "cpu", "auto")
    assert "reference" not in bench.peer_backends("cuda-flashinfer", "cpu", "auto")
    assert bench.peer_backends("reference", "cpu", "none") == {}
    lines = []
    res = bench.run_bench("reference", ops=("hc_post", "hc_pre"), shapes="small", tokens=(1, 7), device="cpu",
                          compile_ref=False, reps=3, log=lines.append, compare=fim.NAME)
    rows = [r for r in res["rows"] if r["status"] == "ok"]
    assert len(rows) == 4
    for r in rows:
        p = r["peers"][fim.NAME]
        assert p["status"] == "ok" and p["us"] > 0 and p["peer_over_ours"] == pytest.approx(p["us"] / r["us"])
        assert p["max_rel_err_vs_ref"] < 2 ** -7, (r["op"], p)     # bf16 outputs
    assert any(f"vs {fim.NAME}:" in line for line in lines)
    md = bench.markdown(dict(res, device_name="cpu"))
    assert "Peers timed in the same run" in md and f"| hc_pre | 7 | {fim.NAME} |" in md
