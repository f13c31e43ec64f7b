"""Bad input for the conformance suite: unknown backend/op, a backend that raises, wrong shape,
dtype or device, NaN outputs, in-place input modification, declines."""

from __future__ import annotations

import pytest
import torch

from dsv4core.conformance import DECLINED, FAILED, NOT_IMPLEMENTED, PASSED, ConformanceError, run
from dsv4core.hal.ops.norms import rms_norm as rms_spec

from conformance_backends import ALT_IMPLS, make_backend


def _one(impls, ops="rms_norm", supports=None, **kw):
    return run(make_backend("t", impls, supports), ops=ops, dtypes=kw.pop("dtypes", "float32"), **kw)


def test_unknown_backend():
    with pytest.raises(ConformanceError, match="unknown backend 'no-such-backend'"):
        run("no-such-backend")


def test_unloadable_backend_reports_cause():
    from dsv4core.hal import discover

    broken = [n for n, st in discover().items() if not st.available]
    if not broken:
        pytest.skip("no unavailable backend installed in this environment")
    with pytest.raises(ConformanceError, match="cannot be loaded"):
        run(broken[0])


@pytest.mark.parametrize("ops", ["rms_norm,nope", "", "  "])
def test_unknown_or_empty_op(ops):
    with pytest.raises(ConformanceError):
        run("reference", ops=ops)


def test_bad_shapes_and_dtype():
    with pytest.raises(ConformanceError, match="shape set"):
        run("reference", shapes="huge")
    with pytest.raises(ConformanceError, match="dtype"):
        run("reference", dtypes="float16")


def test_family_names_select_ops():
    report = run("reference", ops="mhc", dtypes="float32")
    assert [o.op for o in report.ops] == ["hc_pre", "hc_post", "hc_head"]


def test_raising_op_fails_that_op_and_the_run_continues():
    def boom(x, weight, eps):
        raise RuntimeError("kernel launch failed: out of shared memory")

    report = _one({"rms_norm": boom, "hc_post": ALT_IMPLS["hc_post"]}, ops="rms_norm,hc_post")
    st = {o.op: o.status for o in report.ops}
    assert st == {"rms_norm": FAILED, "hc_post": PASSED}
    c = report.failures()[0]
    assert "RuntimeError" in c.message and "out of shared memory" in c.message
    assert all(c.status == FAILED for c in report.ops[0].cases)


def test_wrong_shape_names_expected_and_actual():
    def wrong_shape(x, weight, eps):
        return rms_spec.reference(x, weight, eps)[..., :-1]

    report = _one({"rms_norm": wrong_shape})
    msg = report.failures()[0].message
    assert "shape expected" in msg and "got" in msg


def test_zero_token_output_must_be_empty_with_right_shape():
    def bad_empty(x, weight, eps):
        return torch.empty(0, dtype=x.dtype) if x.shape[0] == 0 else rms_spec.reference(x, weight, eps)

    report = _one({"rms_norm": bad_empty})
    msgs = [c.message for c in report.failures()]
    assert msgs and all("zero-token" in m for m in msgs)


def test_wrong_dtype():
    def fp32_out(x, weight, eps):
        return rms_spec.reference(x.float(), weight, eps)

    report = _one({"rms_norm": fp32_out}, dtypes="bfloat16")
    assert "dtype expected bfloat16, got float32" in report.failures()[0].message


def test_nan_output_fails():
    def nan_out(x, weight, eps):
        y = rms_spec.reference(x, weight, eps).clone()
        if y.numel():
            y.view(-1)[0] = float("nan")
        return y

    report = _one({"rms_norm": nan_out})
    assert report.failed and "NaN" in report.failures()[0].message


def test_inf_where_reference_is_finite_fails_and_matching_inf_passes():
    from dsv4core.hal.ops.compression import indexer_scores as spec

    def inf_out(q, k, weights, k_offsets, k_lengths, scale):
        y = spec.reference(q, k, weights, k_offsets, k_lengths, scale).clone()
        fin = torch.isfinite(y)
        if fin.any():
            y[fin.nonzero()[0].tolist()[0], fin.nonzero()[0].tolist()[1]] = float("inf")
        return y

    report = _one({"indexer_scores": inf_out}, ops="indexer_scores")
    assert report.failed and "non-finite" in report.failures()[0].message
    # the reference's own -inf padding is reproduced by the alt backend: passes
    assert not _one({"indexer_scores": ALT_IMPLS["indexer_scores"]}, ops="indexer_scores").failed


