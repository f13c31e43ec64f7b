"""Launch-config sweep for the Triton kernels on a GPU (device time, cold L2, CUDA graphs).

    python benchmarks/tune_triton.py [--json out.json]

Sets each kernel module's TUNE overrides in turn, times the op at DSV4-Flash shapes with
dsv4core.bench's timer and checks the result against the default config (max rel diff).
"""
from __future__ import annotations

import argparse
import json

import torch

from dsv4core.bench import Timer, get_backend, make_case
from dsv4core.kernels.triton import attention, compress, linear, mhc, moe, norm, rope, wo_a

SWEEPS = [
    # attention at decode batch (target: <= 15 us at T <= 8; `--ops sparse_mqa_attention`): the
    # hand-pipelined gather (pipe 1: 6-15 % faster at T <= 64, 4 % slower at T = 256, bitwise equal;
    # benchmarks/results/h200/2026-12-01_2494243/tune/mhc-attention-variants-flash.json, where the removed variants DV / pv / pipe 2 / S 1 lost),
    # 32 heads on 8 warps. The block-size / split / warp sweeps that set today's defaults:
    # benchmarks/results/h200/2026-12-01_8397775/tune/all-ops-flash.json.
    ("sparse_mqa_attention", attention, (1, 2, 4, 8, 64, 256), [{}, {"pipe": 1}, {"BH": 32, "num_warps": 8},
                                                                {"BH": 32, "num_warps": 8, "pipe": 1}]),
    # linear / wo_a FP8 (targets: >= 80 % of copy at T <= 64, >= 60 % of the bf16 mm rate at
    # T = 4096). {} is the default. NBLK = 128-column scale blocks per K step; bigger BN / more
    # stages = more FP8 bytes in flight per program; mode swap = the converted weight tile feeds
    # wgmma from registers (won at T = 4096: 1004 vs 1132 µs). The removed FP8 decodes (int, mix,
    # dot_scaled) lost or tied: benchmarks/results/h200/2026-12-01_2494243/tune/linear-wo_a-variants-flash.json. Run with --flush read.
    ("linear", linear, (1, 64), [{}]),       # bf16: unchanged path (NBLK = 1), a regression check
    ("linear_fp8", linear, (1, 8), [{}, {"num_stages": 5}, {"NBLK": 2}, {"NBLK": 2, "num_stages": 4},
                                    {"BN": 128, "num_warps": 8, "num_stages": 4},
                                    {"BN": 128, "NBLK": 2, "num_warps": 8, "num_stages": 4},
                                    {"BN": 256, "num_warps": 8, "num_stages": 4},
                                    {"BN": 256, "num_warps": 8, "num_stages": 5}]),
    ("linear_fp8", linear, (64,), [{}, {"BK": 128, "num_stages": 4}, {"NBLK": 2, "num_warps": 8},
                                   {"BN": 256, "num_warps": 8, "num_stages": 4}, {"BN": 64, "BK": 128, "num_stages": 5}]),
    ("linear_fp8", linear, (4096,), [{}, {"mode": "swap"}, {"mode": "swap", "BK": 128},
                                     {"mode": "swap", "num_stages": 4}, {"mode": "swap", "num_stages": 2}]),
    ("linear_lm_head", linear, (1,), [{}, {"BN": 64}]),
    ("wo_a", wo_a, (1,), [{}]),              # bf16 regression check
    ("wo_a_fp8", wo_a, (1, 64), [{}, {"NBLK": 2}, {"NBLK": 2, "num_stages": 5}, {"BN": 64, "NBLK": 2, "num_stages": 4},
                                 {"num_stages": 6}]),
    # hc_pre / hc_head (mhc.py's TUNE keys): target = fewer, fatter mix slices;
    # BT / BK / warps / stages of the mix GEMM (BT 128, BK 64, 8 warps, 4 stages: 105 vs 116 µs at
    # T = 4096). The removed epilogue "vec" and the FMA mixes lost: benchmarks/results/h200/2026-12-01_2494243/tune/mhc-attention-variants-flash.json.
    ("hc_pre", mhc, (1, 8, 64), [{}, {"target": 64}, {"target": 32}]),
    ("hc_pre", mhc, (4096,), [{}, {"BT": 128, "num_warps": 8}, {"BK": 64, "num_stages": 4},
                              {"BT": 128, "BK": 64, "num_warps": 8, "num_stages": 4}, {"target": 528}]),
    ("hc_head", mhc, (1, 64, 4096), [{}, {"target": 64}]),
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
    # the quantised-expert decodes (moe.DECODES; {} = "join"): "scaled" (tl.dot_scaled) won, 33-39 %
    # faster at T = 1 / 64 (the removed "split" and FP8 "scaled" lost: benchmarks/results/h200/2026-12-01_2494243/tune/moe_experts-variants-flash.json);
    # bf16 big tiles at T = 4096 (>= 50 % of mm wanted)
    ("moe_experts_fp4", moe, (1, 64), [{}, {"fp4": "scaled"}, {"fp4": "scaled", "BK": 128},
                                       {"fp4": "scaled", "BNu": 32, "BNd": 64}]),
    ("moe_experts_fp4", moe, (1,), [{"fp4": "scaled", "BK": 256, "num_stages": 3}]),
    ("moe_experts_fp4", moe, (4096,), [{"fp4": "scaled"}, {"fp4": "scaled", "BNu": 128}, {"fp4": "scaled", "num_stages": 4}]),
    ("moe_experts_fp8", moe, (64,), [{}]),
    ("moe_experts", moe, (4096,), [{"BNu": 128, "BNd": 128, "BK": 64, "num_warps": 8, "num_stages": 3},
                                   {"BNu": 128, "BNd": 128, "BK": 64, "num_warps": 8, "num_stages": 4},
                                   {"BNu": 64, "BNd": 128, "BK": 64, "num_warps": 8, "num_stages": 4},
                                   {"BNu": 128, "BNd": 256, "BK": 64, "num_warps": 8, "num_stages": 3},
                                   {"BNu": 128, "BNd": 128, "BK": 32, "num_warps": 8, "num_stages": 4}]),
]


