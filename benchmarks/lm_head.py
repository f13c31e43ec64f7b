"""The lm_head GEMM (x [T, hidden] bf16, weight [vocab, hidden] bf16, fp32 logits) on a backend:
device time, % of the weight-streaming floor measured in the same run, and accuracy against an
fp64 evaluation (max |y - y64| / max |y64|), beside torch's bf16 and fp32 matmuls.

    python benchmarks/lm_head.py --backend cuda --tokens 1,2,8,64,512 --chains 0,16,64 --json lm_head.json

Rows: the backend's linear with fp32 outputs (the served lm_head); the same backend's linear with
bf16 outputs (the same tensor-core GEMM, the fp32 store aside); torch's bf16 matmul
(cuBLAS, bf16 out) and fp32 matmul of the converted operands (the weight converted beforehand, so
it streams 2x the bytes: accuracy only, not a speed peer). ``--chains``: extra fp32-out rows with
the Triton GEMM's TUNE ``chain`` set (K columns an MMA chain sums; 0: one chain over all of K;
kernels/triton/linear.py), for a backend built on the portable kernels."""

from __future__ import annotations

import argparse
import json
import sys

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=129280)
    ap.add_argument("--tokens", default="1,2,8,64,512")
    ap.add_argument("--chains", default="", help="comma-separated TUNE chain values for extra fp32-out rows")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    from dsv4core.bench import Timer, get_backend, measure_ceilings

    dev = torch.device(args.device)
    timer = Timer(dev, flush="read")
    ceil = measure_ceilings(dev, timer)
    lin = get_backend(args.backend).impls["linear"].fn
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden ** -0.5).to(dev, torch.bfloat16)
    w32 = w.float()
    rows = []
    chains = [int(c) for c in args.chains.split(",") if c]
    if chains:
        from dsv4core.kernels.triton.linear import TUNE as tune
    for T in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(T, args.hidden, generator=g).to(dev, torch.bfloat16)
        y64 = (x.double() @ w.double().t())
        scale = y64.abs().max().item()
        # copy_GBps counts the bytes read and written: the rate at which bytes move, read or written
        floor_s = (w.numel() * 2 + x.numel() * 2 + T * args.vocab * 4) / (ceil["copy_GBps"] * 1e9)
        fp32_out = lambda: lin(x, w, out_dtype=torch.float32)   # noqa: E731
        variants = {   # name -> (the call, the TUNE chain it runs with; None: the backend's own)
            f"{args.backend} linear, fp32 out": (fp32_out, None),
            f"{args.backend} linear, bf16 out": (lambda: lin(x, w, out_dtype=torch.bfloat16), None),
            "torch bf16 matmul (bf16 out)": (lambda: x @ w.t(), None),
            "torch fp32 matmul (weight pre-converted)": (lambda: x.float() @ w32.t(), None),
            **{f"{args.backend} linear, fp32 out, chain={c}": (fp32_out, c) for c in chains},
        }
        for name, (fn, c) in variants.items():
            if c is not None:
                tune["chain"] = c
            try:
                err = ((fn().double() - y64).abs().max().item()) / scale
                sec = timer.time(fn, warmup=3, reps=20)
            finally:
                if c is not None:
                    tune.pop("chain", None)
            rows.append({"T": T, "variant": name, "chain": c, "us": sec * 1e6, "floor_us": floor_s * 1e6,
                         "pct_of_floor": 100 * floor_s / sec, "max_rel_err": err})
            print(f"T={T:<4} {name:<42} {sec * 1e6:9.1f} us  {100 * floor_s / sec:5.1f} % of floor  "
                  f"err {err:.3g}", flush=True)
    res = {"device_name": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "backend": args.backend, "hidden": args.hidden, "vocab": args.vocab, "ceilings": ceil,
           "floor": "weight + activation + fp32 logits bytes at the measured copy rate (bytes read + written a second)",
           "accuracy": "max |y - y64| / max |y64|, y64 the fp64 product of the same bf16 operands", "rows": rows}
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
