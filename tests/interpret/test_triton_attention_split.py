"""sparse_mqa_attention's split-KV launch plans: the one-split kernel, the split kernel
with the [S, CB] tile combine (the default tile and a narrow one), against an fp64 evaluation of
the op's formula, with a derived rounding bound; plus the plan's split count at decode batch sizes.

The kernels run under the Triton interpreter (TRITON_INTERPRET=1) in ONE subprocess (the variable
must be set before triton is imported); the test functions judge its JSON report.

Bound (first order in the fp32 unit roundoff u = 2^-24; the interpreter computes the bf16 path with
fp32 products too), per output element (t, h, j):

    |o - o64| <= (2 E + (2 K + 16) u) * mag,   mag = (sum_u p_u |v_uj| + |o_j| (sum_u p_u + p_sink)) / den
    E = gamma_d * scale * max_u sum_i |q_i k_ui| + 2 u max_u |l_u| + 3 u R,   R = max_u |l_u - m|

E bounds a logit's absolute error (the length-d fp32 dot, the fp32 scale's and the product's
rounding) plus the exp arguments' subtraction roundings; an absolute error e in an exponent is a
relative error e in its weight, and the weights enter both the numerator and the denominator
(the 2). (2 K + 16) u covers the two K-term sums (numerator, denominator: gamma_K each), the
online-softmax rescalings and the combine's weights, exp's own error (<= 2 u) and the division.
bf16 outputs add their rounding to nearest (unit roundoff 2^-8): 2^-8 (|o64| + bound). Measured:
fp32 at <= 0.004 of the bound (the bound is the worst case of every rounding), bf16 at <= 0.96
(output rounding dominates).
"""
from __future__ import annotations

import pytest

from _interp import interpreted_report

pytest.importorskip("triton")

