"""Cost of the runtime verify mode (DSV4CORE_VERIFY): prefill and decode time of the same model
with verify off, at 1 % and at 100 % of op calls, reference backend, same process and thread count.

    python benchmarks/verify_overhead.py --json benchmarks/results/cpu/<date>_<commit>/bench/verify-overhead-reference.json

Off must cost nothing (the bound callables are the plain ones: checked by tests); the ratios here
are what turning it on costs. ``per_call``: the host cost of one unchecked call of a call site's
verified callable against the plain call of the same trivial implementation (best of 7 x 200,000
calls), the part of the cost that does not depend on the model. Measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

LENGTHS = {"tiny": (64, 8), "mid": (128, 4)}   # prompt tokens, decode steps (batch 1)


def _config(name: str):
    from dsv4core.model.api import TINY_CONFIG

    if name == "tiny":
        return TINY_CONFIG
    from transformers import DeepseekV4Config

    from bench_model import CONFIGS

    from dsv4core.model import DSV4Config

    kw = dict(CONFIGS[name], eos_token_id=None, bos_token_id=None)
    return DSV4Config.from_dict(json.loads(DeepseekV4Config(**kw).to_json_string()))


def _time(fn, reps: int) -> float:
    fn()                                   # warm-up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure(name: str, fractions, reps: int, dtype: torch.dtype) -> dict:
    from dsv4core.model.api import build_model

    cfg = _config(name)
    P, steps = LENGTHS[name]
    prompt = list(range(3, 3 + P))
    out = {"config": name, "prompt_tokens": P, "decode_steps": steps, "runs": []}
    base = None
    for f in fractions:
        m = build_model(cfg, dtype=dtype, backend="reference", seed=0, verify=f)
        prefill = _time(lambda: m.logits(prompt), reps)
        decode = _time(lambda: m.generate([prompt[:8]], steps), reps)
        s = m.ops.verify_summary()
        run = {"verify": f, "prefill_s": round(prefill, 4), "generate_s": round(decode, 4),
               "checked_calls": s["checked"] if s else 0, "divergences": s["divergences"] if s else 0}
        if base is None:
            base = run
        run["prefill_ratio"] = round(prefill / base["prefill_s"], 3)
        run["generate_ratio"] = round(decode / base["generate_s"], 3)
        out["runs"].append(run)
        print(name, run, flush=True)
    return out


def per_call(n: int = 200_000) -> dict:
    """ns per call: a trivial rms_norm implementation called plainly, and through one call site's
    verified callable at a fraction so small that no call of the run is checked."""
    import timeit

    from dsv4core.hal import catalogue
    from dsv4core.hal.verify import VerifyStats, wrap

    spec = catalogue()["rms_norm"]
    x, w = torch.randn(2, 8), torch.ones(8)

    def fn(x, weight, eps):
        return x

    stats = VerifyStats(1e-9, 1)
    f = wrap(spec, fn, stats, False, "bench")
    f = f.at("layers.0.input_layernorm") if hasattr(f, "at") else f
    best = {k: min(timeit.repeat(lambda g=g: g(x, w, 1e-6), number=n, repeat=7)) / n
            for k, g in (("plain", fn), ("verified", f))}
    assert stats.checked == 0
    out = {"plain_ns": round(best["plain"] * 1e9, 1), "verified_ns": round(best["verified"] * 1e9, 1)}
    out["added_ns"] = round(out["verified_ns"] - out["plain_ns"], 1)
    print("per call", out, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="tiny,mid")
    ap.add_argument("--fractions", default="0,0.01,1")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    fr = [float(f) for f in args.fractions.split(",")]
    res = {"what": "runtime verify mode cost (median of reps; ratio to verify off in the same run)",
           "backend": "reference", "device": "cpu", "threads": args.threads, "dtype": args.dtype,
           "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "per_call": per_call(),
           "results": [measure(c, fr, args.reps, getattr(torch, args.dtype)) for c in args.configs.split(",")]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
