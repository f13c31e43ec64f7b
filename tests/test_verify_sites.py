"""Verify coverage per call site: each site (module path and op) is sampled on its own stream,
stratified (one call of every block of 1 / fraction calls), so a bug confined to one site is
caught within 1 / fraction calls of that site whatever the seed; the summary lists every site
of a tiny-model step."""

from __future__ import annotations

import bisect
import math
from collections import Counter

import pytest
import torch

import dsv4core
from dsv4core.hal import Backend, bind, catalogue, discover, reset
from dsv4core.hal.discovery import _status_for
from dsv4core.hal.verify import Sampler, VerifyStats, sampler, wrap

from _model_hf import _one_thread  # noqa: F401 (autouse: one torch thread)


@pytest.mark.parametrize("fraction", [0.05, 0.25, 0.3, 1 / 3, 0.5, 0.999, 1.0])
def test_the_sampler_checks_exactly_one_call_of_every_block(fraction):
    """The deterministic argument: block b is calls [ceil(b / f), ceil((b + 1) / f)); every block
    holds exactly one checked call, so n calls are checked floor(n f) or ceil(n f) times, and the
    first ceil(1 / f) calls always hold a checked one - for every seed."""
    n = 400
    edges = [math.ceil(b / fraction - 1e-9) for b in range(n + 2)]
    for seed in range(30):
        draw = Sampler(sampler(seed, "linear", "layers.0.self_attn.q_a_proj"), fraction)
        picked = [i for i in range(n) if draw()]
        per_block = Counter(bisect.bisect_right(edges, i) - 1 for i in picked)
        complete = [b for b in range(len(edges) - 1) if edges[b + 1] <= n]
        assert all(per_block[b] == 1 for b in complete) and set(per_block) <= set(complete) | {complete[-1] + 1}
        assert math.floor(n * fraction) <= len(picked) <= math.ceil(n * fraction)
        assert picked[0] < math.ceil(1 / fraction)
    if fraction == 0.05:        # the position in each block is drawn uniformly: 20 positions, 2000 blocks
        draw = Sampler(sampler(0, "linear", "x"), fraction)
        pos = [i % 20 for i in range(40000) if draw()]
        assert len(pos) == 2000 and all(50 <= pos.count(p) <= 150 for p in range(20))


def _sites(bad: int):
    """28 linear call sites (one model step: different weight shapes); the linear is right for
    every site but ``bad`` (it drops the last input column there: a wrong tile edge)."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(2, 8 + i % 5, generator=g), torch.randn(4 + i, 8 + i % 5, generator=g)) for i in range(28)]
    ref = catalogue()["linear"].reference
    bad_w = data[bad][1]

    def linear(x, weight, weight_scale=None, out_dtype=None, act_block=None):
        if weight is bad_w:
            x = torch.cat([x[:, :-1], torch.zeros_like(x[:, -1:])], dim=1)
        return ref(x, weight, weight_scale, out_dtype, act_block)

    return data, linear


def test_a_bug_confined_to_one_call_site_is_caught_at_5_percent_in_every_seed():
    """20 steps of 28 linear sites at f = 0.05: each named site is checked once per 20 of its
    calls, so the one bad site is caught in every seed (>= 95 % asked). One stream for the whole
    op (the calls made on the table directly) reaches that site in only ~1 - (27/28)^28 ~ 64 %."""
    spec = catalogue()["linear"]
    data, linear = _sites(bad=5)
    caught_sited = caught_op = 0
    seeds = range(20)
    for seed in seeds:
        stats = VerifyStats(0.05, seed)
        own = wrap(spec, linear, stats, False, "site-bug")
        calls = [own.at(f"layers.{i // 7}.site{i % 7}") for i in range(28)]
        for _ in range(20):
            for f, (x, w) in zip(calls, data):
                f(x, w)
        bad = stats.sites["layers.0.site5:linear"]
        assert bad.calls == 20 and bad.checked == 1
        assert all(s.checked == 1 and (s.divergences == 0 or s is bad) for s in stats.sites.values() if s.calls)
        caught_sited += bad.divergences > 0
        assert "at layers.0.site5:linear" in stats.first or not bad.divergences
        stats = VerifyStats(0.05, seed)
        own = wrap(spec, linear, stats, False, "site-bug")
        for _ in range(20):
            for x, w in data:
                own(x, w)
        caught_op += stats.divergences > 0
    assert caught_sited == len(seeds)
    assert caught_op < 0.95 * len(seeds)


@pytest.fixture
def site_bug():
    """A tiny model and a backend whose linear is wrong at one call site only (the weight of
    ``layers.2.self_attn.q_b_proj``); every other op is the reference's."""
    reset()
    m = dsv4core.load_model("tiny", backend="reference")
    target = m.model.layers[2].self_attn.q_b_proj.weight
    ref = catalogue()["linear"].reference

    def linear(x, weight, weight_scale=None, out_dtype=None, act_block=None):
        y = ref(x, weight, weight_scale, out_dtype, act_block)
        return y * 1.01 if weight is target else y

    b = Backend(name="site-bug", device_types=("cpu",), priority=500)
    b.add("linear", linear)
    discover()[b.name] = _status_for(b, "test")
    yield m
    reset()


