"""Whole-step verify sampling on a device that replays graphs (dsv4core.hal.verify, "Whole-step
sampling"): the graphs record the plain ops, each step is drawn at the verify fraction (stratified:
one step of every block of 1 / fraction), an unsampled step replays unverified, a sampled one runs
eagerly with every call checked and counted per call site. Graphs come from a CPU stand-in
capture whose replay re-runs the recorded function (as tests/test_model_step_graphs.py), served
by a backend whose ops are the reference's declared capturable - so a replay that ran verified
ops would show in the counts."""

from __future__ import annotations

import pytest
import torch

import dsv4core
from dsv4core.hal import Backend, VerifyError, bind, catalogue, discover, reset
from dsv4core.hal.discovery import _status_for
from dsv4core.hal.verify import Sampler, sampler
from dsv4core.model.opsref import SAMPLED

from _model_hf import _one_thread  # noqa: F401 (autouse: one torch thread)

BAD_SITE = "layers.2.self_attn.q_b_proj"
PROMPT = [3, 4, 5, 6, 7]


class _ReplayByRerun:
    """Stand-in graph capture: 'replay' re-runs the recorded function and refills its outputs."""

    replays = 0

    def new_pool(self, device):
        return object()

    def capture(self, fn, device, pool=None):
        out = fn()

        def replay():
            _ReplayByRerun.replays += 1
            new = fn()
            for o, n in zip(out if isinstance(out, tuple) else (out,), new if isinstance(new, tuple) else (new,)):
                o.copy_(n)
        return replay, out


@pytest.fixture
def capturable():
    """Registers a cpu backend with graph capture: every op the reference's, declared capturable;
    `make(bad=True)` makes its linear wrong (x 1.01) at the weight of BAD_SITE only."""
    target = []

    def make(bad: bool):
        reset()
        b = Backend(name="graphs", device_types=("cpu",), priority=500, graph_capture=_ReplayByRerun())
        ref = catalogue()["linear"].reference

        def linear(x, weight, weight_scale=None, out_dtype=None, act_block=None):
            y = ref(x, weight, weight_scale, out_dtype, act_block)
            return y * 1.01 if bad and target and weight is target[0] else y

        for name, spec in catalogue().items():
            b.add(name, linear if name == "linear" else spec.reference, capturable=True)
        discover()[b.name] = _status_for(b, "test")
        m = dsv4core.load_model("tiny", backend="graphs")
        target[:] = [m.model.layers[2].self_attn.q_b_proj.weight]
        return m

    yield make
    reset()


def _verified(m, fraction, seed, strict=False):
    m.bind_ops(bind("cpu", backend="graphs", policy="allow", verify=fraction, verify_seed=seed, verify_strict=strict))
    return m


def _drawn(seed, fraction, n):
    draw = Sampler(sampler(seed, "whole-step"), fraction)
    return [draw() for _ in range(n)]


def test_unsampled_steps_replay_unverified_and_sampled_steps_check_every_call(capturable):
    m = capturable(bad=False)
    r0 = _ReplayByRerun.replays
    want, _ = _generate_steps(m, 8)                  # plain table: graphs on, every step replayed
    assert m.graph_status() == "" and _ReplayByRerun.replays - r0 == 8
    _verified(m, 0.25, seed=3)
    r0 = _ReplayByRerun.replays
    got, sampled = _generate_steps(m, 8)
    assert m.graph_status() == ""                    # the verify mode no longer turns the graphs off
    assert got == want
    assert sampled == _drawn(3, 0.25, 8) and sum(sampled) == 2     # one step of every block of 4
    assert _ReplayByRerun.replays - r0 == 6
    s = m.ops.verify_summary()
    assert s["steps"] == {"sampled": 2, "total": 8}
    assert s["checked"] == s["calls"] > 0 and s["divergences"] == 0     # no verified call outside a sampled step
    assert s["sites"]["lm_head:linear"] == {"op": "linear", "calls": 2, "checked": 2, "divergences": 0}


def _generate_steps(m, n):
    """Greedy decode of PROMPT for n steps through forward_batch (one request): the tokens and
    whether each step was sampled."""
    st = m.new_state()
    ids, sampled, out = list(PROMPT), [], []
    try:
        for _ in range(n):
            new = ids[st.length:]
            logits = m.forward_batch(torch.tensor(new), torch.arange(st.length, st.length + len(new)),
                                     torch.zeros(len(new), dtype=torch.long), [st], logits_rows=torch.tensor([-1]))
            sampled.append(m.graph_status(last_step=True) == SAMPLED)
            ids.append(int(logits[0].argmax()))
            out.append(ids[-1])
    finally:
        st.release()
    return [out], sampled


