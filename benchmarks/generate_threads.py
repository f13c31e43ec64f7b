"""CPU generate speed against the torch thread count: the measurement behind `dsv4core generate`'s
default thread count on the CPU (`dsv4core.commands.generate.default_threads`, README "Command line").

In one process, the README main command's generation (prompts [0, 17, 42, 7] and "Hello, DSV4" as
its bytes, 16 new tokens; greedy, or with `--sample` the command's temperature 0.8, top-p 0.95,
seed 0) runs `--reps` times for each thread count, the counts alternating so that a change of the
machine's load hits every count alike; reported: the median and the range of the generate wall
time and tokens/s per count, the machine's core counts and load averages. `--model`: a built-in
model, a checkpoint directory, or `small` (random weights with benchmarks/e2e_decode.py's "small"
dims, 4 layers: hidden 256, vocabulary 1024; a step of larger matrices than the tiny model's).

    python benchmarks/generate_threads.py --threads 1,2,3,4 --sample
        # -> results/cpu/<date>_<commit>/bench/generate-threads-tiny-sampled.json
    python benchmarks/generate_threads.py --model small --threads 1,2,4 --reps 9 --json FILE
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    import torch

    default_threads = torch.get_num_threads()     # torch's choice at start-up (OMP_NUM_THREADS when set)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default=None, help=f"comma-separated counts (default: 1 and torch's default, "
                                                    f"here {default_threads})")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--sample", action="store_true", help="sample as the README main command does")
    ap.add_argument("--json", default=None, help="output file (default: results/cpu/<date>_<commit>/bench/...)")
    args = ap.parse_args()
    counts = [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, default_threads})

    import dsv4core
    from dsv4core.commands.generate import physical_cores

    if args.model == "small":
        from dsv4core.model.api import build_model
        from e2e_decode import config_dict

        model = build_model(config_dict("small", 4, None), backend="reference", seed=1)
    else:
        model = dsv4core.load_model(args.model, backend="reference")
    prompts = [[0, 17, 42, 7], list("Hello, DSV4".encode())]   # the tiny tokenizer's ids of the text
    new = 16
    kw = dict(temperature=0.8, top_p=0.95, seed=0) if args.sample else {}
    model.generate(prompts, new, **kw)            # warm-up: pools, first-call costs
    load_before = os.getloadavg()
    times: dict[int, list[float]] = {n: [] for n in counts}
    for _ in range(args.reps):
        for n in counts:
            torch.set_num_threads(n)
            t = time.perf_counter()
            model.generate(prompts, new, **kw)
            times[n].append(time.perf_counter() - t)
    load_after = os.getloadavg()
    tokens = len(prompts) * new
    rows = []
    for n in counts:
        med = statistics.median(times[n])
        rows.append({"threads": n, "torch_default": n == default_threads, "median_s": round(med, 4),
                     "min_s": round(min(times[n]), 4), "max_s": round(max(times[n]), 4),
                     "tokens_per_s_median": round(tokens / med, 1), "runs_s": [round(x, 4) for x in times[n]]})
    base = next(r for r in rows if r["threads"] == counts[0])
    for r in rows:
        r["time_vs_first"] = round(r["median_s"] / base["median_s"], 3)
    out = {
        "what": f"dsv4core generate, model {args.model}, reference backend, float32, {len(prompts)} prompts "
                f"x {new} new tokens ({'sampled: ' + str(kw) if kw else 'greedy'}), wall time of model.generate "
                f"per thread count",
        "method": f"one process; {args.reps} repetitions, the thread counts alternating within each; "
                  "a warm-up generate first",
        "machine": {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                    "physical_cores": physical_cores(),
                    "torch_default_threads": default_threads, "loadavg_before": [round(x, 2) for x in load_before],
                    "loadavg_after": [round(x, 2) for x in load_after], "platform": platform.platform(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "rows": rows,
    }
    if args.json:
        path = Path(args.json)
    else:
        from _results import result_path

        path = result_path("cpu", "bench", f"generate-threads-{args.model}{'-sampled' if kw else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    for r in rows:
        print(f"threads {r['threads']:>2}{' (torch default)' if r['torch_default'] else '':16} "
              f"median {r['median_s'] * 1e3:8.1f} ms  [{r['min_s'] * 1e3:.1f}, {r['max_s'] * 1e3:.1f}]  "
              f"{r['tokens_per_s_median']:7.1f} tok/s  x{r['time_vs_first']}")
    print(f"load average {load_before} -> {load_after}; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
