"""Compile (ahead of time, CPU only) every portable kernel the rocm backend launches, in the branch a GPU runs.

    python benchmarks/aot_rocm_device_branch.py [--archs gfx942,gfx950] [--dtypes bfloat16,float32]
        [--shapes flash] [--out FILE; default benchmarks/results/rocm-aot/<date>_<commit>/aot/device-branch-flash.json]

Why: ``python -m dsv4core.kernels.triton.aot`` launches the kernels on CPU tensors, and the
launchers pick their branch by the tensors' device, through helpers of
dsv4core/kernels/triton/_util.py that each kernel module imports by name:

- ``interp(t)`` (attention, linear, mhc, moe, wo_a): True on CPU -> fp32-upcast / ``ieee`` dots
  instead of the bf16 (or FP8 -> bf16) MFMA dots a GPU runs;
- ``interpreting(t)`` (indexer): already False without TRITON_INTERPRET=1 (patched anyway);
- ``rne(out)`` (every kernel with a bf16 output): True on CPU -> an extra software
  round-to-nearest-even before each bf16 store, which the GPU's conversion does itself;
- ``accurate(t)`` (rope): False on CPU -> plain ``tl.sin`` / ``tl.cos`` instead of libdevice;
- ``target_programs(device, cpu)`` (attention, linear, mhc): on CPU a fixed ``cpu`` count instead
  of 2 programs per compute unit, which sets the split-K factor (the SPLIT / FINAL
  specialisations and the partial-sum kernels).

This script replaces those names, in each kernel module's namespace (where the launchers look
them up; the kernel sources are not edited), with the device answers (``aot.device_branch``,
also ``python -m dsv4core.kernels.triton.aot --device-branch``): ``interp`` / ``interpreting`` /
``rne`` -> False, ``accurate`` -> True, ``target_programs`` -> 2 x the compute units of the
arch's largest part (gfx942: MI300X, 304 CUs; gfx950: MI355X, 256 CUs). Then it
compiles, through the rocm plugin's ``aot_backend`` (its launch tables and ``supports``), every
conformance case for the arch, one arch per subprocess, one after the other (one compile peaks
at several GB of host memory). Per arch it records the kernels (LDS, VGPRs, spills, ok), the
wall time, CPU time and the peak resident memory of the compiling process.

tests/test_rocm_aot.py (the CI gate) compiles the same branch, bf16 cases only; this script adds
fp32 and the time / memory figures. Compile-only evidence: nothing runs on an AMD device.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _results import result_path

from dsv4core.kernels.triton import aot

HERE = Path(__file__).resolve().parent


def _child(arch: str, dtypes: str, shapes: str, out: str) -> int:
    import torch

    import dsv4core_rocm

    target = aot.parse_target(f"hip:{arch}")
    with aot.device_branch(target) as patched:
        recs = aot.compile_all(target, backend=dsv4core_rocm.aot_backend(arch), shapes=shapes,
                               dtypes=tuple(getattr(torch, d) for d in dtypes.split(",")),
                               progress=lambda s: print(f"[{arch}] {s}", file=sys.stderr, flush=True))
    Path(out).write_text(json.dumps({"patched": patched, "kernels": recs}))
    return 0


def _run_arch(arch: str, a) -> dict:
    """Compile ``arch`` in a subprocess; its kernels plus wall / CPU time and peak RSS (wait4)."""
    tmp = Path(a.out).with_suffix(f".{arch}.tmp")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # the 3.9 default, stated (silences its warning)
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, __file__, "--child", arch, "--dtypes", a.dtypes, "--shapes", a.shapes,
                          "--out", str(tmp)], env=env)
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if p.returncode or not tmp.exists():
        raise SystemExit(f"{arch}: the compile process failed (rc {p.returncode})")
    rep = json.loads(tmp.read_text())
    tmp.unlink()
    return {"target": f"hip:{arch}", "compute_units_assumed": aot.COMPUTE_UNITS[arch], "patched": rep["patched"],
            "wall_s": round(wall, 1), "cpu_s": round(ru.ru_utime + ru.ru_stime, 1),
            "peak_rss_gib": round(ru.ru_maxrss / 2**20, 2), "kernels": rep["kernels"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", default="gfx942,gfx950")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--shapes", default="flash")
    ap.add_argument("--out", default=str(result_path("rocm-aot", "aot", "device-branch-flash.json")))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return _child(a.child, a.dtypes, a.shapes, a.out)
    import triton

    out = {"what": __doc__.split("\n\n")[0], "device_branch": True, "backend": "dsv4core_rocm:aot_backend",
           "shapes": a.shapes, "dtypes": a.dtypes, "triton": triton.__version__, "cpu_cores": os.cpu_count()}
    rc = 0
    for arch in a.archs.split(","):
        print(f"[{arch}] compiling the device branch ...", file=sys.stderr, flush=True)
        rep = out[arch] = _run_arch(arch, a)
        bad = [r for r in rep["kernels"] if not r["ok"]]
        for r in bad:
            print(f"[{arch}] FAIL {r['op']}/{r['kernel']} ({r['case']}, {r['dtype']}): " + (r.get("error") or
                  f"LDS {r['lds_bytes']}/{r['lds_limit']}, VGPR spills {r['vgpr_spills']}, "
                  f"SGPR spills {r['sgpr_spills']}"), file=sys.stderr)
        print(f"[{arch}] {len(rep['kernels'])} kernels, {len(bad)} failing; {rep['wall_s']} s wall, "
              f"{rep['cpu_s']} s CPU, peak RSS {rep['peak_rss_gib']} GiB", file=sys.stderr, flush=True)
        rc |= bool(bad)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
