"""Host work of a decode step vs the number of requests: the tiny model on the CPU (reference
backend, 1 thread), decode step wall time at batch 1 and 64 (median of 15 after 3 warm-up), and
the ratio. Runs against any checkout (PYTHONPATH=that checkout) for before/after comparisons;
the old per-request-state API (no configure_cache / release) is handled. Measured, never asserted."""
import json, statistics, sys, time, torch
torch.set_num_threads(1)
import dsv4core
m = dsv4core.load_model("tiny", backend="reference")
out = {"dsv4core": dsv4core.__file__}
for B in (1, 64):
    if hasattr(m, "configure_cache"):
        m.configure_cache(max_requests=B, max_tokens=B * 200, max_request_tokens=256)
    sts = [m.new_state() for _ in range(B)]
    ids = torch.randint(2, 250, (B * 64,), generator=torch.Generator().manual_seed(0))
    m.forward_batch(ids, torch.arange(64).repeat(B), torch.arange(B).repeat_interleave(64), sts)
    tok = torch.full((B,), 5)
    ts = []
    for s in range(18):
        t0 = time.perf_counter()
        m.forward_batch(tok, torch.tensor([st.length for st in sts]), torch.arange(B), sts)
        ts.append(time.perf_counter() - t0)
    out[f"b{B}_ms"] = 1e3 * statistics.median(ts[3:])
    for st in sts:
        getattr(st, "release", lambda: None)()
out["ratio_b64_b1"] = out["b64_ms"] / out["b1_ms"]
print(json.dumps(out))
