"""HAL machinery: discovery of a real installed plugin distribution, broken plugins, selection,
per-op overrides, fallback policies, registration checks, the bound hot path, input errors."""

import inspect
import json
import logging
import re
import subprocess
import sys

import pytest
import torch

from dsv4core.hal import (HAL_API_VERSION, Backend, BackendNotFoundError, FallbackError, HALError, OpInputError,
                          RegistrationError, bind, call, catalogue, discover, reset)

CATALOGUE = ["rms_norm", "hc_pre", "hc_post", "hc_head", "rope", "q_norm_rope", "kv_norm_rope",
             "sparse_mqa_attention", "compress_pool", "compress_windows", "indexer_scores", "indexer_scores_rows",
             "indexer_topk", "indexer_rotate_quant", "cache_store", "linear", "wo_a",
             "moe_route", "moe_experts", "all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
#: Added in HAL 1.1 (pool ops of the engine-grade model core).
SINCE_1_1 = {"compress_windows", "indexer_scores_rows", "cache_store"}
#: Added in HAL 1.2 (the official numerics).
SINCE_1_2 = {"indexer_rotate_quant"}


@pytest.fixture(autouse=True)
def _fresh():
    reset()
    yield
    reset()


def test_catalogue_has_the_initial_ops_and_the_1_1_additions():
    assert list(catalogue()) == CATALOGUE
    assert {n for n, s in catalogue().items() if s.since == (1, 1)} == SINCE_1_1
    assert {n for n, s in catalogue().items() if s.since == (1, 2)} == SINCE_1_2
    for spec in catalogue().values():
        assert spec.doc, f"{spec.name} has no docstring"
        assert spec.tolerance.why, f"{spec.name} tolerance has no reason"
        assert spec._check is not None, f"{spec.name} has no input check"
        assert any(True for _ in spec.sample_cases("small", torch.float32)), f"{spec.name} has no cases"


def test_installed_example_plugin_is_discovered_with_its_metadata():
    st = discover()
    assert st["reference"].available and len(st["reference"].backend.impls) == len(CATALOGUE)
    ex = st["example"]
    assert ex.available and ex.version == "0.3.0" and ex.priority == 10
    assert "dsv4core-example-plugin" in ex.source
    assert sorted(ex.backend.impls) == ["hc_post", "rms_norm"]


def test_broken_plugins_are_reported_not_fatal():
    st = discover()
    assert not st["broken-import"].available
    assert "import failed: ModuleNotFoundError" in st["broken-import"].reason
    assert not st["old-api"].available and "major versions differ" in st["old-api"].reason
    assert "0.7" in st["old-api"].reason and "%d.%d" % HAL_API_VERSION in st["old-api"].reason
    assert not st["unavailable"].available and "FooAccelerator" in st["unavailable"].reason


def test_malformed_backend_object_is_reported_not_fatal(monkeypatch):
    """A plugin registering a Backend whose fields are malformed (here api_version "1.0"), or one
    calling exit(), is listed as failed; discovery of the other backends goes on."""
    import types
    from importlib import metadata

    from dsv4core.hal import discovery, hookimpl

    mod = types.ModuleType("_dsv4core_test_malformed_plugin")

    @hookimpl
    def dsv4core_register_backends(register):
        register(Backend(name="malformed", api_version="1.0"))

    mod.dsv4core_register_backends = dsv4core_register_backends
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    # and one whose registration calls exit() (some vendor libraries do on a missing driver)
    mod2 = types.ModuleType("_dsv4core_test_exiting_plugin")

    @hookimpl
    def dsv4core_register_backends(register):  # noqa: F811
        raise SystemExit("no driver")

    mod2.dsv4core_register_backends = dsv4core_register_backends
    monkeypatch.setitem(sys.modules, mod2.__name__, mod2)
    real = metadata.entry_points(group=discovery.ENTRY_POINT_GROUP)
    fake = [metadata.EntryPoint(name=n, value=m.__name__, group=discovery.ENTRY_POINT_GROUP)
            for n, m in (("malformed", mod), ("exiting", mod2))]
    monkeypatch.setattr(discovery.metadata, "entry_points", lambda group: [*fake, *real])
    reset()
    st = discover()
    assert not st["malformed"].available and "registration failed" in st["malformed"].reason
    assert not st["exiting"].available and "SystemExit: no driver" in st["exiting"].reason
    assert st["example"].available and st["reference"].available
    with pytest.raises(BackendNotFoundError, match="malformed.*not available"):
        bind("cpu", backend="malformed")


def test_explicit_request_for_a_failed_backend_raises_with_cause():
    with pytest.raises(BackendNotFoundError, match="broken-import.*not available.*ModuleNotFoundError") as ei:
        bind("cpu", backend="broken-import")
    assert isinstance(ei.value.__cause__, ModuleNotFoundError)
    with pytest.raises(BackendNotFoundError, match="not installed"):
        bind("cpu", backend="no-such-backend")
    with pytest.raises(BackendNotFoundError, match="does not serve device type 'cuda'"):
        bind("cuda", backend="example")


def test_auto_selection_prefers_available_plugin_by_priority():
    table = bind("cpu", policy="allow")
    b = table.bindings
    assert b["rms_norm"].backend == "example"
    assert b["hc_pre"].backend == "reference" and b["hc_pre"].is_fallback
    assert b["hc_pre"].declined == {"example": "does not implement this op"}
    # the unavailable / old-api plugins have higher priority but are never candidates
    assert "unavailable" not in b["rms_norm"].candidates and "old-api" not in b["rms_norm"].candidates


def test_bound_call_is_the_implementation_itself():
    ref = bind("cpu", backend="reference", policy="strict", check=False)
    for name, spec in catalogue().items():
        assert getattr(ref, name) is spec.reference  # hot path = a plain function, no wrapper
    ex = bind("cpu", backend="example", policy="allow", check=False)
    assert ex.rms_norm is discover()["example"].backend.impls["rms_norm"].fn


def test_strict_policy_raises_on_bind_time_fallback():
    with pytest.raises(FallbackError, match="hc_pre: 'example' declined \\(does not implement this op\\)"):
        bind("cpu", backend="example", policy="strict")


def test_env_backend_and_per_op_override(monkeypatch):
    monkeypatch.setenv("DSV4CORE_BACKEND", "example")
    monkeypatch.setenv("DSV4CORE_OPS", "rms_norm=reference")
    table = bind("cpu", policy="allow")
    assert table.bindings["rms_norm"].backend == "reference"
    assert table.bindings["hc_post"].backend == "example"
    # family names work as keys too
    t2 = bind("cpu", backend="example", ops="mhc=reference", policy="allow")
    assert t2.bindings["hc_post"].backend == "reference" and t2.bindings["rms_norm"].backend == "example"
    # ... also in a dict, like bind's docstring says; an op named itself wins over its family
    t3 = bind("cpu", backend="reference", ops={"norms": "example", "hc_post": "example"}, policy="allow")
    assert t3.bindings["rms_norm"].backend == "example" and t3.bindings["hc_post"].backend == "example"
    assert t3.bindings["hc_pre"].backend == "reference"
    with pytest.raises(HALError, match="unknown op or family 'attn'"):
        bind("cpu", ops={"attn": "reference"})
    with pytest.raises(HALError, match="unknown op or family 'attn'"):
        bind("cpu", ops="attn=reference")
    with pytest.raises(BackendNotFoundError, match="per-op override for rms_norm"):
        bind("cpu", ops="rms_norm=unavailable")


def _hc_post_args(dtype):
    g = torch.Generator().manual_seed(0)
    T, n, H = 3, 4, 32
    return (torch.randn(T, H, generator=g).to(dtype), torch.randn(T, n, H, generator=g).to(dtype),
            torch.rand(T, n, generator=g), torch.rand(T, n, n, generator=g))


def test_runtime_fallback_by_supports_predicate(caplog):
    table = bind("cpu", backend="example", policy="warn", ops="hc_pre=reference,hc_head=reference,rope=reference")
    b = table.bindings["hc_post"]
    ref = catalogue()["hc_post"].reference
    with caplog.at_level(logging.WARNING, logger="dsv4core.hal"):
        for _ in range(3):
            out = table.hc_post(*_hc_post_args(torch.bfloat16))
    assert torch.equal(out, ref(*_hc_post_args(torch.bfloat16)))
    assert b.runtime_fallbacks == 3
    warnings = [r for r in caplog.records if "hc_post" in r.getMessage()]
    assert len(warnings) == 1 and "only float32 residuals, got torch.bfloat16" in warnings[0].getMessage()
    # float32 stays on the plugin and agrees with the reference
    out32 = table.hc_post(*_hc_post_args(torch.float32))
    torch.testing.assert_close(out32, ref(*_hc_post_args(torch.float32)), rtol=1e-6, atol=1e-6)
    assert b.runtime_fallbacks == 3


def test_runtime_fallback_under_strict_raises():
    reset()
    strict = bind("cpu", backend="example", ops={op: "reference" for op in CATALOGUE if op not in ("rms_norm", "hc_post")},
                  policy="strict")
    with pytest.raises(FallbackError, match="hc_post: backend 'example' declined a call \\(only float32"):
        strict.hc_post(*_hc_post_args(torch.bfloat16))


def test_registration_rejects_signature_mismatch_per_op():
    """A mismatch leaves only that op out, recorded in Backend.rejected with the reason naming the
    op and the parameter; nothing is raised, the backend's other ops register."""
    b = Backend(name="bad", device_types=("cpu",))

    def rejected(op, fn, **kw):
        b.rejected.pop(op, None)
        b.add(op, fn, **kw)
        assert op not in b.impls
        return b.rejected[op]

    assert re.search("op 'rms_norm': implementation .*missing parameter 'eps'",
                     rejected("rms_norm", lambda x, weight: x))
    assert re.search("op 'rope': supports .*unexpected parameter 'foo'",
                     rejected("rope", lambda x, positions, inv_freq, inverse=False: x,
                              supports=lambda x, positions, inv_freq, inverse, foo: True))
    assert "unknown op 'attention'" in rejected("attention", lambda q: q)
    # the model omits defaulted arguments and passes the others positionally: both must work
    assert re.search("op 'rope': implementation .*'inverse' must default to False",
                     rejected("rope", lambda x, positions, inv_freq, inverse: x))
    assert re.search("op 'rope': supports .*'inverse' must default to False",
                     rejected("rope", lambda x, positions, inv_freq, inverse=False: x,
                              supports=lambda x, positions, inv_freq, inverse=True: True))
    assert re.search("op 'rms_norm': implementation .*'eps' is keyword-only",
                     rejected("rms_norm", lambda x, weight, *, eps: x))
    assert "not callable" in rejected("hc_post", "not a function")
    assert not b.impls
    b.add("rms_norm", lambda x, weight, eps: x)                    # a good op still registers
    assert list(b.impls) == ["rms_norm"]
    first = b.impls["rms_norm"].fn
    b.add("rms_norm", lambda x, weight, eps: x)
    assert b.impls["rms_norm"].fn is first and "registered twice" in b.rejected["rms_norm"]


@pytest.mark.parametrize("args,match", [
    (("rms_norm", torch.randn(3, 8, dtype=torch.float16), None, 1e-6), "rms_norm: argument 'x' expected dtype float32 or bfloat16"),
    (("rms_norm", torch.randn(3, 8), torch.ones(9), 1e-6), "rms_norm: argument 'weight' expected rank 1 \\[8\\], got rank 1|rms_norm: argument 'weight' expected dim 0 = 8"),
    (("hc_post", torch.randn(2, 16), torch.randn(2, 4, 16), torch.rand(2, 3), torch.rand(2, 4, 4)),
     "hc_post: argument 'post' expected dim 1 \\(n\\) = 4 to match the other arguments, got shape \\(2, 3\\)"),
    (("hc_pre", torch.randn(2, 4, 8), torch.randn(24, 31), torch.rand(3), torch.rand(24), 1e-6, 1e-6, 20),
     "hc_pre: argument 'fn' expected dim 1 = 32"),
    (("sparse_mqa_attention", torch.randn(2, 4, 16), torch.randn(5, 16), torch.tensor([[0, 5], [1, -1]], dtype=torch.int32),
      torch.zeros(4), 0.25), "sparse_mqa_attention: argument 'indices' expected values in \\[-1, 4\\], got range \\[-1, 5\\]"),
    (("sparse_mqa_attention", torch.randn(2, 4, 16), torch.randn(5, 16), torch.zeros(2, 3), torch.zeros(4), 0.25),
     "sparse_mqa_attention: argument 'indices' expected dtype int32 or int64, got float32"),
    (("linear", torch.randn(2, 256), torch.randn(128, 256).to(torch.float8_e4m3fn)),
     "linear: argument 'weight_scale' expected a block scale tensor"),
    (("moe_route", torch.randn(3, 8), 9, 1.0), "moe_route: argument 'topk' expected an int in \\[1, 8\\], got 9"),
    (("indexer_topk", torch.randn(2, 4), torch.tensor([5, 1]), 2), "indexer_topk: argument 'k_lengths' expected values in \\[0, 4\\]"),
    (("rope", torch.randn(3, 8), torch.arange(2), torch.ones(4)), "rope: argument 'positions' expected dim 0 \\(T\\) = 3"),
])
def test_bad_input_errors_name_op_argument_expected_and_actual(args, match):
    with pytest.raises(OpInputError, match=match):
        call(*args)
    # the strict bound table validates too
    with pytest.raises(OpInputError, match=match):
        getattr(bind("cpu", backend="reference", policy="strict"), args[0])(*args[1:])


def test_zero_token_inputs_give_empty_outputs_for_every_op():
    ops = bind("cpu", backend="reference", policy="strict")
    for name, spec in catalogue().items():
        zero = [c for c in spec.sample_cases("small", torch.float32)
                if c.name.startswith(("T0", "hca-main-W0", "hca-main-E0", "rows-E0"))]
        assert zero, f"{name}: no zero-token case"
        for c in zero:
            if spec.writes:      # a store of zero rows returns None and changes nothing
                before = {w: c.kwargs[w].clone() for w in spec.writes}
                assert getattr(ops, name)(**c.kwargs) is None
                assert all(torch.equal(before[w], c.kwargs[w]) for w in spec.writes)
                continue
            out = getattr(ops, name)(**c.kwargs)
            for o in (out if isinstance(out, tuple) else (out,)):
                assert o.shape[0] == 0, f"{name}/{c.name}: {tuple(o.shape)}"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "dsv4core", *args], capture_output=True, text=True, timeout=120)


