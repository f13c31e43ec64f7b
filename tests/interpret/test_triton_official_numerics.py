"""The official-numerics semantics of the portable Triton kernels (HAL 1.2: ``kv_norm_rope``
``nope_quant_block``, ``indexer_rotate_quant``, ``linear`` and ``moe_experts`` ``act_block``),
under the Triton interpreter.

* The kernels' quantisation rules (``_util.e4m3_rne``, ``e2m1_rne``, ``group_scale_exp``) are
  bit-exact (sign of zero included) against ``dsv4core.hal.quant`` (torch's float32 -> e4m3fn
  conversion, the e2m1 grid rounding, ``act_scale``) on every e4m3 / e2m1 value, every midpoint
  between neighbours and the float32 neighbours of each, the amax clamps, subnormals, and 2 x 10^5
  random float32 bit patterns plus 5 x 10^4 values of spread magnitude; so is the activation pass
  of ``linear`` / ``moe_experts`` (``quant.fake_quant_fp8``) against ``hal.quant.fake_quant``, and
  its codes-and-scales form (``quant.quant_fp8``, byte for byte) against ``hal.quant.act_quant``.
* Each served semantic passes the conformance rule (``selftest.check_case``: the op's tolerance,
  with its ``quantized_rows`` allowance, against an fp64 evaluation) on the quantised "small"
  sample cases of the op in float32 and bfloat16, every one served by the kernel (none declined), and
  on edge rows: an all-zero group (the amax clamp), a group below the clamp, groups 2^+-20 apart;
  for the indexer also d = 32 / 256 / 1024, rows 2^+-60 in magnitude, e2m1 ties in every value, a
  non-contiguous query tensor. ``moe_experts`` (slow under the interpreter: its "small" cases run
  in test_triton_kernels.py's conformance run) on one small official case (FP4 gate / up, FP8
  down, a dropped slot, a zero token), with the default launch and with split K in both GEMMs.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from _interp import interpreted_report  # noqa: E402

_SCRIPT = r"""
import json, sys
import torch
import triton, triton.language as tl
from dsv4core.hal import Backend, catalogue, quant
from dsv4core.kernels.triton._util import e2m1_rne, e4m3_rne, exp2_int, group_scale_exp
from dsv4core.kernels.triton.quant import fake_quant_fp8, quant_fp8
from dsv4core.kernels.triton.registry import register_ops
from dsv4core.kernels.triton.selftest import check_case
from dsv4core.conformance.cases import iter_cases

rep = {}


