"""dsv4core.bench's moe_experts cases draw their routing from a seeded generator of their own: the
same case touches the same experts in every run and whatever ran before it (sweeps are compared
across runs by time, and a case's bytes and time depend on the distinct experts it reads)."""
from __future__ import annotations

import torch

from dsv4core.bench import make_case


def test_moe_cases_route_the_same_tokens_in_every_run():
    for label in ("moe_experts", "moe_experts_fp4"):
        for T in (1, 8, 100):
            a = make_case(label, "small", T, "cpu")
            torch.randn(1000)                     # other draws in between (another case, a sweep row)
            b = make_case(label, "small", T, "cpu")
            assert torch.equal(a.kwargs["ids"], b.kwargs["ids"]), (label, T)
            assert a.bytes == b.bytes, (label, T)
            k = a.kwargs["ids"].shape[1]
            if T <= 64:   # distinct experts within a token (top-k of a permutation)
                assert all(len(set(row.tolist())) == k for row in a.kwargs["ids"]), (label, T)
    # the tokens of one case are routed independently (not one routing repeated)
    ids = make_case("moe_experts", "small", 8, "cpu").kwargs["ids"]
    assert len({tuple(r) for r in ids.tolist()}) > 1
