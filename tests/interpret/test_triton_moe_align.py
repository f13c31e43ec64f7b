"""moe_experts' routing kernel (``_moe_align_kernel``, dsv4core/kernels/triton/moe.py) against the
torch ops it replaces (``_route_torch``, kept as the path for large batches and the oracle here):
every output (starts, tcum, tok, inv) bitwise equal, integers, dtype and shape included, for ids
with dropped slots (-1, E and farther outside [0, E)), several expert counts, slots per token and
token counts, and pair counts just below, at and above ``ALIGN_MAX_PAIRS`` (above: the torch
path, by shape). moe_experts' own conformance under the interpreter is run by
tests/interpret/test_triton_kernels.py with every other kernel's.

Kernels run under the Triton interpreter (TRITON_INTERPRET=1) in one subprocess: the variable must
be set before triton is imported.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from launch_recorder import Recorder

pytest.importorskip("triton")

_SCRIPT = r"""
import json, sys
import torch
from dsv4core.kernels.triton import moe

calls = {"torch": 0}
_torch_path = moe._route_torch

def counted(*a, **kw):
    calls["torch"] += 1
    return _torch_path(*a, **kw)

moe._route_torch = counted          # _route looks it up at call time: counts which path ran

g = torch.Generator().manual_seed(0)
NAMES = ("starts", "tcum", "tok", "inv")
records = []

def check(ids, E, BM, label, grid=False):
    P = ids.numel()
    before = calls["torch"]
    got = moe._route(ids, E, BM)
    rec = {"label": label, "P": P, "E": E, "grid": grid, "kernel": calls["torch"] == before, "outputs": {}}
    want = _torch_path(ids, E, BM)
    for name, a, b in zip(NAMES, got, want):
        rec["outputs"][name] = {"dtypes": [str(a.dtype), str(b.dtype)], "shapes": [list(a.shape), list(b.shape)],
                                "equal": bool(a.shape == b.shape and torch.equal(a, b))}
    starts, tcum, tok, inv = got
    # the outputs also agree with each other: a permutation, each token's pairs where inv says
    rec["inv_is_permutation"] = bool(torch.equal(torch.sort(inv).values, torch.arange(P, dtype=torch.int32)))
    rec["tok_matches_inv"] = bool(torch.equal(tok[inv.long()], torch.arange(P, dtype=torch.int32) // ids.shape[1]))
    records.append(rec)

def ids_with_drops(T, K, E, dtype):
    ids = torch.randint(-1, E + 1, (T, K), generator=g)              # -1 and E: dropped
    far = torch.rand(T, K, generator=g) < 0.05
    ids = torch.where(far, torch.randint(E + 1, E + 1000, (T, K), generator=g), ids)   # farther out
    return ids.to(dtype)

n = 0
for E in (1, 8, 256, 384):
    for K in (1, 2, 6):
        for T in (1, 3, 64, 128):
            if K * T == 768 and E in (1, 256):
                continue                # 2.5 s each in the interpreter; E = 8 and 384 keep the shape
            dt = (torch.int64, torch.int32)[n % 2]
            BM = (16, 64)[n % 2]
            check(ids_with_drops(T, K, E, dt), E, BM, f"E={E} K={K} T={T} {dt}", grid=True)
            n += 1
# adversarial: one expert takes every pair (stability is all that orders them), nothing kept,
# ids descending, a non-contiguous view, int64 ids beyond int32
check(torch.full((16, 6), 3), 8, 16, "all one expert")
check(torch.full((5, 6), -1, dtype=torch.int32), 8, 16, "all dropped")
check(torch.arange(383, -1, -4).reshape(16, 6), 384, 16, "descending")
check(torch.randint(-1, 257, (6, 20), generator=g).t(), 256, 16, "transposed view")
check(torch.tensor([[2 ** 40, 5], [-(2 ** 40), 0]]), 8, 16, "int64 beyond int32")
# around the bound: below / at use the kernel, above the torch path (chosen by shape only)
B = moe.ALIGN_MAX_PAIRS
check(ids_with_drops(B - 1, 1, 384, torch.int64), 384, 64, "P = bound - 1")
check(ids_with_drops(B // 2, 2, 384, torch.int32), 384, 64, "P = bound")
check(ids_with_drops(B + 1, 1, 384, torch.int64), 384, 64, "P = bound + 1")
check(ids_with_drops((B + 6) // 6, 6, 256, torch.int64), 256, 128, "P > bound, K = 6")
# experts: up to ALIGN_MAX_BINS - 1 the kernel, more the torch path
NB = moe.ALIGN_MAX_BINS
check(ids_with_drops(4, 6, NB - 1, torch.int64), NB - 1, 16, "E = bins - 1")
check(ids_with_drops(4, 6, NB, torch.int64), NB, 16, "E = bins")
json.dump({"max_pairs": B, "max_bins": NB, "records": records}, open(sys.argv[1], "w"))
"""

#: which path the cases around the bounds must take (True: the kernel)
BOUND_CASES = {"P = bound - 1": True, "P = bound": True, "P = bound + 1": False, "P > bound, K = 6": False,
               "E = bins - 1": True, "E = bins": False}


def test_align_kernel_matches_the_torch_routing_bitwise(tmp_path):
    script = tmp_path / "align.py"
    script.write_text(_SCRIPT)
    out = tmp_path / "align.json"
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(script), str(out)], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and out.exists(), (proc.stdout + proc.stderr)[-4000:]
    rep = json.loads(out.read_text())
    records = rep["records"]
    assert sum(r["grid"] for r in records) == 46
    for r in records:
        # the path is chosen by shape only: the kernel within both bounds, the torch ops beyond
        assert r["kernel"] == (r["P"] <= rep["max_pairs"] and r["E"] + 1 <= rep["max_bins"]), r
        for name, o in r["outputs"].items():
            assert o["dtypes"] == ["torch.int32", "torch.int32"], (r["label"], name, o)
            assert o["shapes"][0] == o["shapes"][1] and o["equal"], (r["label"], name, o)
        assert r["inv_is_permutation"] and r["tok_matches_inv"], r["label"]
    by_label = {r["label"]: r["kernel"] for r in records}
    assert {k: by_label[k] for k in BOUND_CASES} == BOUND_CASES


def test_align_launch_reads_no_device_data(monkeypatch):
    """On meta tensors (shapes, no data: any host read of device data raises) the routing is one
    launch of one program, sized from shapes, with the caller's ids; no torch routing op runs."""
    from dsv4core.kernels.triton import moe

    rec = Recorder()
    monkeypatch.setattr(moe, "_moe_align_kernel", rec)
    monkeypatch.setattr(moe, "_route_torch", lambda *a: pytest.fail("torch routing used within the bound"))
    ids = torch.empty((341, 6), dtype=torch.int64, device="meta")
    starts, tcum, tok, inv = moe._route(ids, 256, 16)
    assert [t.shape for t in (starts, tcum, tok, inv)] == [(257,), (256,), (2046,), (2046,)]
    assert all(t.dtype == torch.int32 and t.device.type == "meta" for t in (starts, tcum, tok, inv))
    (grid, args, kw), = rec.launches
    assert grid == (1,) and args[0] is ids and kw["BP"] == 2048 and kw["EB"] == 512 and kw["BM"] == 16