def test_the_summary_lists_every_site_of_a_tiny_model_step_and_names_the_bad_one(site_bug):
    m = site_bug
    ran = set()
    hooks = [mod.register_forward_pre_hook(lambda mod, args, p=p: ran.add(p))
             for p, mod in m.model.named_modules() if hasattr(mod, "_ops")]
    m.bind_ops(bind("cpu", backend="site-bug", policy="allow", verify=0.05, verify_seed=11))
    m.generate([[3, 4, 5, 6, 7]], 1)                          # one step: the prefill
    for h in hooks:
        h.remove()
    s = m.ops.verify_summary()
    sites = s["sites"]
    assert sum(v["calls"] for v in sites.values()) == s["calls"] > 0      # every call has its site ...
    assert all(":" in k for k in sites)                                  # ... a named one
    paths = {k.rsplit(":", 1)[0] for k in sites}
    assert ran <= paths and {"lm_head", "layers.2.self_attn.q_b_proj", "layers.0.attn_hc", "norm"} <= paths
    # and only sites that hold a table: modules that ran, the indexers (their ops run from their
    # compressor's step) and the wrapper's own
    assert all(p in ran or p.endswith(".indexer") or p in ("lm_head", "ring_store", "embed") for p in paths)
    assert all(v["op"] == k.rsplit(":", 1)[1] for k, v in sites.items())
    # 20 steps: the bad site (called once a step) is checked once, and it is the only one that diverges
    m.bind_ops(bind("cpu", backend="site-bug", policy="allow", verify=0.05, verify_seed=11))
    m.generate([[3, 4, 5, 6, 7]], 20)
    sites = m.ops.verify_summary()["sites"]
    bad = sites["layers.2.self_attn.q_b_proj:linear"]
    assert bad["calls"] == 20 and bad["checked"] == 1 and bad["divergences"] == 1
    assert [k for k, v in sites.items() if v["divergences"]] == ["layers.2.self_attn.q_b_proj:linear"]


def test_the_wrapper_checks_the_calls_its_sampler_picks():
    spec = catalogue()["rms_norm"]
    x, w = torch.randn(2, 8), torch.rand(8) + 0.5
    stats = VerifyStats(0.1, 5)
    f = wrap(spec, spec.reference, stats, True, "ref").at("norm")
    picked = []
    for i in range(100):
        before = stats.checked
        f(x, w, 1e-6)
        if stats.checked > before:
            picked.append(i)
    draw = Sampler(sampler(5, "rms_norm", "norm"), 0.1)
    assert picked == [i for i in range(100) if draw()] and len(picked) == 10
    assert stats.sites["norm:rms_norm"].as_dict() == {"op": "rms_norm", "calls": 100, "checked": 10, "divergences": 0}