def test_cli_backends_and_ops_json():
    r = _cli("backends", "--json")
    assert r.returncode == 0, r.stderr
    rows = {b["name"]: b for b in json.loads(r.stdout)}
    assert rows["reference"]["available"] and rows["example"]["available"]
    assert rows["old-api"]["available"] is False and "major versions differ" in rows["old-api"]["reason"]
    r = _cli("ops", "--backend", "reference", "--json")
    assert r.returncode == 0, r.stderr
    ops = json.loads(r.stdout)["ops"]
    assert [o["op"] for o in ops] == CATALOGUE and {o["backend"] for o in ops} == {"reference"}
    deprecated = {o["op"]: o["deprecated"] for o in ops if o["deprecated"]}
    assert sorted(deprecated) == ["compress_pool", "indexer_scores"], deprecated
    assert "compress_windows" in deprecated["compress_pool"] and "indexer_scores_rows" in deprecated["indexer_scores"]
    r = _cli("ops", "--backend", "reference")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("compress_pool "))
    assert r.returncode == 0 and "deprecated: the model calls compress_windows" in line, r.stdout
    r = _cli("ops", "--backend", "nope")
    assert r.returncode == 2 and "backend 'nope'" in r.stderr and "Traceback" not in r.stderr
    r = _cli("ops", "--device", "nodevice")
    assert r.returncode == 2 and "--device 'nodevice'" in r.stderr and not r.stdout


