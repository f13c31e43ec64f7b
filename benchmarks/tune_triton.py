"""Launch-config sweep for the Triton kernels on a GPU (device time, cold L2, CUDA graphs).

    python benchmarks/tune_triton.py [--json out.json]

Sets each kernel module's TUNE overrides in turn, times the op at DSV4-Flash shapes with
dsv4core.bench's timer and checks the result against the default config (max rel diff).
"""
from __future__ import annotations

import argparse
import json

import torch

from dsv4core.bench import Timer, get_backend, make_case
from dsv4core.kernels.triton import attention, mhc, wo_a

SWEEPS = {
    ("sparse_mqa_attention", attention): {
        (1, 8, 64): [{}, {"BK": 64}, {"BK": 16}, {"target": 528}, {"target": 132}, {"num_stages": 3},
                     {"BH": 32, "num_warps": 8}],
        (256, 4096): [{}, {"BH": 32, "num_warps": 8}, {"BH": 32, "num_warps": 4}, {"BK": 64},
                      {"num_stages": 3}, {"BH": 64, "num_warps": 8, "BK": 16}],
    },
    ("wo_a", wo_a): {
        (1,): [{}, {"BN": 64, "BK": 128}, {"BN": 16, "BK": 256}, {"BK": 512, "num_stages": 3},
               {"BN": 32, "BK": 128, "num_stages": 6}],
        (64,): [{}, {"BM": 64, "BN": 64, "BK": 64}, {"BM": 32, "BN": 32, "BK": 128},
                {"BM": 64, "BN": 32, "BK": 256, "num_stages": 3}, {"BM": 64, "BN": 16, "BK": 128}],
        (4096,): [{}, {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3},
                  {"BM": 128, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 4},
                  {"BM": 64, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 4}],
    },
    ("hc_pre", mhc): {
        (1, 64): [{}, {"target": 132}, {"target": 528}, {"BK": 64}, {"BK": 256}],
        (4096,): [{}, {"BT": 128, "num_warps": 8}, {"BK": 256}, {"num_stages": 4}, {"target": 528},
                  {"BT": 32}],
    },
}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="flash")
    a = ap.parse_args(argv)
    b = get_backend("cuda")
    timer = Timer("cuda")
    rows = []
    for (op, mod), groups in SWEEPS.items():
        impl = b.impls[op]
        for toks, variants in groups.items():
            for T in toks:
                case = make_case(op, a.shapes, T, "cuda")
                mod.TUNE.clear()
                base = impl.fn(**case.kwargs)
                base = base[0] if isinstance(base, tuple) else base
                for v in variants:
                    mod.TUNE.clear()
                    mod.TUNE.update(v)
                    try:
                        t = timer.time(lambda: impl.fn(**case.kwargs), reps=15)
                        out = impl.fn(**case.kwargs)
                        out = out[0] if isinstance(out, tuple) else out
                        diff = float((out.float() - base.float()).abs().max() / base.float().abs().max())
                        r = dict(op=op, T=T, cfg=v, us=t * 1e6, GBps=case.bytes / t / 1e9, diff=diff)
                    except Exception as e:  # noqa: BLE001
                        r = dict(op=op, T=T, cfg=v, error=f"{type(e).__name__}: {str(e)[:160]}")
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                mod.TUNE.clear()
                del case
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
