"""Versioned op contracts and plugin isolation: the frozen contract records, the HAL 1.0 / 1.1
fixture plugins (tests/frozen_plugins, never updated) on the current HAL, and hostile plugins."""

import inspect
import logging
import sys
import threading
import types
from importlib import metadata

import pytest
import torch

from dsv4core.conformance import run
from dsv4core.hal import Backend, FallbackError, RegistrationError, bind, catalogue, discover, hookimpl, reset
from dsv4core.hal import contracts, discovery
from dsv4core.hal.spec import OpSpec, Tolerance

from frozen_plugins import acme_hal_1_0, acme_hal_1_1

TOL = Tolerance(k=1, floor=0, why="test")


@pytest.fixture(autouse=True)
def _fresh():
    reset()
    yield
    reset()


def _install(monkeypatch, plugins, keep_real=True):
    """Entry points for in-process plugin modules: [(entry-point name, module), ...]."""
    eps = []
    for name, mod in plugins:
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        eps.append(metadata.EntryPoint(name=name, value=mod.__name__, group=discovery.ENTRY_POINT_GROUP))
    real = list(metadata.entry_points(group=discovery.ENTRY_POINT_GROUP)) if keep_real else []
    monkeypatch.setattr(discovery.metadata, "entry_points", lambda group: [*eps, *real])
    reset()


def _module(name, hook):
    mod = types.ModuleType(name)
    mod.dsv4core_register_backends = hookimpl(hook)
    return mod


# -- the frozen contracts --------------------------------------------------------------------

def test_catalogue_reproduces_every_frozen_contract():
    assert contracts.frozen_versions()[:3] == [(1, 0), (1, 1), (1, 2)]
    for v in contracts.frozen_versions():
        assert contracts.differences(v) == [], f"HAL {v}: run `python -m dsv4core.hal.contracts`"
    assert contracts.load((1, 0))["ops"]["moe_experts"][-1]["name"] == "swiglu_limit"
    assert [p.name for p in catalogue()["all_gather"].signature_for((1, 1)).parameters.values()] == \
        ["x", "dim", "group"]


def test_unversioned_signature_changes_are_caught(monkeypatch):
    # the catalogue's specs are frozen: edit an unfrozen re-declaration of the op instead
    real = catalogue()["moe_experts"]
    spec = OpSpec(real.reference, real.family, real.tolerance, real.since, real.writes, real.capturable,
                  {n: v for n, v in real.params_since.items() if v != real.since})
    specs = dict(catalogue(), moe_experts=spec)
    monkeypatch.setattr(contracts, "catalogue", lambda: specs)
    assert contracts.differences((1, 0)) == [] and contracts.differences((1, 2)) == []
    added = inspect.Parameter("act_scale", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None)
    monkeypatch.setattr(spec, "signature", spec.signature.replace(
        parameters=[*spec.signature.parameters.values(), added]))
    monkeypatch.setitem(spec.params_since, "act_scale", (1, 0))   # added without a versioned entry
    assert any("'act_scale' is not in the HAL 1.0 contract" in d for d in contracts.differences((1, 0)))
    monkeypatch.setitem(spec.params_since, "act_scale", (1, 2))   # versioned: only the current record moves
    assert contracts.differences((1, 0)) == [] and contracts.differences((1, 1)) == []
    assert contracts.differences((1, 2))
    params = [p for n, p in spec.signature.parameters.items() if n != "swiglu_limit"]
    monkeypatch.setattr(spec, "signature", spec.signature.replace(parameters=params))
    assert any("'swiglu_limit' of the HAL 1.0 contract is gone" in d for d in contracts.differences((1, 0)))


@pytest.mark.parametrize("params_since,match", [
    ({"nope": (1, 2)}, "unknown parameter 'nope'"),
    ({"a": (1, 2)}, "needs a default"),
    ({"b": (1, 9)}, "newer than HAL_API_VERSION"),
    ({"b": (1, 0)}, "must be later than the op's since"),
    ({"b": (1, 2), "c": (1, 1)}, "positional parameter 'c' .* comes after 'b'"),
])
def test_params_since_declaration_errors(params_since, match):
    def f(x, a, b=None, c=None, *, d=None):
        return x
    with pytest.raises(ValueError, match=match):
        OpSpec(f, "test", TOL, (1, 0), params_since=params_since)
    ok = OpSpec(f, "test", TOL, (1, 0), params_since={"c": (1, 1), "d": (1, 1)})
    assert list(ok.signature_for((1, 0)).parameters) == ["x", "a", "b"]
    assert list(ok.signature_for((1, 1)).parameters) == ["x", "a", "b", "c", "d"]