def test_cli_help_and_version():
    r = _cli("--help")
    assert r.returncode == 0 and "backends" in r.stdout and "ops" in r.stdout
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.strip().startswith("dsv4core 0.")
    r = _cli("frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = _cli()                      # no subcommand: usage on stderr, exit 2
    assert r.returncode == 2 and "backends" in r.stderr and not r.stdout


def test_generated_op_reference_is_up_to_date():
    from pathlib import Path

    from dsv4core.hal.docs import render

    page = Path(__file__).resolve().parents[1] / "docs" / "ops.md"
    assert page.read_text() == render(), "docs/ops.md is stale: run `python -m dsv4core.hal.docs > docs/ops.md`"


def test_typed_op_table_is_generated_from_the_catalogue():
    from pathlib import Path

    from dsv4core.hal.docs import render_typed

    path = Path(__file__).resolve().parents[1] / "dsv4core" / "hal" / "typed_ops.py"
    src = path.read_text()
    assert src == render_typed(), ("dsv4core/hal/typed_ops.py is stale: run "
                                   "`python -m dsv4core.hal.docs typed > dsv4core/hal/typed_ops.py`")
    # what a type checker sees: one method per op, with the op's parameters and defaults
    ns: dict = {}
    exec(compile(src.replace("from typing import TYPE_CHECKING", "TYPE_CHECKING = True"), str(path), "exec"), ns)
    typed = ns["TypedOps"]
    specs = catalogue()
    assert sorted(n for n in vars(typed) if not n.startswith("_")) == sorted(specs)
    for name, spec in specs.items():
        params = list(inspect.signature(getattr(typed, name)).parameters.values())[1:]
        assert [(p.name, p.default, p.kind) for p in params] == \
            [(p.name, p.default, p.kind) for p in spec.signature.parameters.values()], name


def test_op_table_attributes_are_the_bound_callables():
    from dsv4core.hal.typed_ops import TypedOps

    assert not [n for n in vars(TypedOps) if not n.startswith("_")]   # nothing at run time
    table = bind("cpu", backend="reference", policy="allow")
    assert isinstance(table, TypedOps)
    for name, b in table.bindings.items():
        assert getattr(table, name) is b.call
    with pytest.raises(AttributeError, match="no HAL op named 'rms_nrom'"):
        table.rms_nrom


def _fake_plugins(monkeypatch, backends):
    """Install in-process backends as if they came from entry points (one module per backend)."""
    import types

    from importlib import metadata

    from dsv4core.hal import discovery, hookimpl
    from dsv4core.hal.ops.norms import rms_norm as spec

    eps = []
    for b in backends:
        b.add("rms_norm", lambda x, weight, eps: spec.reference(x, weight, eps))
        mod = types.ModuleType(f"_dsv4core_test_plugin_{b.name.replace('-', '_')}")

        @hookimpl
        def dsv4core_register_backends(register, _b=b):
            register(_b)

        mod.dsv4core_register_backends = dsv4core_register_backends
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        eps.append(metadata.EntryPoint(name=b.name, value=mod.__name__, group=discovery.ENTRY_POINT_GROUP))
    real = metadata.entry_points(group=discovery.ENTRY_POINT_GROUP)
    monkeypatch.setattr(discovery.metadata, "entry_points", lambda group: [*eps, *real])
    reset()


def test_negative_priority_is_never_chosen_by_auto_only_by_name(monkeypatch):
    _fake_plugins(monkeypatch, [Backend(name="opt-in", priority=-100), Backend(name="opt-in-1", priority=-1)])
    auto = bind("cpu", policy="allow")
    assert auto.bindings["rms_norm"].backend == "example"          # priority 10 wins
    assert not {"opt-in", "opt-in-1"} & set(auto.bindings["rms_norm"].candidates)
    assert bind("cpu", backend="opt-in", policy="allow").bindings["rms_norm"].backend == "opt-in"
    assert bind("cpu", policy="allow", ops="rms_norm=opt-in-1").bindings["rms_norm"].backend == "opt-in-1"
    monkeypatch.setenv("DSV4CORE_BACKEND", "opt-in")
    assert bind("cpu", policy="allow").bindings["rms_norm"].backend == "opt-in"


def test_equal_priorities_are_ordered_by_name_not_by_installation(monkeypatch):
    _fake_plugins(monkeypatch, [Backend(name="tie-zeta", priority=30), Backend(name="tie-alpha", priority=30)])
    b = bind("cpu", policy="allow").bindings["rms_norm"]
    assert b.backend == "tie-alpha" and b.candidates[:3] == ("tie-alpha", "tie-zeta", "example")
    monkeypatch.undo()
    _fake_plugins(monkeypatch, [Backend(name="tie-alpha", priority=30), Backend(name="tie-zeta", priority=30)])
    assert bind("cpu", policy="allow").bindings["rms_norm"].candidates[:2] == ("tie-alpha", "tie-zeta")