_SCRIPT = r"""
import json, sys
import torch
from dsv4core.kernels.triton import attention as A

U = 2.0 ** -24
torch.manual_seed(0)
T, NH, D, K, N = 6, 24, 64, 160, 400     # 24 heads: a full and a part-masked head block
scale = D ** -0.5
idx = torch.stack([torch.randperm(N)[:K] for _ in range(T)]).to(torch.int32)
idx[0, 100:] = -1                       # trailing sentinels
idx[1, :] = -1                          # no valid row: the output is 0 (the reference's value)
idx[2, :] = -1
idx[2, 77] = 11                         # a single valid row
idx[3, :140] = -1                       # valid rows only at the tail: the first splits have none
idx[4, torch.randperm(K)[:90]] = -1     # scattered sentinels

def fp64(q, kv, sink, idx, scale):
    K, D = idx.shape[1], q.shape[2]
    q, kv, sink = q.double(), kv.double(), sink.double()
    valid = idx >= 0
    rows = kv[idx.long().clamp_min(0)]                                   # [T, K, D]
    l = torch.einsum("thd,tkd->thk", q, rows) * scale
    a = torch.einsum("thd,tkd->thk", q.abs(), rows.abs()) * scale
    l = l.masked_fill(~valid[:, None, :], float("-inf"))
    m = torch.maximum(l.amax(-1), sink[None, :])
    p = torch.exp(l - m[..., None])
    ps = torch.exp(sink[None, :] - m)
    den = p.sum(-1) + ps
    o = torch.einsum("thk,tkd->thd", p, rows) / den[..., None]
    lv = torch.where(valid[:, None, :], l, torch.zeros_like(l))
    av = torch.where(valid[:, None, :], a, torch.zeros_like(a))
    R = torch.maximum(torch.where(valid[:, None, :], (l - m[..., None]).abs(), torch.zeros_like(l)).amax(-1),
                      (sink[None, :] - m).abs())
    gd = D * U / (1 - D * U)
    E = gd * av.amax(-1) + 2 * U * lv.abs().amax(-1) + 3 * U * R
    mag = (torch.einsum("thk,tkd->thd", p, rows.abs()) + o.abs() * (p.sum(-1) + ps)[..., None]) / den[..., None]
    return o, (2 * E + (2 * K + 16) * U)[..., None] * mag, mag

PLANS = {"one-split": {"S": 1}, "default": {}, "S3": {"S": 3}, "BK32-S2": {"BK": 32, "S": 2},
         "max-splits": {"S": 64}, "narrow-combine": {"S": 3, "cBLOCK": 64}}
rep = {"cases": [], "plans": {}}
for dtype in (torch.float32, torch.bfloat16):
    q = torch.randn(T, NH, D).to(dtype)
    kv = torch.randn(N, D).to(dtype)
    sink = torch.randn(NH) * 2
    ref, bound, _ = fp64(q, kv, sink, idx, scale)
    if dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * (ref.abs() + bound)
    outs = {}
    for name, tune in PLANS.items():
        A.TUNE.clear(); A.TUNE.update(tune)
        plan = A.plan(T, NH, D, K, dtype == torch.float32, q.device)
        o1 = A.sparse_mqa_attention(q, kv, idx, sink, scale)
        o2 = A.sparse_mqa_attention(q, kv, idx, sink, scale)
        outs[name] = o1
        err = (o1.double() - ref).abs()
        # a zero bound (the empty token: o64 = 0 exactly, bound 0) demands an exact 0
        ratio = torch.where(bound > 0, err / bound.clamp_min(1e-300), torch.where(err > 0, float("inf"), 0.0))
        rep["cases"].append(dict(dtype=str(dtype), plan=name, S=plan["S"], CB=plan["CB"],
                                 ratio=float(ratio.max()), nan=bool(torch.isnan(o1).any()),
                                 ratio_per_token=[float(x) for x in ratio.amax((1, 2))],
                                 empty_zero=bool((o1[1] == 0).all()), bitwise=bool(torch.equal(o1, o2))))
    A.TUNE.clear()
    # the split paths really differ from the one-split path (not the same launch under two names)
    rep.setdefault("differs", {})[str(dtype)] = bool(not torch.equal(outs["one-split"], outs["S3"]))
# the plan's split count at DSV4-Flash decode shapes on a 132-SM GPU (below T = 128 the default
# target is one program per SM: 132), with the CUDA plugin's sm90 entry (its H200 tiles)
from pathlib import Path
from dsv4core.kernels.triton.launch import active
sys.path.insert(0, str(Path(A.__file__).resolve().parents[3] / "plugins" / "cuda"))
from dsv4core_cuda.launch import TABLES
for T_ in (1, 2, 3, 4, 5, 6, 7, 8, 64):
    A.TUNE.clear(); A.TUNE.update({"target": 132})
    entry = TABLES.resolve((9, 0))["attention"](torch.empty(T_, 64, 512, dtype=torch.bfloat16))
    with active({"attention": entry}):
        p = A.plan(T_, 64, 512, 640, False, torch.device("cpu"))
    rep["plans"][T_] = dict(p, programs=T_ * p["nhb"] * p["S"])
A.TUNE.clear()

# the decode-batch variants (module docstring) on a smaller problem: 20 heads (BH 16 / 32 / 64 all
# part-masked), 16-row blocks so that splits hold several blocks (the pipelined loads carry over)
T, NH, K, N = 4, 20, 100, 300
idx = torch.stack([torch.randperm(N)[:K] for _ in range(T)]).to(torch.int32)
idx[0, 40:] = -1                        # trailing sentinels
idx[1, :] = -1                          # no valid row
idx[2, :] = -1
idx[2, 90:95] = torch.arange(5, dtype=torch.int32)   # 5 valid rows (< one block), all in the last split
idx[3, torch.randperm(K)[:50]] = -1     # scattered sentinels
BASE = {"BK": 16, "S": 3, "pipe": 0}     # pipe 0 (the kernel's default) stated: the variants set 1
VARIANTS = {"base": BASE, "pipe1": dict(BASE, pipe=1), "one-split": {"BK": 16, "S": 1, "pipe": 0},
            "pipe1-one-split": {"BK": 16, "S": 1, "pipe": 1}, "one-block": {"BK": 16, "S": 64, "BH": 32},
            "BH64": {"BK": 16, "S": 2, "BH": 64}, "BH64-pipe1": {"BK": 16, "S": 3, "BH": 64, "pipe": 1}}
rep["variants"] = []
for dtype in (torch.float32, torch.bfloat16):
    q = torch.randn(T, NH, D).to(dtype)
    kv = torch.randn(N, D).to(dtype)
    sink = torch.randn(NH) * 2
    ref, bound, _ = fp64(q, kv, sink, idx, scale)
    outs = {}
    for name, tune in VARIANTS.items():
        b = bound
        if dtype == torch.bfloat16:
            b = b + 2.0 ** -8 * (ref.abs() + b)
        A.TUNE.clear(); A.TUNE.update(tune)
        plan = A.plan(T, NH, D, K, dtype == torch.float32, q.device)
        o = A.sparse_mqa_attention(q, kv, idx, sink, scale)
        outs[name] = o
        err = (o.double() - ref).abs()
        r = torch.where(b > 0, err / b.clamp_min(1e-300), torch.where(err > 0, float("inf"), 0.0))
        rep["variants"].append(dict(dtype=str(dtype), plan=name, S=plan["S"], KPS=plan["KPS"],
                                    BH=plan["BH"], ratio=float(r.max()), nan=bool(torch.isnan(o).any()),
                                    empty_zero=bool((o[1] == 0).all())))
    # pipelining moves loads only: bitwise the unpipelined result of the same plan
    rep.setdefault("pipe_bitwise", {})[str(dtype)] = [bool(torch.equal(outs[a], outs[b]))
                                                      for a, b in (("pipe1", "base"), ("pipe1-one-split", "one-split"))]
errs = {}
for bad in ({"pipe": 2}, {"pipe": 3}):
    A.TUNE.clear(); A.TUNE.update(bad)
    try:
        A.plan(1, 64, 64, 100, False, torch.device("cpu"))
    except ValueError as e:
        errs[str(bad)] = str(e)
A.TUNE.clear()
rep["bad_tune"] = errs
json.dump(rep, open(sys.argv[1], "w"))
"""



