"""benchmarks/spec_decode_bench.py on the tiny model (CPU): the JSON's structure, the verify step
is a forward_batch of 1 + k tokens a request, and with a graph capture (the CPU stand-in) the
decode and draft steps it times replay graphs. No timing is asserted."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from _scripts import load_script
from dsv4core.model.api import load_model

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return load_script("spec_decode_bench")


def test_spec_decode_bench_json(tmp_path, capsys):
    b = _bench()
    out = tmp_path / "r.json"
    assert b.main(["--device", "cpu", "--model", "tiny-mtp", "--batches", "1,3", "--ks", "1,2", "--context", "20",
                   "--reps", "1", "--warmup", "1", "--json", str(out), "--markdown", str(tmp_path / "r.md")]) == 0
    res = json.loads(out.read_text())
    assert not res["skipped"] and res["meta"]["formula"] == b.FORMULA
    assert [(r["batch"], r["k"]) for r in res["rows"]] == [(1, 1), (1, 2), (3, 1), (3, 2)]
    train = json.loads((ROOT / b.ACCEPTANCE).read_text())
    for r in res["rows"]:
        assert all(r[key] > 0 for key in ("decode_ms", "verify_ms", "draft_ms"))
        assert {len(v) for v in r["samples_ms"].values()} == {1}
        got = {(x["label"], x["L"]): x["speedup"] for x in r["speedup"]}
        want = [("tiny-mtp trained", train["after"][f"k{r['k']}"]["mean_acceptance_length"]),
                ("tiny-mtp untrained", train["before"][f"k{r['k']}"]["mean_acceptance_length"])]
        want += [("published DSV4", 1.8)] if r["k"] == 1 else []           # none cited for k = 2
        assert sorted(got) == sorted(want)
        for (_, L), s in got.items():
            assert abs(s - L * r["decode_ms"] / (r["verify_ms"] + r["draft_ms"])) <= 1e-9 * s
    md = (tmp_path / "r.md").read_text()
    assert md.count("\n| ") == 1 + len(res["rows"]) and "published" in md


def test_verify_step_is_a_forward_batch_of_1_plus_k_tokens_and_the_graphs_are_timed():
    b = _bench()
    m = load_model("tiny-mtp", backend="reference")
    sts, toks, h = b.setup(m, 2, 9, 40, 3, 8, spare=2)
    assert [(s.length, s.mtp_length) for s in sts] == [(9, 9), (9, 9)] and h.shape == (2, 4, 64)
    forks = [s.fork() for s in sts]
    drafts = [[5, 6, 7], [8, 9, 10]]
    lg, hid, g = b.verify_step(m, sts, toks, drafts)
    ids = torch.tensor([toks[0], 5, 6, 7, toks[1], 8, 9, 10])
    want = m.forward_batch(ids, torch.tensor([9, 10, 11, 12] * 2), torch.tensor([0] * 4 + [1] * 4), forks)
    assert torch.equal(lg, want) and hid.shape == (8, 4, 64) and g == want.argmax(-1).tolist()
    assert [s.length for s in sts] == [s.length for s in forks] == [13, 13]
    for s in sts + forks:
        s.release()

    class Rerun:     # a stand-in graph capture: the replay re-runs the recorded function
        def new_pool(self, device):
            return None

        def capture(self, fn, device, pool=None):
            out = fn()
            outs = out if isinstance(out, tuple) else (out,)

            def replay():
                new = fn()
                for o, n in zip(outs, new if isinstance(new, tuple) else (new,)):
                    o.copy_(n)
            return replay, out

    m._graph_why = ((id(m.ops), m.device), "", Rerun())
    a = argparse.Namespace(warmup=1, reps=1, context=9, prefill_chunk=8)
    rows = b.measure(m, 2, [2], a, torch.device("cpu"))
    assert [(r["decode_path"], r["verify_path"], r["draft_path"]) for r in rows] == [("graph", "graph", "graph")]   # verify: the step graphs
    assert not m.cache.live
