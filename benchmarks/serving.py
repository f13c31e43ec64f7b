"""What a server meets: continuous batching of requests that arrive over time, and the time to the
first token of one prompt alone.

Model: as mixed_steps.py (`--config tiny`, `mid`, or `flash` with `--layers`, `--experts`,
`--weights bf16|official`; random weights drawn on `--device`, bound to `--backend`).

1. serving: `--requests` N requests arrive over the run (seeded: exponential gaps of mean
   1 / `--rate` s, the first at 0; `--rate inf`: all at 0), prompts of lengths drawn uniformly
   from `--prompt-range` (random token ids), `--new-tokens` each, greedy. They run through
   `generate`'s scheduler (`dsv4core.model.scheduler.Scheduler`, driven as `generate` drives it)
   with one change, `ArrivalScheduler`: a request is admitted only after its arrival time, and
   when nothing runs and the next request has not arrived, the host waits for it. `on_token`
   stamps every token as the host reads it (a step's tokens are read one step late while steps
   are queued back to back, as a streaming server would send them). Reported: TTFT (arrival ->
   first token), inter-token latency (the gap between consecutive tokens of one request), queue
   time (arrival -> admission), end-to-end latency (arrival -> last token), each p50 / p90 / p99 /
   max in ms; output tok/s over the run (first arrival -> last token); the steps by kind
   (decode: every request one token; prefill: prompt chunks only; mixed: both), how many of them
   ran eagerly (`graph_status(last_step=True)` not ''), and the device graphs recorded before and
   during the timed run. A token is stamped when the host reads it: a step read one step late
   and the next one read at once (the scheduler leaves its queued path to admit a request) make
   a gap near 0, the one before it a step longer. A warm-up run (`--warmup-requests` of the same
   prompts, all at once, a few new tokens each) comes first, so that graph recording and Triton
   compilation are mostly not timed; graphs of shapes first met in a timed run still record
   there (`graphs` in the JSON: before / after). `--runs` R > 1: the same workload R times (the
   JSON's `serving` holds every run; the later ones replay the graphs the first recorded).
2. ttft: for each of `--ttft-lengths`, one random prompt alone, `generate([prompt], 1)`: the wall
   time to its first token (median of `--ttft-reps` after one untimed call), prefill tok/s, and on
   CUDA the device-busy time of one more call under torch.profiler (e2e_decode.profile_step: the
   summed device events of the whole call) with wall / busy.

The cache is configured for each part: part 1 max_requests = `--max-requests` (default N),
max_request_tokens = the longest prompt + new tokens, max_tokens = every request's tokens (all
may be live at once); part 2 one request of the longest length + 1. max_step_tokens =
`--max-step-tokens` (default CacheConfig's); the prefill chunk is `--prefill-chunk` (default: what
`generate` uses, max_step_tokens).

    python benchmarks/serving.py --config tiny --requests 8 --prompt-range 16,200 --new-tokens 8 \
        --ttft-lengths 64,256 --json /tmp/serving.json
    python benchmarks/serving.py --device cuda --backend cuda --config flash --layers 43 --experts 32 \
        --json FILE

Measured, never asserted. --json is rewritten after every part (and every ttft length).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dsv4core.model.inputs import eos_ids  # noqa: E402
from dsv4core.model.scheduler import Scheduler  # noqa: E402

clock = time.perf_counter


class ArrivalScheduler(Scheduler):
    """`Scheduler` whose request i may be admitted only once `arrivals[i]` seconds have passed
    since `t0` (arrivals in request order); with nothing running and the next request not yet
    arrived, `_admit` sleeps until it arrives. Counts the steps by kind."""

    def __init__(self, *args, arrivals, t0, **kw) -> None:
        super().__init__(*args, **kw)
        self.arrivals, self.t0 = arrivals, t0
        self.admitted: dict[int, float] = {}      # request -> admission time (s after t0)
        self.idle_s = 0.0                         # the host waited for an arrival, nothing running
        self.steps, self.eager, self.tokens = Counter(), Counter(), Counter()

    def _arrived(self, i: int) -> bool:
        return clock() - self.t0 >= self.arrivals[i]

    def _can_admit(self) -> bool:
        return bool(self.waiting) and self._arrived(self.waiting[0]) and super()._can_admit()

    def _admit(self) -> None:
        if self.waiting and not self.running:
            delay = self.t0 + self.arrivals[self.waiting[0]] - clock()
            if delay > 0:
                time.sleep(delay)
                self.idle_s += delay
        now = clock() - self.t0
        n = 0
        for i in self.waiting:                    # in arrival order
            if self.arrivals[i] > now:
                break
            n += 1
        later = [self.waiting.pop() for _ in range(len(self.waiting) - n)]
        before = set(self.running)
        try:
            super()._admit()
        finally:
            self.waiting.extend(reversed(later))
        t = clock() - self.t0
        for i in set(self.running) - before:
            self.admitted[i] = t

    def _next(self, ids, pos, rid, states, owners, rows=None):
        owner = {id(st): i for i, (st, _) in self.running.items()}
        pre = sum(st.length < len(self.prompts[owner[id(st)]]) for st in states)
        kind = "decode" if not pre else "prefill" if pre == len(states) else "mixed"
        out = super()._next(ids, pos, rid, states, owners, rows)
        self.steps[kind] += 1
        self.tokens[kind] += len(pos)
        self.eager[kind] += bool(self.model.graph_status(last_step=True))
        return out


def pct(xs) -> dict:
    """min / p50 / p90 / p99 / max / mean of seconds, in ms ({"n": 0} when empty)."""
    if not len(xs):
        return {"n": 0}
    a = 1e3 * np.asarray(xs, dtype=np.float64)
    return {"n": int(a.size), "min": round(float(a.min()), 3), "p50": round(float(np.percentile(a, 50)), 3),
            "p90": round(float(np.percentile(a, 90)), 3), "p99": round(float(np.percentile(a, 99)), 3),
            "max": round(float(a.max()), 3), "mean": round(float(a.mean()), 3)}


def graph_counts(m) -> dict:
    """Recorded device graphs and replay / eager counters of the model's graph sets (informational)."""
    d, s = getattr(m, "_graphs", None), getattr(m, "_step_graphs", None)
    out = {}
    for name, g in (("decode", d), ("step", s)):
        if g is not None and (name == "decode" or g.decode is d):
            out[name] = {"recorded": len(g.graphs), "failed": len(g.failed), "replays": g.replays, "eager": g.eager}
    return out


