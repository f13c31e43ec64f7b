"""The Triton kernels of the stored row formats (hal.rowformats: the FP8 KV row, the FP4 key)
beyond their conformance cases, under the interpreter:

* cache_store's encoders against ``rowformats.pack``, bitwise, on rows built to reach every code:
  every finite e4m3 / e2m1 magnitude and every midpoint between two neighbours (ties to even), the
  e4m3 subnormals, groups below the amax clamp, both signs, scales over 20 binades, fp32 and bf16
  rows, written into a strided region of a larger buffer (nothing else may change);
* sparse_mqa_attention / indexer_scores_rows decoding pools of arbitrary bytes (every e4m3 code
  but NaN, every nibble, scale bytes over 50 binades) against the reference within the ops' bounds.
"""
from __future__ import annotations

import pytest
from _interp import interpreted_report

pytest.importorskip("triton")

_SCRIPT = r"""
import json, sys
import torch
from dsv4core.hal import catalogue
from dsv4core.hal import rowformats as rf
from dsv4core.hal import compare
from dsv4core.kernels.triton import attention, cache, indexer

g = torch.Generator().manual_seed(0)
out = {}

def judged(spec, got, kw, dt):
    ref, exact = compare.expected_outputs(spec, kw)
    checks = compare.judge(spec, kw, got, ref, exact, dt)
    return dict(ok=all(c.ok for c in checks), message="; ".join(
        compare.describe_check(c, spec.tolerance.k, spec.tolerance.floor_for(dt)) for c in checks if not c.ok))

def grid_rows(values, mids, qmax, group, n_groups, d, rope):
    # groups: qmax * 2^k first (the group's amax: s = 2^k), then grid values and midpoints, signs
    pool_vals = torch.cat([values, mids])
    rows = []
    for r in range(n_groups):
        k = int(torch.randint(-10, 11, (1,), generator=g))
        pick = pool_vals[torch.randint(0, pool_vals.numel(), (group - 1,), generator=g)]
        sign = torch.where(torch.rand(group - 1, generator=g) < 0.5, -1.0, 1.0)
        grp = torch.cat([torch.tensor([qmax]), pick * sign]) * 2.0 ** k
        if r % 9 == 4:
            grp = grp * 2.0 ** -40                             # below the amax clamp
        rows.append(grp)
    x = torch.cat(rows).reshape(-1, d - rope)
    if rope:
        x = torch.cat([x, torch.randn(x.shape[0], rope, generator=g) * 5], 1)
    return x

e4m3 = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()       # 0 .. 448
e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
cases = {"fp8": (grid_rows(e4m3, (e4m3[1:] + e4m3[:-1]) / 2, 448.0, 64, 7 * 40, 512, 64), 512),
         "fp4": (grid_rows(e2m1, (e2m1[1:] + e2m1[:-1]) / 2, 6.0, 32, 4 * 40, 128, 0), 128)}
for fmt, (x, d) in cases.items():
    for dt in (torch.float32, torch.bfloat16):
        rows = x.to(dt)
        W = rf.row_bytes(fmt, d)
        big = torch.randint(0, 256, (rows.shape[0] + 9, W + 10), generator=g, dtype=torch.uint8)
        pool = big[5:5 + rows.shape[0] + 2, 4:4 + W]          # a strided region of a larger buffer
        index = torch.randperm(rows.shape[0] + 2, generator=g)[:rows.shape[0]].to(torch.int32)
        index[3] = -1
        want = big.clone()
        keep = index >= 0
        want[5:5 + rows.shape[0] + 2, 4:4 + W][index[keep].long()] = rf.pack(fmt, rows[keep])
        cache.cache_store(pool, index, rows, row_format=fmt)
        diff = (big != want).nonzero().tolist()
        out[f"store/{fmt}/{dt}"] = dict(bitwise=not diff, first_diffs=diff[:5])

def arbitrary_pool(fmt, n, d):
    W = rf.row_bytes(fmt, d)
    b = torch.randint(0, 256, (n, W), generator=g, dtype=torch.uint8)
    if fmt == "fp8":
        nope = b[:, :d - 64]
        nope[(nope & 0x7F) == 0x7F] = 0x7E                    # no NaN codes
        b[:, d - 64:d + 64] = torch.randn(n, 64, generator=g).bfloat16().view(torch.uint8)
        b[:, d + 64:] = torch.randint(100, 150, (n, W - d - 64), generator=g, dtype=torch.uint8)
    else:
        b[:, d // 2:] = torch.randint(100, 150, (n, d // 32), generator=g, dtype=torch.uint8)
    return b

for dt in (torch.float32, torch.bfloat16):
    spec = catalogue()["sparse_mqa_attention"]
    N, T, K, h, d = 96, 3, 40, 8, 512
    kv = arbitrary_pool("fp8", N, d)
    args = dict(q=torch.randn(T, h, d, generator=g).to(dt) * 0.05, kv=kv,
                indices=torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)]).to(torch.int32),
                sink=torch.randn(h, generator=g), scale=d ** -0.5, kv_format="fp8")
    out[f"attention/{dt}"] = judged(spec, attention.sparse_mqa_attention(**args), args, dt)
    spec = catalogue()["indexer_scores_rows"]
    N, T, L, nI, dI = 80, 4, 50, 16, 128
    k = arbitrary_pool("fp4", N, dI)
    rows = torch.stack([torch.randperm(N, generator=g)[:L] for _ in range(T)])
    rows[1, 7:] = -1
    args = dict(q=torch.randn(T, nI, dI, generator=g).to(dt), k=k,
                weights=torch.randn(T, nI, generator=g) * nI ** -0.5, rows=rows, scale=dI ** -0.5, k_format="fp4")
    out[f"indexer/{dt}"] = judged(spec, indexer.indexer_scores_rows(**args), args, dt)

json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return interpreted_report(_SCRIPT, tmp_path_factory.mktemp("rowformats"), "rowformats", timeout=600)


@pytest.mark.parametrize("key", [f"store/{f}/{d}" for f in ("fp8", "fp4") for d in ("torch.float32", "torch.bfloat16")])
def test_store_encodes_every_code_like_the_reference(report, key):
    r = report[key]
    assert r["bitwise"], r


@pytest.mark.parametrize("key", [f"{op}/{d}" for op in ("attention", "indexer") for d in ("torch.float32", "torch.bfloat16")])
def test_reads_decode_arbitrary_bytes(report, key):
    r = report[key]
    assert r["ok"], r
