"""An oracle plugins cannot bend: conformance compares the live oracle (references, tolerances,
checks, cases, comparison code, the torch functions they call) with the installed files and
refuses to judge (exit 2, naming the plugin) when a plugin changed it; the isolated oracle (a
process that loads no plugin) fails a backend that agrees with a kernel registered over torch's."""

from __future__ import annotations

import json
import sys
from importlib import metadata

import pytest
import torch

import oracle_tamper_plugins as tamper
from dsv4core.commands.conformance import main
from dsv4core.conformance import FAILED, PASSED, run
from dsv4core.hal import Backend, catalogue, discovery, oracle, reset

ARGS = ["--ops", "rms_norm", "--dtype", "float32", "--no-model", "--world-sizes", "none", "-q"]


def _install(monkeypatch, kinds):
    eps = []
    for kind in kinds:
        mod = tamper.module(kind)
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
        eps.append(metadata.EntryPoint(name=f"tamper-{kind}", value=mod.__name__, group=discovery.ENTRY_POINT_GROUP))
    monkeypatch.setattr(discovery.metadata, "entry_points", lambda group: eps)
    monkeypatch.setattr(oracle, "CHANGED_BY", [])
    reset()


@pytest.fixture
def restore():
    yield
    for kind in tamper.KINDS:
        tamper.undo(kind)
    reset()
    assert oracle.problems() == []


def test_the_clean_oracle_matches_the_files_and_is_recorded(tmp_path, capsys):
    assert oracle.problems() == [] and oracle.refusal() is None
    fp = oracle.expected()
    assert {"op rms_norm.tolerance", "op rms_norm.reference", "op rms_norm.cases", "module compare.judge",
            "torch torch.rsqrt"} <= set(fp)
    j = tmp_path / "r.json"
    assert main(["--backend", "reference", *ARGS, "--json", str(j)]) == 0
    data = json.loads(j.read_text())
    assert data["oracle"] == {"digest": oracle.digest(fp), "isolated": False}
    assert f"oracle: {oracle.digest(fp)}\n" in capsys.readouterr().out
    # a full-conformance claim takes the expected outputs from a process that loads no plugin
    assert main(["--backend", "reference", *ARGS, "--require-all", "--json", str(j)]) == 0
    iso = json.loads(j.read_text())
    assert iso["oracle"] == {"digest": oracle.digest(fp), "isolated": True}
    assert f"oracle: {oracle.digest(fp)} (isolated)" in capsys.readouterr().out
    assert [c["worst_ratio"] for c in iso["ops"][0]["cases"]] == [c["worst_ratio"] for c in data["ops"][0]["cases"]]


@pytest.mark.parametrize("kind,field", [("setattr", "op rms_norm.tolerance"), ("class", "module spec.OpSpec"),
                                        ("torch", "torch torch.rsqrt")])
def test_a_plugin_that_bends_the_oracle_is_named_and_nothing_is_judged(monkeypatch, capsys, restore, kind, field):
    _install(monkeypatch, [kind])
    assert discovery.discover()[f"tamper-{kind}"].available
    rc = main(["--backend", f"tamper-{kind}", *ARGS])
    out, err = capsys.readouterr()
    assert rc == 2, out + err
    assert "refusing to judge" in err and f"changed by plugin ? (_dsv4core_tamper_{kind})" in err, err
    assert field in err, err
    assert "result:" not in out                                # no verdict was given
    if kind == "torch":
        assert "replaced by oracle_tamper_plugins._wrong_rsqrt" in err


def test_a_change_after_loading_names_the_field(restore):
    spec = catalogue()["rms_norm"]
    good = spec.tolerance
    object.__setattr__(spec, "tolerance", tamper.LOOSE)
    try:
        with pytest.raises(Exception) as e:
            run("reference", ops=["rms_norm"], dtypes="float32")
        assert type(e.value).__name__ == "OracleChanged"
        assert "changed after the plugins loaded" in str(e.value) and "op rms_norm.tolerance: expected" in str(e.value)
        assert "k=1e+30" in str(e.value)
    finally:
        object.__setattr__(spec, "tolerance", good)


