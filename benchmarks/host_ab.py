"""A/B of a decode step's host part on a GPU (tiny model, cuda backend, graph replay): the queued
page-locked uploads (staging.Uploads) against plain blocking copies, serial steps (ids read back)
and queued steps (DeviceTokens). Prints one JSON line per variant. Diagnostic, not a test."""
import json
import statistics
import sys
import time

import numpy as np
import torch

import dsv4core
from dsv4core.model import staging


def blocking_copy(self, dst, src):
    dst.copy_(torch.from_numpy(np.ascontiguousarray(src)).view(dst.shape))


def main():
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    m = dsv4core.load_model("tiny", backend="cuda", device="cuda")
    m.configure_cache(max_requests=max(B, 2), max_tokens=B * 2048 + 4096, max_request_tokens=2048)
    orig = staging.Uploads.copy
    for variant in ("queued-uploads", "blocking-copies", "queued-uploads"):
        staging.Uploads.copy = orig if variant == "queued-uploads" else blocking_copy
        sts = [m.new_state() for _ in range(B)]
        for st in sts:
            m.forward_batch(torch.arange(3, 40), torch.arange(37), torch.zeros(37, dtype=torch.long), [st])
        lg = m.forward_batch(torch.full((B,), 5), torch.tensor([s.length for s in sts]), torch.arange(B), sts)
        res = {}
        for mode in ("serial", "queued"):
            walls, hosts = [], []
            for i in range(60):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                ids = lg.argmax(-1) if mode == "serial" else m.greedy_tokens(lg)
                h0 = time.perf_counter()
                lg = m.forward_batch(ids, torch.tensor([s.length for s in sts]), torch.arange(B), sts)
                h1 = time.perf_counter()
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                if i >= 10:
                    walls.append(t1 - t0)
                    hosts.append(h1 - h0)
            res[mode] = dict(step_ms=1e3 * statistics.median(walls), forward_batch_host_ms=1e3 * statistics.median(hosts))
        for s in sts:
            s.release()
        print(json.dumps(dict(variant=variant, batch=B, **res)), flush=True)
    staging.Uploads.copy = orig


if __name__ == "__main__":
    main()