# The choices the all-ops sweep left open (FP4 "scaled" tiles, the bf16 / FP8 prefill tiles, FP8
# "via_f32"), each timed beside the current default, with the default repeated to show the run's
# noise. `--set variants`; measured: benchmarks/results/h200/2026-12-01_2494243/tune/*-variants-flash.json,
# benchmarks/results/h200/2026-12-01_c29f187/tune/fp8-via-f32-flash.json.
_FP4 = {"fp4": "scaled"}
_BIG = {"BNu": 128, "BNd": 256, "BK": 64, "num_warps": 8, "num_stages": 3}
VARIANTS = [
    ("moe_experts_fp4", moe, (1, 8, 64), [{}, _FP4, {**_FP4, "BK": 128}, {**_FP4, "BK": 128, "num_warps": 8},
                                          {**_FP4, "BK": 128, "num_stages": 3}, {**_FP4, "BK": 128, "BNu": 128}, {}]),
    ("moe_experts_fp4", moe, (4096,), [{**_FP4, "BNu": 128}, {**_FP4, "BNu": 128, "BNd": 256},
                                       {**_FP4, "BNu": 128, "BNd": 256, "num_stages": 4}]),
    ("moe_experts", moe, (4096,), [{}, _BIG, {**_BIG, "num_stages": 4}, {}]),
    ("moe_experts", moe, (2048,), [{}, {**_BIG, "BM": 128}]),
    ("moe_experts_fp8", moe, (4096,), [{}, {**_BIG, "BK": 128}]),
    ("wo_a_fp8", wo_a, (1, 8, 16), [{}, {"NBLK": 2}, {}]),
    ("linear_fp8", linear, (512, 1024, 2048), [{}, {"mode": "swap"}]),
    # fp8 "via_f32": the same bf16 operand with one conversion a code pair fewer on sm90
    # (benchmarks/results/sm90-aot/2026-12-01_7374812/aot/sass-fp8-decode-loops.md: the default FP8 GEMV is conversion-bound)
    ("linear_fp8", linear, (1, 8, 64, 4096), [{}, {"fp8": "via_f32"}, {"fp8": "via_f32", "NBLK": 2},
                                              {"fp8": "via_f32", "mode": "swap"}, {}]),
    ("wo_a_fp8", wo_a, (1, 8, 64), [{"fp8": "via_f32"}, {"fp8": "via_f32", "NBLK": 2}]),
    ("moe_experts_fp8", moe, (1, 64), [{}, {"fp8": "via_f32"}, {}]),
    ("sparse_mqa_attention", attention, (16, 32, 128), [{}, {"pipe": 1}]),
    ("hc_pre", mhc, (256, 1024, 4096), [{}, {"BT": 128, "BK": 64, "num_warps": 8, "num_stages": 4},
                                        {"BT": 128, "BK": 64, "num_warps": 8, "num_stages": 3}, {}]),
    ("hc_head", mhc, (4096,), [{}, {"BT": 128, "BK": 64, "num_warps": 8, "num_stages": 4}]),
    ("linear_lm_head", linear, (1,), [{}, {"BN": 32}, {}, {"BN": 128}]),
]

