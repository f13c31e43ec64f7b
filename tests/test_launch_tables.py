"""The launch-table mechanism (dsv4core/kernels/triton/launch.py): a plugin's table reaches the
shared kernels only while that plugin's op runs; tuning overrides win; callable entries see the
call; target-only keywords are filtered by what a Triton target accepts."""
from __future__ import annotations

import types

import pytest

import torch

from dsv4core.hal import Backend
from dsv4core.kernels.triton import registry
from dsv4core.kernels.triton.launch import AMD_ONLY, Tune, active, for_target


def test_tune_layers_override_table_default():
    t = Tune("dsv4core.kernels.triton.attention")
    assert t.get("BK", 64) == 64 and not t and t.options() == {}
    with active({"attention": {"BK": 32, "launch": {"waves_per_eu": 2}}, "norm": {"ROWS": 4}}):
        assert t.get("BK", 64) == 32 and t.get("BH", 16) == 16 and t
        assert t.options() == {"waves_per_eu": 2}
        t["BK"] = 128                      # a tuning script's override wins over the table
        assert t.get("BK", 64) == 128
        t.clear()
    assert t.get("BK", 64) == 64           # the table is gone after the block


def test_registry_wrapper_activates_the_backends_table(monkeypatch):
    seen = []
    tune = Tune("norm")

    def rms_norm(x, weight, eps):
        seen.append((tune.get("ROWS", 1), tune.options()))
        return x

    monkeypatch.setitem(registry._mods, "norm", types.SimpleNamespace(rms_norm=rms_norm))
    calls = []

    def entry(*args, **kwargs):              # a callable entry sees the op's arguments
        calls.append(args[0].dtype)
        return {"ROWS": 8 if args[0].dtype == torch.float32 else 2, "launch": {"num_ctas": 1}}

    resolved = []

    def table():                              # resolved once, at the first call
        resolved.append(1)
        return {"norm": entry}

    b = Backend(name="t", device_types=("cpu",))
    registry.register_ops(b, "cpu", ops={"rms_norm"}, launch=table)
    assert not resolved
    x = torch.zeros(2, 4)
    b.impls["rms_norm"].fn(x, None, 1e-6)
    b.impls["rms_norm"].fn(x.bfloat16(), None, 1e-6)
    assert seen == [(8, {"num_ctas": 1}), (2, {"num_ctas": 1})] and len(resolved) == 1
    assert calls == [torch.float32, torch.bfloat16]
    assert tune.get("ROWS", 1) == 1                            # nothing leaks out of the call
    assert b.impls["rms_norm"].supports(x, None, 1e-6)
    assert not b.impls["rms_norm"].supports(x.to(torch.int32), None, 1e-6)


def test_extra_supports_predicates_decline():
    b = Backend(name="t", device_types=("cpu",))
    registry.register_ops(b, "cpu", ops={"rms_norm"}, supports={"rms_norm": lambda *a, **k: a[0].shape[-1] <= 4})
    assert b.impls["rms_norm"].supports(torch.zeros(2, 4), None, 1e-6)
    assert not b.impls["rms_norm"].supports(torch.zeros(2, 8), None, 1e-6)


def test_for_target_drops_unaccepted_keywords():
    table = {"attention": {"BK": 16, "launch": {"waves_per_eu": 2, "num_ctas": 1}},
             "moe": lambda *a, **k: {"BN": 32, "launch": {"matrix_instr_nonkdim": 16}}}
    cuda_like = {"num_warps", "num_stages", "num_ctas"}
    out = for_target(table, cuda_like)
    assert out["attention"] == {"BK": 16, "launch": {"num_ctas": 1}}
    assert out["moe"]() == {"BN": 32, "launch": {}}
    assert table["attention"]["launch"] == {"waves_per_eu": 2, "num_ctas": 1}     # not modified
    assert {"waves_per_eu", "matrix_instr_nonkdim", "kpack"} <= set(AMD_ONLY)


def test_amd_options_are_what_triton_amd_accepts_and_cuda_rejects():
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget

    from dsv4core.kernels.triton.launch import accepted_options

    amd = accepted_options(GPUTarget("hip", "gfx942", 64))
    cuda = accepted_options(GPUTarget("cuda", 90, 32))
    assert {"waves_per_eu", "matrix_instr_nonkdim", "kpack"} <= amd
    assert not ({"waves_per_eu", "matrix_instr_nonkdim", "kpack"} & cuda)
