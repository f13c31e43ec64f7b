"""Quantised weights converted to bf16 once per call (dsv4core/kernels/triton/dequant.py) on a CUDA
device: every quantised conformance case of linear, wo_a and moe_experts at the small and flash
shapes, bf16 activations (the tensor-core path; fp32 ones take the fp32-product path, checked under
the interpreter: tests/interpret/test_triton_dequant.py), passes the conformance judge (conformance.cases.run_case: the op's stated
tolerance, the moved-code allowance of the official expert math) with the conversion forced
(TUNE ``dequant_rows`` 0, over the cuda launch table), and moe_experts also in chunks of one
expert (``dequant_bytes`` 1). The conformance cases are smaller than the rows at which a launch
table converts, so the suite alone would not reach these launches. Needs a CUDA device and the
`cuda` plugin; skipped (reported as skipped) elsewhere."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

WEIGHT_SCALES = {"linear": "weight_scale", "wo_a": "weight_scale", "moe_experts": "w13_scale"}


def _quantised(op, kw) -> bool:
    if op == "moe_experts":
        return kw.get("w13_scale") is not None or kw.get("w2_scale") is not None
    return kw.get(WEIGHT_SCALES[op]) is not None


@pytest.mark.parametrize("op,tune", [("linear", {"dequant_rows": 0}), ("wo_a", {"dequant_rows": 0}),
                                     ("moe_experts", {"dequant_rows": 0}),
                                     ("moe_experts", {"dequant_rows": 0, "dequant_bytes": 1})])
def test_converted_weights_pass_conformance(op, tune):
    from dsv4core.bench import get_backend
    from dsv4core.conformance.cases import iter_cases, run_case
    from dsv4core.conformance.results import DECLINED, PASSED
    from dsv4core.hal import catalogue
    from dsv4core.kernels.triton import OPS
    import importlib

    be = get_backend("cuda")
    if op not in be.impls:
        pytest.skip(f"cuda serves no {op}")
    mod = importlib.import_module(f"dsv4core.kernels.triton.{OPS[op]}")
    spec = catalogue()[op]
    ran, bad = 0, []
    mod.TUNE.update(tune)
    try:
        for shapes in ("small", "flash"):
            for dt in (torch.bfloat16,):   # fp32 activations take the fp32-product path the interpreter checks
                for case in iter_cases(spec, shapes, dt, "cuda", 0):
                    if not _quantised(op, case.kwargs):
                        continue
                    r = run_case(spec, be.impls[op], case, dt, shapes)
                    if r.status == DECLINED:   # not served by cuda at all (not a converted launch)
                        continue
                    ran += 1
                    if r.status != PASSED:
                        bad.append(f"{shapes}/{dt}/{case.name}: {r.status} {r.message}")
    finally:
        mod.TUNE.clear()
    assert ran >= 4, ran
    assert not bad, bad
