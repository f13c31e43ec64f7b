"""Where a verified step's time goes: one step run as whole-step verify runs a sampled step
(eagerly, every op call checked against the reference), against the same step replayed as a graph
and run eagerly unchecked, with the check time split per op: the reference in the call dtype, its
fp64 evaluation and the comparison (``compare.expected_outputs`` / ``eval64`` / ``judge``, timed
with the device synchronised around each).

    python benchmarks/verify_checks.py --config tiny --cases decode --requests 2 --context 64
    python benchmarks/verify_checks.py --device cuda --config flash --layers 4 --experts 32 \\
        --cases decode,prefill --json .../bench/verify-checks-flash-4layers-bf16.json

``predicted_ratio`` is what whole-step sampling at each fraction f would cost against plain graph
replays of this step: ``(1 - f) + f * checked_ms / graph_ms`` (the draw itself costs nothing a
step). Measured, never asserted; a row is written after every case.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


class CheckClock:
    """Per-op time of the verify checks: the device synchronised before and after each timed part."""

    PARTS = ("expected_outputs", "eval64", "judge")

    def __init__(self, dev: torch.device) -> None:
        from dsv4core.hal import compare

        self.compare, self.dev = compare, dev
        self.orig = {p: getattr(compare, p) for p in self.PARTS}
        self.t = collections.defaultdict(lambda: dict.fromkeys(("calls",) + self.PARTS, 0.0))

    def _sync(self) -> None:
        if self.dev.type != "cpu":
            getattr(torch, self.dev.type).synchronize()

    def __enter__(self):
        for p in self.PARTS:
            setattr(self.compare, p, self._timed(p, self.orig[p]))
        return self

    def __exit__(self, *exc) -> None:
        for p, f in self.orig.items():
            setattr(self.compare, p, f)

    def _timed(self, part, fn):
        def timed(spec, *a, **k):
            self._sync()
            t0 = time.perf_counter()
            try:
                return fn(spec, *a, **k)
            finally:
                self._sync()
                row = self.t[spec.name]
                row[part] += time.perf_counter() - t0
                row["calls"] += part == "expected_outputs"
        return timed

    def rows(self) -> list[dict]:
        out = []
        for op, r in sorted(self.t.items(), key=lambda kv: -(kv[1]["expected_outputs"] + kv[1]["judge"])):
            total = r["expected_outputs"] + r["judge"]
            out.append({"op": op, "calls": int(r["calls"]), "ms": round(1e3 * total, 2),
                        "reference_ms": round(1e3 * (r["expected_outputs"] - r["eval64"]), 2),
                        "eval64_ms": round(1e3 * r["eval64"], 2), "judge_ms": round(1e3 * r["judge"], 2),
                        "ms_per_call": round(1e3 * total / max(1, r["calls"]), 3)})
        return out


def _sync(dev: torch.device) -> None:
    if dev.type != "cpu":
        getattr(torch, dev.type).synchronize()


def measure(m, base, case: str, C: int, steps: int, fractions) -> dict:
    from mixed_steps import _step

    dev = m.device
    whole = m.ops.whole_steps() if m.graph_status() == "" else None
    plain_table = whole.plain if whole is not None else m.ops.unverified()
    row = {"case": case, "requests": 1 if case == "prefill" else len(base), "chunk": C}

    def step(draw: bool, graphs: bool, plain: bool = False):
        ids, pos, rid, sts, rows, hrows = _step(m, base, case, C, 0)
        m.use_graphs = graphs
        if whole is not None:
            whole._draw = (lambda: True) if draw else (lambda: False)
        _sync(dev)
        t0 = time.perf_counter()
        if plain:
            with m._ops.using(plain_table):
                out = m.forward_batch(ids, pos, rid, sts, logits_rows=rows)
        else:
            out = m.forward_batch(ids, pos, rid, sts, logits_rows=rows)
        out.sum().item()
        t = time.perf_counter() - t0
        for s in sts:
            s.release()
        row["tokens"] = int(pos.numel())
        return t

    runs = {"graph": (False, True, False), "eager": (False, False, True)}
    for name, (draw, graphs, plain) in runs.items():
        if whole is None and name == "graph":
            continue
        ts = [step(draw, graphs, plain) for _ in range(steps + 1)][1:]
        row[f"{name}_ms"] = round(1e3 * statistics.median(ts), 3)
    step(True, True)                          # warm-up of the checked path (reference kernels)
    with CheckClock(dev) as clock:
        t = step(True, True)
    row["checked_ms"] = round(1e3 * t, 3)
    row["graph_status"] = m.graph_status(last_step=True) if whole is not None else m.graph_status()
    row["ops"] = clock.rows()
    row["checks"] = sum(r["calls"] for r in row["ops"])
    row["check_ms"] = round(sum(r["ms"] for r in row["ops"]), 2)
    base_ms = row.get("graph_ms", row["eager_ms"])
    row["checked_over_plain"] = round(row["checked_ms"] / base_ms, 2)
    row["predicted_ratio"] = {str(f): round((1 - f) + f * row["checked_ms"] / base_ms, 3) for f in fractions}
    print(json.dumps({k: v for k, v in row.items() if k != "ops"}), flush=True)
    for r in row["ops"][:8]:
        print("   ", json.dumps(r), flush=True)
    return row


def main(argv=None) -> int:
    from mixed_steps import model_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_args(ap, layers=4)
    ap.add_argument("--cases", default="decode,prefill")
    ap.add_argument("--requests", type=int, default=8, help="decode requests")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk tokens")
    ap.add_argument("--steps", type=int, default=5, help="timed repeats of the graph / eager step")
    ap.add_argument("--fractions", default="0.01,0.1")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    os.environ["DSV4CORE_VERIFY"] = "1"          # every call of a sampled step checked
    from mixed_steps import build

    t0 = time.perf_counter()
    with torch.no_grad():
        m, meta = build(args, getattr(torch, args.dtype))
    meta["build_s"] = round(time.perf_counter() - t0, 1)
    whole = m.ops.whole_steps() if m.graph_status() == "" else None
    if whole is None:
        print("no graph capture on this device: per-call sampling, every call checked (fraction 1)", flush=True)
    else:
        whole._draw = lambda: False           # the context prefill replays unverified
    m.configure_cache(max_requests=3 * args.requests, max_tokens=4 * args.requests * (args.context + args.chunk),
                      max_request_tokens=args.context + args.chunk + 1,
                      max_step_tokens=max(args.chunk + args.requests, 1024))
    base = [m.new_state() for _ in range(args.requests)]
    with torch.no_grad():
        for j, s in enumerate(base):
            ids = torch.randint(2, m.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(10 + j))
            for a in range(0, args.context, 1024):
                b = min(args.context, a + 1024)
                m.forward_batch(ids[a:b], torch.arange(a, b), torch.zeros(b - a, dtype=torch.long), [s])
    fractions = [float(f) for f in args.fractions.split(",")]
    res = {"what": "a whole-step verify sampled step (eager, every call checked) against graph replay and eager, "
                   "check time per op", "config": args.config, **meta, "device": str(m.device),
           "backend": m.hal_report()[0].get("backend"), "dtype": args.dtype, "context": args.context,
           "torch": torch.__version__, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "complete": False, "rows": []}
    plan = [(c, args.chunk if c == "prefill" else 0) for c in args.cases.split(",")]
    for i, (c, C) in enumerate(plan):
        with torch.no_grad():
            res["rows"].append(measure(m, base, c, C, args.steps, fractions))
        res["complete"] = i == len(plan) - 1
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
