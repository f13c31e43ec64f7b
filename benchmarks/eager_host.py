"""Host cost per layer of an eager decode step on the Triton kernel path, the kernels not run.

The GPU's eager step is bound by the host (Python) work that issues its kernels. This measures
that work on the CPU with the device work taken out: the model (Flash dims by default: hidden
4096, 64 heads x 512, indexer 64 x 128, window 128; `--layers` cycling sliding / CSA / HCA / CSA,
`--experts` routed experts, a small vocabulary; bf16, weights left unset) is bound to the portable
Triton kernels registered for CPU tensors with the CUDA plugin's sm90 launch table, in the branch
a GPU runs (`aot.device_branch`: no interpreter paths, 2 programs per SM of an H200); every
`kernel[grid](...)` is recorded and returns at once (Triton's own launcher, its argument binding
and the driver call are not part of it: `triton_launch_not_timed`). The top-k kernel's output is
filled with -1 (no pick) so that the glue indexing with it stays in range; that fill is timed and
subtracted. So what is timed is the model core, the HAL dispatch and the kernel modules' launcher
code up to the launch, on the CPU tensors a GPU step would hold on the device.

Per batch (`--batches`, one token a request, after a 64-token prefill each):
  * `layers_ms`: the median of `--steps` eager steps of the time from the first layer's start to
    the last layer's end; `per_layer_ms` = that / layers; `step_ms` the whole `forward_batch`;
    `*_cpu_ms`: the same in this thread's CPU time (`time.thread_time`: less disturbed by other
    work on a shared machine than the wall time; the figures to compare);
  * `torch_calls_per_layer`: the torch functions a step calls (tensor attribute reads included;
    counted, so not disturbed) / layers; `python_calls_per_layer`, `builtin_calls_per_layer`: the
    Python-level and built-in (C: torch ops, dict / len / isinstance ...) function calls a step
    makes (a profile hook counts them) / layers: the host work in counts, which the load of a
    shared machine does not change;
  * `launches_per_layer`: recorded kernel launches of one step / layers (the lm head's and
    hc_head's included: a few a step);
  * at batch 1 only, `breakdown`: per op, calls a layer, host us a layer inside the bound op
    (dispatch + launcher) and inside the kernel function (launcher), from one instrumented pass
    (a counting proxy adds its own cost there: read the shares, not the sum).

    python benchmarks/eager_host.py                                   # this checkout, JSON on stdout
    python benchmarks/eager_host.py --compare before=/path/to/old/checkout after=. --rounds 3 \\
        --json benchmarks/results/cpu/<date>_<commit>/bench/eager-host-per-layer-flash.json

`--compare` runs each checkout (PYTHONPATH=that checkout and its plugins) in its own process
(`NAME@COMMIT=PATH` names the commit of a checkout without git metadata, e.g. a `git archive`),
alternating, for `--rounds` rounds, and keeps per figure the minimum over rounds (the machine is
shared). Measured, never asserted.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from decode_host_scaling import _count_torch_calls   # the torch calls of one step, counted
from host_overhead import _merge                  # per figure, the minimum over runs


def _setup(layers: int, experts: int, vocab: int):
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import jit

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from e2e_decode import DSV4Config, config_dict

    from dsv4core.hal import Backend, bind, discover
    from dsv4core.hal.discovery import _status_for
    from dsv4core.kernels.triton import aot, registry
    from dsv4core.model.api import build_model
    from dsv4core_cuda.launch import TABLES

    rec = {"launches": collections.Counter(), "fill_s": 0.0}

    def run(self, *args, grid, warmup, **kwargs):      # the launch: recorded, nothing run
        rec["launches"][self.fn.__name__] += 1
        if self.fn.__name__ == "_topk_kernel":         # no pick: the glue's gathers stay in range
            t0 = time.perf_counter()
            args[2].fill_(-1)
            rec["fill_s"] += time.perf_counter() - t0

    jit.JITFunction.run = run
    statuses = discover()
    b = Backend(name="eager-host-triton", device_types=("cpu",), priority=-1)
    registry.register_ops(b, "cpu", launch=TABLES.resolve("sm90"))
    statuses[b.name] = _status_for(b, "benchmark")
    ops = bind("cpu", backend=b.name, policy="allow", check=False)
    branch = aot.device_branch(GPUTarget("cuda", 90, 32))
    branch.__enter__()                                  # for the whole process
    d = config_dict("flash", layers, experts)
    d["vocab_size"] = vocab
    model = build_model(DSV4Config.from_dict(d), dtype=torch.bfloat16, ops=ops, seed=None)
    model.use_graphs = False
    return model, ops, rec


def _timed_layers(model, marks):
    layers = model.model.layers
    first, last = layers[0], layers[-1]
    f_first, f_last = first.forward, last.forward

    def a(*args, **kw):
        marks["l0"], marks["c0"] = time.perf_counter(), time.thread_time()
        return f_first(*args, **kw)

    def z(*args, **kw):
        try:
            return f_last(*args, **kw)
        finally:
            marks["l1"], marks["c1"] = time.perf_counter(), time.thread_time()
    first.forward, last.forward = a, z


def measure(batches, steps: int, layers: int, experts: int, vocab: int) -> dict:
    import torch

    torch.set_num_threads(1)
    model, ops, rec = _setup(layers, experts, vocab)
    marks: dict = {}
    _timed_layers(model, marks)
    out = {"layers": layers, "experts": experts, "vocab": vocab, "batches": {}}
    for B in batches:
        model.configure_cache(max_requests=B, max_tokens=B * 1024, max_request_tokens=1024, max_step_tokens=256)
        sts = [model.new_state() for _ in range(B)]
        for st in sts:
            model.forward_batch(torch.randint(0, vocab, (64,)), torch.arange(64), torch.zeros(64, dtype=torch.long),
                                [st])

        def step():
            model.forward_batch(torch.full((B,), 5), torch.tensor([s.length for s in sts]), torch.arange(B), sts)
        for _ in range(3):
            step()
        rec["launches"].clear()
        step()
        launches = sum(rec["launches"].values())
        lay, cpu, tot = [], [], []
        for _ in range(steps):
            rec["fill_s"] = 0.0
            t0 = time.perf_counter()
            step()
            t1 = time.perf_counter()
            lay.append(marks["l1"] - marks["l0"] - rec["fill_s"])
            cpu.append(marks["c1"] - marks["c0"] - rec["fill_s"])
            tot.append(t1 - t0 - rec["fill_s"])
        row = {"layers_ms": 1e3 * statistics.median(lay), "layers_cpu_ms": 1e3 * statistics.median(cpu),
               "step_ms": 1e3 * statistics.median(tot), "launches_per_layer": launches / layers,
               "torch_calls_per_layer": _count_torch_calls(step) / layers}
        calls = _calls(step)
        row["python_calls_per_layer"] = calls["python"] / layers
        row["builtin_calls_per_layer"] = calls["builtin"] / layers
        row["per_layer_ms"] = row["layers_ms"] / layers
        row["per_layer_cpu_ms"] = row["layers_cpu_ms"] / layers
        if B == batches[0]:
            row["breakdown"] = _breakdown(model, ops, step, layers)
        out["batches"][str(B)] = row
        for st in sts:
            st.release()
    out["fallbacks"] = {r["op"]: r["runtime_fallbacks"] for r in ops.report() if r["runtime_fallbacks"]}
    return out


def _calls(step) -> dict:
    """Function calls one step makes, counted with a profile hook (deterministic, unlike the
    timings on a shared machine): Python functions and built-in / C functions (torch's included)."""
    n = {"python": 0, "builtin": 0}

    def hook(frame, event, arg):
        if event == "call":
            n["python"] += 1
        elif event == "c_call":
            n["builtin"] += 1
    sys.setprofile(hook)
    try:
        step()
    finally:
        sys.setprofile(None)
    return n


def _breakdown(model, ops, step, layers: int, n: int = 10) -> dict:
    from dsv4core.kernels.triton import registry

    hal, ker, calls = collections.Counter(), collections.Counter(), collections.Counter()

    class Proxy:
        def __getattr__(self, name):
            fn = getattr(ops, name)
            if name not in ops.bindings:
                return fn

            def timed(*a, **k):
                calls[name] += 1
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    hal[name] += time.perf_counter() - t0
            return timed

    saved = dict(registry.KERNELS)

    def wrap(op, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                ker[op] += time.perf_counter() - t0
        return timed
    # the lazy wrappers read KERNELS once: rebind them through a fresh table with the same impls
    from dsv4core.hal import Backend, bind, discover
    from dsv4core.hal.discovery import _status_for
    from dsv4core_cuda.launch import TABLES

    for op, fn in saved.items():
        registry.KERNELS[op] = wrap(op, fn)
    b = Backend(name="eager-host-triton-timed", device_types=("cpu",), priority=-1)
    registry.register_ops(b, "cpu", launch=TABLES.resolve("sm90"))
    discover()[b.name] = _status_for(b, "benchmark")
    timed_ops = bind("cpu", backend=b.name, policy="allow", check=False)
    ops_saved, ops = ops, timed_ops
    model._ops.t = Proxy()
    try:
        step()
        hal.clear(), ker.clear(), calls.clear()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        wall = (time.perf_counter() - t0) / n
    finally:
        model._ops.t = ops_saved
        registry.KERNELS.update(saved)
    per = n * layers
    return {"instrumented_step_ms": 1e3 * wall,
            "in_ops_ms": 1e3 * sum(hal.values()) / n, "in_kernel_functions_ms": 1e3 * sum(ker.values()) / n,
            "ops": {op: {"calls_per_layer": calls[op] / per, "op_us_per_layer": 1e6 * hal[op] / per,
                         "kernel_function_us_per_layer": 1e6 * ker[op] / per}
                    for op in sorted(hal, key=lambda o: -hal[o])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--compare", nargs="+", metavar="NAME=CHECKOUT")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the result here too")
    a = ap.parse_args()
    batches = [int(x) for x in a.batches.split(",")]
    if not a.compare:
        res = measure(batches, a.steps, a.layers, a.experts, a.vocab)
    else:
        named = [c.split("=", 1) for c in a.compare]
        runs: dict = {name.split("@")[0]: [] for name, _ in named}
        for r in range(a.rounds):
            for name, path in named:
                root = os.path.abspath(path)
                plugins = [os.path.join(root, "plugins", p) for p in ("cuda", "rocm", "ascend", "xpu")]
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([root] + plugins), OMP_NUM_THREADS="1")
                env.pop("TRITON_INTERPRET", None)
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--batches", a.batches,
                                       "--steps", str(a.steps), "--layers", str(a.layers), "--experts",
                                       str(a.experts), "--vocab", str(a.vocab)],
                                      env=env, capture_output=True, text=True, check=True, cwd=root)
                runs[name.split("@")[0]].append(json.loads(proc.stdout))
                print(f"round {r + 1}/{a.rounds} {name}: done", file=sys.stderr, flush=True)
        res = {"what": "eager decode step host time per layer on the Triton kernel path, launches recorded "
                       "not run (benchmarks/eager_host.py; Flash dims, CPU, 1 torch thread; checkouts "
                       "alternate in one run, per figure the minimum over rounds)",
               "rounds": a.rounds, "steps": a.steps, "triton_launch_not_timed": True,
               "python": platform.python_version(), "checkouts": {n: _merge(r) for n, r in runs.items()}}
        for name, _ in named:
            if "@" in name:
                res["checkouts"][name.split("@")[0]]["commit"] = name.split("@", 1)[1]
        for name, path in named:
            if "@" in name:                  # NAME@COMMIT=PATH: a checkout without git metadata (an export)
                continue
            try:
                res["checkouts"][name]["commit"] = subprocess.run(
                    ["git", "rev-parse", "--short", "HEAD"], cwd=path, text=True, capture_output=True,
                    check=True).stdout.strip()
            except (OSError, subprocess.CalledProcessError):
                pass
    text = json.dumps(res, indent=1)
    print(text)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