def workload(args, V: int):
    """(arrival times s, prompts) of the seeded workload."""
    rng = np.random.default_rng(args.seed)
    N = args.requests
    lo, hi = args.prompt_range
    if math.isinf(args.rate):
        arrivals = np.zeros(N)
    else:
        gaps = rng.exponential(1.0 / args.rate, N)
        arrivals = np.cumsum(gaps) - gaps[0]
    lengths = rng.integers(lo, hi + 1, N)
    prompts = [rng.integers(2, V, int(n)).tolist() for n in lengths]
    return arrivals.tolist(), prompts


@torch.no_grad()
def serve(m, prompts, arrivals, new_tokens: int, chunk: int | None) -> dict:
    """One run of the prompts arriving at `arrivals`, driven as `generate` drives its scheduler."""
    cache = m._cache_for([len(p) + new_tokens for p in prompts])
    chunk = min(chunk or cache.cc.max_step_tokens, cache.cc.max_step_tokens)
    stamps: list[list[float]] = [[] for _ in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    before = graph_counts(m)
    t0 = clock()
    sched = ArrivalScheduler(m, cache, prompts, new_tokens, eos_ids(None), chunk, None, None,
                             lambda i, tok: stamps[i].append(clock() - t0), arrivals=arrivals, t0=t0)
    try:
        sched.run(out)
    finally:
        sched.release_all()
    wall = clock() - t0
    ttft = [s[0] - a for s, a in zip(stamps, arrivals) if s]
    itl = [b - a for s in stamps for a, b in zip(s, s[1:])]
    e2e = [s[-1] - a for s, a in zip(stamps, arrivals) if s]
    queue = [sched.admitted[i] - a for i, a in enumerate(arrivals) if i in sched.admitted]
    counts = [len(o) for o in out]
    end = max((s[-1] for s in stamps if s), default=wall)
    return {
        "requests": len(prompts), "prefill_chunk": chunk, "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": sum(counts), "tokens_per_request": {"min": min(counts), "max": max(counts)},
        "all_requests_complete": all(c == new_tokens and len(s) == c for s, c in zip(stamps, counts)),
        "last_arrival_s": round(max(arrivals), 4), "wall_s": round(wall, 4), "idle_s": round(sched.idle_s, 4),
        "output_tok_s": round(sum(counts) / end, 2) if end > 0 else None,
        "total_tok_s": round((sum(counts) + sum(map(len, prompts))) / end, 2) if end > 0 else None,
        "ttft_ms": pct(ttft), "itl_ms": pct(itl), "queue_ms": pct(queue), "e2e_ms": pct(e2e),
        "steps": dict(sched.steps), "step_tokens": dict(sched.tokens), "eager_steps": dict(sched.eager),
        "graph_status_last_step": m.graph_status(last_step=True),
        "graphs": {"before": before, "after": graph_counts(m)},
    }


def ttft_row(m, L: int, reps: int, seed: int, chunk: int | None) -> dict:
    from e2e_decode import profile_step, sync

    dev = m.device
    prompt = np.random.default_rng(seed + L).integers(2, m.config.vocab_size, L).tolist()

    def call():
        return m.generate([prompt], 1, prefill_chunk=chunk)

    call()                                     # untimed: graph recording, compilation at this length
    times = []
    for _ in range(reps):
        sync(dev)
        t0 = clock()
        out = call()                           # the token is on the host when generate returns
        times.append(clock() - t0)
    assert len(out[0]) == 1
    wall = statistics.median(times)
    cc = m.cache.cc
    c = min(chunk or cc.max_step_tokens, cc.max_step_tokens)
    row = {"prompt_tokens": L, "prefill_chunk": c, "steps": -(-L // c), "wall_ms": round(1e3 * wall, 3),
           "wall_ms_all": [round(1e3 * t, 3) for t in times], "prefill_tok_s": round(L / wall, 1),
           "graph_status_last_step": m.graph_status(last_step=True)}
    prof = profile_step(call, dev)
    row["busy_ms"] = prof["busy_ms"] if prof["busy_ms"] == "n/a" else round(prof["busy_ms"], 3)
    if row["busy_ms"] != "n/a":
        row["kernels"] = prof["kernels"]
        row["wall_over_busy"] = round(row["wall_ms"] / row["busy_ms"], 3)
    return row


def _pair(s: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in s.replace("..", ",").split(","))
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want LO,HI with 1 <= LO <= HI; got {s!r}")
    return lo, hi


def main(argv=None) -> int:
    from mixed_steps import model_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_args(ap, layers=43)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=8.0, help="arrivals a second (mean); inf: all at once")
    ap.add_argument("--prompt-range", type=_pair, default=(256, 4096), help="LO,HI prompt tokens (uniform)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="default: what generate uses (max_step_tokens)")
    ap.add_argument("--max-requests", type=int, default=None, help="cache slots (default: --requests)")
    ap.add_argument("--max-step-tokens", type=int, default=8192)
    ap.add_argument("--warmup-requests", type=int, default=8, help="requests of the untimed warm-up run (0: none)")
    ap.add_argument("--runs", type=int, default=1, help="timed runs of the same workload (the later ones replay "
                    "the graphs the first recorded)")
    ap.add_argument("--ttft-lengths", default="1024,8192,32768", help="prompt lengths of part 2 ('' : skip it)")
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.rate <= 0 or min(args.requests, args.new_tokens, args.runs) < 1:
        ap.error("--rate must be > 0, --requests, --new-tokens and --runs >= 1")
    ttft_lengths = [int(v) for v in args.ttft_lengths.split(",") if v.strip()]

    from mixed_steps import build

    t0 = clock()
    with torch.no_grad():
        m, meta = build(args, getattr(torch, args.dtype))
    meta["build_s"] = round(clock() - t0, 1)
    print(json.dumps(meta), flush=True)
    maxpos = m.config.max_position_embeddings
    longest = args.prompt_range[1] + args.new_tokens
    if longest > maxpos or any(L + 1 > maxpos for L in ttft_lengths):
        ap.error(f"prompt + new tokens must fit max_position_embeddings={maxpos}")
    dev = m.device
    res = {"what": "serving: continuous batching with arrivals (TTFT, inter-token latency, tok/s); "
                   "time to first token of one prompt alone",
           "config": args.config, **meta, "device": str(dev),
           "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
           "backend": m.hal_report()[0].get("backend"), "dtype": args.dtype, "graph_status": m.graph_status(),
           "step_graph_buckets": list(m.step_graph_buckets), "graph_buckets": list(m.graph_buckets),
           "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
           "machine": platform.machine(), "threads": torch.get_num_threads(), "argv": sys.argv[1:],
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "workload": {"requests": args.requests, "rate": "inf" if math.isinf(args.rate) else args.rate,
                        "prompt_range": list(args.prompt_range), "new_tokens": args.new_tokens,
                        "seed": args.seed, "warmup_requests": args.warmup_requests},
           "complete": False, "serving": [], "ttft": []}

    def save():
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")

    # part 1: serving with arrivals
    arrivals, prompts = workload(args, m.config.vocab_size)
    cc = dict(max_requests=args.max_requests or args.requests, max_request_tokens=longest,
              max_tokens=max(longest, sum(len(p) for p in prompts) + args.requests * args.new_tokens),
              max_step_tokens=args.max_step_tokens)
    m.configure_cache(**cc)
    res["cache_serving"] = cc
    if args.warmup_requests:
        k = min(args.warmup_requests, args.requests)
        t = clock()
        w = serve(m, prompts[:k], [0.0] * k, min(args.new_tokens, 4), args.prefill_chunk)
        res["warmup"] = {"requests": k, "new_tokens": min(args.new_tokens, 4), "wall_s": round(clock() - t, 3),
                         "steps": w["steps"], "graphs": w["graphs"]["after"]}
        print(json.dumps({"warmup": res["warmup"]}), flush=True)
    for run in range(args.runs):
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        r = serve(m, prompts, arrivals, args.new_tokens, args.prefill_chunk)
        if dev.type == "cuda":
            r["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
        r["graph_status"] = m.graph_status()
        res["serving"].append(r)
        res["complete"] = not ttft_lengths and run == args.runs - 1
        print(json.dumps({"run": run, **{k: r[k] for k in (
            "requests", "prefill_chunk", "output_tokens", "tokens_per_request", "wall_s", "output_tok_s", "ttft_ms",
            "itl_ms", "steps", "eager_steps")}}), flush=True)
        save()

    # part 2: time to first token of one prompt alone
    if ttft_lengths:
        m.configure_cache(max_requests=1, max_request_tokens=max(ttft_lengths) + 1, max_tokens=max(ttft_lengths) + 1,
                          max_step_tokens=args.max_step_tokens)
        for j, L in enumerate(ttft_lengths):
            row = ttft_row(m, L, args.ttft_reps, args.seed, args.prefill_chunk)
            res["ttft"].append(row)
            res["complete"] = j == len(ttft_lengths) - 1
            print(json.dumps(row), flush=True)
            save()
    res["total_s"] = round(clock() - t0, 1)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