def test_a_backend_wrong_at_one_call_site_is_caught_at_the_step_rate_in_every_seed(capturable):
    """f = 0.25 over 4 steps: exactly one sampled step, whichever the seed, and it checks every
    call: the one bad site (its linear x 1.01, called once a step) diverges, and only it. The
    unsampled steps replay the same wrong kernel unseen, so the seed decides when, never whether."""
    m = capturable(bad=True)
    when = set()
    for seed in range(3):
        _verified(m, 0.25, seed)
        _, sampled = _generate_steps(m, 4)
        s = m.ops.verify_summary()
        assert s["steps"] == {"sampled": 1, "total": 4} and s["checked"] == s["calls"]
        bad = s["sites"][f"{BAD_SITE}:linear"]
        assert bad["calls"] == bad["checked"] == bad["divergences"] == 1
        assert [k for k, v in s["sites"].items() if v["divergences"]] == [f"{BAD_SITE}:linear"]
        assert f"at {BAD_SITE}:linear" in s["diverged"]["linear"]["first_divergence"]
        when.add(sampled.index(True))
    assert len(when) > 1                              # the sampled step is drawn, not fixed
    m.use_graphs = False                              # eager: per-call sampling, no steps drawn
    _verified(m, 0.25, 0)
    _generate_steps(m, 4)
    s = m.ops.verify_summary()
    assert s["steps"] == {"sampled": 0, "total": 0} and 0 < s["checked"] < s["calls"]


def test_a_sampled_step_that_fails_changes_no_request_state(capturable):
    """Strict mode: the sampled step raises VerifyError; the request is as before it (a twin forked
    before it continues bit for bit the same), and every call site calls the bound table again."""
    m = capturable(bad=True)
    seed = next(s for s in range(100) if _drawn(s, 0.5, 2) == [False, True])   # the prefill replays
    _verified(m, 0.5, seed, strict=True)
    st = m.new_state()
    m.forward_batch(torch.tensor(PROMPT), torch.arange(5), torch.zeros(5, dtype=torch.long), [st])
    assert m.graph_status(last_step=True) == ""
    twin, c = st.fork(), m.cache
    before = (st.length, st.ring_hi, st.win_lo, c.window_table.copy(), c.comp_table.copy(),
              c.win_pool.ref.copy(), c.comp_pool.ref.copy())
    one = (torch.tensor([9]), torch.tensor([5]), torch.zeros(1, dtype=torch.long))
    with pytest.raises(VerifyError, match=f"linear .*at {BAD_SITE}:linear"):
        m.forward_batch(*one, [st])
    after = (st.length, st.ring_hi, st.win_lo, c.window_table, c.comp_table, c.win_pool.ref, c.comp_pool.ref)
    assert before[:3] == after[:3] and all((x == y).all() for x, y in zip(before[3:], after[3:]))
    table = m.ops
    assert all(ref.t is table.at(name) for name, ref in m._ops._sites.items())
    assert m.ops.verify_summary()["steps"] == {"sampled": 1, "total": 2}
    m.use_graphs = False
    m.bind_ops(bind("cpu", backend="graphs", policy="allow"))
    assert torch.equal(m.forward_batch(*one, [st]), m.forward_batch(*one, [twin]))


def test_the_overhead_benchmark_runs_whole_step_sampling_with_graphs_on(capturable, tmp_path):
    """benchmarks/verify_overhead.py with graphs on (the stand-in capture): the verified run is
    repeated until its steps hold the sampled ones asked for, and reports them. No timing asserted."""
    import json

    from _scripts import load_script

    capturable(bad=False)
    b = load_script("verify_overhead")
    out = tmp_path / "r.json"
    assert b.main(["--configs", "tiny", "--fractions", "0,0.25", "--reps", "1", "--graphs", "on", "--backend", "graphs",
                   "--lengths", "8,2", "--min-sampled", "1", "--per-call-calls", "1000", "--json", str(out)]) == 0
    off, quarter = json.loads(out.read_text())["results"][0]["runs"]
    assert off["graphs"] == quarter["graphs"] == "on" and off["steps"] is None
    assert quarter["reps"] == [4, 2]                 # ceil(1 / 0.25) prefills; 4 steps in generates of 2
    steps = quarter["steps"]   # the timed steps and a warm-up each: 1 + 4 prefills, (1 + 2) x 2 generate steps
    assert steps["total"] == 11 and steps["sampled"] in (2, 3) and quarter["divergences"] == 0


def test_the_whole_steps_of_a_verified_table_share_its_counts():
    plain = bind("cpu", backend="reference", policy="strict", check=False)
    assert plain.unverified() is plain and plain.whole_steps() is None
    t = bind("cpu", backend="reference", policy="strict", check=False, verify=0.25, verify_seed=5)
    ws = t.whole_steps()
    assert t.unverified() is plain and ws is t.whole_steps() and ws.plain is plain and ws.checked.whole_steps() is None
    assert len(t.capturable()) == len(t.bindings) and all("verify mode on" in v for v in t.capturable().values())
    x, w = torch.randn(3, 16), torch.rand(16) + 0.5
    for _ in range(3):
        ws.checked.at("norm").rms_norm(x, w, 1e-6)          # a sampled step: every call checked
    for _ in range(4):
        t.at("norm").rms_norm(x, w, 1e-6)                   # per-call sampling: one of the block of 4
    site = t.bindings["rms_norm"].verify.sites["norm:rms_norm"]
    assert (site.calls, site.checked) == (7, 4)
    assert [ws.draw() for _ in range(8)] == _drawn(5, 0.25, 8)
    s = t.verify_summary()
    assert s["steps"] == {"sampled": 2, "total": 8} and s["sites"]["norm:rms_norm"]["checked"] == 4
