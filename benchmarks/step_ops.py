"""Which source lines issue device work in one decode step: aten ops of an eager decode step,
grouped by the innermost dsv4core frame (model core, HAL, kernel launchers, plugins).

    python benchmarks/step_ops.py --device cuda --dims flash --backend cuda --batch 1 --json ops.json
    TRITON_INTERPRET=1 python benchmarks/step_ops.py --device cpu --dims tiny --backend triton-interpret
    python benchmarks/step_ops.py --device cpu --dims tiny --backend reference --graph-step   # what a graph records

Views and allocations (no kernel) are left out; what is left is roughly one device kernel per aten
op (sort, cumsum and the like launch several). Kernel launches themselves (Triton) are not aten ops:
the kernels per step are e2e_decode.py's profile. Measured, never asserted.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_decode import DSV4Config, build_model, config_dict, prefill, prompts, randomize_on_device_  # noqa: E402

NO_KERNEL = {"view", "unsqueeze", "expand", "slice", "detach", "empty", "as_strided", "_reshape_alias", "select",
             "t", "permute", "transpose", "empty_like", "new_empty", "squeeze", "alias", "_unsafe_view",
             "empty_strided", "unbind", "split", "split_with_sizes", "narrow", "lift_fresh", "set_", "reshape"}
ROOT = str(Path(__file__).resolve().parents[1]) + "/"


class Where(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.lines = collections.defaultdict(collections.Counter)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        st = traceback.extract_stack()
        if name not in NO_KERNEL and not any("triton/runtime" in f.filename for f in st):
            for f in reversed(st):
                if ("/dsv4core/" in f.filename or "/plugins/" in f.filename or "dsv4core_" in f.filename) \
                        and "_python_dispatch" not in f.filename:
                    where = f.filename.split("site-packages/")[-1].replace(ROOT, "")
                    self.lines[f"{where}:{f.lineno} {f.name}"][name] += 1
                    break
        return func(*args, **(kwargs or {}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dims", default="flash")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--graph-step", action="store_true",
                    help="count the step a decode graph records (every token an emission / ring candidate, "
                         "padding masks, entry tables of the context bucket) instead of the eager one")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    backend = a.backend or ("cuda" if dev.type == "cuda" else "reference")
    cfg = DSV4Config.from_dict(config_dict(a.dims, a.layers, a.experts))
    model = build_model(cfg, dtype=getattr(torch, a.dtype), device=dev, backend=backend, seed=None)
    randomize_on_device_(model, cfg, seed=0)
    B, n = a.batch, a.context + 16
    model.configure_cache(max_tokens=B * ((n + 255) // 256) * 256, max_requests=B, max_request_tokens=1 << (n - 1).bit_length(),
                          max_step_tokens=max(256, B * a.context))
    states = [model.new_state() for _ in range(B)]
    box = [prefill(model, prompts(cfg.vocab_size, B, a.context), max(256, B * a.context), states)]
    model.use_graphs = False

    def step():
        pos = torch.tensor([s.length for s in states])
        box[0] = model.forward_batch(box[0].argmax(-1), pos, torch.arange(B), states)

    step(), step()
    if a.graph_step:                   # the graph's forward, run eagerly (its last use of the states)
        from dsv4core.model.graphs import DecodeGraphs

        g = DecodeGraphs(model, (B,), None)
        inputs = torch.zeros(5, B, dtype=torch.int64, device=dev)
        inputs[0], inputs[1] = box[0].argmax(-1), torch.tensor([s.length for s in states])
        inputs[2], inputs[3] = torch.tensor([s.slot for s in states]), 1
        ctx = g.context_bucket(int(inputs[1].max()) + 1)
        step = lambda: model._forward(g._step(inputs, B, ctx))  # noqa: E731
    mode = Where()
    with mode, torch.no_grad():
        step()
    rows = sorted(((sum(c.values()), k, dict(c.most_common())) for k, c in mode.lines.items()), key=lambda r: -r[0])
    total = sum(r[0] for r in rows)
    by_file = collections.Counter()
    for n_, k, _ in rows:
        by_file[k.split(":")[0]] += n_
    if a.json:                  # first: a reader that stops early (| head) loses nothing
        Path(a.json).write_text(json.dumps(dict(args=vars(a), total=total, by_file=dict(by_file),
                                                lines=[dict(n=n_, where=k, ops=o) for n_, k, o in rows]), indent=1))
    kind = "graph-recorded" if a.graph_step else "eager"
    print(f"aten ops issuing device work in one {kind} decode step ({backend}, {a.dims}, batch {B}): {total}")
    for f, n_ in by_file.most_common():
        print(f"{n_:5d}  {f}")
    for n_, k, ops in rows[:60]:
        print(f"{n_:5d}  {k}  {ops}")


if __name__ == "__main__":
    main()
