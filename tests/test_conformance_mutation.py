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
    # one unrestricted, one judged on the FP8-row cases (the only scale left: d^-0.5)
    assert [m.only for m in fixed] == [None, ("kv_format", "fp8")]
    from dsv4core.conformance.cases import run_case
    from dsv4core.conformance.results import FAILED

    for m in fixed:
        impl = m.impl(spec)
        assert all(run_case(spec, impl, c, torch.float32).status != FAILED for c in m.judged_on(spec, cases))


#: the quantised-path switches of HAL 1.2 / 1.3 (optional arguments whose values pick a format or a
#: block size) and the values the cases must give each
SWITCHES = {"linear": {("act_block", 128)}, "moe_experts": {("act_block", 128)},
            "kv_norm_rope": {("nope_quant_block", 64)}, "cache_store": {("row_format", "fp8"), ("row_format", "fp4")},
            "sparse_mqa_attention": {("kv_format", "fp8")}, "indexer_scores_rows": {("k_format", "fp4")}}


@pytest.mark.parametrize("op", sorted(SWITCHES))
def test_every_quantised_path_gets_the_mutants_of_the_other_arguments(op):
    """Each switch value's cases alone kill a mutant of every other argument (fixed to each of
    its values, dropped, an axis collapsed): a quantised kernel of its own cannot hard-code
    what the unquantised cases vary. Those mutants are built and killed in the test above; here:
    they exist for every HAL 1.2 / 1.3 switch, and the 1.2 / 1.3 arguments all have mutants."""
    import torch

    from dsv4core.conformance.mutation import switches

    spec = catalogue()[op]
    cases = list(iter_cases(spec, "small", torch.float32, "cpu", 0))
    assert set(switches(spec, cases)) == SWITCHES[op]
    ms = mutants(spec, cases)
    newer = {p for p, v in spec.params_since.items() if v >= (1, 2)}
    assert newer and newer <= {m.param for m in ms if m.only is None}
    for switch in SWITCHES[op]:
        restricted = {m.param for m in ms if m.only == switch}
        assert restricted == set(spec.signature.parameters) - {switch[0]}, (switch, restricted)
    # a switch is also fixed to each of its values: the kernel that always (or never) quantises
    for name, value in SWITCHES[op]:
        assert any(m.param == name and m.only is None and m.how == f"fixed to {value!r}" for m in ms)
        assert any(m.param == name and m.only is None and m.how == "fixed to None" for m in ms)