def test_wrong_tuple_structure():
    from dsv4core.hal.ops.mhc import hc_pre as spec

    def two(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
        return spec.reference(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult)[:2]

    report = _one({"hc_pre": two}, ops="hc_pre")
    assert "expected a tuple of 3 tensors (y, post, comb)" in report.failures()[0].message


def test_in_place_input_modification_fails():
    def inplace(x, weight, eps):
        y = rms_spec.reference(x, weight, eps)
        x.mul_(0)
        return y

    report = _one({"rms_norm": inplace})
    assert any("modified its input" in c.message for c in report.failures())


def test_declined_is_neither_pass_nor_fail():
    def only_fp32(x, weight, eps):
        return x.dtype == torch.float32

    report = _one({"rms_norm": ALT_IMPLS["rms_norm"]}, supports={"rms_norm": only_fp32}, dtypes="float32,bfloat16")
    o = report.ops[0]
    assert o.count(DECLINED) > 0 and o.count(PASSED) > 0 and o.count(FAILED) == 0
    assert not report.failed and not report.complete
    assert report.exit_code() == 0 and report.exit_code(require_all=True) == 1
    assert all(c.message for c in o.cases if c.status == DECLINED)


def test_supports_must_return_plain_bool():
    report = _one({"rms_norm": ALT_IMPLS["rms_norm"]}, supports={"rms_norm": lambda x, weight, eps: torch.tensor(True)})
    assert report.failed and "plain bool" in report.failures()[0].message


def test_not_implemented_is_distinct_from_failed():
    report = _one({"rms_norm": ALT_IMPLS["rms_norm"]}, ops="rms_norm,hc_post")
    st = {o.op: o.status for o in report.ops}
    assert st == {"rms_norm": PASSED, "hc_post": NOT_IMPLEMENTED}
    assert report.exit_code() == 0 and report.exit_code(require_all=True) == 1


def test_cases_reproducible_from_seed():
    from dsv4core.conformance import iter_cases
    from dsv4core.hal import catalogue

    spec = catalogue()["sparse_mqa_attention"]
    a = list(iter_cases(spec, "small", torch.float32, "cpu", 7))
    b = list(iter_cases(spec, "small", torch.float32, "cpu", 7))
    c = list(iter_cases(spec, "small", torch.float32, "cpu", 8))
    assert [x.name for x in a] == [x.name for x in b]
    assert all(torch.equal(x.kwargs["q"], y.kwargs["q"]) for x, y in zip(a, b))
    assert any(not torch.equal(x.kwargs["q"], y.kwargs["q"]) for x, y in zip(a, c) if x.kwargs["q"].numel())


def test_every_op_has_small_float32_cases_with_a_zero_size_one():
    # (flash / pro cases allocate real-model tensors: too big to generate for every op here)
    from dsv4core.conformance import iter_cases
    from dsv4core.hal import catalogue

    for name, spec in catalogue().items():
        n = sum(1 for _ in iter_cases(spec, "small", torch.float32, "cpu", 0))
        assert n >= 4, name
        assert any(c.kwargs and any(isinstance(v, torch.Tensor) and v.numel() == 0 for v in c.kwargs.values())
                   for c in iter_cases(spec, "small", torch.float32, "cpu", 0)), f"{name}: no zero-size case"


def test_an_op_with_no_applicable_case_is_not_reported_as_passed():
    """moe_route takes fp32 logits only: a bfloat16-only run has no case for it. That is "no cases"
    (nothing was checked), never "passed", and it makes the run incomplete for --require-all."""
    from dsv4core.conformance import run
    from dsv4core.conformance.results import NO_CASES

    report = run("reference", ops="moe_route,rms_norm", shapes="small", dtypes="bfloat16")
    status = {o.op: o.status for o in report.ops}
    assert status == {"moe_route": NO_CASES, "rms_norm": "passed"}
    assert report.exit_code() == 0 and report.exit_code(require_all=True) == 1


def test_why_not_must_return_a_string():
    from dsv4core.hal import Backend

    b = Backend(name="t", device_types=("cpu",))
    b.add("rms_norm", ALT_IMPLS["rms_norm"], supports=lambda x, weight, eps: False, why_not=lambda x, weight, eps: 3)
    report = run(b, ops="rms_norm", dtypes="float32")
    assert report.failed and all("why_not() must return a str" in c.message for c in report.failures())
