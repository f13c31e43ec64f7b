"""The conformance suite has teeth: correct backends pass, each subtly broken backend fails for
exactly its broken op (see tests/conformance_backends.py for the backends)."""

from __future__ import annotations

import pytest

from dsv4core.conformance import FAILED, PASSED, run
from dsv4core.hal import catalogue

import torch

from conformance_backends import ALT_IMPLS, BROKEN, QUANT_BROKEN, make_alt_backend, make_backend, make_broken_backend


def _statuses(report):
    return {o.op: o.status for o in report.ops}


def test_reference_passes_everything():
    report = run("reference", shapes="small", dtypes="float32,bfloat16")
    assert not report.failed, [f"{c.id}: {c.message}" for c in report.failures()]
    assert report.exit_code() == 0
    # complete but for the collectives, which need spawned ranks (test_conformance_distributed.py)
    assert [g for g in report.gaps() if "one process only" not in g] == []
    assert set(_statuses(report)) == set(catalogue())
    # the bound is never tight for the reference itself: err_ref / (k err_ref + floor) < 1
    assert all(o.worst_ratio is None or o.worst_ratio < 1 for o in report.ops)


def test_differently_computed_legal_backend_passes_everything():
    """Split-K / chunked sums, online softmax, complex-number rope, sort-based top-k, slot-major
    experts: legal differences in rounding must never fail."""
    report = run(make_alt_backend(), shapes="small", dtypes="float32,bfloat16")
    assert not report.failed, [f"{c.id}: {c.message}" for c in report.failures()]
    assert [g for g in report.gaps() if "one process only" not in g] == []


@pytest.mark.parametrize("kind", sorted(BROKEN))
def test_broken_backend_fails_exactly_its_op(kind):
    broken_op = BROKEN[kind][0]
    report = run(make_broken_backend(kind), shapes="small", dtypes="float32")
    st = _statuses(report)
    assert st[broken_op] == FAILED, f"{kind}: {broken_op} was not caught"
    assert {op for op, s in st.items() if s != PASSED} == {broken_op}, st
    assert report.exit_code() == 1
    # every failure names the op, the case and the measured value against the bound
    for c in report.failures():
        assert c.op == broken_op and c.message
    msg = report.failures()[0].message
    assert "bound" in msg or "query" in msg or "index" in msg


@pytest.mark.parametrize("kind", ["hc-pre-bf16-accumulation", "rope-neox-pairs", "attention-sink-ignored",
                                  "swiglu-clamp-missing", "hc-post-comb-transposed"])
def test_broken_backend_also_caught_in_bfloat16(kind):
    op = BROKEN[kind][0]
    report = run(make_broken_backend(kind), ops=op, shapes="small", dtypes="bfloat16")
    assert _statuses(report)[op] == FAILED


def test_sinkhorn_invariant_reports_the_excess_deviation():
    report = run(make_broken_backend("sinkhorn-one-short"), ops="hc_pre", dtypes="float32")
    msgs = " ".join(c.message for c in report.failures())
    assert "comb rows and columns sum to 1" in msgs


def test_rope_invariant_names_interleaved_pairs():
    report = run(make_broken_backend("rope-neox-pairs"), ops="rope", dtypes="float32")
    assert any("interleaved pair" in c.message for c in report.failures())


def test_topk_threshold_one_too_small_is_caught():
    import torch

    from conformance_backends import _topk

    def low(scores, k_lengths, topk):       # drops the last valid key of every query
        return _topk(scores, k_lengths - 1 if k_lengths.numel() else k_lengths, topk)

    def low_clamped(scores, k_lengths, topk):
        return low(scores, torch.clamp_min(k_lengths, 1) if k_lengths.numel() else k_lengths, topk)

    report = run(make_backend("topk-low", {"indexer_topk": low_clamped}), ops="indexer_topk", dtypes="float32")
    assert _statuses(report)["indexer_topk"] == FAILED


def test_ties_are_not_failures():
    """A backend breaking ties differently (reverse order among equal scores) still passes."""
    import torch

    def reversed_ties(scores, k_lengths, topk):
        T, L = scores.shape
        out = torch.full((T, topk), -1, dtype=torch.int32, device=scores.device)
        for t in range(T):
            n = int(k_lengths[t])
            v = scores[t, :n].flip(0)
            order = (n - 1 - torch.sort(v, descending=True, stable=True).indices)[:topk]
            out[t, :order.numel()] = order.to(torch.int32)
        return out

    def route_reversed(logits, topk, scaling, correction_bias=None, hash_ids=None):
        from dsv4core.hal.ops.moe import moe_route
        E = logits.shape[1]
        w, ids = moe_route.reference(logits.flip(-1), topk, scaling,
                                     None if correction_bias is None else correction_bias.flip(-1),
                                     None if hash_ids is None else (E - 1 - hash_ids.long()))
        return w, (E - 1 - ids.long()).to(torch.int32)

    report = run(make_backend("ties", {"indexer_topk": reversed_ties, "moe_route": route_reversed}),
                 ops="indexer_topk,moe_route", dtypes="float32")
    assert not report.failed, [f"{c.id}: {c.message}" for c in report.failures()]


@pytest.mark.parametrize("kind", sorted(QUANT_BROKEN))
def test_official_numerics_mistakes_are_caught(kind):
    """The classic mistakes of the official quantisation rules each fail their op's quantised
    cases (and only those: the exact-numerics cases of the op still pass)."""
    op, fn = QUANT_BROKEN[kind]
    report = run(make_backend(f"broken-{kind}", dict(ALT_IMPLS, **{op: fn})), ops=[op], shapes="small",
                 dtypes="float32,bfloat16")
    assert _statuses(report)[op] == FAILED, f"{kind}: {op} was not caught"
    failed = {c.case for c in report.failures()}
    quant_cases = {c.name for c in catalogue()[op].sample_cases("small", torch.float32)
                   if any(c.kwargs.get(a) is not None
                          for a in ("act_block", "nope_quant_block", "row_format", "kv_format", "k_format"))
                   or op == "indexer_rotate_quant"}
    assert failed and failed <= quant_cases, (kind, failed - quant_cases)
