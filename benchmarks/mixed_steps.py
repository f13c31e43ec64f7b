"""Prefill, mixed, verification and decode steps: wall, device-busy and host time, step graphs
against eager.

Model: `--config tiny` (the built-in tiny dims), `mid` (bench_model's: real head / rope / indexer
dims, 4 layers sliding / CSA 4 / HCA 128 / CSA 4), or `flash` (e2e_decode's: DSV4-Flash dims,
`--layers` cycling the same four kinds, `--experts` routed experts; `--weights official`: FP8
projections and packed FP4 experts where the bound ops read them, as e2e_decode); random weights
drawn on `--device`, bound to `--backend`. B requests of `--context` tokens are prefilled once;
every timed step runs on forks of them (released after it), so each step starts from the same state:

  prefill  one request, a chunk of C new tokens, the logits of its last row;
  mixed    B - 1 decode tokens + one chunk of C (logits rows: each request's last, as `generate`);
  verify   B requests x (1 + k) tokens, every row's logits and hidden rows (speculative verification);
  decode   B requests x 1 token (a pure decode step).

Per mode ("graph": `use_graphs`, the JSON's `graph_status` is `graph_status(last_step=True)`: ''
when the step replayed a graph, else why it ran eagerly; then "eager": `use_graphs = False`), over
`--steps` steps after one warm-up step (which records the graph): `<mode>_ms`, the median wall time
from `forward_batch` to its logits on the host; `<mode>_host_ms`, the median time `forward_batch`
holds the host before it returns (the device may still be working); and on a CUDA device
`<mode>_busy_ms`, the summed device time of one more step under torch.profiler, with
`<mode>_wall_over_busy`.

    python benchmarks/mixed_steps.py --device cpu --config tiny --steps 3
    python benchmarks/mixed_steps.py --device cuda --backend cuda --config mid --json FILE
    python benchmarks/mixed_steps.py --device cuda --backend cuda --config flash --layers 43 --experts 32 \
        --requests 32 --chunks 512,2048,8192 --weights official --json FILE

Measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def build(args, dtype: torch.dtype):
    """(model, meta): the model of ``args.config`` with random weights, and how it was built."""
    from dsv4core.model.api import TINY_CONFIG, build_model

    if args.config != "flash":
        from bench_model import CONFIGS

        cfg = dict(TINY_CONFIG, **(CONFIGS[args.config] or {}))
        return build_model(cfg, dtype=dtype, device=args.device, backend=args.backend, seed=0), {}
    from e2e_decode import config_dict, quantize_official_, randomize_on_device_

    from dsv4core.model import DSV4Config

    dev = torch.device(args.device)
    cfg = DSV4Config.from_dict(config_dict("flash", args.layers, args.experts))
    m = build_model(cfg, dtype=dtype, device=dev, backend=args.backend, seed=None)
    randomize_on_device_(m, cfg, seed=0)
    meta = {"layers": args.layers, "experts": cfg.n_routed_experts, "weights": args.weights}
    if args.weights == "official":
        q = quantize_official_(m, dev)
        meta["quantization"] = {"kept": q["kept"], "declined": q["declined"]}
    return m, meta


def _step(m, base, case: str, C: int, k: int):
    """(ids, positions, request ids, states, logits rows, hidden rows) of one step on forks of base."""
    sts = [s.fork() for s in (base[:1] if case == "prefill" else base)]
    V = m.config.vocab_size
    counts = {"prefill": [C], "mixed": [1] * (len(sts) - 1) + [C], "verify": [1 + k] * len(sts),
              "decode": [1] * len(sts)}[case]
    pos = torch.cat([torch.arange(s.length, s.length + c) for s, c in zip(sts, counts)])
    rid = torch.cat([torch.full((c,), j) for j, c in enumerate(counts)])
    ids = torch.randint(2, V, (pos.numel(),), generator=torch.Generator().manual_seed(1))
    ends = torch.cumsum(torch.tensor(counts), 0) - 1
    if case == "verify":
        return ids, pos, rid, sts, None, torch.arange(pos.numel())
    return ids, pos, rid, sts, ends, None


def measure(m, base, case: str, C: int, k: int, steps: int) -> dict:
    from e2e_decode import profile_step

    row = {"case": case, "requests": 1 if case == "prefill" else len(base), "chunk": C, "k": k}
    for mode in ("graph", "eager"):
        m.use_graphs = mode == "graph"
        def step(times=None):
            ids, pos, rid, sts, rows, hrows = _step(m, base, case, C, k)
            t0 = time.perf_counter()
            out = m.forward_batch(ids, pos, rid, sts, logits_rows=rows, hidden_rows=hrows)
            t1 = time.perf_counter()
            (out[0] if isinstance(out, tuple) else out).sum().item()      # the logits on the host
            if times is not None:
                times.append((time.perf_counter() - t0, t1 - t0))
            for s in sts:
                s.release()
            return int(pos.numel())

        times = []
        for i in range(steps + 1):
            row["tokens"] = step(times if i else None)
        row[f"{mode}_ms"] = round(1e3 * statistics.median(t for t, _ in times), 3)
        row[f"{mode}_host_ms"] = round(1e3 * statistics.median(h for _, h in times), 3)
        if mode == "graph":
            row["graph_status"] = m.graph_status(last_step=True)
        busy = profile_step(step, m.device)["busy_ms"]
        if busy != "n/a":
            row[f"{mode}_busy_ms"] = round(busy, 3)
            row[f"{mode}_wall_over_busy"] = round(row[f"{mode}_ms"] / busy, 3)
    row["eager_over_graph"] = round(row["eager_ms"] / row["graph_ms"], 3)
    print(json.dumps(row), flush=True)
    return row


def model_args(ap, layers: int) -> None:
    """The model options of the step benchmarks (`build` reads them): --config, --layers (flash; default
    ``layers``), --experts, --weights, --device, --backend, --dtype."""
    ap.add_argument("--config", default="tiny", choices=["tiny", "mid", "flash"])
    ap.add_argument("--layers", type=int, default=layers, help="flash: layers")
    ap.add_argument("--experts", type=int, default=None, help="flash: routed experts (default: Flash's 256)")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "official"], help="flash: weight formats")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    model_args(ap, layers=43)
    ap.add_argument("--cases", default="prefill,mixed,verify,decode")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunks", default="64,512", help="prefill chunk sizes C")
    ap.add_argument("--k", type=int, default=3, help="drafts per request in the verify case")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with torch.no_grad():
        m, meta = build(args, getattr(torch, args.dtype))
    meta["build_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(meta), flush=True)
    cases = args.cases.split(",")
    chunks = [int(c) for c in args.chunks.split(",")]
    m.configure_cache(max_requests=3 * args.requests, max_tokens=4 * args.requests * (args.context + max(chunks)),
                      max_request_tokens=args.context + max(chunks) + args.k + 1,
                      max_step_tokens=max(8192, max(chunks) + args.requests))
    m.use_graphs = False
    base = [m.new_state() for _ in range(args.requests)]
    for j, s in enumerate(base):
        n = args.context
        ids = torch.randint(2, m.config.vocab_size, (n,), generator=torch.Generator().manual_seed(10 + j))
        for a in range(0, n, 4096):
            b = min(n, a + 4096)
            m.forward_batch(ids[a:b], torch.arange(a, b), torch.zeros(b - a, dtype=torch.long), [s])
    plan = [(c, 0) for c in ("decode",) if c in cases]
    plan += [(c, C) for C in chunks for c in ("mixed", "prefill") if c in cases]
    plan += [(c, 0) for c in ("verify",) if c in cases]
    res = {"what": "prefill / mixed / verify / decode steps: wall, host and device-busy ms, step graphs against eager",
           "config": args.config, **meta, "device": str(m.device), "backend": m.hal_report()[0].get("backend"),
           "dtype": args.dtype, "requests": args.requests, "context": args.context,
           "step_graph_buckets": list(m.step_graph_buckets), "torch": torch.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "complete": False, "rows": []}
    for i, (c, C) in enumerate(plan):     # written after every row: a run cut short keeps its rows
        res["rows"].append(measure(m, base, c, C, args.k, args.steps))
        res["complete"] = i == len(plan) - 1
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
