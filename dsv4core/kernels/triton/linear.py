"""linear: ``y = x @ W^T`` with fp32 accumulation, one grouped split-K GEMM kernel for every T.

W is bf16 / fp32, or float8_e4m3fn with 128x128 block dequantisation multipliers (fp32 or e8m0).
The weight is read in place through its strides: never an upcast (or any) copy of it. FP8 codes
are converted to bf16 in registers (exact: every e4m3 value is a bf16 value) and multiplied by
the bf16 activation on the tensor cores; the block scale multiplies each 128-wide partial sum in
fp32, so the result equals the exact dequantisation followed by the fp32 product.

Small T (decode): the weight is streamed once; when the N tiles alone cannot fill the GPU, K is
split over programs (split-K) and a second kernel sums the fp32 partials in a fixed order (one
tree sum over the splits: the result does not depend on scheduling). Two inner products (TUNE
key ``mode``): "dot" (an MMA on [T, N] tiles) and "swap" (an MMA on [N, T] tiles: the weight rows
are the MMA's M side, so T = 1 pads the MMA's N side to 16 instead of its M side to 64, and an
FP8 tile converted in registers feeds a Hopper wgmma from registers). ``NBLK`` makes a K step
cover several 128-column scale blocks (more bytes in flight per program; each block's scale
still multiplies its own partial sum). ``grouped_gemm`` takes G groups: it serves ``wo_a`` too
(wo_a.py passes its own defaults and TUNE).

``act_block`` (the official W8A8), two paths (TUNE ``w8a8``, :data:`W8A8_PATHS`): "values" (the
portable default) fake-quantises x per token per ``act_block`` columns (quant.py: the e4m3 codes
times their power-of-two scales, exact in x's dtype), then the same GEMM runs on those values:
bf16 (or fp32) products of e4m3 activations and FP8 weight codes are exact, so the
fp32-accumulated result is the FP8 x FP8 product with both scales applied, up to the order of the
fp32 sums. "fp8" (FP8 weights, half-precision in and out) quantises x to its e4m3 codes and
per-block scales (quant.quant_fp8) and the kernel (constexpr ``A8``) runs each 128-column
block's sum as an FP8 x FP8 MMA on the two codes, then multiplies it by the weight block's and
the token's scale, as the official kernel does: no conversion of the weight codes, half the
activation bytes.

Many rows (TUNE ``dequant_rows``, dequant.py): an FP8 weight is converted to bf16 once per call
instead of once per row tile in registers (UE8M0 scales folded in: a plain bf16 GEMM; fp32 scales:
the codes, the scales kept on the block sums), within a scratch of ``dequant_bytes``.

fp32 outputs of tensor-core products (the lm_head's logits, the router gate, the compressor
projections; TUNE key ``chain``): the MMA's own
accumulator sums at most ``chain`` K columns, and each such chain's result is added to the fp32
running sum by an ordinary fp32 add. One MMA chain over all of K is not an fp32 sum: a GPU's
tensor cores may add each instruction's products into the accumulator with truncation rather
than round-to-nearest, a bias that grows with the number of instructions chained and with the
accumulator's magnitude (docs/perf/linear.md "fp32 logits"). The chain starts from a runtime
zero (the kernel argument ``zero``): from a constant zero, the compiler folds ``acc + dot(a, w, 0)``
back into ``dot(a, w, acc)``, one chain again.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import BIG_TILE_SHARED, interp, np2, rne, shared_bytes, target_programs, to_out
from .launch import GEMM_KEYS, Tune  # noqa: F401 - GEMM_KEYS: the keys of grouped_gemm's launches
from .predicates import _E8M0, cdiv
from . import dequant, predicates
from .registry import implements

#: launch parameters: tuning overrides (benchmarks/tune_triton.py) over the bound backend's launch
#: table (launch.py); the defaults are the kernels' own
TUNE = Tune(__name__)   # its keys: launch.GEMM_KEYS


@triton.jit
def _mac(acc, a, w, MODE: tl.constexpr, IEEE: tl.constexpr, VIA32: tl.constexpr):
    """``acc + a @ w^T`` for an activation tile a [BM, BK] and a weight tile w [BN, BK], in the
    layout of ``MODE``: 0 "dot" accumulates [BM, BN], 1 "swap" accumulates [BN, BM] (the weight
    tile is the MMA's M side: at small T its rows fill the MMA, and an FP8 tile converted in
    registers feeds a Hopper wgmma from registers, with no shared-memory round trip). IEEE: fp32
    operands and products (fp32 inputs, the interpreter). VIA32: FP8 codes reach the bf16 operand
    through fp32 (the same values: TUNE ``fp8`` "via_f32")."""
    if VIA32:
        w = w.to(tl.float32)
    if MODE == 1:
        if IEEE:
            r = acc + tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), input_precision="ieee")
        else:
            r = tl.dot(w.to(a.dtype), tl.trans(a), acc)
    else:
        if IEEE:
            r = acc + tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            r = tl.dot(a, tl.trans(w.to(a.dtype)), acc)
    return r


@triton.jit
def _gemm_kernel(a_ptr, w_ptr, s_ptr, as_ptr, out_ptr, part_ptr,
                 M, N, K, KPS, S, NB, KB, zero,
                 sa_m, sa_g, sa_k, sw_g, sw_n, sw_k, ss_g,
                 G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 SCALE: tl.constexpr, E8M0: tl.constexpr, IEEE: tl.constexpr, KSUB: tl.constexpr,
                 NBLK: tl.constexpr, EVEN_K: tl.constexpr, SPLIT: tl.constexpr, RNE: tl.constexpr,
                 MODE: tl.constexpr, VIA32: tl.constexpr = False, CHAIN: tl.constexpr = False,
                 A8: tl.constexpr = False):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    pz = tl.program_id(2)
    g = (pz // S).to(tl.int64)
    sp = pz % S
    rows = pm * BM + tl.arange(0, BM)
    rm = rows < M
    cols = pn * BN + tl.arange(0, BN)
    cm = cols < N
    kk = tl.arange(0, BK)
    a_base = a_ptr + rows.to(tl.int64)[:, None] * sa_m + g * sa_g
    w_base = w_ptr + g * sw_g + cols.to(tl.int64)[:, None] * sw_n
    k_lo = sp * KPS
    k_hi = tl.minimum(k_lo + KPS, K)
    if MODE == 1:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    # one step = NBLK groups of KSUB sub-blocks of BK. With scales (or fp32 products) a group is
    # summed into `blk` first: exactly one 128-column block of K, whose multiplier is applied once
    # to the block's sum (fp32 products: a two-level sum); otherwise KSUB and NBLK only unroll the
    # loop. NBLK > 1 puts several scale blocks' loads in one step (more bytes in flight). CHAIN:
    # each sub-block's MMA starts from a runtime zero and its result is added to acc in fp32.
    # A8 (with SCALE): a holds e4m3 codes and as_ptr their scales [M, KB], one a row a 128-column
    # block: the block's sum is an FP8 x FP8 MMA on the codes, times both blocks' scales
    if CHAIN:
        rz = tl.zeros_like(acc) + zero
    for k1 in range(k_lo, k_hi, BK * KSUB * NBLK):
        for nb in tl.static_range(NBLK):
            kb = k1 + nb * (BK * KSUB)
            blk = tl.zeros_like(acc)
            for kin in tl.static_range(KSUB):
                ks = kb + kin * BK + kk
                if EVEN_K:
                    a = tl.load(a_base + ks[None, :] * sa_k, mask=rm[:, None], other=0.0)
                    w = tl.load(w_base + ks[None, :] * sw_k, mask=cm[:, None], other=0.0)
                else:
                    km = ks < k_hi
                    a = tl.load(a_base + ks[None, :] * sa_k, mask=rm[:, None] & km[None, :], other=0.0)
                    w = tl.load(w_base + ks[None, :] * sw_k, mask=cm[:, None] & km[None, :], other=0.0)
                if SCALE or IEEE:
                    blk = _mac(blk, a, w, MODE, IEEE, VIA32)
                elif CHAIN:
                    acc += _mac(rz, a, w, MODE, IEEE, VIA32)
                else:
                    acc = _mac(acc, a, w, MODE, IEEE, VIA32)
            if SCALE:
                if NBLK > 1:   # a group past the end of K (ragged K) has blk = 0: its block
                    kb = tl.minimum(kb, k_hi - 1)   # index is clamped into the scale grid
                sidx = g * ss_g + (cols // 128) * KB + kb // 128
                if E8M0:
                    sv = tl.exp2(tl.load(s_ptr + sidx, mask=cm, other=127).to(tl.float32) - 127.0)
                else:
                    sv = tl.load(s_ptr + sidx, mask=cm, other=0.0)
                if A8:
                    av = tl.load(as_ptr + rows.to(tl.int64) * KB + kb // 128, mask=rm, other=0.0)
                    if MODE == 1:
                        acc += blk * sv[:, None] * av[None, :]
                    else:
                        acc += blk * sv[None, :] * av[:, None]
                elif MODE == 1:
                    acc += blk * sv[:, None]
                else:
                    acc += blk * sv[None, :]
            elif IEEE:
                acc += blk
    # outputs [M, G, N] (split: fp32 partials [S, M, G, N], summed by _reduce_kernel in a fixed order)
    if SPLIT:
        rr = sp * M + rows.to(tl.int64)
    else:
        rr = rows.to(tl.int64)
    if MODE == 1:
        off = (rr[None, :] * G + g) * N + cols[:, None]
        om = cm[:, None] & rm[None, :]
    else:
        off = (rr[:, None] * G + g) * N + cols[None, :]
        om = rm[:, None] & cm[None, :]
    if SPLIT:
        tl.store(part_ptr + off, acc, mask=om)
    else:
        tl.store(out_ptr + off, to_out(acc, out_ptr, RNE), mask=om)


@triton.jit
def _reduce_kernel(part_ptr, out_ptr, R, S, BLOCK: tl.constexpr, SP: tl.constexpr, RNE: tl.constexpr):
    # the S partials of BLOCK outputs loaded at once ([SP, BLOCK], SP = next power of 2 >= S) and
    # summed by one tl.sum: a fixed order for a given S (no dependence on scheduling), and one
    # memory latency instead of S in a row
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < R
    sp = tl.arange(0, SP)
    p = tl.load(part_ptr + sp[:, None].to(tl.int64) * R + offs[None, :], mask=(sp[:, None] < S) & m[None, :], other=0.0)
    tl.store(out_ptr + offs, to_out(tl.sum(p, axis=0), out_ptr, RNE), mask=m)


#: the kernel's MODE constexpr by name (TUNE key "mode"); see _mac
MODES = {"dot": 0, "swap": 1}
#: how FP8 e4m3 codes become the MMA's bf16 operand (TUNE key "fp8"; both give the same bf16
#: values, so the same result bit for bit): "cvt" (default) converts e4m3 -> bf16, "via_f32"
#: e4m3 -> fp32 -> bf16, a chain that some targets run with fewer conversion instructions (sm90
#: SASS: benchmarks/results/sm90-aot/2026-12-01_7374812/aot/sass-fp8-decode-loops.md; on an H200 15-21 % faster, the CUDA
#: plugin's table entry: benchmarks/results/h200/2026-12-01_c29f187/tune/fp8-via-f32-flash.json)
FP8_PATHS = ("cvt", "via_f32")
#: K columns an MMA chain sums before its result joins the fp32 running sum, for fp32 outputs of
#: tensor-core products (TUNE key ``chain``; the module docstring says why). Design reason: the
#: portable tiles' K step (linear_tiles' BK), so with them each tl.dot starts its own chain and the
#: tiles stay as they are. (A plugin table sets its own from a measurement: the CUDA sm90 entry.)
CHAIN_K = 64


def linear_tiles(M: int, scaled: bool, big: bool = False) -> tuple:
    """linear's portable launch defaults for M rows: (mode, BM, BN, BK, num_warps, num_stages) (an
    op's tiles may add NBLK as a seventh value). A plugin's launch table replaces them with its own
    function of the same arguments (TUNE ``tiles``; ``big``: the device has BIG_TILE_SHARED of
    shared memory a block, which these tiles do not use).

    Design reason, no device timed: "dot" (the MMA every Triton backend lowers); 16 rows at decode
    (M <= 16, the smallest MMA row tile, so T = 1 pads least), 64 above; 64-column weight tiles and
    64-column K steps (with 128x128 block scales: two sub-blocks a scale block) on 4 warps, 2
    stages: (BM + BN) x BK x 2 B x 2 stages <= 32 KiB of shared memory for bf16 operands, within
    the 64 KiB a block of the smallest targets (gfx942 LDS, an XPU's SLM)."""
    return "dot", 16 if M <= 16 else 64, 64, 64, 4, 2


def _config(op: str, M: int, ieee: bool, scaled: bool, tune, tiles, f32: bool = True, big: bool = False,
            quantised=None, chained: bool = False, a8: bool = False) -> dict:
    """The launch of one call: ``tiles(M, quantised, big)`` (TUNE ``tiles``, a plugin table's tile
    function, else ``tiles``, the op's portable defaults; ``a8``, the FP8 x FP8 GEMM: TUNE
    ``w8a8_tiles`` first; ``quantised``: FP8
    codes read, default ``scaled``; bf16 codes converted once take the bf16 tiles; small fp32
    tiles when the products are fp32), then the TUNE / launch-table keys ``mode`` (dot | swap), ``BM``, ``BN``,
    ``BK``, ``num_warps``, ``num_stages``, ``KSUB`` (unrolled sub-blocks a group; set by BK with
    block scales or fp32 products, where a group is one 128-column block), ``NBLK`` (groups a K
    step, default 1: with block scales, scale blocks a step), ``fp8`` (:data:`FP8_PATHS`; FP8
    weights only), ``S`` (a fixed split-K factor), ``target`` (the programs the split rule
    fills; default 2 per SM) and, when ``chained`` (fp32 outputs of tensor-core products without
    block scales), ``chain`` (K columns an MMA chain sums, default :data:`CHAIN_K`; 0: one chain
    over all of K): a K step keeps its bytes, in sub-blocks of ``chain`` columns."""
    if ieee:
        # fp32 products: small tiles; fp32 inputs sum 32-column dots in 128-column blocks (two
        # levels), bf16 inputs under the interpreter one dot a block (fewer interpreted steps)
        mode, BM, BN, BK, nw, ns, *nblk = "dot", min(64, max(16, np2(M))), 64, 32 if f32 else 128, 4, 2
    else:
        tf = (a8 and tune.get("w8a8_tiles")) or tune.get("tiles", tiles)
        mode, BM, BN, BK, nw, ns, *nblk = tf(M, scaled if quantised is None else quantised, big)
        if scaled:
            BK = min(BK, 128)   # bf16 codes with block scales: a K step within one 128-column block
    cfg = dict(mode=mode, BM=BM, BN=BN, BK=BK, num_warps=nw, num_stages=ns, NBLK=nblk[0] if nblk else 1)
    cfg.update({k: tune.get(k, v) for k, v in cfg.items()})
    if cfg["mode"] not in MODES:
        raise ValueError(f"{op}: TUNE mode={cfg['mode']!r}; expected one of {', '.join(MODES)}")
    cfg["fp8"] = tune.get("fp8", FP8_PATHS[0])
    if cfg["fp8"] not in FP8_PATHS:
        raise ValueError(f"{op}: TUNE fp8={cfg['fp8']!r}; expected one of {', '.join(FP8_PATHS)}")
    BK, NBLK = cfg["BK"], cfg["NBLK"]
    if scaled and 128 % BK:
        raise ValueError(f"{op}: BK={BK} must divide 128 with block-scaled weights (TUNE override?)")
    cfg["KSUB"] = max(1, 128 // BK) if scaled or ieee else tune.get("KSUB", 1)
    cfg["chain"] = 0
    if chained:
        # the same bytes a K step, in sub-blocks of at most `chain` columns: one MMA chain each
        chain = tune.get("chain", CHAIN_K)
        if chain and (not isinstance(chain, int) or chain < 16 or chain & (chain - 1)):
            raise ValueError(f"{op}: TUNE chain={chain!r}; expected 0 or a power of two >= 16 (tl.dot)")
        if chain and chain < BK:
            cfg["KSUB"], cfg["BK"] = cfg["KSUB"] * (BK // chain), chain
            BK = chain
        cfg["chain"] = min(chain, BK)
    step = BK * cfg["KSUB"] * NBLK
    if NBLK < 1 or step & (step - 1):   # the split-K step (a multiple of it) and EVEN_K assume powers of two
        raise ValueError(f"{op}: BK * KSUB * NBLK = {BK} * {cfg['KSUB']} * {NBLK} = {step} must be a power of two "
                         f"(TUNE override?)")
    if min(cfg["BM"], cfg["BN"], BK) < 16:
        raise ValueError(f"{op}: {cfg['mode']} mode needs BM, BN, BK >= 16 (tl.dot), got {cfg} (TUNE override?)")
    return cfg


def _plan(op, M, G, K, N, f32, ieee, big, scaled, e8, out, tune, tiles, w_dtype, a8=False):
    """grouped_gemm's launch for these shapes: (S, grid, {KPS, NB, KB, const: the GEMM's constexprs
    and launch keywords}, the reduction's (grid, keywords) or None). ``a8``: FP8 activation codes
    with per-row block scales (the FP8 x FP8 product; its tiles: TUNE ``w8a8_tiles``)."""
    fp8 = scaled and w_dtype != torch.bfloat16      # FP8 codes read (not bf16 codes converted once)
    chained = not ieee and not scaled and out.dtype == torch.float32
    cfg = _config(op, M, ieee, scaled, tune, tiles, f32, big, quantised=fp8, chained=chained, a8=a8)
    BM, BN, BK, KSUB, NBLK = cfg["BM"], cfg["BN"], cfg["BK"], cfg["KSUB"], cfg["NBLK"]
    NB, KB = cdiv(N, 128), cdiv(K, 128)
    mt, nt = cdiv(M, BM), cdiv(N, BN)
    # split K when the (M, N, G) tiles alone leave the GPU idle; a split is whole 128-blocks
    step = max(BK * KSUB * NBLK, 128)  # a multiple of BK * KSUB * NBLK (all powers of two)
    kblocks = cdiv(K, step)
    S = tune.get("S") or tune.get("target", target_programs(out.device)) // (mt * nt * G)
    KPS = cdiv(kblocks, max(1, min(kblocks, S))) * step
    S = cdiv(K, KPS)
    # VIA32 / CHAIN are passed only when set: other launches keep their constexprs
    via = {"A8": True} if a8 else {"VIA32": True} if fp8 and cfg["fp8"] == "via_f32" else {}
    if cfg["chain"]:
        via["CHAIN"] = True
    const = dict(G=G, BM=BM, BN=BN, BK=BK, SCALE=scaled, E8M0=e8, IEEE=ieee, KSUB=KSUB, NBLK=NBLK,
                 EVEN_K=K % KPS == 0, SPLIT=S > 1, RNE=rne(out), MODE=MODES[cfg["mode"]],
                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **via, **tune.options())
    red = None
    if S > 1:
        SP = np2(S)
        BLOCK = max(32, min(1024, 8192 // SP))      # <= 8192 partials in flight per program
        red = ((cdiv(M * G * N, BLOCK),), dict(BLOCK=BLOCK, SP=SP, RNE=rne(out), num_warps=4, **tune.options()))
    return S, (mt, nt, G * S), {"KPS": KPS, "NB": NB, "KB": KB, "const": const}, red


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, scale, out_dtype: torch.dtype, *, tune=TUNE,
                 tiles=linear_tiles, op: str = "linear", a_scale=None) -> torch.Tensor:
    """``out[m, g, n] = sum_k a[m, g, k] * W[g, n, k] (* block scale)``; a [M, G, K] and w [G, N, K]
    in any strides; scale [G, ceil(N/128), ceil(K/128)] (fp32 / e8m0) or None. Returns [M, G, N].
    ``tune`` / ``tiles`` / ``op``: the calling op's launch parameters, defaults and name (wo_a
    passes its own). ``a_scale``: a holds float8_e4m3fn codes (G = 1, w FP8 with ``scale``) and
    a_scale [M, ceil(K/128)] float32 their multipliers per 128-column block: the FP8 x FP8 GEMM."""
    M, G, K = a.shape
    N = w.shape[1]
    out = torch.empty((M, G, N), dtype=out_dtype, device=a.device)
    if M == 0 or G == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()
    scaled = scale is not None
    f32 = a.dtype == torch.float32 or w.dtype == torch.float32
    ieee = f32 or interp(a)
    # many rows (TUNE "dequant_rows"; the scratch at most "dequant_bytes"): the FP8 codes converted
    # to bf16 once (dequant.py), then bf16 tiles; the block scales still multiply each block's sum
    a8 = a_scale is not None
    if a8 and not (scaled and G == 1 and a.dtype == w.dtype == torch.float8_e4m3fn
                   and tuple(a_scale.shape) == (M, cdiv(K, 128)) and a_scale.dtype == torch.float32):
        raise ValueError(f"{op}: FP8 activations need e4m3 a and block-scaled e4m3 w (G = 1) and float32 a_scale "
                         f"[{M}, {cdiv(K, 128)}]; got a {a.dtype}, w {w.dtype}, scale {scale is not None}, "
                         f"a_scale {a_scale.dtype} {tuple(a_scale.shape)}")
    codes = scaled and not a8 and w.dtype != torch.bfloat16 and dequant.wanted(tune, op, M) \
        and 2 * w.numel() <= dequant.budget(tune, op)
    if codes and dequant.foldable(scale):   # UE8M0 scales: folded in, a plain bf16 GEMM
        w, scale, scaled = dequant.fp8_to_bf16(w, scale), None, False
    elif codes:
        w = dequant.fp8_codes(w)
    big = shared_bytes(a.device) >= BIG_TILE_SHARED
    e8 = scaled and _E8M0 is not None and scale.dtype == _E8M0
    # the launch (everything but the tensors and their strides) depends on these values and the
    # launch parameters only: planned once per such key (Tune.memo; the device helpers in the key:
    # aot.device_branch and tests replace them)
    S, grid, kw, red = tune.memo((op, M, G, K, N, a.dtype, w.dtype, out_dtype, a.device, scaled, e8, ieee, big,
                                  tiles, target_programs, rne, a8),
                                 lambda: _plan(op, M, G, K, N, f32, ieee, big, scaled, e8, out, tune, tiles, w.dtype,
                                               a8))
    s = scale.contiguous() if scaled else a
    if e8:
        s = s.view(torch.uint8)
    part = torch.empty((S, M, G, N), dtype=torch.float32, device=a.device) if S > 1 else out
    # a_scale None (every launch but the FP8 x FP8 one): Triton takes the argument as a constant,
    # so those launches compile to the code they had before the argument existed
    _gemm_kernel[grid](a, w, s, a_scale.contiguous() if a8 else None, out, part, M, N, K, kw["KPS"], S, kw["NB"], kw["KB"], 0.0,
                       a.stride(0), a.stride(1), a.stride(2), w.stride(0), w.stride(1), w.stride(2), kw["NB"] * kw["KB"],
                       **kw["const"])
    if S > 1:
        _reduce_kernel[red[0]](part, out, M * G * N, S, **red[1])
    return out


#: how linear runs the official W8A8 (``act_block``) with FP8 weights (TUNE key ``w8a8``):
#: "values" (default; portable: any tensor-core backend) multiplies the dequantised activation
#: values (quant.fake_quant_fp8, exact in x's dtype) with the weight codes converted in registers,
#: a bf16 MMA; "fp8" runs an FP8 x FP8 MMA on the activation codes (quant.quant_fp8) and the
#: weight codes, for targets with FP8 tensor cores (a plugin's table says which). Both compute
#: each 128-column block's sum of exact products, scaled once per block; "fp8" is taken for
#: half-precision outputs only: an FP8 MMA's own accumulation over a block's 128 columns is not
#: an fp32 sum on every target (docs/perf/linear.md "W8A8 on FP8 tensor cores"), which an fp32
#: output's bound would see and a bf16 / fp16 output's rounding hides
W8A8_PATHS = ("values", "fp8")


def _w8a8_codes(x, weight, weight_scale, act_block, out_dtype) -> bool:
    """linear takes the FP8 x FP8 path for this call (TUNE ``w8a8`` "fp8" and a call it computes)."""
    path = TUNE.get("w8a8", W8A8_PATHS[0])
    if path not in W8A8_PATHS:
        raise ValueError(f"linear: TUNE w8a8={path!r}; expected one of {', '.join(W8A8_PATHS)}")
    half = (torch.bfloat16, torch.float16)
    return (path == "fp8" and act_block == 128 and weight.dtype == torch.float8_e4m3fn and weight_scale is not None
            and x.dtype in half and (out_dtype or x.dtype) in half)


@implements("linear", supports=predicates.linear_supports)
def linear(x, weight, weight_scale=None, out_dtype=None, act_block=None):
    K = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)  # a view whenever the leading dims allow it; strides are passed through
    ws = None if weight_scale is None else weight_scale.unsqueeze(0)
    a_scale = None
    if act_block is not None:
        from .quant import fake_quant_fp8, quant_fp8

        if _w8a8_codes(x, weight, weight_scale, act_block, out_dtype):
            x2, a_scale = quant_fp8(x2, act_block)
        else:
            x2 = fake_quant_fp8(x2, act_block)
    out = grouped_gemm(x2.unsqueeze(1), weight.unsqueeze(0), ws, out_dtype or x.dtype, a_scale=a_scale)
    return out.view(*lead, weight.shape[0])
