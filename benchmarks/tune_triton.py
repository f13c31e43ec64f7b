"""Launch-config sweep for the Triton kernels on a GPU (device time, cold L2, CUDA graphs).

    python benchmarks/tune_triton.py [--json out.json]

Sets each kernel module's TUNE overrides in turn, times the op at DSV4-Flash shapes with
dsv4core.bench's timer and checks the result against the default config (max rel diff).
"""
from __future__ import annotations

import argparse
import json

from dsv4core.bench import Timer, get_backend, make_case
from dsv4core.kernels.triton import attention, compress, linear, mhc, moe, norm, rope, wo_a

SWEEPS = [
    # attention at decode batch (issue 10: <= 15 us at T <= 8; `--ops sparse_mqa_attention`, 54
    # rows): the variants of kernels/triton/attention.py (hand-pipelined gather, 32 heads on 8
    # warps, all 64 heads a program on Hopper-sized dots: the DV column split, pv apart / dup), the
    # single-launch plan (S 1), and the pipelining at T = 64 / 256 (non-regression). The earlier
    # block-size / split / warp sweeps that set today's defaults: tune-s18-h200-flash-read.json.
    ("sparse_mqa_attention", attention, (1, 2, 4, 8), [
        {}, {"pipe": 1}, {"BK": 32, "pipe": 2}, {"BH": 32, "num_warps": 8},
        {"BH": 32, "num_warps": 8, "BK": 32, "pipe": 1}, {"BH": 32, "num_warps": 8, "BK": 32, "pv": "dup"},
        {"BH": 64, "DV": 128, "BK": 32},
        {"BH": 64, "DV": 128, "BK": 16, "target": 264},
        {"BH": 64, "DV": 128, "BK": 32, "num_warps": 8, "pv": "apart"},
        {"BH": 64, "num_warps": 8, "pv": "dup", "BK": 16}, {"BH": 64, "num_warps": 8, "pv": "dup", "BK": 32}]),
    ("sparse_mqa_attention", attention, (1, 8), [{"S": 1, "BH": 64, "DV": 128, "BK": 32, "pipe": 1},
                                                 {"S": 1, "BH": 32, "num_warps": 8, "BK": 32, "pipe": 2}]),
    ("sparse_mqa_attention", attention, (64, 256), [{}, {"pipe": 1}, {"BK": 32, "pipe": 2}]),
    # linear / wo_a at decode sizes (issue 10): {} is the default; linear bf16 {} and linear_fp8 /
    # wo_a_fp8 {"mode": "dot"} are the tiles timed before the modes existed; wo_a {} = the tiles of
    # wo_a's former own kernel. Run with --flush read too (see dsv4core.bench.Timer).
    ("linear", linear, (1, 8, 64), [{}, {"mode": "swap"}, {"mode": "swap", "BN": 128}, {"KSUB": 2}]),
    ("linear", linear, (1, 8), [{"mode": "fma"}]),
    ("linear_fp8", linear, (1, 8, 64), [{}, {"mode": "dot"}, {"BN": 128}, {"BK": 64}]),
    ("linear_fp8", linear, (1, 8), [{"mode": "fma"}]),
    ("linear_lm_head", linear, (1,), [{}, {"BN": 64}]),
    ("wo_a", wo_a, (1, 8, 64), [{}, {"mode": "swap", "BK": 128}, {"mode": "swap", "BN": 64, "BK": 128},
                                {"target": 528}]),
    ("wo_a", wo_a, (1, 8), [{"mode": "fma"}]),
    ("wo_a_fp8", wo_a, (1, 8, 64), [{}, {"mode": "dot"}, {"BN": 64}, {"target": 528}]),
    ("wo_a_fp8", wo_a, (1, 8), [{"mode": "fma"}]),
    ("hc_pre", mhc, (1, 64, 4096), [{}, {"target": 64}, {"target": 132}]),
    ("hc_post", mhc, (1, 64), [{}, {"post_BLOCK": 512, "post_num_warps": 4}, {"post_BLOCK": 256, "post_num_warps": 2},
                               {"post_BLOCK": 128, "post_num_warps": 4}]),
    ("hc_post", mhc, (4096,), [{}, {"post_BLOCK": 2048, "post_num_warps": 8}, {"post_BLOCK": 512, "post_num_warps": 4}]),
    ("rms_norm", norm, (4096,), [{}, {"ROWS": 2, "num_warps": 8}, {"num_warps": 16}, {"ROWS": 4, "num_warps": 8},
                                 {"num_warps": 4}]),
    ("kv_norm_rope", rope, (4096,), [{}, {"HB": 16}, {"HB": 4}, {"rowpos_below": 0}]),
    ("q_norm_rope", rope, (64, 4096), [{}, {"HB": 4}, {"HB": 16, "num_warps": 8}, {"HB": 8, "num_warps": 8}]),
    ("rope", rope, (4096,), [{}, {"HB": 4}, {"HB": 16, "num_warps": 8}]),
    ("compress_pool", compress, (4096,), [{}, {"BD": 128}, {"BD": 64}, {"BD": 256, "num_warps": 8}]),
    ("compress_pool_hca", compress, (4096,), [{}, {"BD": 32}, {"BD": 8}, {"BD": 64, "num_warps": 8}]),
    ("moe_experts", moe, (1, 64), [{}, {"BNu": 32}, {"BNd": 128}]),
    ("moe_experts", moe, (4096,), [{}, {"BM": 64, "BNd": 64, "num_warps": 4}]),
    ("moe_experts_fp8", moe, (1, 4096), [{}, {"BK": 128}]),
    # the shared expert (E = 1): {} shrinks the N blocks to fill the SMs; the rest are fixed choices
    ("moe_experts_shared", moe, (1, 8, 64), [{}, {"BNu": 64, "BNd": 128}, {"BNu": 32, "BNd": 64},
                                             {"BNu": 16, "BNd": 64}, {"BNu": 16, "BNd": 32, "num_warps": 2}]),
    # longer K steps (more bytes in flight per program) for the few-program shared expert, and T = 1 routed
    ("moe_experts_shared", moe, (1, 8), [{"BK": 128}, {"BK": 256}, {"BNu": 16, "BNd": 32, "BK": 256},
                                         {"BNu": 16, "BNd": 32, "BK": 128}, {"BK": 256, "num_stages": 3},
                                         {"BNu": 16, "BNd": 64, "BK": 256, "num_warps": 8}]),
    ("moe_experts", moe, (1, 8), [{}, {"BK": 128}, {"BK": 256, "num_stages": 3}, {"BNu": 32, "BK": 128}]),
    ("moe_experts_fp4", moe, (1, 4096), [{}, {"BK": 128}, {"BK": 32}]),
]