# -- the frozen HAL 1.0 / 1.1 plugins ---------------------------------------------------------

def _frozen(monkeypatch):
    _install(monkeypatch, [("acme-1.0", acme_hal_1_0), ("acme-1.1", acme_hal_1_1)])
    return discover()


@pytest.mark.parametrize("name,ops", [
    ("acme-1.0", ["rms_norm", "hc_post", "moe_experts", "all_reduce", "all_gather", "reduce_scatter"]),
    ("acme-1.1", ["cache_store", "rope", "moe_experts", "all_gather"]),
])
def test_frozen_plugins_register_and_pass_conformance(monkeypatch, name, ops):
    st = _frozen(monkeypatch)[name]
    assert st.available and st.rejected == {} and sorted(st.backend.impls) == sorted(ops)
    report = run(name, ops=ops, shapes="small")
    assert report.exit_code() == 0, report.verdict()
    version = name.split("-")[1]
    for o in report.ops:
        assert o.count("failed") == 0 and o.count("passed") > 0, o.op
        declined = [c for c in o.cases if c.status == "declined"]
        # the cases that set a parameter newer than the plugin's version (quantised experts, the
        # official numerics) are declined with the reason, not failed; no other case is
        v = tuple(int(p) for p in version.split("."))
        newer = {p for p, since in catalogue()[o.op].params_since.items() if since > v}
        if o.op == "moe_experts":
            assert declined
        for c in declined:
            assert any(c.message == f"{name} implements HAL {version}, which has no {p}" for p in newer), c.message
        if not newer:
            assert not declined, o.op


def test_old_contract_calls_are_trimmed_or_declined_at_call_time(monkeypatch, caplog):
    _frozen(monkeypatch)
    table = bind("cpu", backend="acme-1.0", policy="warn")
    b = table.bindings["all_gather"]
    assert "implements HAL 1.0, which has no sizes" in b.limits["acme-1.0"]
    x = torch.randn(4, 3)
    assert torch.equal(table.all_gather(x, 0, None, None), x) and b.runtime_fallbacks == 0   # default: served
    assert torch.equal(table.all_gather(x, sizes=None), x) and b.runtime_fallbacks == 0
    with caplog.at_level(logging.WARNING, logger="dsv4core.hal"):
        assert torch.equal(table.all_gather(x, 0, None, [4]), x)                  # set: the reference
    assert b.runtime_fallbacks == 1
    assert "all_gather: acme-1.0 implements HAL 1.0, which has no sizes: served by reference" in caplog.text
    with pytest.raises(FallbackError, match="which has no sizes"):
        impls = discover()["acme-1.0"].backend.impls
        bind("cpu", backend="acme-1.0", policy="strict", check=False,
             ops={o: "reference" for o in catalogue() if o not in impls}).all_gather(x, sizes=[4])
    assert not table.accepts("all_gather", x, 0, None, [4]) and table.accepts("all_gather", x)


def test_ops_cli_shows_the_limit(monkeypatch, capsys):
    from dsv4core.cli import main

    _frozen(monkeypatch)
    assert main(["ops", "--backend", "acme-1.1"]) == 0
    out = capsys.readouterr().out
    assert "acme-1.1: implements HAL 1.1, which has no w13_scale, w2_scale" in out


# -- isolation ---------------------------------------------------------------------------------

class _Skipped(BaseException):
    """Like pytest's Skipped: a BaseException that is not an Exception."""


