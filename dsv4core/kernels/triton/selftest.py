"""Check the Triton kernels against the HAL reference on the op specs' sample cases.

    TRITON_INTERPRET=1 python -m dsv4core.kernels.triton.selftest --device cpu --shapes small
    python -m dsv4core.kernels.triton.selftest --device cuda --shapes flash --json out.json

Criterion: the conformance rule, judged by the same code (:func:`dsv4core.hal.compare.judge`):
per output ``err_kernel <= k * err_reference + floor`` against an fp64 evaluation of the
reference on the same inputs, with the op's discrete checks (moe_route: the expert-id sets, then
the weights aligned by id; indexer_topk: the index sets); right shape and dtype; NaN fails; an op
that writes in place runs on copies. Cases the kernel's predicate declines are reported as
``declined`` (they fall back to the reference in the HAL). Without the conformance suite's
report, CLI and model check: a quick kernel-level loop for kernel work.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dsv4core.hal import Backend, catalogue
from dsv4core.hal import compare

from .registry import register_ops


def check_case(spec, impl, kw: dict, dtype: torch.dtype) -> dict:
    """Run one case through ``impl`` and judge it: status pass / fail / declined / error, the worst
    error / bound ratio and what failed."""
    if not impl.supports(**kw):
        return dict(status="declined")
    t0 = time.perf_counter()
    ref, exact = compare.expected_outputs(spec, kw)
    call_kw = compare.with_copies(spec, kw)
    try:
        raw = impl.fn(**call_kw)
    except Exception as e:  # noqa: BLE001
        return dict(status="error", detail=f"{type(e).__name__}: {e}")
    if spec.writes:
        if raw is not None:
            return dict(status="fail", detail=f"writes {spec.writes} in place but returned {type(raw).__name__}, not None")
        raw = compare.written_values(spec, call_kw)
    rec = dict(seconds=round(time.perf_counter() - t0, 4))
    try:
        checks = compare.judge(spec, call_kw, raw, ref, exact, dtype)
    except compare.Mismatch as e:
        return dict(rec, status="fail", detail=f"{e.kind}: {e}")
    tol = spec.tolerance
    bad = [compare.describe_check(c, tol.k, tol.floor_for(dtype)) for c in checks if not c.ok]
    rec.update(status="fail" if bad else "pass", ratio=round(max((c.ratio for c in checks), default=0.0), 4))
    if bad:
        rec["detail"] = "; ".join(bad)
    return rec


def run(device: str, shapes: str, dtypes, ops=None, seed: int = 0, verbose: bool = False):
    b = Backend(name="triton-selftest", device_types=(device,))
    register_ops(b, device, ops)
    specs = catalogue()
    results = []
    for op, impl in b.impls.items():
        spec = specs[op]
        for dtype in dtypes:
            for case in spec.sample_cases(shapes, dtype, device, seed):
                rec = dict(op=op, case=case.name, dtype=str(dtype).replace("torch.", ""))
                rec.update(check_case(spec, impl, case.kwargs, dtype))
                results.append(rec)
                if verbose:
                    print(rec, flush=True)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="small")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ops", default=None, help="comma list (default: all Triton ops)")
    ap.add_argument("--json", default=None)
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args(argv)
    dtypes = [getattr(torch, d) for d in a.dtypes.split(",")]
    ops = a.ops.split(",") if a.ops else None
    res = run(a.device, a.shapes, dtypes, ops, verbose=a.verbose)
    counts = {}
    for r in res:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    for r in res:
        if r["status"] in ("fail", "error"):
            print(f"{r['status'].upper()} {r['op']} {r['case']} {r['dtype']}: {r.get('detail')}")
    print(json.dumps(counts))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=a.device, shapes=a.shapes, results=res, counts=counts), f, indent=1)
    return 0 if counts.get("fail", 0) == 0 and counts.get("error", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
