"""Validated calls (``check=True``: strict policy / DSV4CORE_CHECK=1) check a set of argument
metadata once: a call whose arguments have the shapes, strides, dtypes and devices of one that
passed, and whose check reads no tensor values, skips the repeat. Every bad input still raises the
same OpInputError, and a check that reads values (an index range) runs on every call."""
from __future__ import annotations

import pytest
import torch

from dsv4core.hal import OpInputError, bind, catalogue


@pytest.fixture
def checked():
    return bind("cpu", backend="reference", policy="allow", check=True)


def _error(fn, *args):
    with pytest.raises(OpInputError) as e:
        fn(*args)
    return str(e.value)


def test_bad_input_after_good_calls_gets_the_same_error(checked):
    x, w = torch.randn(3, 8), torch.ones(8)
    ref = catalogue()["rms_norm"]
    want = torch.nn.functional.rms_norm(x, (8,), w, 1e-6)
    for _ in range(3):                                   # the second and third: a remembered key
        torch.testing.assert_close(checked.rms_norm(x, w, 1e-6), want, rtol=1e-6, atol=1e-6)
    bad_w = torch.ones(4)
    assert _error(checked.rms_norm, x, bad_w, 1e-6) == _error(ref, x, bad_w, 1e-6)
    bad_x = torch.randn(3, 8, dtype=torch.float16)
    assert _error(checked.rms_norm, bad_x, w, 1e-6) == _error(ref, bad_x, w, 1e-6)
    assert "rms_norm" in _error(checked.rms_norm, x.int(), w, 1e-6)
    torch.testing.assert_close(checked.rms_norm(x, w, 1e-6), want, rtol=1e-6, atol=1e-6)


def test_a_check_that_reads_values_runs_on_every_call(checked):
    pool, rows = torch.zeros(8, 4), torch.randn(2, 4)
    good, bad = torch.tensor([1, 5]), torch.tensor([1, 9])        # same key: shape, dtype, device
    for _ in range(3):
        checked.cache_store(pool, good, rows)
    torch.testing.assert_close(pool[[1, 5]], rows, rtol=0, atol=0)
    before = pool.clone()
    msg = _error(checked.cache_store, pool, bad, rows)
    assert msg == _error(catalogue()["cache_store"], pool, bad, rows) and "index" in msg
    assert torch.equal(pool, before)                               # a refused call changes nothing


def test_a_new_layout_or_scalar_is_checked_again(checked):
    x, w = torch.randn(4, 8), torch.ones(8)
    checked.rms_norm(x, w, 1e-6)
    strided = torch.randn(8, 4).t()                                # same shape, other strides
    assert strided.shape == x.shape
    torch.testing.assert_close(checked.rms_norm(strided, w, 1e-6),
                               torch.nn.functional.rms_norm(strided, (8,), w, 1e-6), rtol=1e-6, atol=1e-6)
    ref = catalogue()["hc_pre"]
    case = next(c for c in ref.sample_cases("small", torch.float32) if c.kwargs["x"].shape[0] > 0)
    kw = dict(case.kwargs)
    checked.hc_pre(**kw)
    checked.hc_pre(**kw)
    kw["iters"] = 0                                                # a scalar is part of the key
    assert _error(lambda: checked.hc_pre(**kw)) == _error(lambda: ref(**kw)) and "iters" in _error(lambda: ref(**kw))