def _parts(timer, shapes, rows):
    """hc_pre / hc_head: the split-K mixes kernel alone vs the whole op."""
    for T in (1, 64, 4096):
        case = make_case("hc_pre", shapes, T, "cuda")
        x, fn = case.kwargs["x"], case.kwargs["fn"]
        n, H = x.shape[1], x.shape[2]
        t = timer.time(lambda: mhc._mix(x.view(T, n * H), fn, fn.shape[0]), reps=15)
        # the bytes this kernel must move: x and fn (case.bytes also counts the op's outputs)
        mix_bytes = x.numel() * x.element_size() + fn.numel() * fn.element_size()
        r = dict(op="hc_pre[mix kernel only]", T=T, cfg={}, us=t * 1e6, GBps=mix_bytes / t / 1e9)
        rows.append(r)
        print(json.dumps(r), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="flash")
    ap.add_argument("--ops", default=None, help="comma list of sweep labels (default: all)")
    ap.add_argument("--flush", default="write", choices=("write", "read"),
                    help="how L2 is emptied before each timed call (dsv4core.bench.Timer)")
    a = ap.parse_args(argv)
    want = set(a.ops.split(",")) if a.ops else None
    b = get_backend("cuda")
    timer = Timer("cuda", flush=a.flush)
    rows = []
    if want is None or "hc_pre" in want:
        _parts(timer, a.shapes, rows)
    for label, mod, toks, variants in SWEEPS:
        if want is None or label in want:
            for T in toks:
                case = make_case(label, a.shapes, T, "cuda")
                op = label
                impl = b.impls[case.op]
                mod.TUNE.clear()
                base = impl.fn(**case.kwargs)
                base = base[0] if isinstance(base, tuple) else base
                for v in variants:
                    mod.TUNE.clear()
                    mod.TUNE.update(v)
                    try:
                        t = timer.time(lambda: impl.fn(**case.kwargs), reps=15, graph=case.graphable)
                        out = impl.fn(**case.kwargs)
                        out = out[0] if isinstance(out, tuple) else out
                        diff = float((out.float() - base.float()).abs().max() / base.float().abs().max())
                        r = dict(op=op, T=T, cfg=v, flush=a.flush, us=t * 1e6, GBps=case.bytes / t / 1e9,
                                 TFLOPs=case.flops / t / 1e12, graphed=timer.last_graphed, diff=diff)
                    except Exception as e:  # noqa: BLE001
                        r = dict(op=op, T=T, cfg=v, error=f"{type(e).__name__}: {str(e)[:160]}")
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                    if a.json:  # keep what was measured if the run is cut short
                        json.dump(rows, open(a.json, "w"), indent=1)
                mod.TUNE.clear()
                del case
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