# FP4 experts at decode batches (the e2e decode of the official weights spends 31 / 68 / 82 % of its
# GPU time at batch 1 / 8 / 32 in the expert GEMMs, benchmarks/results/h200/2026-12-02_c4c8464/e2e/decode-flash-4layers-official.json):
# "scaled"'s tiles, warps and stages around today's choice (BM 16, BNu 64, BNd 128, BK 128 while the
# grid fits the target, 4 warps, 4 stages), "join" and the default repeated for the run's noise.
# `--set fp4-decode`; measured: benchmarks/results/h200/2026-12-01_2d29a67/tune/moe_experts-fp4-decode-flash.json.
_S = {"fp4": "scaled", "BK": 128}
FP4_DECODE = [
    ("moe_experts_fp4", moe, (1, 8, 32, 64), [
        {}, _FP4, _S, {**_S, "num_warps": 8}, {**_S, "num_stages": 2}, {**_S, "num_stages": 3},
        {**_S, "num_stages": 5}, {**_S, "BNu": 32}, {**_S, "BNu": 32, "num_warps": 8},
        {**_S, "BNd": 64}, {**_S, "BNd": 256, "num_warps": 8}, {**_S, "BNu": 32, "BNd": 64},
        {**_FP4, "BK": 256, "num_stages": 3}, {**_FP4, "BK": 64}, _FP4]),
]
# FP4 "group" (one unscaled e2m1 dot a 32-column group, the scale on its fp32 partial; the kernel
# change: the patch of commit 2d29a67; docs/perf/moe_experts.md) lost and was not kept: even at T = 1, 8 %
# faster at T = 8, 3.8x slower at T = 32 / 64, 12x at 4096 (benchmarks/results/h200/2026-12-01_2d29a67/tune/moe_experts-fp4-group-decode-flash.json)
# split K (moe TUNE "Su" over H for gate / up, "Sd" over I for down): at decode batches the expert
# GEMMs run few programs of long K loops (T = 1: 6 row tiles x 32 N blocks, 32 steps each), so each
# program's serial decode -> MMA -> wait chain may bound them, not the bytes. `--set split-k`;
# measured: benchmarks/results/h200/2026-12-02_62140f5/tune/moe_experts-split-k-flash.json.
_SPL = [{}, {"Su": 2}, {"Su": 4}, {"Su": 8}, {"Sd": 2}, {"Sd": 4}, {"Su": 4, "Sd": 2}, {"Su": 4, "Sd": 4},
        {"Su": 8, "Sd": 4}, {"Su": 4, "Sd": 2, "BNd": 128}, {}]
