"""Host (Python) cost of the HAL's dispatch path: per op call, and per layer of an eager step.

CPU, one torch thread, tiny tensors (compute negligible). Two parts:

* ``ops``: per op (every non-collective op, its smallest non-empty sample case), microseconds a
  call through each path, on an implementation that returns at once, so that only the path is
  timed (``direct``: that function called as a plain function):
    bound      the op table's attribute (the model's hot path; the reference backend's binding)
    checked    the same with input validation on (``check=True``: ``DSV4CORE_CHECK=1`` / strict)
    triton     the portable Triton kernels' registration (``registry.register_ops``: the op's
               ``supports`` predicate, the lazy wrapper, the launch table made active) with the
               kernel replaced by that function (needs triton importable; no kernel runs)
  ``*_us`` minus ``direct_us`` is what the path adds per call.
* ``step``: the tiny model (reference backend) running eager decode steps at batch 1: wall ms a
  step, op calls a layer (counted), the same step with validation on, and, per layer, the
  validation's measured cost and the dispatch cost the ``ops`` figures give for those calls.

    python benchmarks/host_overhead.py                          # this checkout: JSON on stdout
    python benchmarks/host_overhead.py --compare before=/path/to/old/checkout after=. --rounds 3 \\
        --json benchmarks/results/cpu/<date>_<commit>/bench/host-overhead-dispatch.json

``--compare`` runs each checkout (PYTHONPATH=that checkout) in its own process, alternating, for
``--rounds`` rounds, and keeps per figure the minimum over rounds (the machine is shared). Measured,
never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import timeit


def _best_us(fn, number: int, repeat: int = 5) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def _case(spec):
    import torch

    best = None
    for c in spec.sample_cases("small", torch.float32):
        ts = [v for v in c.kwargs.values() if isinstance(v, torch.Tensor)]
        if not ts or any(t.numel() == 0 for t in ts):
            continue
        size = sum(t.numel() for t in ts)
        if best is None or size < best[0]:
            best = (size, c)
    return None if best is None else best[1]


def _args(spec, kwargs):
    """The case's arguments as the model passes them: positional in signature order, defaults left out."""
    args = []
    for name, p in spec.signature.parameters.items():
        if name not in kwargs:
            break
        args.append(kwargs[name])
    return tuple(args)


