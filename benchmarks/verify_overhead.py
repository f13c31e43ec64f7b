"""Cost of the runtime verify mode (DSV4CORE_VERIFY): prefill and generate time of the same model
with verify off and at each fraction of op calls (default 0, 1 %, 10 %, 100 %), same process and
thread count, with graphs off (every step eager: per-call sampling) and with graphs on (where the
device has graph capture and the ops are capturable: whole-step sampling, `dsv4core.hal.verify`).

    python benchmarks/verify_overhead.py --json benchmarks/results/cpu/<date>_<commit>/bench/verify-overhead-reference.json
    python benchmarks/verify_overhead.py --device cuda --configs tiny,mid --json .../bench/verify-overhead-cuda.json

Each run reports the mean time of one prefill (`m.logits` of the prompt) and of one `generate`
(a prefill and the decode steps, batch 1), and their ratio to verify off in the same graph mode;
``graphs`` is the model's `graph_status()` ('on', or why its steps ran eagerly). Under whole-step
sampling a run's cost is in its few sampled steps, so a run with graphs on is repeated until at
least `--min-sampled` of its steps were due to be sampled (``reps``; the means are over all of
them, ``steps`` counts the steps drawn and sampled). Off must cost nothing (the bound callables
are the plain ones: checked by tests); the ratios here are what turning it on costs.
``per_call``: the host cost of one unchecked call of a call site's verified callable against the
plain call of the same trivial implementation (best of 7 x 200,000 calls), the part of the cost
that does not depend on the model. Measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import math
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


def _sync(dev: torch.device) -> None:
    mod = getattr(torch, dev.type, None)
    if dev.type != "cpu" and hasattr(mod, "synchronize"):
        mod.synchronize()


def _times(fn, reps: int, dev: torch.device) -> list[float]:
    fn()                                   # warm-up (graph recording, compilation)
    _sync(dev)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t0)
    return ts


def measure(name: str, fractions, reps: int, dtype: torch.dtype, dev: torch.device, backend: str,
            graphs: bool, min_sampled: int = 10, max_reps: int = 2000, lengths: tuple | None = None) -> dict:
    from dsv4core.model.api import build_model

    cfg = _config(name)
    P, steps = lengths or LENGTHS[name]
    prompt = list(range(3, 3 + P))
    out = {"config": name, "prompt_tokens": P, "decode_steps": steps, "graphs_asked": graphs, "runs": []}
    base = None
    for f in fractions:
        m = build_model(cfg, dtype=dtype, device=dev, backend=backend, seed=0, verify=f)
        m.use_graphs = graphs
        whole = graphs and f > 0 and not m.graph_status()      # whole-step sampling: repeat until sampled
        n = min(max_reps, max(reps, math.ceil(min_sampled / f))) if whole else reps
        t0 = time.perf_counter()
        prefill = _times(lambda: m.logits(prompt), n, dev)
        t1 = time.perf_counter()
        decode = _times(lambda: m.generate([prompt[:8]], steps), max(reps, math.ceil(n / steps)) if whole else reps,
                        dev)
        print(f"{name} verify={f}: {len(prefill)} prefills in {t1 - t0:.1f} s, {len(decode)} generates in "
              f"{time.perf_counter() - t1:.1f} s", flush=True)
        s = m.ops.verify_summary()
        run = {"verify": f, "graphs": m.graph_status() or "on", "reps": [len(prefill), len(decode)],
               "prefill_s": round(statistics.fmean(prefill), 5), "generate_s": round(statistics.fmean(decode), 5),
               "prefill_median_s": round(statistics.median(prefill), 5),
               "generate_median_s": round(statistics.median(decode), 5),
               "checked_calls": s["checked"] if s else 0, "divergences": s["divergences"] if s else 0,
               "steps": s["steps"] if s else None}
        if base is None:
            base = run
        run["prefill_ratio"] = round(run["prefill_s"] / base["prefill_s"], 3)
        run["generate_ratio"] = round(run["generate_s"] / base["generate_s"], 3)
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
    ap.add_argument("--fractions", default="0,0.01,0.1,1")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", help="default: cuda on a CUDA device, else reference")
    ap.add_argument("--graphs", default="off,on", help="graph modes to run (off, on)")
    ap.add_argument("--per-call-calls", type=int, default=200_000, help="calls per timing of `per_call`")
    ap.add_argument("--lengths", default=None, help="prompt tokens,decode steps (default per config: "
                    + "; ".join(f"{k} {p},{d}" for k, (p, d) in LENGTHS.items()) + ")")
    ap.add_argument("--min-sampled", type=int, default=10,
                    help="with graphs on, repeat a run until this many of its steps were due to be sampled")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    fr = [float(f) for f in args.fractions.split(",")]
    if fr[0] != 0:
        ap.error("--fractions must start with 0 (verify off: the base of the ratios)")
    modes = [{"off": False, "on": True}[g.strip()] for g in args.graphs.split(",")]
    lengths = tuple(int(v) for v in args.lengths.split(",")) if args.lengths else None
    dev = torch.device(args.device)
    backend = args.backend or ("cuda" if dev.type == "cuda" else "reference")
    res = {"what": "runtime verify mode cost (mean of reps; ratio to verify off in the same run and graph mode)",
           "backend": backend, "device": dev.type, "threads": args.threads, "dtype": args.dtype,
           "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "per_call": per_call(args.per_call_calls),
           "results": [measure(c, fr, args.reps, getattr(torch, args.dtype), dev, backend, g, args.min_sampled,
                               lengths=lengths) for c in args.configs.split(",") for g in modes]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