@triton.jit
def _rules(x_ptr, a_ptr, b_ptr, s8_ptr, s4_ptr, N, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    x = tl.load(x_ptr + o, mask=m, other=0.0)
    tl.store(a_ptr + o, e4m3_rne(tl.minimum(tl.maximum(x, -448.0), 448.0)), mask=m)
    tl.store(b_ptr + o, e2m1_rne(tl.minimum(tl.maximum(x, -6.0), 6.0)), mask=m)
    tl.store(s8_ptr + o, exp2_int(group_scale_exp(tl.abs(x), 1e-4, 1.0 / 448.0)), mask=m)
    tl.store(s4_ptr + o, exp2_int(group_scale_exp(tl.abs(x), 6.0 * 2.0 ** -126, 1.0 / 6.0)), mask=m)


g = torch.Generator().manual_seed(0)
codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
codes = codes[torch.isfinite(codes)].unique()
f4 = torch.tensor(quant.FP4_E2M1_TABLE).unique()
edge = torch.tensor([0.0, 1e-4, 448.0, 6.0, 6 * 2.0 ** -126, 1e-40, 2.0 ** -10, 2.0 ** -6, 2.0 ** 127])
base = torch.cat([codes, (codes[1:] + codes[:-1]) / 2, f4, (f4[1:] + f4[:-1]) / 2, edge])
inf = torch.full_like(base, float("inf"))
near = torch.cat([base, torch.nextafter(base, inf), torch.nextafter(base, -inf)])
bits = torch.randint(1, 0x7F7FFFFF, (200000,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
sign = torch.where(torch.rand(bits.shape, generator=g) < 0.5, -1.0, 1.0)
wide = torch.randn(50000, generator=g) * 2.0 ** torch.randint(-12, 10, (50000,), generator=g).float()
x = torch.cat([near, -near, bits * sign, wide]).contiguous()
outs = [torch.empty_like(x) for _ in range(4)]
_rules[(triton.cdiv(x.numel(), 4096),)](x, *outs, x.numel(), BLOCK=4096)
refs = (x.clamp(-448, 448).to(torch.float8_e4m3fn).float(), quant._fp4_round(x.clamp(-6, 6)),
        quant.act_scale(x.abs(), "fp8"), quant.act_scale(x.abs(), "fp4"))
rep["values"] = x.numel()
rep["rules"] = {name: int((got.view(torch.int32) != ref.view(torch.int32)).sum())
                for name, got, ref in zip(("e4m3", "e2m1", "fp8_scale", "fp4_scale"), outs, refs)}

OPS = ("kv_norm_rope", "indexer_rotate_quant", "linear")   # (moe_experts: below)
QUANT = ("act_block", "nope_quant_block")
b = Backend(name="t", device_types=("cpu",))
register_ops(b, "cpu", list(OPS) + ["moe_experts"])
specs = catalogue()
rep["cases"] = []


def record(op, name, dt, kw):
    r = check_case(specs[op], b.impls[op], kw, dt)
    quantised = op == "indexer_rotate_quant" or any(kw.get(a) is not None for a in QUANT)
    rep["cases"].append(dict(op=op, case=name, dtype=str(dt), quantised=quantised, **r))


for op in OPS:       # the quantised cases (the suite's run in test_triton_kernels.py covers the rest)
    for dt in (torch.float32, torch.bfloat16):
        for case in iter_cases(specs[op], "small", dt, "cpu", 0):
            if op == "indexer_rotate_quant" or any(case.kwargs.get(a) is not None for a in QUANT):
                record(op, case.name, dt, case.kwargs)

# kv rows: d 192 (128 non-rope channels: two groups of 64), rope 64; group 0 of row 0 all zero
# (the amax clamp), of row 1 below the clamp (1e-6), and groups 2^20 apart in the other rows
T, d = 9, 192
kv = torch.randn(T, d, generator=g)
kv[:, 64:128] *= 2.0 ** 20
kv[0, :64] = 0.0
kv[1, :64] = 1e-6 * torch.randn(64, generator=g)
w = torch.ones(d)
w[64:128] = 2.0 ** -20
for dt in (torch.float32, torch.bfloat16):
    record("kv_norm_rope", "edge-groups", dt, dict(kv=kv.to(dt), weight=w, positions=torch.arange(T),
                                                   inv_freq=1.0 / 10000 ** (torch.arange(32) / 32),
                                                   eps=1e-6, nope_quant_block=64))

# indexer rows: d = 32 (one group, one 32-column dot chunk), 256 and 1024 (16-row programs);
# an all-zero row (the FP4 amax clamp), rows 2^+-60 in magnitude (scales far from 1), a
# non-contiguous query tensor (heads and tokens transposed), a row that rotates to an exact tie
# of the e2m1 grid in every value (values +-2.5 at scale 1/2: code 5, between 4 and 6 -> 4, value 2)
for d, rows in ((32, 5), (256, 6), (1024, 3)):
    x = torch.randn(rows, d, generator=g)
    x[0] = 0.0
    x[1] *= 2.0 ** 60
    x[2] *= 2.0 ** -60
    x[-1] = 0.0
    x[-1, 3] = 2.5 * d ** 0.5             # rotates to +-2.5 in every value: amax 2.5, codes at 5 (tie)
    for dt in (torch.float32, torch.bfloat16):
        record("indexer_rotate_quant", f"edge-d{d}", dt, dict(x=x.to(dt)))
q = torch.randn(4, 40, 128, generator=g).transpose(0, 1)
for dt in (torch.float32, torch.bfloat16):
    record("indexer_rotate_quant", "noncontig-queries", dt, dict(x=q.to(dt)))

# experts (official math): FP4 w13, FP8 w2 (e8m0 block scales), a dropped slot, a zero token,
# token blocks 2^+-8 apart; the default launch and split K in both GEMMs (TUNE Su / Sd 2: the raw
# sums of two parts, the down parts summed unweighted by the combine)
from dsv4core.kernels.triton import moe
E, H, I, T = 3, 256, 128, 6
w13 = quant.quantize_fp4(torch.randn(E, 2 * I, H, generator=g) * H ** -0.5 * 4)
w2 = quant.quantize_fp8_block(torch.randn(E, H, I, generator=g) * I ** -0.5, quant.E8M0, pow2=True)
ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
ids[2, 1] = -1
xm = torch.randn(T, H, generator=g) * 3.0 * 2.0 ** (8.0 * torch.tensor([0.0, -1.0])).repeat_interleave(128)
xm[4] = 0.0
kw = dict(ids=ids, weights=torch.rand(T, 2, generator=g), w13=w13[0], w2=w2[0], swiglu_limit=10.0,
          w13_scale=w13[1], w2_scale=w2[1], act_block=128)
for label, tune in (("default", {}), ("split", {"Su": 2, "Sd": 2})):
    moe.TUNE.clear()
    moe.TUNE.update(tune)
    for dt in (torch.float32, torch.bfloat16):
        record("moe_experts", f"official-{label}", dt, dict(kw, x=xm.to(dt)))
moe.TUNE.clear()


# a plugin's own FP4 expert GEMMs (moe TUNE "gemm"): a torch stand-in of the contract (fp64 sums
# of the kept sorted rows, expert by expert from ``starts``) with FP4 gate / up and down weights,
# bf16 x (where the hook applies): the routing, activation and combine around it are the portable
# kernels', so the result passing the conformance rule checks moe.py's wiring of the hook (rows
# for the up GEMM, the bf16 FP8-valued down input, no split, the raw sums)
class TorchGemm:
    def __init__(self):
        self.calls = []

    def serves(self, w, scale, BM, P):
        return True

    def __call__(self, a, rows, w, scale, out, tcum, starts, BM):
        self.calls.append(dict(a=str(a.dtype), rows=rows is not None, out=list(out.shape)))
        W = quant.dequantize_fp4(w, scale, torch.float64)
        src = rows if rows is not None else torch.arange(out.shape[0])
        for e in range(w.shape[0]):
            lo, hi = int(starts[e]), int(starts[e + 1])
            out[lo:hi] = (a[src[lo:hi].long()].double() @ W[e].T).float()


w2f = quant.quantize_fp4(torch.randn(E, H, I, generator=g) * I ** -0.5 * 4)
stand_in = TorchGemm()
moe.TUNE.clear()
moe.TUNE.update({"gemm": stand_in, "Su": 2, "Sd": 2})   # the hook turns the split off where it serves
record("moe_experts", "official-plugin-gemm", torch.bfloat16, dict(kw, x=xm.bfloat16(), w2=w2f[0], w2_scale=w2f[1]))
moe.TUNE.clear()
rep["gemm_calls"] = stand_in.calls

# the activation pass of linear / moe_experts (quant.py) against hal.quant.fake_quant, bit for
# bit: fp32 rows with full 24-bit mantissas (values near the e4m3 subnormal midpoints of their
# group's scale), zero rows, a group at the amax clamp, K = 384 (a masked tail group), strided x
K = 384
xa = torch.randn(7, K, generator=g) * 2.0 ** torch.randint(-30, 30, (7, 3), generator=g).float().repeat_interleave(128, 1)
xa[0] = 0.0
xa[1, :128] = 5e-5
xa[2, :128] = (torch.randint(0, 16, (128,), generator=g).float() + 0.5) * 2.0 ** -9 * (1 + 2.0 ** -20)
xa[2, 0] = 448.0
strided = torch.randn(K, 5, generator=g).t()
rep["act_pass"] = {}
for name, xx in (("fp32", xa), ("bf16", xa.bfloat16()), ("strided", strided)):
    got, ref = fake_quant_fp8(xx, 128), quant.fake_quant(xx, "fp8", 128)
    rep["act_pass"][name] = int((got.float().view(torch.int32) != ref.float().view(torch.int32)).sum())
    # the codes / scales pass (linear's FP8 x FP8 path): the e4m3 bytes and float32 scales of act_quant
    q, sc = quant_fp8(xx, 128)
    rq, rs = quant.act_quant(xx, 128)
    rep["act_pass"][name + "_codes"] = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum()) + \
        int((sc.view(torch.int32) != rs.float().view(torch.int32)).sum())
json.dump(rep, open(sys.argv[1], "w"))
"""


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return interpreted_report(_SCRIPT, tmp_path_factory.mktemp("official"), "official", timeout=600)


def test_quantisation_rules_bit_exact(report):
    assert report["values"] > 250000
    assert report["rules"] == {"e4m3": 0, "e2m1": 0, "fp8_scale": 0, "fp4_scale": 0}, report["rules"]
    assert report["act_pass"] == {"fp32": 0, "bf16": 0, "strided": 0, "fp32_codes": 0, "bf16_codes": 0,
                                  "strided_codes": 0}, report["act_pass"]


@pytest.mark.parametrize("op,least", [("kv_norm_rope", 8), ("indexer_rotate_quant", 16), ("linear", 10),
                                      ("moe_experts", 4)])
def test_official_semantics_pass_conformance(report, op, least):
    """``least``: the quantised sample cases (at the time of writing) plus the edge cases, both dtypes."""
    cases = [c for c in report["cases"] if c["op"] == op]
    bad = [f"{c['case']} {c['dtype']}: {c['status']} {c.get('detail', '')}" for c in cases if c["status"] != "pass"]
    assert not bad, "\n".join(bad)
    assert len(cases) >= least and all(c["quantised"] for c in cases), cases


def test_plugin_gemm_hook_wiring(report):
    """moe_experts called a plugin's ``gemm`` for both GEMMs (up with the pair rows, down on the
    bf16 activation), and that case passed the conformance rule (test above)."""
    calls = report["gemm_calls"]
    assert [(c["a"], c["rows"]) for c in calls] == [("torch.bfloat16", True), ("torch.bfloat16", False)], calls
    assert any(c["case"] == "official-plugin-gemm" and c["status"] == "pass" for c in report["cases"])


def test_cuda_serves_only_validated_semantics(monkeypatch):
    """The cuda plugin serves the portable kernels its recorded validation passed, and of those
    only the semantics that record exercised: a call setting an official-numerics argument the
    record did not exercise is declined (the reference serves it) unless ``DSV4CORE_CUDA_TRY``
    names the op."""
    import os

    import torch

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "..", "..", "plugins", "cuda"))
    import dsv4core_cuda as cu

    assert set(cu.UNVALIDATED_ARGS) <= cu.CUDA_OPS            # validated kernels: the gate is what declines
    assert set(cu.unvalidated_gates()) == set(cu.UNVALIDATED_ARGS)
    # the mechanism, on an entry (the shipped table is empty once every argument has a record)
    monkeypatch.setattr(cu, "UNVALIDATED_ARGS", {"moe_experts": ("act_block",)})
    gates = cu.unvalidated_gates()
    assert set(gates) == {"moe_experts"}
    x = torch.randn(2, 128)
    assert gates["moe_experts"](x, None, None, None, None, 10.0)
    assert not gates["moe_experts"](x, None, None, None, None, 10.0, act_block=128)
    assert not gates["moe_experts"](x, None, None, None, None, 10.0, None, None, 128)
    env = {cu.TRY_ENV: "moe_experts"}
    assert cu.tried_args(env) == {"moe_experts"} and cu.tried_ops(env) == frozenset()
    assert cu.unvalidated_gates(cu.tried_args(env)) == {}