def test_names_only_tooling_can_bind_are_not_oracle_changes(restore):
    """pytest's assertion rewriting (it rewrites every module of a distribution that registers a
    pytest plugin, as an installed dsv4core does) adds "@py_builtins" / "@pytest_ar" to the modules:
    not an identifier, so no code can read it by name, and not a change of the oracle; a rebound
    identifier is one."""
    import builtins

    from dsv4core.hal import compare

    assert oracle.problems() == []
    vars(compare)["@py_builtins"] = builtins
    try:
        assert oracle.problems() == []
        run("reference", ops=["rms_norm"], dtypes="float32")      # judges, does not refuse
    finally:
        del vars(compare)["@py_builtins"]
    good = compare.error
    compare.error = lambda *a: 0.0
    try:
        assert any("compare.error" in p for p in oracle.problems())
    finally:
        compare.error = good


@pytest.mark.filterwarnings("ignore:Warning only once for all operators")
def test_the_isolated_oracle_fails_a_backend_that_agrees_with_an_overridden_kernel():
    """A kernel registered over torch's own ``aten::rsqrt`` (below what the fingerprint sees) bends
    the in-process reference and fp64 evaluation alike: a backend computing the same wrong values
    passes in-process, and fails against the isolated oracle."""
    b = Backend(name="agrees", version="0", device_types=("cpu",))
    b.add("rms_norm", tamper._agreeing_rms_norm)
    lib = torch.library.Library("aten", "IMPL")
    try:
        lib.impl("rsqrt", lambda x: 1.5 / torch.sqrt(x), "CPU")
        x = torch.full((2,), 4.0)
        assert torch.equal(torch.rsqrt(x), torch.full((2,), 0.75))         # the override is live
        assert oracle.problems() == []                                    # and invisible to the fingerprint
        bent = run(b, ops=["rms_norm"], shapes="small", dtypes="float32")
        assert [o.status for o in bent.ops] == [PASSED]                   # judged by the bent oracle
        iso = run(b, ops=["rms_norm"], shapes="small", dtypes="float32", isolate=True)
    finally:
        lib._destroy()
    assert [o.status for o in iso.ops] == [FAILED] and iso.oracle["isolated"]
    judged = [c for c in iso.ops[0].cases if not c.case.startswith("T0-")]     # T0: empty, nothing to bend
    assert len(judged) >= 5 and all(c.status == FAILED and c.failure == "numeric" for c in judged)
    assert torch.equal(torch.rsqrt(torch.full((2,), 4.0)), torch.full((2,), 0.5))


def test_the_isolated_oracle_ships_the_moved_code_allowance(monkeypatch):
    """Under isolation the moved-code allowance of the official expert math comes from the isolated
    process with the expected outputs (None for every other call): equal to the one computed here,
    and the judge uses it: with the judging process's allowance disabled, every case still passes."""
    from dsv4core.conformance import cases, isolate
    from dsv4core.hal import compare

    spec = catalogue()["moe_experts"]
    impl = cases.load_backend("reference").impls["moe_experts"]
    _, found = isolate.expected_cases(["moe_experts"], ["small"], ["float32"], "cpu", 0)
    entries = found["moe_experts/small/float32"]
    assert not isinstance(entries, str) and all(exp is not None for _, exp, _ in entries)
    official = [(c, exp) for c, exp, _ in entries if "official" in c.tags]
    assert len(official) >= 3
    for c, (_, _, allow) in official:
        here = compare._moved_code_allowance(spec, c.kwargs)
        assert allow.dtype == torch.float64 and torch.equal(allow, here)
    assert all(exp[2] is None for c, exp, _ in entries if "official" not in c.tags)

    def refuse(*a, **k):
        raise AssertionError("the judging process computed the moved-code allowance")

    monkeypatch.setattr(compare, "_moved_code_allowance", refuse)
    results = [cases.run_case(spec, impl, c, torch.float32, "small", expected=exp) for c, exp, _ in entries]
    assert [r.case for r in results if r.status != PASSED] == []
    assert {r.case for r in results if any(ch.metric == "max_rel_moved" for ch in r.checks)} == \
        {c.name for c, _ in official}
