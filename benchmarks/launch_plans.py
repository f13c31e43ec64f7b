"""Every kernel launch the portable Triton kernels make under each plugin's launch table, recorded
without compiling or running anything (CPU tensors; each ``kernel[grid](...)`` intercepted: the
kernel, its grid, its arguments (tensors by shape / strides / dtype), constexprs and launch
keywords). Two trees' files compared say which launches a change of kernel defaults or tables moves.

    python benchmarks/launch_plans.py --ops hc_pre,sparse_mqa_attention --json new.json
    python benchmarks/launch_plans.py ... --json new.json --compare old.json   # old.json: the old tree's run
    python benchmarks/launch_plans.py ... --device-branch   # the launches a GPU makes (aot.device_branch)

Tables: none (the kernels' defaults), cuda sm90 and sm80 (a capability without an entry), every
rocm arch, xpu at SLM tiers 0 / 64 KiB / 66,624 / 100,384 / 256 KiB. Cases: each op's conformance
cases (shape set ``flash``, bfloat16 and float32), plus hc_pre / hc_head at T = 1024 / 2048 / 4096
(flash dims) with the device's shared memory a block read as 0 and as 227 KiB (the prefill tiles),
and likewise linear (bf16 and block-scaled FP8 weights, 4096 x 4096) at T = 1024 / 4096 and
moe_experts (bf16 and FP8 experts, 8 experts of H 4096 x I 256, top 6) at T = 64 / 1024.
``--device-branch``: each table's launches in the branch its GPU takes (rocm gfx942 / gfx950: theirs,
every other table an sm90 GPU's), else the CPU tensors' branch. Launch plans only: the AOT compile (``python -m dsv4core.kernels.triton.aot``) says what they compile to.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

PREFILL_SHARED = 232448     # 227 KiB a block (sm90)


def _tables() -> dict:
    import dsv4core_cuda.launch as cu
    import dsv4core_rocm.launch as ro
    import dsv4core_xpu.launch as xp

    tables = {"none": None, "cuda sm90": cu.TABLES.resolve((9, 0)), "cuda sm80 (fallback)": cu.TABLES.resolve((8, 0))}
    tables.update({f"rocm {a}": ro.TABLES.resolve(a) for a in ro.TABLES})
    tables.update({f"xpu slm {s}": xp.TABLES.resolve(s) for s in (0, 64 * 1024, 66_624, 100_384, 256 * 1024)})
    return tables


def _shared(value: int) -> None:
    """Make the kernels and the CUDA table read ``value`` bytes of shared memory a block (whichever
    of them reads it in this tree)."""
    import dsv4core_cuda.launch as cu

    from dsv4core.kernels.triton import linear, mhc, moe

    for mod in (mhc, linear, moe, cu):
        if hasattr(mod, "shared_bytes"):
            mod.shared_bytes = lambda device, v=value: v


def _branch_target(table: str) -> str:
    """The AOT target whose GPU branch ``--device-branch`` records a table's launches in: the rocm
    arches their own; every other table an sm90 GPU's (132 compute units: for xpu and rocm
    "other" only a stand-in for the split factors)."""
    arch = table.split()[-1]
    return f"hip:{arch}" if table.startswith("rocm") and arch in ("gfx942", "gfx950") else "cuda:90"


def record(ops, device_branch: bool = False) -> dict:
    import contextlib

    from triton.runtime.jit import JITFunction

    from dsv4core.kernels.triton import aot

    from dsv4core.hal import catalogue
    from dsv4core.kernels.triton import OPS
    from dsv4core.kernels.triton.aot import _args, _grid
    from dsv4core.kernels.triton.registry import _lazy

    got = []

    def run(self, *args, grid, warmup, **kw):
        got.append([self.__name__, _grid(grid), _args(args),
                    {k: v if isinstance(v, (int, float, bool, str)) or v is None else str(v) for k, v in sorted(kw.items())}])

    specs, out = catalogue(), {}
    orig = JITFunction.run
    JITFunction.run = run
    try:
        for name, table in _tables().items():
            res = out[name] = {}
            branch = contextlib.ExitStack()
            if device_branch:
                branch.enter_context(aot.device_branch(aot.parse_target(_branch_target(name))))

            def call(key, op, kwargs, shared=0):
                del got[:]
                _shared(shared)
                _lazy(op, OPS[op], specs[op].signature, "cpu", table)(**kwargs)
                res[key] = list(got)

            for op in ops:
                for dt in (torch.bfloat16, torch.float32):
                    for case in specs[op].sample_cases("flash", dt, "cpu", seed=0):
                        call(f"{op}/{case.name}/{dt}", op, case.kwargs)
            for T in (1024, 2048, 4096):
                for dt in (torch.bfloat16, torch.float32):
                    for op, mixes in (("hc_pre", 24), ("hc_head", 4)):
                        if op not in ops:
                            continue
                        kw = dict(x=torch.empty(T, 4, 4096, dtype=dt), fn=torch.empty(mixes, 4 * 4096),
                                  scale=torch.ones(3 if op == "hc_pre" else 1), base=torch.zeros(mixes),
                                  rms_eps=1e-6, hc_eps=1e-6, **({"iters": 20} if op == "hc_pre" else {}))
                        for shared in (0, PREFILL_SHARED):
                            call(f"{op}/T{T}-shared{shared}/{dt}", op, kw, shared)
            for key, op, kw in _prefill_cases(ops):
                for shared in (0, PREFILL_SHARED):
                    call(f"{op}/{key}-shared{shared}", op, kw, shared)
            branch.close()
    finally:
        JITFunction.run = orig
        _shared(0)
    return out


def _prefill_cases(ops):
    """(name, op, kwargs): linear's and moe_experts' many-row launches (the tiles that read the
    device's shared memory), CPU tensors that nothing reads."""
    fp8 = torch.float8_e4m3fn
    if "linear" in ops:
        for T in (1024, 4096):
            x = torch.empty(T, 4096, dtype=torch.bfloat16)
            yield f"T{T}-bf16", "linear", dict(x=x, weight=torch.empty(4096, 4096, dtype=torch.bfloat16))
            yield f"T{T}-fp8", "linear", dict(x=x, weight=torch.empty(4096, 4096, dtype=fp8),
                                              weight_scale=torch.ones(32, 32))
    if "moe_experts" in ops:
        E, H, I, K = 8, 4096, 256, 6
        for T in (64, 1024):
            g = torch.Generator().manual_seed(0)
            kw = dict(x=torch.empty(T, H, dtype=torch.bfloat16), ids=torch.randint(0, E, (T, K), generator=g),
                      weights=torch.full((T, K), 1.0 / K), swiglu_limit=10.0)
            yield f"T{T}-bf16", "moe_experts", dict(kw, w13=torch.empty(E, 2 * I, H, dtype=torch.bfloat16),
                                                     w2=torch.empty(E, H, I, dtype=torch.bfloat16))
            yield f"T{T}-fp8", "moe_experts", dict(kw, w13=torch.empty(E, 2 * I, H, dtype=fp8),
                                                    w2=torch.empty(E, H, I, dtype=fp8),
                                                    w13_scale=torch.ones(E, 2 * I // 128, H // 128),
                                                    w2_scale=torch.ones(E, H // 128, I // 128))


def compare(old: dict, new: dict) -> dict:
    """Per table: cases, how many launch the same, and the changed cases."""
    out = {}
    for t in new:
        changed = sorted(k for k in new[t] if old.get(t, {}).get(k) != new[t][k])
        out[t] = {"cases": len(new[t]), "same": len(new[t]) - len(changed), "changed": changed}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", required=True, help="comma-separated op names")
    ap.add_argument("--json", required=True, help="write the recorded launches here")
    ap.add_argument("--compare", default=None, metavar="OLD.json", help="the old tree's --json: print the comparison")
    ap.add_argument("--device-branch", action="store_true",
                    help="record the branch a GPU runs (aot.device_branch: its tensor-core tiles, its split "
                         "factors), not the one CPU tensors select (the interpreter's fp32 tiles)")
    a = ap.parse_args(argv)
    new = record(a.ops.split(","), a.device_branch)
    with open(a.json, "w") as f:
        json.dump(new, f)
    if a.compare:
        with open(a.compare) as f:
            print(json.dumps(compare(json.load(f), new), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
