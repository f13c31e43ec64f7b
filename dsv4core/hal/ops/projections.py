"""Projections: linear (bf16 / fp8 128x128 block-scaled) and the grouped wo_a (SPEC.md section 2)."""

from __future__ import annotations

import torch

from ..quant import FP8_BLOCK as BLOCK, FP8_E4M3 as FP8, fake_quant, quantize_fp8_block
from ..spec import ACT_DTYPES, Case, Dims, Tolerance, compute_dtype, expect, op
from ._cases import TOKENS, block_varied, dims, noncontig, randn

SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)
WEIGHT_DTYPES = ACT_DTYPES + (torch.float64, FP8)


def dequant_block_fp8(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """``W[i, j] = Wq[i, j] * S[i // block, j // block]`` over the last two dims, computed in ``dtype``.

    The scale is the dequantisation multiplier (float32 or float8_e8m0fnu, i.e. ``2^(byte-127)``).
    """
    rows, cols = w.shape[-2], w.shape[-1]
    s = scale.to(dtype).repeat_interleave(block, -2)[..., :rows, :].repeat_interleave(block, -1)[..., :cols]
    return w.to(dtype) * s


def _weight(w: torch.Tensor, scale: torch.Tensor | None, ct: torch.dtype) -> torch.Tensor:
    return w.to(ct) if scale is None else dequant_block_fp8(w, scale, ct)


def _check_scale(op_name: str, d: Dims, weight, weight_scale, lead: tuple) -> None:
    if weight.dtype == FP8:
        expect(op_name, "weight_scale", weight_scale is not None,
               "a block scale tensor for a float8_e4m3fn weight", None)
    if weight_scale is not None:
        expect(op_name, "weight", weight.dtype == FP8, "dtype float8_e4m3fn when weight_scale is given", weight.dtype)
        grid = lead + (-(-weight.shape[-2] // BLOCK), -(-weight.shape[-1] // BLOCK))
        d.tensor("weight_scale", weight_scale, grid, SCALE_DTYPES)


#: the activation block sizes of the official quantised numerics (``act_block`` arguments)
ACT_BLOCKS = (128,)


def quantized_activation(x: torch.Tensor, act_block: int | None, ct: torch.dtype) -> torch.Tensor:
    """``x`` in ``ct``; with ``act_block`` the official FP8 activation quantisation first
    (``fake_quant(x, "fp8", act_block)``: per row, per ``act_block`` columns; exact values)."""
    return x.to(ct) if act_block is None else fake_quant(x, "fp8", act_block).to(ct)


def check_act_block(op_name: str, act_block, x) -> None:
    expect(op_name, "act_block", act_block is None or (isinstance(act_block, int) and act_block in ACT_BLOCKS),
           f"None or one of {ACT_BLOCKS}", act_block)
    if act_block is not None:
        expect(op_name, "x", x.shape[-1] % act_block == 0, f"last dim a multiple of act_block {act_block}",
               f"shape {tuple(x.shape)}")


@op(family="projections", params_since={"act_block": (1, 2)}, tolerance=Tolerance(
    k=4.0, floor=1e-6,
    why="a length-K fp32 dot product per output: blocked/split-K accumulation orders differ from "
        "torch's by a few roundings of K-term sums; fp8 weights are dequantised exactly; the "
        "activation quantisation (act_block) is exact and depends on x only"))
def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None, act_block: int | None = None) -> torch.Tensor:
    """``y = x @ W^T`` with fp32 accumulation. weight [N, K] in an act dtype, or float8_e4m3fn with
    ``weight_scale`` [ceil(N/128), ceil(K/128)] block dequantisation multipliers. Output dtype
    ``out_dtype`` (default x.dtype).

    ``act_block`` (HAL 1.2): None = x as it is (exact numerics); 128 = the official W8A8: x is first
    quantised per token per 128 columns with the official rule (``hal.quant.act_quant``: a
    power-of-two scale ``2^ceil(log2(amax / 448))``, e4m3 codes) and the product is taken with
    the dequantised codes, i.e. an FP8 x FP8 GEMM with both scales applied per 128-wide K block.
    Any weight dtype: FP8 weights, or weights holding FP8-dequantised values, give the same result."""
    ct = compute_dtype(x)
    return (quantized_activation(x, act_block, ct) @ _weight(weight, weight_scale, ct).T).to(out_dtype or x.dtype)


@linear.check
def _(x, weight, weight_scale=None, out_dtype=None, act_block=None):
    d = Dims("linear").tensor("x", x, dtypes=ACT_DTYPES + (torch.float64,), min_rank=1)
    d.sizes["K"] = x.shape[-1]
    d.tensor("weight", weight, ("N", "K"), WEIGHT_DTYPES)
    _check_scale("linear", d, weight, weight_scale, ())
    expect("linear", "out_dtype", out_dtype is None or isinstance(out_dtype, torch.dtype), "a torch.dtype or None",
           out_dtype)
    check_act_block("linear", act_block, x)


@linear.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    H, q_lora = D["H"], D["q_lora"]
    for T in TOKENS[shapes]:
        yield Case(f"T{T}-wq_a", dict(x=randn((T, H), gen, dtype, device),
                                      weight=randn((q_lora, H), gen, dtype, device, H ** -0.5)))
    w = randn((q_lora, H), gen, torch.float32, device, H ** -0.5)
    for sd in SCALE_DTYPES:
        q, s = quantize_fp8_block(w, sd, BLOCK, pow2=True)
        yield Case(f"fp8-{str(sd).replace('torch.', '')}", dict(x=randn((5, H), gen, dtype, device), weight=q,
                                                                weight_scale=s), ("fp8",))
    yield Case("out-fp32", dict(x=randn((3, H), gen, dtype, device), weight=randn((64, H), gen, dtype, device),
                                out_dtype=torch.float32))
    # ragged fp8 block grid (N, K not multiples of 128), 3-d non-contiguous x, large magnitudes
    wr = randn((200, 300), gen, torch.float32, device, 300 ** -0.5 * 50)
    q, s = quantize_fp8_block(wr, torch.float32, BLOCK, pow2=True)
    yield Case("fp8-ragged-3d", dict(x=randn((2, 3, 300), gen, dtype, device, 100.0), weight=q, weight_scale=s,
                                     out_dtype=torch.float32), ("fp8", "extreme"))
    yield Case("noncontig-3d", dict(x=noncontig(randn((2, 5, H), gen, dtype, device)),
                                    weight=randn((96, H), gen, dtype, device, H ** -0.5)), ("noncontig",))
    yield Case("T1-lm_head-fp32out", dict(x=randn((1, H), gen, dtype, device),
                                          weight=randn((1000, H), gen, dtype, device, H ** -0.5),
                                          out_dtype=torch.float32))
    # block scales that differ in BOTH directions (2 x 3 grid, magnitudes 2^-3 .. 2^3 per block):
    # a kernel applying the scales per output row only, per column only, or one scale for all
    # blocks fails; e8m0, power-of-two fp32 and free fp32 (amax / 448) scales
    wv = block_varied(randn((256, 384), gen, torch.float32, device, 384 ** -0.5), levels=7, block=BLOCK)
    for label, sd, pow2 in (("e8m0", torch.float8_e8m0fnu, True), ("float32", torch.float32, False)):
        q, s = quantize_fp8_block(wv, sd, BLOCK, pow2=pow2)
        yield Case(f"fp8-varied-blocks-{label}", dict(x=randn((4, 384), gen, dtype, device), weight=q, weight_scale=s),
                   ("fp8",))
    # an output dtype other than the input's (bf16 out from fp32 in, fp32 out from bf16 in)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    yield Case("out-other-dtype", dict(x=randn((3, H), gen, dtype, device),
                                       weight=randn((64, H), gen, dtype, device, H ** -0.5), out_dtype=other))
    yield from _w8a8_cases(shapes, dtype, device, gen, wv)
    # the lm_head as the published models run it (bf16 x and weight [vocab, H], fp32 logits) at
    # decode batch sizes: the widest GEMM of the model (a grid over ~10^5 output column tiles, a
    # 1 - 1.9 GB weight operand). Only in the flash / pro sets and in bf16 (the weight is drawn once,
    # last, so the cases above keep their generator draws); never in the small set
    if "V" in D and dtype == torch.bfloat16:
        w = randn((D["V"], H), gen, dtype, device, H ** -0.5)
        for T in (1, 2, 8):
            yield Case(f"lm_head-T{T}-V{D['V']}", dict(x=randn((T, H), gen, dtype, device), weight=w,
                                                       out_dtype=torch.float32), ("extreme",))
    yield from _w8a8_fp8_cases(shapes, dtype, device, gen)


