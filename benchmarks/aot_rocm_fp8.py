"""Compile (ahead of time, CPU only) the rocm backend's FP8 linear / wo_a kernels as the device runs them.

    python benchmarks/aot_rocm_fp8.py [--shapes flash] [--out FILE; default benchmarks/results/rocm-aot/<date>_<commit>/aot/fp8-linear-wo_a-flash.json]

``python -m dsv4core.kernels.triton.aot`` launches on CPU tensors, where linear / wo_a pick their
interpreter branch (fp32 ``ieee`` dots, dsv4core/kernels/triton/_util.py ``interp``). This script
turns that test off so the device branch (fp8 codes converted to bf16 in registers, bf16 MFMA) is
what compiles: on gfx942 the rocm backend hands the kernels e4m3fnuz weights (``*fp8e4b8``,
dsv4core_rocm/fp8.py), on gfx950 the OCP e4m3fn ones (``*fp8e4nv``). Compile-only evidence
(LDS, VGPRs, spills); nothing runs.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from _results import result_path

from dsv4core.kernels.triton import aot, linear, wo_a


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="flash")
    ap.add_argument("--out", default=str(result_path("rocm-aot", "aot", "fp8-linear-wo_a-flash.json")))
    a = ap.parse_args()
    for mod in (linear, wo_a):
        mod.interp = lambda t: False          # the device branch, not the interpreter's
    out, rc = {}, 0
    for arch in ("gfx942", "gfx950"):
        tmp = Path(a.out).with_suffix(f".{arch}.tmp")
        rc |= aot.main(["--target", f"hip:{arch}", "--backend", "dsv4core_rocm:aot_backend", "--ops", "linear,wo_a",
                        "--dtypes", "bfloat16", "--shapes", a.shapes, "--json", str(tmp)])
        rep = json.loads(tmp.read_text())
        tmp.unlink()
        rep["kernels"] = [k for k in rep["kernels"] if k.get("constexprs", {}).get("SCALE")]   # the FP8 ones
        out[arch] = rep
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"what": __doc__.split("\n\n")[0], "device_branch": True, **out}, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
