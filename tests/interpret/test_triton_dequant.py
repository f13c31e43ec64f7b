"""Quantised weights converted to bf16 once per call (dsv4core/kernels/triton/dequant.py; TUNE
``dequant_rows`` / ``dequant_bytes`` of linear, wo_a and moe) under the Triton interpreter:

* the FP4 conversion kernel gives the reference's dequantised values exactly (``hal.quant``), for
  every code and every scale byte (255: NaN in both);
* with the conversion forced (``dequant_rows`` 0) the quantised conformance cases of the small
  shapes pass the conformance rule (selftest.check_case: error vs an fp64 evaluation <= k x the
  reference's error + floor): moe_experts FP8 / FP4 / mixed / official in one chunk, the mixed case
  also in chunks of one expert and of as many as 192 KiB of bf16 holds
  (``dequant_bytes``: the up and down kernels launched once a chunk, the counts checked), and
  linear / wo_a FP8 with UE8M0 scales (folded in) and fp32 scales (the codes converted), a W8A8
  case included;
* the default launch of a small call does not convert.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from _interp import interpreted_report  # noqa: E402

_SCRIPT = r"""
import json, sys
import torch
from dsv4core.hal import Backend, catalogue, quant
from dsv4core.kernels.triton import dequant, linear, moe, wo_a
from dsv4core.kernels.triton.registry import register_ops
from dsv4core.kernels.triton.selftest import check_case
from dsv4core.conformance.cases import iter_cases

out = {}
# every code in both nibbles x every scale byte: 256 rows of 32 columns (one scale group), row r
# scaled by byte r, its byte j = code j (low nibble) | code (j + r) % 16 (high nibble)
j = torch.arange(16)
packed = torch.stack([j | (((j + r) % 16) << 4) for r in range(256)]).to(torch.uint8)
scale = torch.arange(256, dtype=torch.uint8).view(256, 1).view(torch.float8_e8m0fnu)
got = dequant.fp4_to_bf16(packed.unsqueeze(0), scale.unsqueeze(0))[0].float()
want = quant.dequantize_fp4(packed, scale, torch.float32)
same = (got == want) | (torch.isnan(got) & torch.isnan(want))
out["fp4"] = dict(rows=256, exact=bool(same.all()), nan_rows=int(torch.isnan(want).any(1).sum()),
                  bad=int((~same).sum()))

class Count:   # forwards a kernel's launches, counting them
    def __init__(self, k):
        self.k, self.n = k, 0
    def __getitem__(self, grid):
        self.n += 1
        return self.k[grid]

b = Backend(name="t", device_types=("cpu",))
register_ops(b, "cpu", ["moe_experts", "linear", "wo_a"])
up, down = Count(moe._moe_up_kernel), Count(moe._moe_down_kernel)
moe._moe_up_kernel, moe._moe_down_kernel = up, down
results = []
moe_cases = ("fp8-f32scale-T6", "fp4-T33", "fp4-w13-fp8-w2-T3", "official-fp4")
# moe: E = 8 experts; gate / up of an expert 2 I x H bf16 (small shapes: I 64, H 256 -> 64 KiB; official 128 x 128)
runs = [("moe_experts", moe, n, {"dequant_rows": 0}) for n in moe_cases]
runs += [("moe_experts", moe, "fp4-w13-fp8-w2-T3", {"dequant_rows": 0, "dequant_bytes": b}) for b in (1, 3 * 65536)]
runs += [("linear", linear, n, {"dequant_rows": 0}) for n in ("fp8-float32", "fp8-float8_e8m0fnu", "fp8-ragged-3d",
                                                              "w8a8-fp8-weight")]
runs += [("wo_a", wo_a, n, {"dequant_rows": 0}) for n in ("fp8", "fp8-f32scale-noncontig")]
for op, mod, name, tune in runs:
    spec = catalogue()[op]
    case = next(c for c in iter_cases(spec, "small", torch.bfloat16, "cpu", 0) if c.name == name)
    mod.TUNE.clear()
    mod.TUNE.update(tune)
    n0 = (up.n, down.n)
    r = check_case(spec, b.impls[op], case.kwargs, torch.bfloat16)
    mod.TUNE.clear()
    row = dict(op=op, case=name, tune=tune, status=r["status"], detail=r.get("detail", ""))
    if op == "moe_experts":
        row.update(experts=case.kwargs["w13"].shape[0], I=case.kwargs["w2"].shape[1] and case.kwargs["w13"].shape[1] // 2,
                   H=case.kwargs["x"].shape[1], up=up.n - n0[0], down=down.n - n0[1])
    results.append(row)
out["cases"] = results
# the default launch of a small call: no conversion (the conversion's own kernel never runs)
calls = []
real = dequant.fp4_to_bf16
dequant.fp4_to_bf16 = lambda *a, **k: calls.append(1) or real(*a, **k)
spec = catalogue()["moe_experts"]
case = next(c for c in iter_cases(spec, "small", torch.bfloat16, "cpu", 0) if c.name == "fp4-T33")
check_case(spec, b.impls["moe_experts"], case.kwargs, torch.bfloat16)
out["default_converts"] = len(calls)
json.dump(out, open(sys.argv[1], "w"))
"""


def test_dequant_paths_pass_the_conformance_rule_in_interpreter(tmp_path):
    rep = interpreted_report(_SCRIPT, tmp_path, "dequant")
    assert rep["fp4"] == dict(rows=256, exact=True, nan_rows=1, bad=0), rep["fp4"]
    bad = [c for c in rep["cases"] if c["status"] != "pass"]
    assert not bad, bad
    assert len(rep["cases"]) == 4 + 2 + 4 + 2
    for c in rep["cases"]:
        if c["op"] != "moe_experts":
            continue
        budget = c["tune"].get("dequant_bytes")
        # experts a chunk: all (the default 1 GiB), else as many bf16 gate / up weights (2 I x H
        # values, 2 bytes each) as the budget holds, at least one
        per = c["experts"] if budget is None else max(1, budget // (2 * 2 * c["I"] * c["H"]))
        chunks = -(-c["experts"] // per)
        assert (c["up"], c["down"]) == (chunks, chunks), c
    assert rep["default_converts"] == 0