SPLIT_K = [
    ("moe_experts_fp4", moe, (1, 8, 32), _SPL),
    ("moe_experts_fp8", moe, (1, 8), _SPL),
    ("moe_experts", moe, (1, 8), [{}, {"Su": 2}, {"Su": 4}, {"Su": 4, "Sd": 2}, {}]),
    ("moe_experts_shared", moe, (1, 8, 64), [{}, {"Su": 2}, {"Su": 4}, {"Su": 4, "Sd": 2}, {"Su": 8, "Sd": 4},
                                             {"Su": 4, "Sd": 2, "BNu": 64, "BNd": 128}, {}]),
]
# Where split K pays (the split-k set timed -10 % for FP4 at T = 1 with Su 2 and -12-17 % for the
# shared expert with Su 4 / Sd 2): the decode batches between, the shared expert's down split alone,
# the default twice (the noise). `--set split-k-rule`; measured:
# benchmarks/results/h200/2026-12-02_62140f5/tune/moe_experts-split-k-rule-flash.json.
SPLIT_K_RULE = [
    ("moe_experts_fp4", moe, (1, 2, 4, 8, 16), [{}, {"Su": 2}, {"Su": 4}, {}]),
    ("moe_experts_fp8", moe, (1, 2, 4, 8), [{}, {"Su": 2}, {"Su": 2, "Sd": 2}, {}]),
    ("moe_experts", moe, (1, 2, 4), [{}, {"Su": 2}, {}, {"Su": 2}]),
    ("moe_experts_shared", moe, (1, 8, 64, 256), [{}, {"Sd": 2}, {"Sd": 4}, {"Sd": 8}, {"Su": 2, "Sd": 2},
                                                  {"Su": 4, "Sd": 2}, {"Su": 2, "Sd": 4}, {"Su": 4, "Sd": 4}, {}]),
]
# After the split rule (Su 2 by default for FP4 "scaled" at <= 96 pairs): the T = 1 tile rules
# (BK 128, BNd 64) at the decode batches above T = 1, and Su 4. `--set fp4-decode-tiles`; measured:
# benchmarks/results/h200/2026-12-02_8b88262/tune/moe_experts-fp4-decode-tiles-flash.json.
FP4_DECODE_TILES = [
    ("moe_experts_fp4", moe, (2, 4, 8, 16), [{}, {"BK": 128}, {"BNd": 64}, {"BK": 128, "BNd": 64}, {"Su": 4},
                                             {"BK": 128, "Su": 4}, {}]),
]

# FP4 "gemv" (one GEMV a pair row on the FMA units, 8 e2m1 codes a 32-bit word decoded
# exactly by bit placement, the group scale on each word's partial; the kernel change is
# in commit 959676a; docs/perf/moe_experts.md) lost and was not kept: its best launch 136 / 221 / 400 /
# 740 µs at T = 1 / 2 / 4 / 8 against the table's 104-105 / 181-184 / 283-285 / 381-384
# (benchmarks/results/h200/2026-12-02_108d4ca/tune/moe_experts-fp4-gemv-flash.json)

# FP8 "f16" (e4m3 -> fp16 exactly, one conversion a code pair; the bf16 activation rows
# scaled by powers of two into fp16; fp16 tensor cores; the kernel change is
# in commit 06ebc28; docs/perf/linear.md) lost and was not kept: linear FP8 15.2 / 15.7 / 27.2 /
# 1470 µs at T = 1 / 8 / 64 / 4096 against "via_f32"'s 13.9-14.3 / 14.3 / 20.6-20.7 / 856; wo_a FP8
# 23.6 / 23.3 / 53.9 / 1359 against 16.2-17.1 / 16.1-16.3 / 31.1-31.2 / 875
# (benchmarks/results/h200/2026-12-02_6df36df/tune/linear-fp8-f16-flash.json)
# hc_pre epi_apart (post / comb in their own epilogue program; bitwise the same outputs)
# won 4-8 % at T = 8 / 64 (benchmarks/results/h200/2026-12-02_1b71fa6/tune/hc_pre-epilogue-apart-flash.json) but was reverted for want of
# its GPU conformance run; the kernel change and its sweep set are commit 7d2ffb5.

