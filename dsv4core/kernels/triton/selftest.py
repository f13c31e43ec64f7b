"""Check the Triton kernels against the HAL reference on the op specs' sample cases.

    TRITON_INTERPRET=1 python -m dsv4core.kernels.triton.selftest --device cpu --shapes small
    python -m dsv4core.kernels.triton.selftest --device cuda --shapes flash --json out.json

Criterion (the conformance rule): per output, ``err_kernel <= k * err_reference + floor`` where both
errors are measured against an fp64 evaluation of the reference on the same inputs (``k``, ``floor``
and the metric from the op's Tolerance). Extra checks: every output element written (the output is
compared in full, NaN fails), right shape and dtype. Cases the kernel's predicate declines are
reported as ``declined`` (they fall back to the reference in the HAL).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from dsv4core.hal import Backend, catalogue
from dsv4core.hal.compare import with_copies, written_values

from .registry import register_ops


def _to64(v):
    if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype.itemsize >= 2 \
            and v.dtype not in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e8m0fnu", None)):
        return v.to(torch.float64)
    return v


def _dequant64(w, s):
    """fp8 weight [..., N, K] with block scales [..., ceil(N/128), ceil(K/128)] -> fp64 (exact)."""
    s64 = s.to(torch.float32).to(torch.float64)
    s64 = s64.repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :w.shape[-2], :w.shape[-1]]
    return w.to(torch.float32).to(torch.float64) * s64


def _fp64_eval(spec, kw):
    kw64 = {k: _to64(v) for k, v in kw.items()}
    if kw.get("weight_scale") is not None:
        kw64["weight"] = _dequant64(kw["weight"], kw["weight_scale"])
        kw64["weight_scale"] = None
    return spec.reference(**kw64)


def _err(a, b, metric):
    if metric == "bitwise":
        same = a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
        return 0.0 if same else float("inf")
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    if a64.numel() == 0:
        return 0.0
    if torch.isnan(a64).any():
        return float("inf")
    d = (a64 - b64).abs()
    d = torch.where(torch.isinf(a64) & torch.isinf(b64) & (a64 == b64), torch.zeros_like(d), d)
    if metric == "max_abs":
        return float(d.max())
    ref = b64[torch.isfinite(b64)].abs()
    denom = float(ref.max()) if ref.numel() else 1.0
    return float(d.max()) / (denom if denom > 0 else 1.0)


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def run(device: str, shapes: str, dtypes, ops=None, seed: int = 0, verbose: bool = False):
    b = Backend(name="triton-selftest", device_types=(device,))
    register_ops(b, device, ops)
    specs = catalogue()
    results = []
    for op, impl in b.impls.items():
        spec = specs[op]
        tol = spec.tolerance
        for dtype in dtypes:
            for case in spec.sample_cases(shapes, dtype, device, seed):
                kw = case.kwargs
                rec = dict(op=op, case=case.name, dtype=str(dtype).replace("torch.", ""))
                if not impl.supports(**kw):
                    rec["status"] = "declined"
                    results.append(rec)
                    continue
                t0 = time.perf_counter()
                call_kw = with_copies(spec, kw)     # an in-place op writes its own copy of the pool
                try:
                    got = impl.fn(**call_kw)
                except Exception as e:  # noqa: BLE001
                    rec.update(status="error", detail=f"{type(e).__name__}: {e}")
                    results.append(rec)
                    continue
                rec["seconds"] = round(time.perf_counter() - t0, 4)
                if spec.writes:
                    if got is not None:
                        rec.update(status="fail", detail=f"returned {type(got).__name__}, not None")
                        results.append(rec)
                        continue
                    # a store has no arithmetic: the reference on its own copy is the exact value
                    ref_kw = with_copies(spec, kw)
                    spec.reference(**ref_kw)
                    got, ref = _as_tuple(written_values(spec, call_kw)), _as_tuple(written_values(spec, ref_kw))
                    exact = ref
                else:
                    got, ref, exact = _as_tuple(got), _as_tuple(spec.reference(**kw)), _as_tuple(_fp64_eval(spec, kw))
                worst = 0.0
                ok = True
                details = []
                if tol.metric == "route":
                    # ids may differ among tied keys (the conformance suite's route metric checks
                    # them as sets); here: the weights per token, sorted, with max_rel
                    got, ref, exact = ((t[0].sort(-1).values,) for t in (got, ref, exact))
                for i, (g, r, e) in enumerate(zip(got, ref, exact)):
                    if g.shape != r.shape or g.dtype != r.dtype:
                        ok = False
                        details.append(f"out{i}: shape/dtype {tuple(g.shape)} {g.dtype} vs {tuple(r.shape)} {r.dtype}")
                        continue
                    metric = "max_rel" if tol.metric == "route" else tol.metric
                    ek, er = _err(g, e, metric), _err(r, e, metric)
                    bound = tol.k * er + tol.floor
                    worst = max(worst, ek / bound if bound > 0 else (0.0 if ek == 0 else float("inf")))
                    if not ek <= bound:
                        ok = False
                        details.append(f"out{i}: err {ek:.3g} > bound {bound:.3g} (ref err {er:.3g})")
                rec.update(status="pass" if ok else "fail", ratio=round(worst, 4))
                if details:
                    rec["detail"] = "; ".join(details)
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
