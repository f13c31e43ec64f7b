"""Host work of a decode step vs the number of requests: the tiny model on the CPU (reference
backend, 1 torch thread), decode steps at batch 1 / 8 / 64 (median of `--steps` after 3 warm-up).

Per batch, two paths:
  * eager: the whole step (`step_ms`), split into the host work before the layers (`pre_ms`:
    validation, block staging, table sync, packing the step's metadata), the layers themselves
    (`layers_ms`: on the CPU these are the device work, index builder and ring writes included)
    and the host work after them (`post_ms`: commit); `torch_calls`: the torch functions an
    eager step calls, the mean of 16 steps (one HCA window; counted, not timed, so not disturbed
    by other work on the machine: on a GPU each is a dispatch, most a kernel launch);
  * graph: the decode path a recorded device graph takes, with a stand-in capture whose replay
    does nothing (the CPU has no graph capture): everything it still costs is host work outside
    the replay, split into before the replay (`pre_ms`: validation, staging, bucket, filling the
    static input buffer) and after it (`post_ms`: logits copy, commit).
On the GPU the graph path's host work is what the replay's wall time exceeds its GPU-busy time by
(the target: <= 1.15x).

    python benchmarks/decode_host_scaling.py                      # this checkout, one JSON line
    python benchmarks/decode_host_scaling.py --compare main=/path/to/main this=. --rounds 5 \
        --json benchmarks/results/cpu/<date>_<commit>/bench/decode-host-scaling-tiny.json

`--compare` runs each checkout (PYTHONPATH=that checkout) in its own process, alternating, for
`--rounds` rounds, and keeps the median over rounds of each figure (the machine is shared).
A checkout with the old per-request-state API (eb25adc: no configure_cache) gets `step_ms` only.
Measured, never asserted."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time


def _count_torch_calls(fn) -> int:
    import torch
    from torch.overrides import TorchFunctionMode

    class Count(TorchFunctionMode):
        n = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    with Count():
        fn()
    return Count.n


class _HostOnlyCapture:
    """A graph capture whose replay does nothing: `fn` runs once (its outputs are the static
    outputs a replay would refill), the replay returns at once."""

    def __init__(self, marks: dict) -> None:
        self.marks = marks

    def new_pool(self, device):
        return None

    def capture(self, fn, device, pool=None):
        out = fn()

        def replay():
            self.marks["replay"] = time.perf_counter()
        return replay, out


def measure(batches, steps: int) -> dict:
    import torch
    torch.set_num_threads(1)
    import dsv4core
    m = dsv4core.load_model("tiny", backend="reference")
    out = {"dsv4core": os.path.dirname(os.path.dirname(dsv4core.__file__)), "batches": {}}
    new_api = hasattr(m, "configure_cache")
    marks: dict = {}
    if new_api:
        inner = m._forward

        def timed_forward(*a, **k):
            marks["f0"] = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                marks["f1"] = time.perf_counter()
        m._forward = timed_forward
    for B in batches:
        if new_api:
            m.configure_cache(max_requests=B, max_tokens=B * 512, max_request_tokens=512)
        sts = [m.new_state() for _ in range(B)]
        ids = torch.randint(2, 250, (B * 64,), generator=torch.Generator().manual_seed(0))
        m.forward_batch(ids, torch.arange(64).repeat(B), torch.arange(B).repeat_interleave(64), sts)
        tok = torch.full((B,), 5)
        res = {}
        for mode in ("eager", "graph") if new_api else ("eager",):
            if mode == "graph":
                m._graphs = None
                m._graph_why = ((id(m._ops.t), m.device), "", _HostOnlyCapture(marks))
            rows = []
            for s in range(3 + steps):
                pos = torch.tensor([st.length for st in sts])
                marks.clear()
                t0 = time.perf_counter()
                m.forward_batch(tok, pos, torch.arange(B), sts)
                t1 = time.perf_counter()
                if s < 3:
                    continue
                if mode == "graph":
                    assert "replay" in marks and "f0" not in marks, "graph path not taken"
                    rows.append((t1 - t0, marks["replay"] - t0, t1 - marks["replay"]))
                elif new_api:
                    rows.append((t1 - t0, marks["f0"] - t0, marks["f1"] - marks["f0"], t1 - marks["f1"]))
                else:
                    rows.append((t1 - t0,))
            med = [1e3 * statistics.median(c) for c in zip(*rows)]
            names = {"graph": ("host_ms", "pre_ms", "post_ms")}.get(mode, ("step_ms", "pre_ms", "layers_ms",
                                                                           "post_ms"))
            res[mode] = dict(zip(names, med))
            if mode == "eager":
                res[mode]["torch_calls"] = sum(_count_torch_calls(lambda: m.forward_batch(
                    tok, torch.tensor([st.length for st in sts]), torch.arange(B), sts)) for _ in range(16)) / 16
            if new_api:
                m._graphs, m._graph_why = None, None
        out["batches"][str(B)] = res
        for st in sts:
            getattr(st, "release", lambda: None)()
    return out


def compare(named: list[str], rounds: int, batches: str, steps: int) -> dict:
    runs: dict[str, list] = {}
    for r in range(rounds):
        for item in named:
            name, path = item.split("=", 1)
            env = dict(os.environ, PYTHONPATH=os.path.abspath(path))
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--batches", batches, "--steps", str(steps)],
                               env=env, capture_output=True, text=True, cwd="/", check=True)
            runs.setdefault(name, []).append(json.loads(p.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{rounds} {name}: done", file=sys.stderr, flush=True)
    out = {}
    for name, rs in runs.items():
        agg: dict = {}
        for B in rs[0]["batches"]:
            agg[B] = {mode: {k: statistics.median(x["batches"][B][mode][k] for x in rs) for k in fig}
                      for mode, fig in rs[0]["batches"][B].items()}
            for mode, fig in agg[B].items():       # the least disturbed round (a shared machine)
                fig["min_over_rounds"] = {k: min(x["batches"][B][mode][k] for x in rs) for k in list(fig)}
        b1, bl = agg[min(agg, key=int)], agg[max(agg, key=int)]
        top = max(agg, key=int)
        ratios = {f"{mode}_b{top}_over_b1": bl[mode][next(iter(bl[mode]))] / b1[mode][next(iter(b1[mode]))]
                  for mode in b1}
        git = subprocess.run(["git", "-C", rs[0]["dsv4core"], "describe", "--always", "--dirty"], capture_output=True,
                             text=True)
        out[name] = {"dsv4core": rs[0]["dsv4core"], "commit": git.stdout.strip() or None, "rounds": len(rs),
                     "batches": agg, **ratios}
    return out


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--compare", nargs="+", metavar="NAME=CHECKOUT")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the --compare result here")
    a = ap.parse_args()
    if not a.compare:
        print(json.dumps(measure([int(b) for b in a.batches.split(",")], a.steps)))
        return
    res = compare(a.compare, a.rounds, a.batches, a.steps)
    import torch
    doc = {"what": "tiny model, reference backend, CPU, 1 torch thread: decode step host work at batch "
                   f"{a.batches} (benchmarks/decode_host_scaling.py; per checkout the median over rounds of "
                   "the median of the steps; checkouts alternate in one run)",
           "machine": f"{_cpu_name()}, {os.cpu_count()} cores",
           "torch": torch.__version__, "python": platform.python_version(), "threads": 1, "runs": res}
    text = json.dumps(doc, indent=2)
    print(text)
    if a.json:
        with open(a.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