def test_hostile_plugins_are_isolated(monkeypatch):
    def importing(register):
        raise AssertionError("unreachable")

    def hook_base(register):
        register(Backend(name="kept-before"))
        raise _Skipped("no device")

    def bad_priority(register):
        register(Backend(name="bad-priority", priority="high"))

    def mutated(register):
        b = Backend(name="mutated")
        b.priority = None
        register(b)

    def one_bad_op(register):
        b = Backend(name="one-bad-op", priority=20)
        b.add("rms_norm", lambda x, weight: x)                         # contract failure: only this op
        b.add("hc_post", acme_hal_1_0.hc_post)
        register(b)
        register(Backend(name="one-bad-op-sibling", priority=-1))

    def taken(register):
        raise RuntimeError("hook failed")

    def dup(register):
        register(Backend(name="reference"))

    mods = [(n, _module(f"_dsv4core_hostile_{i}", h)) for i, (n, h) in enumerate(
        [("hook-base", hook_base), ("bad-priority", bad_priority), ("mutated", mutated),
         ("one-bad-op", one_bad_op), ("reference", taken), ("dup", dup)])]

    _install(monkeypatch, mods)
    eps = discovery.metadata.entry_points(group=discovery.ENTRY_POINT_GROUP)

    class _ImportSkipEP:                       # an entry point whose import raises a BaseException
        name, value, dist = "import-skip", "_dsv4core_hostile_import", None

        def load(self):
            raise _Skipped("skipped at import")
    monkeypatch.setattr(discovery.metadata, "entry_points", lambda group: [_ImportSkipEP(), *eps])
    reset()
    st = discover()
    assert "_Skipped: no device" in st["hook-base"].reason and st["kept-before"].available
    assert "priority must be an int" in st["bad-priority"].reason and "'high'" in st["bad-priority"].reason
    assert "priority must be an int" in st["mutated"].reason
    assert st["one-bad-op"].available and list(st["one-bad-op"].backend.impls) == ["hc_post"]
    assert "missing parameter 'eps'" in st["one-bad-op"].rejected["rms_norm"]
    assert st["one-bad-op-sibling"].available
    failed_ref = st["reference (from ? (_dsv4core_hostile_4))"]
    assert "hook failed" in failed_ref.reason and "already taken by builtin" in failed_ref.reason
    dup = st["reference (from ? (_dsv4core_hostile_5))"]
    assert not dup.available and "backend name 'reference' is already taken by builtin" in dup.reason
    assert "_Skipped: skipped at import" in st["import-skip"].reason
    assert st["reference"].available and st["reference"].source == "builtin"
    table = bind("cpu", policy="allow")                      # auto works for everyone
    assert table.bindings["rms_norm"].declined["one-bad-op"].startswith("implementation rejected:")
    assert table.bindings["hc_post"].backend == "one-bad-op"
    with pytest.raises(RegistrationError, match="priority must be an int"):
        Backend(name="x", priority=None)


def test_keyboard_interrupt_is_not_isolated(monkeypatch):
    def hook(register):
        raise KeyboardInterrupt
    _install(monkeypatch, [("ctrl-c", _module("_dsv4core_ctrl_c", hook))], keep_real=False)
    with pytest.raises(KeyboardInterrupt):
        discover()


def test_blocking_probe_is_bounded_and_plugins_can_be_limited(monkeypatch):
    release = threading.Event()
    probed = []

    def hook(register):
        register(Backend(name="blocking", available=lambda: (probed.append(1), release.wait(), (True, ""))[-1]))
    monkeypatch.setenv("DSV4CORE_PROBE_TIMEOUT", "0.2")
    try:
        _install(monkeypatch, [("blocking", _module("_dsv4core_blocking", hook))])
        monkeypatch.setenv("DSV4CORE_PLUGINS", "example")
        st = discover()
        assert not probed and "DSV4CORE_PLUGINS does not name it" in st["blocking"].reason
        assert st["example"].available and "not loaded" in st["cuda"].reason
        monkeypatch.setenv("DSV4CORE_PLUGINS", "none")
        reset()
        assert {n for n, s in discover().items() if s.available} == {"reference"}
        monkeypatch.delenv("DSV4CORE_PLUGINS")
        reset()
        st = discover()
        assert not st["blocking"].available and "did not answer within 0.2 s" in st["blocking"].reason
        assert st["example"].available
    finally:
        release.set()


def test_non_bool_supports_is_reported_and_served_by_the_next(monkeypatch, caplog):
    def hook(register):
        b = Backend(name="tensor-supports", priority=-1)
        b.add("rms_norm", acme_hal_1_0.rms_norm, supports=lambda x, weight, eps: torch.tensor(True))
        register(b)
    _install(monkeypatch, [("tensor-supports", _module("_dsv4core_tensor_supports", hook))])
    table = bind("cpu", backend="tensor-supports", policy="allow", ops="mhc=reference")
    x = torch.randn(3, 8)
    with caplog.at_level(logging.ERROR, logger="dsv4core.hal"):
        y = table.rms_norm(x, None, 1e-6)
        table.rms_norm(x, None, 1e-6)
    assert torch.equal(y, catalogue()["rms_norm"].reference(x, None, 1e-6))
    b = table.bindings["rms_norm"]
    assert b.runtime_fallbacks == 2 and "returned Tensor, not a bool" in b.problems["tensor-supports"]
    assert caplog.text.count("returned Tensor, not a bool") == 1
    assert not table.accepts("rms_norm", x, None, 1e-6)
