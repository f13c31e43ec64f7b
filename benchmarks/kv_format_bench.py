"""The stored row formats against plain rows, per op, on one device: `sparse_mqa_attention` over a
bf16 pool vs an FP8 KV-row pool, `indexer_scores_rows` over bf16 vs FP4 keys, `cache_store` of
bf16 rows vs FP8 / FP4 encoding (DeepSeek-V4-Flash dims: h 64, d 512, nI 64, dI 128).

    python benchmarks/kv_format_bench.py --backend cuda --json out.json

Device time of each call (10 calls captured in a CUDA graph, replayed --reps times, median; the
pools are larger than L2, the gathered rows random, so the calls mostly miss L2), and the bytes
of a row in each format.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from dsv4core.hal import bind
from dsv4core.hal import rowformats as rf


def timed(fn, reps: int, calls: int = 10) -> float:
    """Device µs of one call: ``calls`` calls captured in a CUDA graph, the graph replayed ``reps``
    times (median), so no host launch cost is counted."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):                 # warm-up (Triton JIT) outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--pool-rows", type=int, default=1 << 18, help="rows of the KV pool (bf16: 256 MiB at 2^18)")
    ap.add_argument("--attention-sweep", action="store_true",
                    help="also the FP8 attention at other (BK, num_stages) launch values")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    ops = bind(dev, backend=a.backend)
    g = torch.Generator().manual_seed(0)
    h, d, nI, dI, K, L = 64, 512, 64, 128, 640, 2048
    N = a.pool_rows
    rows = torch.randn(N, d, generator=g).to(dev, torch.bfloat16)
    kv_plain = rows.clone()
    kv_fp8 = rf.pack("fp8", rows)
    keys = torch.randn(N // 4, dI, generator=g).to(dev, torch.bfloat16)
    k_fp4 = rf.pack("fp4", keys)
    res = {"meta": dict(backend=a.backend, device=torch.cuda.get_device_name(dev), torch=torch.__version__,
                        pool_rows=N, reps=a.reps, h=h, d=d, nI=nI, dI=dI, K=K, L=L), "rows": []}
    for T in (1, 8, 64):
        q = torch.randn(T, h, d, generator=g).to(dev, torch.bfloat16)
        idx = torch.randint(0, N, (T, K), generator=g, dtype=torch.int32).to(dev)
        sink = torch.zeros(h, device=dev)
        t_plain = timed(lambda: ops.sparse_mqa_attention(q, kv_plain, idx, sink, d ** -0.5), a.reps)
        t_fp8 = timed(lambda: ops.sparse_mqa_attention(q, kv_fp8, idx, sink, d ** -0.5, kv_format="fp8"), a.reps)
        res["rows"].append(dict(op="sparse_mqa_attention", T=T, plain_us=t_plain, format_us=t_fp8, format="fp8",
                                ratio=t_fp8 / t_plain, plain_row_bytes=2 * d, format_row_bytes=rf.row_bytes("fp8", d)))
        qi = torch.randn(T, nI, dI, generator=g).to(dev, torch.bfloat16)
        w = torch.randn(T, nI, generator=g).to(dev)
        r = torch.randint(0, N // 4, (T, L), generator=g).to(dev)
        t_plain = timed(lambda: ops.indexer_scores_rows(qi, keys, w, r, dI ** -0.5), a.reps)
        t_fp4 = timed(lambda: ops.indexer_scores_rows(qi, k_fp4, w, r, dI ** -0.5, k_format="fp4"), a.reps)
        res["rows"].append(dict(op="indexer_scores_rows", T=T, plain_us=t_plain, format_us=t_fp4, format="fp4",
                                ratio=t_fp4 / t_plain, plain_row_bytes=2 * dI, format_row_bytes=rf.row_bytes("fp4", dI)))
    if a.attention_sweep:
        from dsv4core.kernels.triton import attention as attn
        for T in (1, 8, 64):
            q = torch.randn(T, h, d, generator=g).to(dev, torch.bfloat16)
            idx = torch.randint(0, N, (T, K), generator=g, dtype=torch.int32).to(dev)
            sink = torch.zeros(h, device=dev)
            for BK, st in ((64, 1), (32, 1), (32, 2), (16, 2), (16, 3)):
                attn.TUNE.update(BK=BK, num_stages=st)
                try:
                    t = timed(lambda: ops.sparse_mqa_attention(q, kv_fp8, idx, sink, d ** -0.5, kv_format="fp8"), a.reps)
                except Exception as e:  # noqa: BLE001 -- out of shared memory: recorded
                    t = None
                    print(f"BK {BK} stages {st}: {type(e).__name__}: {str(e)[:120]}")
                finally:
                    attn.TUNE.clear()
                res["rows"].append(dict(op="sparse_mqa_attention", T=T, format="fp8", BK=BK, num_stages=st, format_us=t))
                print(f"sweep fp8 attention T={T} BK={BK} stages={st}: {t if t is None else round(t, 1)} us")
    for E in (64, 4096):
        dst = torch.randperm(N, generator=g)[:E].to(dev)
        src = rows[:E].clone()
        t_plain = timed(lambda: ops.cache_store(kv_plain, dst, src), a.reps)
        t_fp8 = timed(lambda: ops.cache_store(kv_fp8, dst, src, row_format="fp8"), a.reps)
        res["rows"].append(dict(op="cache_store", T=E, plain_us=t_plain, format_us=t_fp8, format="fp8",
                                ratio=t_fp8 / t_plain, plain_row_bytes=2 * d, format_row_bytes=rf.row_bytes("fp8", d)))
    report = {row["op"]: row for row in ops.report()} if hasattr(ops, "report") else {}
    res["meta"]["served_by"] = {op: str(report.get(op, {}).get("backend", "?"))
                                for op in ("sparse_mqa_attention", "indexer_scores_rows", "cache_store")}
    for row in res["rows"]:
        if "plain_us" not in row:
            continue
        print(f"{row['op']:22s} T={row['T']:<5d} plain {row['plain_us']:8.1f} us   {row['format']} "
              f"{row['format_us']:8.1f} us   x{row['ratio']:.2f}   bytes/row {row['plain_row_bytes']} -> "
              f"{row['format_row_bytes']}")
    print("served by", res["meta"]["served_by"])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
