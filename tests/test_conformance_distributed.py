"""Collectives over real process groups: spawned gloo ranks, subgroups, uneven splits,
fp64 formulas; and a mutation check that the multi-rank cases distinguish every parameter."""

from __future__ import annotations

import pytest

from dsv4core.conformance import FAILED, PASSED, run
from dsv4core.conformance.distributed import OPS, mutation_results, run_many
from dsv4core.hal import catalogue

from conformance_backends import DIST_BROKEN, make_alt_backend


@pytest.mark.parametrize("op", OPS)
def test_multi_rank_cases_distinguish_every_parameter(op):
    """Parameters from the op's signature (group and split sizes included): each mutant must be
    killed at some world size (group only can be at 4: 2 ranks have no proper subgroup)."""
    by_name: dict[str, str] = {}
    for ws in (2, 4):
        for m in mutation_results(op, ws):
            by_name[m.name] = by_name.get(m.name) or m.killed_by
    assert {n.split("(")[1].split(":")[0] for n in by_name} == set(catalogue()[op].signature.parameters)
    survivors = [n for n, k in by_name.items() if not k]
    assert not survivors, f"no multi-rank case of {op} fails under {survivors}"


@pytest.fixture(scope="module")
def spawned():
    """One spawn of 4 gloo ranks checks both test backends (2 ranks: the CI's `dsv4core conformance
    --backend reference` run and tests/test_ref_collectives.py)."""
    return run_many(["conformance_backends:dist_alt", "conformance_backends:dist_broken"], world_sizes=(4,))


def test_spawned_ranks_pass_a_correct_backend(spawned):
    """A legal backend computing the collectives differently (broadcast-based gathers, fp32 sums in
    rank order) passes every case on 4 ranks: subgroups and uneven splits included."""
    out = spawned["conformance_backends:dist_alt"]
    assert set(out) == set(OPS)
    for op, cases in out.items():
        bad = [f"{c.id}: {c.message}" for c in cases if c.status != PASSED]
        assert cases and not bad, bad
        ids = " ".join(c.id for c in cases)
        assert "ws4-" in ids and "bfloat16" in ids
        if op != "all_reduce":
            assert "uneven" in ids
    assert any("group-uneven-groups" in c.id for c in out["all_reduce"])


def test_spawned_ranks_catch_each_broken_collective(spawned):
    """Caught only with real ranks (in one process every collective is the identity)."""
    out = spawned["conformance_backends:dist_broken"]
    status = {op: (FAILED if any(c.status == FAILED for c in cs) else PASSED) for op, cs in out.items()}
    assert status == {**{op: FAILED for op, _ in DIST_BROKEN.values()}, "all_to_all": PASSED}, status
    for op, _ in DIST_BROKEN.values():
        msg = next(c.message for c in out[op] if c.status == FAILED)
        assert "rank" in msg, msg


def test_in_process_collectives_are_a_gap_not_complete():
    report = run(make_alt_backend(), ops="collectives", dtypes="float32")
    assert not report.failed and report.verified and not report.complete
    assert any("one process only" in g for g in report.gaps())
    assert report.exit_code() == 0 and report.exit_code(require_all=True) == 1


def test_cli_world_sizes_bad_value_exits_2(capsys):
    from dsv4core.commands.conformance import main

    assert main(["--backend", "reference", "--no-model", "--world-sizes", "1"]) == 2
    assert "--world-sizes" in capsys.readouterr().err


def test_seeds_and_bounds_are_the_suites_shared_formulas():
    """The spawned-rank cases draw from the same seed formula as the single-process suite
    (cases.mix_seed; case_seed is it over op/shapes/dtype), written out here independently, and
    judge with the same bound (compare.tolerance_check: k x reference error + floor + one
    output rounding)."""
    import zlib

    import torch

    from dsv4core.hal import compare
    from dsv4core.conformance.distributed import _gen
    from dsv4core.conformance.cases import case_seed
    from dsv4core.hal.spec import Tolerance

    assert case_seed(3, "linear", "small", torch.bfloat16) == (3 * 1_000_003 + zlib.crc32(b"linear/small/bfloat16")) % 2 ** 63
    assert _gen(3, "T5", 1).initial_seed() == (3 * 1_000_003 + zlib.crc32(b"T5/1")) % 2 ** 63
    exact = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
    ref = exact.to(torch.bfloat16)
    got = ref * 1.01
    tol = Tolerance(k=2.0, floor=1e-3, why="test")
    c = compare.tolerance_check("out", tol, 1e-3, got, ref, exact)
    e_r = compare.error(tol.metric, ref, exact)
    assert c.bound == 2.0 * e_r + 1e-3 + compare.output_rounding(tol.metric, torch.bfloat16, exact)
    assert c.err == compare.error(tol.metric, got, exact) and c.ok == (c.err <= c.bound)
