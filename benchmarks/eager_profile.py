"""Where an eager step's host time goes on the device itself: eager decode steps of one model run
under cProfile, reported per function (own and cumulative time, calls, per step) and summed by
where the function lives (Triton's launcher, torch, dsv4core's model core, its HAL, the kernel
modules' launchers, the rest).

`benchmarks/eager_host.py` measures the Python side of a step on the CPU with the launches
recorded instead of run; this runs the real launches (Triton's launcher and the driver included)
on the device, so the two together say how much of the eager step is whose.

    python benchmarks/eager_profile.py --device cuda --backend cuda --config flash --layers 4 --experts 32 \\
        --json .../bench/eager-profile-flash-4layers-bf16.json

Per batch (`--batches`): `step_ms` (median wall of `--steps` eager steps, unprofiled), `profiled_step_ms`
(the same under the profiler: its overhead inflates every figure, so read shares), `by_place` (own
time summed per place, ms a step and share), `top` (the `--top` functions by own time). Measured,
never asserted.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

PLACES = (("triton launcher", ("triton/runtime", "triton/backends", "triton/compiler", "triton/knobs")),
          ("kernel launchers", ("dsv4core/kernels/",)),
          ("plugin", ("dsv4core_cuda", "dsv4core_rocm", "dsv4core_xpu")),
          ("hal reference ops", ("dsv4core/hal/ops/",)),
          ("hal", ("dsv4core/hal/",)),
          ("model core", ("dsv4core/model/",)),
          ("torch python", ("torch/",)))


def _place(filename: str, name: str) -> str:
    f = filename.replace("\\", "/")
    for place, parts in PLACES:
        if any(p in f for p in parts):
            return place
    if f.startswith("~") or f == "<built-in>":     # C functions: torch ops, builtins, driver calls
        return "built-in (torch ops, driver)" if "torch" in name or "_C" in name else "built-in (other)"
    return "other python"


def _sync(dev: torch.device) -> None:
    if dev.type != "cpu":
        getattr(torch, dev.type).synchronize()


def measure(m, base, steps: int, top: int) -> dict:
    from mixed_steps import _step

    m.use_graphs = False
    dev = m.device

    def step():
        ids, pos, rid, sts, rows, _ = _step(m, base, "decode", 0, 0)
        out = m.forward_batch(ids, pos, rid, sts, logits_rows=rows)
        out.sum().item()
        for s in sts:
            s.release()

    for _ in range(2):
        step()
    ts = []
    for _ in range(steps):
        _sync(dev)
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    prof = cProfile.Profile()
    _sync(dev)
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    prof.disable()
    prof_ms = 1e3 * (time.perf_counter() - t0) / steps
    st = pstats.Stats(prof)
    rows, by_place = [], {}
    for (fn, line, name), (cc, nc, tt, ct, _callers) in st.stats.items():
        place = _place(fn, name)
        by_place[place] = by_place.get(place, 0.0) + tt
        rows.append({"function": f"{fn.split('site-packages/')[-1]}:{line}({name})", "place": place,
                     "calls_per_step": round(nc / steps, 1), "own_ms": round(1e3 * tt / steps, 3),
                     "cum_ms": round(1e3 * ct / steps, 3)})
    rows.sort(key=lambda r: -r["own_ms"])
    total = sum(by_place.values())
    return {"requests": len(base), "step_ms": round(1e3 * statistics.median(ts), 3),
            "profiled_step_ms": round(prof_ms, 3),
            "by_place": {k: {"ms": round(1e3 * v / steps, 3), "share": round(v / total, 3)}
                         for k, v in sorted(by_place.items(), key=lambda kv: -kv[1])},
            "top": rows[:top]}


def main(argv=None) -> int:
    from mixed_steps import model_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_args(ap, layers=4)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from mixed_steps import build

    with torch.no_grad():
        m, meta = build(args, getattr(torch, args.dtype))
    batches = [int(b) for b in args.batches.split(",")]
    B = max(batches)
    m.configure_cache(max_requests=3 * B, max_tokens=4 * B * (args.context + 64),
                      max_request_tokens=args.context + 64, max_step_tokens=max(1024, B))
    m.use_graphs = False
    base = [m.new_state() for _ in range(B)]
    with torch.no_grad():
        for j, s in enumerate(base):
            ids = torch.randint(2, m.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(10 + j))
            m.forward_batch(ids, torch.arange(args.context), torch.zeros(args.context, dtype=torch.long), [s])
    res = {"what": "eager decode steps under cProfile: host time per function and per place", "config": args.config,
           **meta, "device": str(m.device), "backend": m.hal_report()[0].get("backend"), "dtype": args.dtype,
           "context": args.context, "steps": args.steps, "torch": torch.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "complete": False, "rows": []}
    try:
        import triton
        res["triton"] = triton.__version__
    except ImportError:
        pass
    for i, b in enumerate(batches):
        with torch.no_grad():
            row = measure(m, base[:b], args.steps, args.top)
        row["per_layer_ms"] = round(row["step_ms"] / m.config.num_hidden_layers, 3)
        res["rows"].append(row)
        res["complete"] = i == len(batches) - 1
        print(json.dumps({k: v for k, v in row.items() if k != "top"}), flush=True)
        for r in row["top"][:15]:
            print("   ", json.dumps(r), flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
