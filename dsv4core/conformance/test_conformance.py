"""The conformance suite as pytest items: ``pytest --pyargs dsv4core.conformance --dsv4core-backend NAME``.

One item per op x shape set x dtype x case (``test_op[rms_norm-small-float32-T7-hidden256]``); a
declined case or an unimplemented op is a *skip* with its reason (never a pass); one
``test_collectives`` item per collective op the backend implements (all of its cases over 2 and 4
spawned ranks, ``--dsv4core-world-sizes``); plus one ``test_model`` item. Needs pytest installed
(``pip install pytest``): the CLI route does not. Options: see :mod:`dsv4core.conformance.pytest_plugin`.
"""

from __future__ import annotations

import pytest
import torch

from dsv4core.conformance import cases, results
from dsv4core.hal.compare import dtype_name
from dsv4core.conformance.pytest_plugin import settings

_cache: dict = {}


def _backend(s):
    key = ("backend", s["backend"], s["device"])
    if key not in _cache:
        _cache[key] = cases.load_backend(s["backend"], s["device"])
    return _cache[key]


def _cases(spec, shapes, dtype, device, seed):
    key = ("cases", spec.name, shapes, dtype, device, seed)
    if key not in _cache:
        for k in [k for k in _cache if k[0] == "cases"]:   # keep one case list in memory at a time
            del _cache[k]
        _cache[key] = list(cases.iter_cases(spec, shapes, dtype, device, seed))
    return _cache[key]


def pytest_generate_tests(metafunc):
    s = settings(metafunc.config)
    if not {"conformance_item", "conformance_model", "conformance_dist"} & set(metafunc.fixturenames):
        return
    if not s["backend"]:
        raise pytest.UsageError("dsv4core conformance: give the backend to check with --dsv4core-backend NAME "
                                f"(or ${'DSV4CORE_CONFORMANCE_BACKEND'}); if the option is unknown, add "
                                "-p dsv4core.conformance.pytest_plugin")
    from dsv4core.hal import oracle

    refusal = oracle.refusal()
    if refusal:
        raise pytest.UsageError(f"dsv4core conformance: {refusal}")
    try:
        be = _backend(s)
        ops = cases.parse_ops(s["ops"])
        shape_sets = cases.parse_shapes(s["shapes"])
        dtypes = cases.parse_dtypes(s["dtypes"])
    except results.ConformanceError as e:
        raise pytest.UsageError(f"dsv4core conformance: {e}") from None
    if "conformance_model" in metafunc.fixturenames:
        metafunc.parametrize("conformance_model", [s["model"]], ids=[f"{s['backend']}-{s['model']}"])
        return
    if "conformance_dist" in metafunc.fixturenames:
        from dsv4core.conformance.distributed import OPS

        dist_ops = [op for op in ops if op in OPS and op in be.impls]
        metafunc.parametrize("conformance_dist", dist_ops, ids=[f"{op}-spawned" for op in dist_ops])
        return
    from dsv4core.hal import catalogue

    params, ids = [], []
    specs = catalogue()
    for op in ops:
        if op not in be.impls:
            params.append((op, None, None, None))
            ids.append(f"{op}-not-implemented")
            continue
        for sh in shape_sets:
            for dt in dtypes:
                names = [c.name for c in _cases(specs[op], sh, dt, s["device"], s["seed"])]
                for i, name in enumerate(names):
                    params.append((op, sh, dt, i))
                    ids.append(f"{op}-{sh}-{dtype_name(dt)}-{name}")
    _cache.clear()
    metafunc.parametrize("conformance_item", params, ids=ids)


def test_op(conformance_item, request):
    record_property = request.node.user_properties.append
    s = settings(request.config)
    op, sh, dt, i = conformance_item
    be = _backend(s)
    if sh is None:
        pytest.skip(f"not implemented: backend {be.name!r} has no implementation of {op}")
    from dsv4core.hal import catalogue

    spec = catalogue()[op]
    case = _cases(spec, sh, dt, s["device"], s["seed"])[i]
    res = cases.run_case(spec, be.impls[op], case, dt, sh)
    w = res.worst
    if w is not None:
        record_property(("metric", w.metric))
        record_property(("err", f"{w.err:.4g}"))
        record_property(("bound", f"{w.bound:.4g}"))
        record_property(("err_over_bound", f"{w.ratio:.4g}"))
    if res.status == results.DECLINED:
        pytest.skip(f"declined by supports(): {res.message}")
    assert res.status == results.PASSED, f"{res.id}: {res.message}"


def test_model(conformance_model, request):
    record_property = request.node.user_properties.append
    s = settings(request.config)
    if s["no_model"]:
        pytest.skip("model check disabled (--dsv4core-no-model)")
    from dsv4core.conformance.model_check import check_model
    from dsv4core.conformance.report import format_model

    dtypes = tuple(dtype_name(d) for d in cases.parse_dtypes(s["dtypes"]))
    m = check_model(_backend(s), conformance_model, dtypes, s["device"], s["seed"])
    record_property(("model", format_model(m)))
    if m["status"] == "unavailable":
        pytest.skip(m["reason"])
    assert m["status"] == results.PASSED, format_model(m)


def test_collectives(conformance_dist, request):
    """All multi-rank cases of one collective (one spawn per world size, shared by the ops)."""
    s = settings(request.config)
    sizes = cases.parse_world_sizes(s["world_sizes"])
    if not sizes:
        pytest.skip("spawned collectives disabled (--dsv4core-world-sizes none)")
    key = ("dist", s["backend"], sizes)
    if key not in _cache:
        from dsv4core.conformance.distributed import run_distributed

        _cache[key] = run_distributed(s["backend"], world_sizes=sizes, dtypes=cases.parse_dtypes(s["dtypes"]),
                                      seed=s["seed"], device=s["dist_device"], dist_backend=s["dist_backend"])
    results = _cache[key].get(conformance_dist, [])
    bad = [f"{c.id}: {c.message}" for c in results if c.status == results.FAILED]
    assert results and not bad, "\n".join(bad) or "no case ran"
