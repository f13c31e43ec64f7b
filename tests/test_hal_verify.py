"""Runtime verify mode: DSV4CORE_VERIFY re-checks a fraction of op calls against the
reference; zero cost when off; a planted bug is caught at run time in `dsv4core generate`."""

from __future__ import annotations

import logging

import pytest
import torch

import dsv4core
from dsv4core.hal import Backend, HALError, VerifyError, bind, catalogue, discover, reset
from dsv4core.hal.discovery import _status_for

from _model_hf import _one_thread  # noqa: F401 (autouse: one torch thread)
from conformance_backends import ALT_IMPLS, BROKEN


@pytest.fixture
def planted():
    """A cpu backend (priority 500) = the legal alt ops, one of them broken (sink ignored)."""
    reset()
    b = Backend(name="planted", device_types=("cpu",), priority=500)
    impls = dict(ALT_IMPLS, sparse_mqa_attention=BROKEN["attention-sink-ignored"][1])
    for op, fn in impls.items():
        b.add(op, fn)
    discover()[b.name] = _status_for(b, "test")
    yield b
    reset()


@pytest.mark.parametrize("value", ["abc", "1.5", "-0.1", "200%", "nan"])
def test_invalid_verify_value_is_a_clear_error_at_bind_time(monkeypatch, value):
    monkeypatch.setenv("DSV4CORE_VERIFY", value)
    with pytest.raises(HALError, match=f"DSV4CORE_VERIFY: expected a fraction .* got '{value}'"):
        bind("cpu")
    monkeypatch.delenv("DSV4CORE_VERIFY")
    with pytest.raises(HALError, match="verify: expected a fraction"):
        bind("cpu", verify=value)


def test_off_is_the_plain_table():
    plain = bind("cpu", backend="reference", policy="strict", check=False)
    for v in (None, 0, "0", ""):
        t = bind("cpu", backend="reference", policy="strict", check=False, verify=v)
        assert t is plain
        assert all(getattr(t, n) is s.reference for n, s in catalogue().items())
        assert t.verify_summary() is None and "verify" not in t.report()[0]


def test_fraction_is_deterministic_and_correct_ops_never_diverge():
    t = bind("cpu", backend="reference", verify="25%")
    x, w = torch.randn(3, 16), torch.rand(16) + 0.5
    for _ in range(8):
        t.rms_norm(x, w, 1e-6)
    st = t.bindings["rms_norm"].verify
    assert (st.calls, st.checked, st.divergences) == (8, 2, 0)
    assert t.bindings["rms_norm"].call is not t.bindings["rms_norm"].impl.fn      # wrapped
    assert t.verify_summary()["checked"] == 2 and not t.verify_summary()["diverged"]


def test_planted_bug_is_caught_in_the_model_and_named(planted, caplog):
    m = dsv4core.load_model("tiny", backend="planted", verify=1.0)
    with caplog.at_level(logging.WARNING, logger="dsv4core.hal"):
        m.generate([[3, 4, 5, 6, 7]], 3)
    rep = {r["op"]: r for r in m.hal_report()}
    v = rep["sparse_mqa_attention"]["verify"]
    assert v["checked"] == v["calls"] > 0 and v["divergences"] > 0
    assert all(r["verify"]["divergences"] == 0 for op, r in rep.items() if op != "sparse_mqa_attention")
    warned = [r.getMessage() for r in caplog.records if "verify:" in r.getMessage()]
    assert len(warned) == 1 and "sparse_mqa_attention" in warned[0] and "q[" in warned[0] and "bound" in warned[0]


def test_strict_raises_and_generate_exits_nonzero(planted, monkeypatch, capsys):
    from dsv4core.cli import main

    monkeypatch.setenv("DSV4CORE_VERIFY", "1")
    assert main(["generate", "--model", "tiny", "--backend", "planted", "--input-ids", "3,4,5,6", "--max-new-tokens", "2",
                 "--no-progress"]) == 0
    assert "diverged (sparse_mqa_attention" in capsys.readouterr().err
    monkeypatch.setenv("DSV4CORE_VERIFY_STRICT", "1")
    with pytest.raises(VerifyError, match="sparse_mqa_attention"):
        dsv4core.load_model("tiny", backend="planted").generate([[3, 4, 5]], 1)
    rc = main(["generate", "--model", "tiny", "--backend", "planted", "--input-ids", "3,4,5,6", "--max-new-tokens", "2",
               "--no-progress"])
    assert rc != 0 and "sparse_mqa_attention" in capsys.readouterr().err


def test_a_legal_backend_never_diverges_in_the_model():
    """No false alarms: the differently-computed legal backend, every call checked, both dtypes."""
    reset()
    b = Backend(name="legal", device_types=("cpu",), priority=500)
    for op, fn in ALT_IMPLS.items():
        b.add(op, fn)
    discover()[b.name] = _status_for(b, "test")
    try:
        for dt in ("float32", "bfloat16"):
            m = dsv4core.load_model("tiny", backend="legal", dtype=dt, verify=1.0)
            m.generate([list(range(3, 30))], 3)
            s = m.ops.verify_summary()
            assert s["checked"] == s["calls"] > 100 and s["divergences"] == 0, s["diverged"]
    finally:
        reset()