# Quantised weights converted to bf16 once per call at prefill sizes (dequant.py, TUNE
# ``dequant_rows``: {} the launch table's (the CUDA plugin's sm90: 4,096 rows a GEMM weight, 384
# pairs an expert); None never; 0 always). `--set dequant`; measured (before the UE8M0 fold, FP8
# codes converted): benchmarks/results/h200/2026-12-03_45d660e/tune/dequant-flash.json.
_DQ = [{}, {"dequant_rows": None}, {"dequant_rows": 0}, {}]
DEQUANT = [
    ("linear_fp8", linear, (512, 1024, 2048, 4096), _DQ),
    ("wo_a_fp8", wo_a, (512, 1024, 4096), _DQ),
    ("moe_experts_fp4", moe, (512, 1024, 2048, 4096, 8192), _DQ),
    ("moe_experts_fp8", moe, (512, 1024, 4096), _DQ),
]


# Packed FP4 experts under the official activation through the CUDA plugin's own grouped GEMM
# (TUNE "gemm", plugins/cuda/dsv4core_cuda/fp4_experts.cu) against the portable kernels ("gemm"
# None), the table's default twice (the noise). `--set fp4-gemm`.
FP4_GEMM = [
    ("moe_experts_fp4_official", moe, (1, 2, 4, 8, 16, 32, 64, 256), [{}, {"gemm": None}, {}]),
]


# The FP4 GEMM with a warp-wide expert lookup (one round of loads instead of the binary search's
# dependent chain) and rt = 1 / 2 / 4 / 8 weight tiles a block with its ring (stages 4 / 8) running
# across them lost and was not kept: the lookup changed nothing (T = 1 68.6 against 68.4-68.9 µs
# for the whole op), more tiles a block or a deeper ring were slower at T <= 8 (rt 8: 96.6 µs at
# T = 1) and within 2 % at 16-64: the kernel is bound by its instructions a weight byte, not by
# latency (docs/perf/moe_experts.md). The kernel change is in commit edc3739
# (benchmarks/results/h200/2026-12-04_edc3739/tune/fp4-gemm-tiles-flash.json)


# The official W8A8 with FP8 weights (UE8M0 scales; linear TUNE ``w8a8``): the FP8 x FP8 MMA on
# the activation codes ("fp8", with the table's ``w8a8_tiles``) against the dequantised activation
# values through a bf16 MMA ("values", the kernel default), then other tiles for the FP8 x FP8
# launches (each sets the whole tile), "fp8" again last (the run's noise). `--set w8a8`.
def _t(mode, BM, BN, BK, nw, ns, **kw):
    return {"w8a8": "fp8", "mode": mode, "BM": BM, "BN": BN, "BK": BK, "num_warps": nw, "num_stages": ns, **kw}


_F8 = {"w8a8": "fp8"}
W8A8 = [
    ("linear_fp8_official", linear, (1, 8), [{"w8a8": "values"}, _F8, _t("dot", 16, 64, 128, 4, 3),
                                             _t("swap", 16, 128, 128, 4, 4), _F8]),
    ("linear_fp8_official", linear, (64,), [{"w8a8": "values"}, _F8, _t("swap", 64, 128, 128, 4, 3), _F8]),
    ("linear_fp8_official", linear, (512, 4096), [{"w8a8": "values"}, _F8, _t("dot", 128, 128, 128, 8, 4),
                                                  _t("dot", 128, 256, 128, 8, 3), _F8]),
]


def _no_default_split(rows):
    """The split-k sets were timed before the split rule (moe._split_rule): a row's unset Su / Sd meant 1.
    Pinned so that a re-run times what their JSONs recorded."""
    return [(label, mod, toks, [{"Su": 1, "Sd": 1, **v} for v in variants]) for label, mod, toks, variants in rows]


