"""Run the ROCm and XPU launch tables' configurations on an NVIDIA GPU through the conformance suite.

    python benchmarks/vendor_tables_on_cuda.py [--shapes small,flash] [--json FILE; default benchmarks/results/h200/<date>_<commit>/conformance/rocm-xpu-launch-tables-<shapes>.json]

Functional evidence for the one kernel source under the other vendors' tile sizes, warps and
stages: each table (rocm gfx942 / gfx950 / other, xpu) drives the portable kernels on "cuda",
with the launch keywords CUDA's Triton rejects (waves_per_eu, matrix_instr_nonkdim, warp_size,
...) removed and listed in the report. Not performance evidence, and not evidence about AMD or
Intel code generation (that is the AOT gate and vendor CI). aiter is not used (absent on NVIDIA).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def backends(accepted):
    import dsv4core_rocm
    import dsv4core_xpu
    from dsv4core_rocm.launch import TABLES
    from dsv4core_xpu.launch import current

    ok = lambda: (True, "")  # noqa: E731
    out = {}
    for arch in TABLES:
        out[f"rocm-{arch}"] = dsv4core_rocm.make_backend("cuda", arch=lambda a=arch: a, available=ok,
                                                         launch=TABLES.resolve(arch, accepted))
    # CUDA's Triton has a `warp_size` option too, with another meaning (32 lanes, fixed): the XPU
    # sub-group keywords are dropped by name, not only by what CUDA accepts
    xpu_accepted = frozenset(accepted) - set(XPU_ONLY)
    for name, slm in (("xpu-slm64k", 64 * 1024), ("xpu-slm128k", 128 * 1024)):
        out[name] = dsv4core_xpu.make_backend("cuda", available=ok,
                                              launch=lambda s=slm: current(accepted=xpu_accepted, slm=s))
    return out


XPU_ONLY = ("warp_size", "threads_per_warp", "grf_mode")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="small,flash")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ops", default=None)
    ap.add_argument("--tables", default=None, help="comma-separated subset of rocm-gfx942,rocm-gfx950,rocm-other,xpu-slm64k,xpu-slm128k")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if a.json is None:
        from _results import result_path

        a.json = str(result_path("h200", "conformance", f"rocm-xpu-launch-tables-{a.shapes.replace(',', '-')}.json"))
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    from triton.runtime import driver

    from dsv4core.conformance import run
    from dsv4core.kernels.triton import OPS
    from dsv4core.kernels.triton.launch import AMD_ONLY, accepted_options

    target = driver.active.get_current_target()
    accepted = accepted_options(target)
    ops = a.ops or ",".join(OPS)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": __import__("triton").__version__, "target": str(target), "shapes": a.shapes,
              "dropped_launch_keywords": {"rocm": sorted(k for k in AMD_ONLY if k not in accepted),
                                          "xpu": list(XPU_ONLY)},
              "tables": {}}
    failed = False
    chosen = a.tables.split(",") if a.tables else None
    for name, b in backends(accepted).items():
        if chosen is not None and name not in chosen:
            continue
        t0 = time.perf_counter()
        rep = run(b, ops=ops, shapes=a.shapes, dtypes=a.dtypes, device="cuda",
                  progress=lambda s, n=name: print(f"[{n}] {s}", flush=True))
        d = rep.as_dict()
        result["tables"][name] = {"failed": d["failed"], "seconds": round(time.perf_counter() - t0, 1),
                                  "summary": d["summary"],
                                  "failures": [c.id + ": " + c.message for c in rep.failures()]}
        failed |= d["failed"]
        print(f"{name}: {'FAILED' if d['failed'] else 'passed'}", flush=True)
        with open(a.json, "w") as f:          # after every table: a cut-short run keeps what finished
            json.dump(result, f, indent=1)
    print(f"wrote {a.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
