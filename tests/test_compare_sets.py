"""The set judges of indexer_topk and moe_route (`hal.compare.index_set_check`, `route_check`)
against a plain per-row statement of their rules, on random sets with every kind of fault: the
vectorised pass that picks the rows to walk must never leave out a wrong row, and a right row
must pass (the per-row rules below are the spec's words, written independently of compare.py)."""

from __future__ import annotations

import math

import torch

from dsv4core.hal import compare
from dsv4core.hal.compare import Outputs


def _topk_row_ok(scores, n_valid, topk, row, tol) -> bool:
    picks = [int(v) for v in row if v >= 0]
    if any(v < -1 for v in row):
        return False
    valid = [float(x) for x in scores[:n_valid]]
    n_fin = sum(math.isfinite(x) for x in valid)
    if not min(topk, n_fin) <= len(picks) <= min(topk, n_valid):
        return False
    if any(p >= n_valid for p in picks) or len(set(picks)) != len(picks):
        return False
    if not picks:
        return True
    kth = sorted(valid, reverse=True)[len(picks) - 1]
    if any(valid[p] < kth - tol for p in picks):
        return False
    return all(j in picks for j, x in enumerate(valid) if x > kth + tol)


def _faulty(g: torch.Tensor, N: int, gen: torch.Generator) -> torch.Tensor:
    """Each row kept, or given one fault: a pick dropped, duplicated, moved out of range, moved to
    the lowest key, a -2."""
    g = g.clone()
    for t in range(g.shape[0]):
        kind = int(torch.randint(0, 7, (1,), generator=gen))
        j = int(torch.randint(0, g.shape[1], (1,), generator=gen))
        if kind == 1:
            g[t, j] = -1
        elif kind == 2 and g.shape[1] > 1:
            g[t, j] = g[t, (j + 1) % g.shape[1]]
        elif kind == 3:
            g[t, j] = N + 3
        elif kind == 4:
            g[t, j] = -2
        elif kind == 5:
            g[t, j] = int(torch.randint(0, N, (1,), generator=gen))
    return g


def test_index_set_check_matches_the_rules_on_faulty_sets():
    gen = torch.Generator().manual_seed(0)
    T, N, topk, tol = 300, 40, 8, 1e-6
    scores = torch.randn(T, N, generator=gen).round(decimals=1)     # ties within and around the k-th score
    scores[5, 3] = float("-inf")
    scores[6, :] = float("-inf")
    lengths = torch.randint(0, N + 1, (T,), generator=gen)
    lengths[:4] = torch.tensor([0, 1, topk, N])
    right = torch.full((T, topk), -1, dtype=torch.long)
    for t in range(T):
        n = min(topk, int(lengths[t]))
        if n:
            right[t, :n] = scores[t, :int(lengths[t])].topk(n).indices
    bads = []
    for g in (right, _faulty(right, N, gen), right.flip(1)):
        kw = {"scores": scores, "k_lengths": lengths, "topk": topk}
        want_bad = sum(not _topk_row_ok(scores[t], int(lengths[t]), topk, g[t].tolist(), tol) for t in range(T))
        (check,) = compare.index_set_check(kw, g, right, tie_tol=tol)
        assert check.ok == (want_bad == 0) and math.isclose(check.err, want_bad / T), (check, want_bad)
        bads.append(want_bad)
    assert bads[0] == bads[2] == 0 and bads[1] > T // 3     # right sets in any order pass; the faults are seen


def _route_row_ok(key, row, topk, tol, hashed) -> bool:
    E = key.shape[0]
    ids = [int(v) for v in row]
    if any(not 0 <= v < E for v in ids) or len(set(ids)) != len(ids):
        return False
    if hashed is not None:
        return sorted(ids) == sorted(int(v) for v in hashed)
    kth = sorted(key.tolist(), reverse=True)[topk - 1]
    if any(float(key[v]) < kth - tol for v in ids):
        return False
    return all(j in ids for j in range(E) if float(key[j]) > kth + tol)


def test_route_check_ids_match_the_rules_on_faulty_sets():
    gen = torch.Generator().manual_seed(1)
    T, E, topk = 200, 24, 4
    logits = torch.randn(T, E, generator=gen).round(decimals=1)
    bias = torch.zeros(E)
    keys = torch.sqrt(torch.nn.functional.softplus(logits.double())) + bias.double()
    right = keys.topk(topk, 1).indices
    weights = torch.ones(T, topk) / topk
    tie_tol = 4 * 2.0 ** -23 * max(1.0, keys.abs().max().item())
    for hashed in (None, right.flip(1)):
        bads = []
        for g in (right, _faulty(right, E, gen).clamp(min=-1), right.flip(1)):
            kw = {"logits": logits, "correction_bias": bias, "scaling": 1.0, "topk": topk,
                  "hash_ids": hashed}
            want_bad = sum(not _route_row_ok(keys[t], g[t], topk, tie_tol, None if hashed is None else hashed[t])
                           for t in range(T))
            got = Outputs(("weights", "ids"), (weights, g))
            ref = Outputs(("weights", "ids"), (weights, right))
            checks = compare.route_check(kw, got, ref, 4.0, 0.0)
            assert checks[0].ok == (want_bad == 0) and math.isclose(checks[0].err, want_bad / T), (checks[0], want_bad)
            bads.append(want_bad)
        assert bads[0] == bads[2] == 0 and bads[1] > T // 3