SETS = {"all": SWEEPS, "variants": VARIANTS, "fp4-decode": FP4_DECODE, "split-k": _no_default_split(SPLIT_K),
        "split-k-rule": _no_default_split(SPLIT_K_RULE), "fp4-decode-tiles": FP4_DECODE_TILES,
        "dequant": DEQUANT, "fp4-gemm": FP4_GEMM, "w8a8": W8A8}


def _parts(timer, shapes, rows):
    """hc_pre / hc_head: the split-K mixes kernel alone (compare with the whole op's rows)."""
    for T in (1, 8, 64, 4096):
        case = make_case("hc_pre", shapes, T, "cuda")
        x, fn = case.kwargs["x"], case.kwargs["fn"]
        n, H = x.shape[1], x.shape[2]
        mhc.TUNE.clear()
        t = timer.time(lambda: mhc._mix(x.view(T, n * H), fn, fn.shape[0]), reps=15)
        # the bytes this kernel must move: x and fn (case.bytes also counts the op's outputs)
        mix_bytes = x.numel() * x.element_size() + fn.numel() * fn.element_size()
        r = dict(op="hc_pre[mix kernel only]", T=T, cfg={}, us=t * 1e6, GBps=mix_bytes / t / 1e9)
        rows.append(r)
        print(json.dumps(r), flush=True)


def _rel_diff(out, base) -> float:
    """max |out - base| / max |base|, the worst over the outputs of a tuple-returning op."""
    pairs = zip(out, base) if isinstance(base, tuple) else ((out, base),)
    return max(float((o.float() - b.float()).abs().max() / b.float().abs().max())
               for o, b in pairs if isinstance(b, torch.Tensor) and b.numel())


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="flash")
    ap.add_argument("--ops", default=None, help="comma list of sweep labels (default: all)")
    ap.add_argument("--set", default="all", choices=sorted(SETS), help="which list of sweeps (default: all)")
    ap.add_argument("--flush", default="write", choices=("write", "read"),
                    help="how L2 is emptied before each timed call (dsv4core.bench.Timer)")
    a = ap.parse_args(argv)
    want = set(a.ops.split(",")) if a.ops else None
    b = get_backend("cuda")
    timer = Timer("cuda", flush=a.flush)
    rows = []
    if a.set == "all" and (want is None or "hc_pre" in want):
        _parts(timer, a.shapes, rows)
    for label, mod, toks, variants in SETS[a.set]:
        if want is None or label in want:
            for T in toks:
                case = make_case(label, a.shapes, T, "cuda")
                op = label
                impl = b.impls[case.op]
                mod.TUNE.clear()
                base = impl.fn(**case.kwargs)
                for v in variants:
                    mod.TUNE.clear()
                    mod.TUNE.update(v)
                    try:
                        t = timer.time(lambda: impl.fn(**case.kwargs), reps=15, graph=case.graphable)
                        diff = _rel_diff(impl.fn(**case.kwargs), base)
                        r = dict(op=op, T=T, cfg=v, flush=a.flush, us=t * 1e6, GBps=case.bytes / t / 1e9,
                                 TFLOPs=case.flops / t / 1e12, graphed=timer.last_graphed, diff=diff)
                    except Exception as e:  # noqa: BLE001
                        r = dict(op=op, T=T, cfg=v, error=f"{type(e).__name__}: {str(e)[:160]}")
                    rows.append(r)
                    print(json.dumps(r, default=repr), flush=True)
                    if a.json:  # keep what was measured if the run is cut short (launch objects by repr)
                        json.dump(rows, open(a.json, "w"), indent=1, default=repr)
                mod.TUNE.clear()
                del case
    if a.json:
        json.dump(rows, open(a.json, "w"), indent=1, default=repr)


if __name__ == "__main__":
    main()