def _w8a8_fp8_cases(shapes, dtype, device, gen):
    """The official W8A8 on FP8 weights as the published checkpoints store them (e4m3 codes,
    UE8M0 128x128 block scales), the call a backend may run as an FP8 x FP8 product on the
    activation codes: decode and batch row counts (and a prefill one in the flash / pro sets),
    per-block activation magnitudes 2^-6 .. 2^6 with a zero token, and a ragged N (a partial
    output tile and scale block). Drawn after every other case (their draws are unchanged)."""
    D = dims(shapes)
    H = D["H"]
    w = randn((D["q_lora"], H), gen, torch.float32, device, H ** -0.5)
    q, s = quantize_fp8_block(w, torch.float8_e8m0fnu, BLOCK, pow2=True)
    rows = (1, TOKENS[shapes][-1]) + ((1024,) if shapes != "small" else ())
    for T in rows:
        x = block_varied(randn((T, H), gen, torch.float32, device), levels=13, block=BLOCK)
        if T > 1:
            x[T // 2] = 0.0
        yield Case(f"w8a8-fp8-T{T}", dict(x=x.to(dtype), weight=q, weight_scale=s, act_block=128), ("w8a8", "fp8"))
    wr = randn((200, 256), gen, torch.float32, device, 256 ** -0.5 * 8)
    q, s = quantize_fp8_block(wr, torch.float8_e8m0fnu, BLOCK, pow2=True)
    yield Case("w8a8-fp8-ragged-N", dict(x=randn((5, 256), gen, dtype, device, 3.0), weight=q, weight_scale=s,
                                         act_block=128), ("w8a8", "fp8"))


def _w8a8_cases(shapes, dtype, device, gen, wv):
    """The official W8A8 (act_block=128). The activations are built so that the classic mistakes
    of the activation rule are large errors, not rounding noise: per-token, per-block magnitudes
    spread over 2^-6 .. 2^6 (a per-tensor or per-row amax flushes the small blocks), block maxima
    of the form 1.6 * 2^k (floor instead of ceil in the scale exponent makes x / s reach 1.6 * 448
    and clamp), and values on a fine grid (a non-power-of-two scale amax / 448 rounds them to
    other codes)."""
    D = dims(shapes)
    H = D["H"]
    for T in (1, TOKENS[shapes][-1]):
        x = block_varied(randn((T, H), gen, torch.float32, device), levels=13, block=BLOCK)
        yield Case(f"w8a8-T{T}", dict(x=x.to(dtype), weight=randn((D["q_lora"], H), gen, dtype, device, H ** -0.5),
                                      act_block=128), ("w8a8",))
    # activation blocks 2^0, 2^-8, 2^-16 ... apart, the weight's columns scaled back: every block
    # contributes alike to y, so a block quantised with another block's (or the tensor's) amax
    # shows at full weight
    f = 2.0 ** (-8.0 * (torch.arange(H // BLOCK) % 3)).repeat_interleave(BLOCK).to(device)
    yield Case("w8a8-block-magnitudes", dict(x=(randn((5, H), gen, torch.float32, device) * f).to(dtype),
                                             weight=(randn((64, H), gen, torch.float32, device, H ** -0.5) / f).to(dtype),
                                             out_dtype=torch.float32, act_block=128), ("w8a8",))
    # W8A8 with an output dtype other than the input's (a W8A8 kernel that ignores out_dtype fails)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    yield Case("w8a8-out-other-dtype", dict(x=randn((3, H), gen, dtype, device),
                                            weight=randn((64, H), gen, dtype, device, H ** -0.5),
                                            out_dtype=other, act_block=128), ("w8a8",))
    q, s = quantize_fp8_block(wv, torch.float8_e8m0fnu, BLOCK, pow2=True)
    x = randn((6, wv.shape[1]), gen, torch.float32, device, 0.5)
    x[:, ::BLOCK] = 1.6 * 2.0 ** torch.randint(-4, 4, (6, 1), generator=gen).to(device)   # amax 1.6 * 2^k
    x[1] = 0.0                                                                    # a zero token
    yield Case("w8a8-fp8-weight", dict(x=x.to(dtype), weight=q, weight_scale=s, act_block=128), ("w8a8", "fp8"))
    yield Case("w8a8-fp32out-3d", dict(x=randn((2, 3, H), gen, dtype, device, 40.0),
                                       weight=randn((64, H), gen, dtype, device, H ** -0.5),
                                       out_dtype=torch.float32, act_block=128), ("w8a8",))


@op(family="projections", tolerance=Tolerance(
    k=4.0, floor=1e-6, why="a length-D fp32 dot product per output, like linear"))
def wo_a(o: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped low-rank output projection ``out[t, g, r] = sum_d o[t, g, d] * W[g, r, d]``.
    o [T, G, D]; weight [G, R, D] (act, or float8_e4m3fn with scales [G, R/128, D/128]); fp32
    accumulation, result in o.dtype."""
    ct = compute_dtype(o)
    return torch.einsum("tgd,grd->tgr", o.to(ct), _weight(weight, weight_scale, ct)).to(o.dtype)


@wo_a.check
def _(o, weight, weight_scale=None):
    d = Dims("wo_a").tensor("o", o, ("T", "G", "D"), ACT_DTYPES + (torch.float64,))
    d.tensor("weight", weight, ("G", "R", "D"), WEIGHT_DTYPES)
    _check_scale("wo_a", d, weight, weight_scale, (weight.shape[0],))


@wo_a.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    G, R, Din = D["G"], D["R"], D["heads"] * D["d"] // D["G"]
    w = randn((G, R, Din), gen, torch.float32, device, Din ** -0.5)
    for T in TOKENS[shapes]:
        yield Case(f"T{T}", dict(o=randn((T, G, Din), gen, dtype, device), weight=w.to(dtype)))
    q, s = quantize_fp8_block(w, torch.float8_e8m0fnu, BLOCK, pow2=True)
    yield Case("fp8", dict(o=randn((3, G, Din), gen, dtype, device), weight=q, weight_scale=s), ("fp8",))
    q, s = quantize_fp8_block(w, torch.float32, BLOCK, pow2=True)
    yield Case("fp8-f32scale-noncontig", dict(o=noncontig(randn((5, G, Din), gen, dtype, device, 30.0)), weight=q,
                                              weight_scale=s), ("fp8", "noncontig"))
    # o as the attention output really arrives: [T, h, d] viewed as [T, G, h/G * d] after a transpose
    o = randn((4, D["heads"], D["d"]), gen, dtype, device).view(4, G, Din)
    yield Case("grouped-view", dict(o=o, weight=w.to(dtype)))