@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return interpreted_report(_SCRIPT, tmp_path_factory.mktemp("smqa"), "report")


def test_every_plan_within_the_derived_bound(report):
    assert len(report["cases"]) == 12
    bad = [c for c in report["cases"] if c["nan"] or not c["ratio"] <= 1.0]
    assert not bad, bad
    # the plans are what their names say: one split, several, and the most the rows allow
    by = {(c["dtype"], c["plan"]): c for c in report["cases"]}
    for dt in ("torch.float32", "torch.bfloat16"):
        assert by[(dt, "one-split")]["S"] == 1
        assert by[(dt, "S3")]["S"] == 3
        # the most splits K = 160 rows allow: the default 16-row blocks
        assert by[(dt, "max-splits")]["S"] == 10
        assert by[(dt, "narrow-combine")]["CB"] == 16          # 64 // np2(3): several combine programs a token
    # (fp32: in bf16 the output rounding may hide the split's different fp32 summation order)
    assert report["differs"]["torch.float32"], report["differs"]


def test_empty_and_sparse_tokens(report):
    """Token 1 has no valid row (exactly 0, as the reference), token 2 one row, token 3 valid rows
    only in the last split(s): each is judged per token by the same bound."""
    for c in report["cases"]:
        assert c["empty_zero"], c
        assert max(c["ratio_per_token"][1:4]) <= 1.0, c


def test_two_calls_bitwise_equal(report):
    assert all(c["bitwise"] for c in report["cases"]), [c for c in report["cases"] if not c["bitwise"]]


def test_decode_variants_within_the_bound(report):
    """pipe 1 (several 16-row blocks per split, so the indices carried to the next step are used),
    with one split and with several, the one-block plan, BH 64 > NH (one part-masked head block),
    each against the fp64 formula with the bound above; -1 sentinels, a token without rows, a token
    whose 5 rows are all in its last split (the others have none)."""
    v = report["variants"]
    assert len(v) == 14
    bad = [c for c in v if c["nan"] or not c["ratio"] <= 1.0 or not c["empty_zero"]]
    assert not bad, bad
    by = {(c["dtype"], c["plan"]): c for c in v}
    for dt in ("torch.float32", "torch.bfloat16"):
        assert by[(dt, "pipe1")]["S"] == 3 and by[(dt, "pipe1")]["KPS"] == 48       # 3 blocks a split
        assert by[(dt, "pipe1-one-split")]["S"] == 1 and by[(dt, "pipe1-one-split")]["KPS"] == 112
        assert by[(dt, "one-block")]["KPS"] == 16 and by[(dt, "one-block")]["S"] == 7
        assert by[(dt, "BH64-pipe1")]["BH"] == 64 and by[(dt, "BH64-pipe1")]["S"] == 3
    # pipelining moves loads only: bitwise the result of the same plan without it
    assert report["pipe_bitwise"] == {"torch.float32": [True, True], "torch.bfloat16": [True, True]}


def test_bad_tune_values_are_named(report):
    e = report["bad_tune"]
    assert set(e) == {"{'pipe': 2}", "{'pipe': 3}"}, e
    assert all("sparse_mqa_attention" in m and "expected 0 (none) or 1" in m for m in e.values())
    assert "pipe=2" in e["{'pipe': 2}"] and "pipe=3" in e["{'pipe': 3}"]


def test_plan_fills_the_gpu_at_decode_batch(report):

    """At T = 1..8 (Flash: 64 heads, 640 rows) the split kernel runs the CUDA sm90 entry's 64-row
    blocks with at most one program per SM of a 132-SM GPU (target 132), splitting the rows
    as far as that allows; every row is in exactly one split."""
    for T, p in report["plans"].items():
        T = int(T)
        assert p["S"] <= 64 and p["KPS"] % p["BK"] == 0
        assert p["KPS"] * p["S"] >= 640 and p["KPS"] * (p["S"] - 1) < 640, p
        if T <= 8:
            assert p["BK"] == 64 and p["programs"] <= 132, (T, p)
            s0 = min(10, 132 // (T * 4))          # 4 head blocks of 16, 10 row blocks of 64
            assert p["S"] == -(-640 // (-(-10 // s0) * 64)), (T, p)   # whole blocks per split
    assert report["plans"]["64"]["S"] == 1          # T = 64 fills the GPU without splitting
