"""Every argument that changes an op's result is exercised by some conformance case.

The parameters are enumerated from each op's signature (dsv4core.conformance.mutation), so an
argument added to a spec is covered here without editing this file: if no case can tell a kernel
that ignores it (or collapses one of its axes) from a correct one, this test fails and names it.
Collectives are checked over real process groups in tests/test_conformance_distributed.py.
"""

from __future__ import annotations

import pytest

from dsv4core.conformance.mutation import check_op, mutants
from dsv4core.conformance.cases import iter_cases
from dsv4core.hal import catalogue

OPS = [name for name, s in catalogue().items() if s.family != "collectives"]


@pytest.mark.parametrize("op", OPS)
def test_every_parameter_is_distinguished_by_some_case(op):
    spec = catalogue()[op]
    results = check_op(spec, shapes="small")
    params = {r.mutant.param for r in results}
    assert params == set(spec.signature.parameters), "a parameter has no mutant"
    survivors = [r.mutant.name for r in results if not r.killed]
    assert not survivors, (f"no conformance case of {op} fails under {survivors}: add a case that passes "
                           f"another value (or varies that axis) in the op's @cases function")


def test_a_case_list_that_never_varies_a_parameter_is_reported():
    """The check has teeth: with the attention cases cut to those passing scale = d^-0.5 (the
    outside test's finding), the 'scale fixed' mutant survives."""
    import torch

    spec = catalogue()["sparse_mqa_attention"]
    cases = [c for c in iter_cases(spec, "small", torch.float32, "cpu", 0) if "scale" not in c.tags]
    fixed = [m for m in mutants(spec, cases) if m.param == "scale"]
    assert len(fixed) == 1
    from dsv4core.conformance.cases import run_case
    from dsv4core.conformance.results import FAILED

    impl = fixed[0].impl(spec)
    assert all(run_case(spec, impl, c, torch.float32).status != FAILED for c in cases)