def measure_ops(calls: int) -> dict:
    import torch

    from dsv4core.hal import Backend, bind, catalogue, discover, reset
    from dsv4core.hal.discovery import _status_for

    specs = {n: s for n, s in catalogue().items() if s.family != "collectives"}
    reset()
    statuses = discover()
    fake = Backend(name="host-overhead", device_types=("cpu",), priority=-1)
    fns = {}
    for name, spec in specs.items():
        def fn(*a, **k):
            return None
        fn.__signature__ = spec.signature
        fn.__name__ = name
        fns[name] = fn
        fake.add(name, fn)
    statuses[fake.name] = _status_for(fake, "benchmark")
    bound = bind("cpu", backend="host-overhead", policy="allow", check=False)
    checked = bind("cpu", backend="host-overhead", policy="allow", check=True)

    triton, why = None, ""
    try:
        import importlib

        from dsv4core.kernels.triton import OPS, registry

        for mod in set(OPS.values()):
            importlib.import_module(f"dsv4core.kernels.triton.{mod}")
        kernels = Backend(name="host-overhead-triton", device_types=("cpu",), priority=-1)
        registry.register_ops(kernels, "cpu", ops=set(OPS) & set(specs))
        for name in kernels.impls:
            registry.KERNELS[name] = fns[name]        # the kernel replaced: only the path runs
        statuses[kernels.name] = _status_for(kernels, "benchmark")
        triton = bind("cpu", backend="host-overhead-triton", policy="allow", check=False)
    except ImportError as e:
        why = f"{type(e).__name__}: {e}"

    out = {}
    for name, spec in specs.items():
        case = _case(spec)
        if case is None:
            continue
        a = _args(spec, case.kwargs)
        row = {"case": case.name}
        fn = fns[name]
        row["direct_us"] = _best_us(lambda: fn(*a), calls)
        f = getattr(bound, name)
        row["bound_us"] = _best_us(lambda: f(*a), calls)
        f = getattr(checked, name)
        checked.bindings[name].call(*a)              # a first call (e.g. a cache's miss) is not timed
        row["checked_us"] = _best_us(lambda: f(*a), max(1, calls // 10))
        if triton is not None and name in triton.bindings and triton.bindings[name].backend == "host-overhead-triton":
            f = getattr(triton, name)
            f(*a)
            if triton.bindings[name].runtime_fallbacks == 0:     # its predicate accepted the case
                row["triton_us"] = _best_us(lambda: f(*a), calls)
        out[name] = row
    reset()
    return {"ops": out, "triton_path": "measured" if triton is not None else f"not measured ({why})"}


class _Counter:
    """Stands in for the op table: counts the op calls, then calls the real one."""

    def __init__(self, table, counts):
        self._table, self._counts = table, counts

    def __getattr__(self, name):
        fn = getattr(self._table, name)
        if not callable(fn) or name.startswith("_") or name not in self._table.bindings:
            return fn
        counts = self._counts

        def counted(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)
        return counted


def measure_step(steps: int) -> dict:
    import torch

    import dsv4core
    from dsv4core.hal import bind

    m = dsv4core.load_model("tiny", backend="reference")
    layers = m.config.num_hidden_layers
    st = m.new_state()
    ids = torch.randint(2, 250, (64,), generator=torch.Generator().manual_seed(0))
    m.forward_batch(ids, torch.arange(64), torch.zeros(64, dtype=torch.long), [st])
    plain = m._ops.t
    checked = bind("cpu", backend="reference", policy="allow", check=True)

    def step():
        m.forward_batch(torch.tensor([5]), torch.tensor([st.length]), torch.zeros(1, dtype=torch.long), [st])

    counts: dict = {}
    m._ops.t = _Counter(plain, counts)
    step()
    m._ops.t = plain
    out = {"layers": layers, "op_calls_per_layer": {k: v / layers for k, v in sorted(counts.items())}}
    times = {}
    for label, table in (("plain", plain), ("checked", checked)) * 2:   # alternating, twice
        m._ops.t = table
        for _ in range(2):
            step()
        best = []
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            best.append(time.perf_counter() - t0)
        times[label] = min(times.get(label, 1e9), min(best) * 1e3)
    m._ops.t = plain
    out["step_ms"] = times["plain"]
    out["step_checked_ms"] = times["checked"]
    out["validation_us_per_layer"] = (times["checked"] - times["plain"]) * 1e3 / layers
    return out


def measure(calls: int, steps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    import dsv4core

    res = {"dsv4core": os.path.dirname(os.path.dirname(dsv4core.__file__)), "torch": torch.__version__,
           "python": platform.python_version()}
    res.update(measure_ops(calls))
    res["step"] = measure_step(steps)
    per_layer = res["step"]["op_calls_per_layer"]
    for path in ("bound", "checked", "triton"):
        key = f"{path}_us"
        if all(key in res["ops"].get(op, {}) for op in per_layer if op in res["ops"]):
            res["step"][f"{path}_dispatch_us_per_layer"] = sum(
                n * (res["ops"][op][key] - res["ops"][op]["direct_us"]) for op, n in per_layer.items() if op in res["ops"])
    return res


def _merge(runs: list[dict]) -> dict:
    """Per numeric figure, the minimum over runs (the rest from the first run)."""
    def merge(vals):
        if all(isinstance(v, dict) for v in vals):
            keys = [k for k in vals[0] if all(k in v for v in vals)]
            return {k: merge([v[k] for v in vals]) for k in keys}
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            return min(vals)
        return vals[0]
    return merge(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=20_000, help="calls per timing (validated: a tenth)")
    ap.add_argument("--steps", type=int, default=10, help="timed decode steps per table")
    ap.add_argument("--compare", nargs="+", metavar="NAME=CHECKOUT", help="checkouts to measure, alternating")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the result here too")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.compare:
        res = measure(args.calls, args.steps)
    else:
        named = [c.split("=", 1) for c in args.compare]
        runs: dict = {name: [] for name, _ in named}
        for _ in range(args.rounds):
            for name, path in named:
                root = os.path.abspath(path)
                plugins = [os.path.join(root, "plugins", p) for p in ("cuda", "rocm", "ascend", "xpu")]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + plugins), OMP_NUM_THREADS="1")
                proc = subprocess.run([sys.executable, __file__, "--worker", "--calls", str(args.calls),
                                       "--steps", str(args.steps)], env=env, capture_output=True, text=True,
                                      check=True)
                runs[name].append(json.loads(proc.stdout))
        res = {"rounds": args.rounds, "calls": args.calls, "steps": args.steps,
               "checkouts": {name: _merge(r) for name, r in runs.items()}}
        for name, path in named:
            try:
                res["checkouts"][name]["commit"] = subprocess.run(
                    ["git", "rev-parse", "--short", "HEAD"], cwd=path, text=True, capture_output=True,
                    check=True).stdout.strip()
            except (OSError, subprocess.CalledProcessError):
                pass
    text = json.dumps(res, indent=1, sort_keys=True)
    print(text)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
