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


def test_fraction_is_reproducible_per_seed_and_correct_ops_never_diverge(monkeypatch):
    # sampling is stratified per call site: one call of every block of 1 / 0.25 = 4 calls, drawn at
    # random within the block (not every 4th call), so the seed picks the calls, not their number
    x, w = torch.randn(3, 16), torch.rand(16) + 0.5

    def checked(**kw):
        t = bind("cpu", backend="reference", verify="25%", **kw)
        st, picked = t.bindings["rms_norm"].verify, []
        for i in range(200):
            before = st.checked
            t.rms_norm(x, w, 1e-6)
            if st.checked > before:
                picked.append(i)
        assert (st.calls, st.divergences) == (200, 0)
        assert t.bindings["rms_norm"].call is not t.bindings["rms_norm"].impl.fn      # wrapped
        s = t.verify_summary()
        assert s["checked"] == st.checked and s["ops"]["rms_norm"] == {"calls": 200, "checked": st.checked}
        assert s["sites"] == {"rms_norm": {"op": "rms_norm", "calls": 200, "checked": st.checked, "divergences": 0}}
        assert not s["diverged"]
        return tuple(picked), s["seed"]

    monkeypatch.setenv("DSV4CORE_VERIFY_SEED", "7")
    p7, seed = checked()
    assert seed == 7 and checked() == (p7, 7) and checked(verify_seed=7) == (p7, 7)
    assert [i // 4 for i in p7] == list(range(50))          # exactly one call of each block of 4
    picks = {checked(verify_seed=s)[0] for s in range(8)}
    assert len(picks) == 8                      # the seed picks the calls
    assert {i % 4 for p in picks for i in p} == {0, 1, 2, 3}
    monkeypatch.delenv("DSV4CORE_VERIFY_SEED")
    assert checked()[1] != checked()[1]         # no seed given: a fresh one per table, reported


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", True])
def test_invalid_verify_seed_is_a_clear_error(monkeypatch, value):
    with pytest.raises(HALError, match="verify_seed: expected a non-negative integer seed"):
        bind("cpu", verify=0.5, verify_seed=value)
    if isinstance(value, str):
        monkeypatch.setenv("DSV4CORE_VERIFY_SEED", value)
        with pytest.raises(HALError, match=f"DSV4CORE_VERIFY_SEED: expected a non-negative integer seed.*'{value}'"):
            bind("cpu", verify=0.5)


def _linear_sites(bad_shape):
    """28 linear weights of different shapes (one step of a model) and a linear right for every
    shape but ``bad_shape`` (where it drops the last input column: a wrong kernel tile edge)."""
    g = torch.Generator().manual_seed(0)
    shapes = [(4 + i, 8 + (i % 5)) for i in range(28)]
    sites = [(torch.randn(2, k, generator=g), torch.randn(n, k, generator=g)) for n, k in shapes]
    ref = catalogue()["linear"].reference

    def linear(x, weight, weight_scale=None, out_dtype=None, act_block=None):
        if tuple(weight.shape) == bad_shape:
            x = torch.cat([x[:, :-1], torch.zeros_like(x[:, -1:])], dim=1)
        return ref(x, weight, weight_scale, out_dtype, act_block)

    return shapes, sites, linear


def test_a_bug_at_one_call_site_is_caught_at_5_percent():
    """A fixed pattern of 28 linear calls a step: every call site is checked at the rate asked for.
    (Checking every 20th call would only ever reach 7 of the 28 sites - never the first one.)"""
    from dsv4core.hal.verify import VerifyStats, wrap

    spec = catalogue()["linear"]
    shapes, sites, linear = _linear_sites(bad_shape=(4, 8))           # the step's first call
    assert sum(1 for s in shapes if s == (4, 8)) == 1

    def run(seed):
        stats = VerifyStats(0.05, seed)
        verified = wrap(spec, linear, stats, False, "one-site-bug")
        picked = []
        for _ in range(200):
            for i, (x, w) in enumerate(sites):
                before = stats.checked
                verified(x, w)
                if stats.checked > before:
                    picked.append(i)
        return stats, picked

    stats, picked = run(seed=12345)
    assert stats.calls == 200 * 28
    assert 0 < stats.divergences == picked.count(0)        # only the bad site diverges, and it was checked
    assert set(picked) == set(range(28))                     # every call site was checked at least once
    assert "weight[4, 8]" in stats.first
    again, picked_again = run(seed=12345)
    assert picked_again == picked and (again.checked, again.divergences) == (stats.checked, stats.divergences)
    assert run(seed=54321)[1] != picked


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


def test_the_frame_a_backend_sees_is_the_same_on_checked_and_unchecked_calls():
    """A backend inspecting its caller (the verify wrapper) finds the same local names, and the
    same objects but for the call's own arguments, whether or not the call is judged: the draw
    and every copy come after it returns. So it cannot be right only when checked."""
    import sys

    from dsv4core.hal.verify import VerifyStats, wrap

    spec = catalogue()["rms_norm"]
    frames = []

    def spy(*args, **kwargs):
        loc = sys._getframe(1).f_locals
        frames.append({n: (type(v), None if n in ("args", "kwargs") else id(v)) for n, v in loc.items()})
        return spec.reference(*args, **kwargs)

    stats = VerifyStats(0.5, seed=7)
    f = wrap(spec, spy, stats, True, "spy")
    x, w = torch.randn(3, 16), torch.rand(16) + 0.5
    for _ in range(40):
        f(x, w, 1e-6)
    assert 0 < stats.checked < stats.calls == 40 and stats.divergences == 0
    assert all(fr == frames[0] for fr in frames), [sorted(set(fr) ^ set(frames[0])) for fr in frames]


@pytest.mark.parametrize("bug", ["wrong-row", "wrong-value", "none"])
def test_a_pool_store_is_judged_on_what_it_left(bug):
    from dsv4core.hal.verify import VerifyStats, wrap

    spec = catalogue()["cache_store"]

    def store(pool, index, rows):
        if bug == "wrong-row":
            index = torch.where(index >= 0, (index + 1) % pool.shape[0], index)
        elif bug == "wrong-value":
            rows = rows + 1.0
        return spec.reference(pool, index, rows)

    stats = VerifyStats(1.0, seed=0)
    f = wrap(spec, store, stats, False, "store")
    pool = torch.zeros(16, 8)
    for k in range(4):
        f(pool, torch.tensor([2 * k, -1, 2 * k + 9]), torch.randn(3, 8))
    assert stats.checked == 4
    assert stats.divergences == (0 if bug == "none" else 4)
