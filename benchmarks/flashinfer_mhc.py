"""FlashInfer's mHC kernels beside our Triton hc_pre / hc_post, on one GPU, in one run (< 60 s).

    python benchmarks/fetch_flashinfer_mhc.py          # here, once: sources + tvm-ffi wheel (ignored)
    bash benchmarks/h200_run.sh fimhc                  # on the GPU (carry .whl and .vendor)
    # or directly, with apache-tvm-ffi importable:
    DSV4CORE_FLASHINFER_SRC=.vendor/flashinfer-mhc python benchmarks/flashinfer_mhc.py --json out.json

1. builds the ``cuda-flashinfer`` provider (nvcc through its source path, or the installed
   flashinfer), timing the build;
2. runs its conformance for hc_pre / hc_post (bf16; shapes small and flash) against the fp64
   oracle, as ``dsv4core conformance --backend cuda-flashinfer`` would;
3. times, in the same process and the same way as ``dsv4core bench`` (dsv4core.bench Timer:
   cold L2, CUDA-graph replay, median), at T = 1, 64, 4096 on Flash dims: our ``cuda`` kernels,
   the provider's whole op, and for hc_pre its two parts (the torch fp32 mix GEMM, FlashInfer's
   big-fuse kernel on a precomputed GEMM), with % of the copy bandwidth measured in the run;
4. checks that a CUDA-graph replay of each provider op gives the eager result;
5. writes one JSON (``--json``) and prints a table.

The provider's priority stays below ``cuda`` until this JSON says otherwise (plugins/cuda/README.md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch


def _case_kwargs(label, T, device):
    from dsv4core.bench import make_case

    return make_case(label, "flash", T, device)


def _conformance(name, log):
    from dsv4core.conformance import run

    t0 = time.perf_counter()
    rep = run(name, ops="hc_pre,hc_post", shapes="small,flash", dtypes="bfloat16", device="cuda")
    out = {"seconds": time.perf_counter() - t0, "failed": rep.failed, "ops": {}}
    for o in rep.ops:
        out["ops"][o.op] = {"status": o.status, "passed": o.count("passed"), "declined": o.count("declined"),
                            "failed": o.count("failed"), "worst_ratio": o.worst,
                            "declined_cases": {c.id: c.message for c in o.cases if c.status == "declined"},
                            "failures": {c.id: c.message for c in o.cases if c.status == "failed"}}
        log(f"conformance {name} {o.op}: {o.status} (passed {o.count('passed')}, declined {o.count('declined')}, "
            f"failed {o.count('failed')}, worst err/bound {o.worst})")
    return out


def _graph_matches(fn):
    """A CUDA-graph replay of ``fn`` gives the eager result (bit for bit)."""
    want = fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = fn()
    g.replay()
    torch.cuda.synchronize()
    want, got = (want if isinstance(want, tuple) else (want,)), (got if isinstance(got, tuple) else (got,))
    return all(torch.equal(a, b) for a, b in zip(want, got))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="flashinfer-mhc.json")
    ap.add_argument("--tokens", default="1,64,4096")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    log = lambda m: print(m, flush=True)  # noqa: E731
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    from dsv4core.bench import Timer, _rel_err, get_backend, measure_ceilings
    from dsv4core.hal import catalogue
    from dsv4core_cuda import flashinfer_mhc as fim

    res = {"device_name": torch.cuda.get_device_name(), "torch": torch.__version__,
           "capability": list(torch.cuda.get_device_capability()), "origin": list(fim.origin())}
    t0 = time.perf_counter()
    mod, why = fim.KERNELS.get()
    res.update(build_seconds=time.perf_counter() - t0, kernels_from=fim.KERNELS.origin, kernels_error=why)
    log(f"FlashInfer mHC kernels: {fim.KERNELS.origin or '-'} in {res['build_seconds']:.1f} s {why}")
    if mod is None:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        return 1
    res["conformance"] = _conformance(fim.NAME, log)

    timer = Timer("cuda")
    ceil = measure_ceilings("cuda", timer)
    res["ceilings"] = ceil
    ours, peer = get_backend("cuda"), get_backend(fim.NAME)
    specs = catalogue()
    rows = []
    for label in ("hc_pre", "hc_post"):
        for T in (int(t) for t in args.tokens.split(",")):
            case = _case_kwargs(label, T, "cuda")
            kw = case.kwargs
            want = specs[label].reference(**kw)
            row = {"op": label, "T": T, "shapes": "flash", "bytes": case.bytes}
            variants = {"triton (cuda)": lambda: ours.impls[label].fn(**kw),
                        "flashinfer (cuda-flashinfer)": lambda: peer.impls[label].fn(**kw)}
            if label == "hc_pre":
                x, n, H = kw["x"], kw["x"].shape[1], kw["x"].shape[2]
                dot = torch.mm(x.view(T, n * H).float(), kw["fn"].t())
                post, comb = torch.empty(T, 4, device="cuda"), torch.empty(T, 4, 4, device="cuda")
                y = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
                variants["  part: torch fp32 mix GEMM"] = lambda: torch.mm(x.view(T, n * H).float(), kw["fn"].t())
                variants["  part: flashinfer big-fuse kernel"] = lambda: mod.mhc_pre_big_fuse_with_prenorm(
                    post, comb, y, dot, x, kw["scale"], kw["base"], 1e-6, 1e-6, 1e-6, 2.0, 20, 0)
            for name, fn in variants.items():
                try:
                    t = timer.time(fn, reps=args.reps)
                    v = {"us": t * 1e6, "graphed": timer.last_graphed, "pct_copy": 100 * case.bytes / t / 1e9 / ceil["copy_GBps"]}
                    if not name.startswith("  part"):
                        v["max_rel_err_vs_ref"] = _rel_err(fn(), want)
                except Exception as e:  # noqa: BLE001 - recorded
                    v = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                row[name.strip()] = v
            a, b = row["triton (cuda)"], row["flashinfer (cuda-flashinfer)"]
            if "us" in a and "us" in b:
                row["flashinfer_over_triton"] = b["us"] / a["us"]
            if T == 64:
                row["provider_graph_replay_matches_eager"] = _graph_matches(variants["flashinfer (cuda-flashinfer)"])
            rows.append(row)
            log(f"{label:8s} T={T:<5d} " + "  ".join(
                f"{k.strip()}: {v['us']:.1f} us ({v['pct_copy']:.0f}% copy)" if "us" in v else f"{k.strip()}: {v.get('error')}"
                for k, v in ((k, row[k.strip()]) for k in variants)) +
                (f"  fi/triton {row['flashinfer_over_triton']:.2f}" if "flashinfer_over_triton" in row else ""))
    res["rows"] = rows
    res["note"] = ("Timer of dsv4core.bench: median device time, cold L2 (256 MiB written before each call), "
                   "CUDA-graph replay where capturable. flashinfer (cuda-flashinfer) hc_pre = torch fp32 mix GEMM + "
                   "FlashInfer mhc_pre_big_fuse_with_prenorm; the two parts are also timed alone.")
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    log(f"wrote {args.json}")
    return 1 if res["conformance"]["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
