"""Rotary position embedding: interleaved, partial (trailing channels), forward and inverse;
fused with the per-head q norm and the kv norm (SPEC.md section 2, rope)."""

from __future__ import annotations

import math

import torch

from ..quant import OFFICIAL_ACT_DTYPE, fake_quant
from ..spec import ACT_DTYPES, F32, INT_DTYPES, Case, Dims, Tolerance, compute_dtype, expect, op
from ._cases import TOKENS, block_varied, dims, noncontig, positions, randn
from .norms import rms


def rotate(xf: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Rotate the last ``2 * len(inv_freq)`` channels of ``xf`` (compute dtype) in pairs (2i, 2i+1).

    Angles are ``fl32(p) * fl32(inv_freq_i)`` (the product rounded to fp32, as the spec says), then
    cos/sin are taken in the compute dtype. Dims between the token dim and the channel dim broadcast.
    """
    d_r = 2 * inv_freq.shape[0]
    angle = (positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]).to(xf.dtype)
    angle = angle.view(angle.shape[0], *([1] * (xf.dim() - 2)), angle.shape[1])
    cos, sin = angle.cos(), angle.sin()
    if inverse:
        sin = -sin
    pairs = xf[..., xf.shape[-1] - d_r:].unflatten(-1, (d_r // 2, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((xf[..., :xf.shape[-1] - d_r], rotated), dim=-1)


def rope_frequencies(d_r: int, theta: float, factor: float | None = None, original_max_position: int | None = None,
                     beta_fast: float = 32.0, beta_slow: float = 1.0) -> torch.Tensor:
    """float32 inverse frequencies [d_r/2] (SPEC.md rope): ``theta^(-2i/d_r)``, or with ``factor`` the
    YaRN ramp between that base and base/factor (no mscale). The one definition in dsv4core: the
    model's config and the conformance cases both call it. float32 arithmetic in the order
    transformers' default / YaRN initialisers use, so the values are bit-identical to theirs."""
    pos_freqs = theta ** (torch.arange(0, d_r, 2, dtype=torch.float32) / d_r)
    base = 1.0 / pos_freqs
    if factor is None:
        return base

    def corr(r: float) -> float:
        return d_r * math.log(original_max_position / (r * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(math.floor(corr(beta_fast)), 0)
    hi = min(math.ceil(corr(beta_slow)), d_r - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(d_r // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    extrap = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrap) + base * extrap


def yarn_inv_freq(d_r: int, theta: float, factor: float, original_max_position: int,
                  beta_fast: float, beta_slow: float) -> torch.Tensor:
    """Compressed layers' inv_freq (SPEC.md rope): YaRN ramp between base and base/factor, no mscale."""
    return rope_frequencies(d_r, theta, factor, original_max_position, beta_fast, beta_slow)


def main_inv_freq(d_r: int, theta: float) -> torch.Tensor:
    """Sliding-only layers' inv_freq: ``theta^(-2i/d_r)``."""
    return rope_frequencies(d_r, theta)


def _check_rope_args(op_name: str, d: Dims, x_arg: str, x, positions, inv_freq) -> None:
    d.tensor("positions", positions, ("T",), INT_DTYPES)
    d.tensor("inv_freq", inv_freq, ("R",), F32)
    expect(op_name, "inv_freq", 0 < 2 * inv_freq.shape[0] <= x.shape[-1],
           f"2 * len(inv_freq) <= {x_arg}.shape[-1] = {x.shape[-1]}", f"len {inv_freq.shape[0]}")


@op(family="rope", tolerance=Tolerance(
    k=2.0, floor=1e-6,
    why="two products and a sum per channel with fp32 cos/sin of the same fp32 angle; angle "
        "rounding is part of the spec, so a backend computing the angle differently fails at "
        "large positions, as it should"))
def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``d_r = 2 * len(inv_freq)`` channels of x [T, ..., d] in interleaved
    pairs by ``t = fl32(p) * inv_freq_i`` (``-t`` if inverse); other channels pass through."""
    return rotate(x.to(compute_dtype(x)), positions, inv_freq, inverse).to(x.dtype)


@rope.check
def _(x, positions, inv_freq, inverse=False):
    d = Dims("rope").tensor("x", x, dtypes=ACT_DTYPES + (torch.float64,), min_rank=2)
    d.sizes["T"] = x.shape[0]
    _check_rope_args("rope", d, "x", x, positions, inv_freq)


def _rope_cases(shapes, dtype, device, gen, make_x, extra, arg="x"):
    D = dims(shapes)
    freqs = {"main": main_inv_freq(D["d_r"], 10000.0),
             "yarn": yarn_inv_freq(D["d_r"], 160000.0, 16.0, 65536, 32.0, 1.0)}
    for T in TOKENS[shapes]:
        for fname, f in freqs.items():
            yield Case(f"T{T}-{fname}", dict({arg: make_x(T)}, positions=positions(T, gen, device),
                                             inv_freq=f.to(device), **extra))


@rope.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    main = main_inv_freq(D["d_r"], 10000.0).to(device)
    yield from _rope_cases(shapes, dtype, device, gen, lambda T: randn((T, D["heads"], D["d"]), gen, dtype, device),
                           dict(inverse=False))
    yield Case("inverse", dict(x=randn((5, D["heads"], D["d"]), gen, dtype, device), positions=positions(5, gen, device),
                               inv_freq=main, inverse=True))
    yield Case("indexer-2d", dict(x=randn((6, D["dI"]), gen, dtype, device), positions=positions(6, gen, device),
                                  inv_freq=main, inverse=False))
    # the whole head rotated (d_r = d), small positions (0, 1, 2 ...: exact angles)
    full = main_inv_freq(D["d"], 10000.0).to(device)
    yield Case("full-width", dict(x=randn((4, 2, D["d"]), gen, dtype, device),
                                  positions=torch.arange(4, device=device), inv_freq=full, inverse=False))
    # 1M-token context positions: angle rounding (fl32(p) * inv_freq) matters here
    yield Case("long-context", dict(x=randn((5, D["heads"], D["d"]), gen, dtype, device),
                                    positions=positions(5, gen, device, max_pos=1 << 20), inv_freq=main,
                                    inverse=False), ("extreme",))
    yield Case("noncontig-int32", dict(x=noncontig(randn((7, D["heads"], D["d"]), gen, dtype, device)),
                                       positions=positions(7, gen, device).to(torch.int32), inv_freq=main,
                                       inverse=False), ("noncontig",))
    yield Case("large-magnitude", dict(x=randn((3, 4, D["d"]), gen, dtype, device, 1e4),
                                       positions=positions(3, gen, device), inv_freq=main, inverse=True), ("extreme",))


@op(family="rope", tolerance=Tolerance(
    k=2.0, floor=1e-6, why="an rms reduction of length d then the rotation, fp32 with one rounding"))
def q_norm_rope(q: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head unweighted rms_norm of q [T, h, d], then rope on its trailing channels; fp32, one cast."""
    return rotate(rms(q.to(compute_dtype(q)), None, eps), positions, inv_freq, False).to(q.dtype)


@q_norm_rope.check
def _(q, positions, inv_freq, eps):
    d = Dims("q_norm_rope").tensor("q", q, ("T", "h", "d"), ACT_DTYPES + (torch.float64,))
    _check_rope_args("q_norm_rope", d, "q", q, positions, inv_freq)


@q_norm_rope.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    yield from _rope_cases(shapes, dtype, device, gen,
                           lambda T: randn((T, D["heads"], D["d"]), gen, dtype, device, 4.0), dict(eps=1e-6), "q")
    yield Case("noncontig", dict(q=noncontig(randn((5, D["heads"], D["d"]), gen, dtype, device, 1e3)),
                                 positions=positions(5, gen, device), inv_freq=main_inv_freq(D["d_r"], 10000.0).to(device),
                                 eps=1e-6), ("noncontig", "extreme"))
    # an eps comparable to the mean square (inputs ~3e-2, eps 1e-3): ignoring eps changes every output
    yield Case("eps-visible", dict(q=randn((3, D["heads"], D["d"]), gen, dtype, device, 3e-2),
                                   positions=positions(3, gen, device),
                                   inv_freq=main_inv_freq(D["d_r"], 10000.0).to(device), eps=1e-3), ("eps",))


@op(family="rope", params_since={"nope_quant_block": (1, 2)}, tolerance=Tolerance(
    k=2.0, floor=1e-6, quantized_rows=32, quantized_step=2.0 ** -3,
    why="a weighted rms reduction of length d then the rotation, fp32 with one rounding; the "
        "official row (nope_quant_block) rounds to bf16 and then to e4m3: a legal fp32 difference "
        "crosses a bf16 rounding boundary with probability ~2^-16 a value and that moves its e4m3 code "
        "(one step: at most 1/8 of the value) about 1 time in 16; 448 values a row give ~0.04 % of "
        "rows, so 1 row in 32 may differ in a moved code"))
def kv_norm_rope(kv: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                 eps: float, nope_quant_block: int | None = None) -> torch.Tensor:
    """Weighted rms_norm of kv [T, d], then rope on its trailing channels; fp32, one cast.

    ``nope_quant_block`` (HAL 1.2; None = exact): the official KV row. The normed row is rounded to
    bfloat16 (the official activation dtype), rope turns its trailing ``2 * len(inv_freq)``
    channels (fp32, rounded to bfloat16 again), and the other channels are fake-quantised to FP8
    per ``nope_quant_block`` (64) channels with the official rule (``hal.quant.fake_quant``); the
    rope channels are not quantised. The values are exact in bfloat16 and in e4m3 x a UE8M0 scale:
    an FP8 row store of them is lossless."""
    ct = compute_dtype(kv)
    y = rms(kv.to(ct), weight, eps)
    if nope_quant_block is None:
        return rotate(y, positions, inv_freq, False).to(kv.dtype)
    y = rotate(y.to(OFFICIAL_ACT_DTYPE).to(ct), positions, inv_freq, False).to(OFFICIAL_ACT_DTYPE)
    nope = y.shape[-1] - 2 * inv_freq.shape[0]
    y = torch.cat((fake_quant(y[..., :nope], "fp8", nope_quant_block), y[..., nope:]), -1)
    return y.to(kv.dtype)


#: the block of the official KV rows' non-rope FP8 fake-quantisation
NOPE_QUANT_BLOCKS = (64,)


@kv_norm_rope.check
def _(kv, weight, positions, inv_freq, eps, nope_quant_block=None):
    d = Dims("kv_norm_rope").tensor("kv", kv, ("T", "d"), ACT_DTYPES + (torch.float64,))
    d.tensor("weight", weight, ("d",), ACT_DTYPES + F32)
    _check_rope_args("kv_norm_rope", d, "kv", kv, positions, inv_freq)
    expect("kv_norm_rope", "nope_quant_block", nope_quant_block is None or nope_quant_block in NOPE_QUANT_BLOCKS,
           f"None or one of {NOPE_QUANT_BLOCKS}", nope_quant_block)
    if nope_quant_block is not None:
        nope = kv.shape[-1] - 2 * inv_freq.shape[0]
        expect("kv_norm_rope", "kv", nope % nope_quant_block == 0,
               f"non-rope channels (d - 2 * len(inv_freq)) a multiple of nope_quant_block {nope_quant_block}",
               f"{nope} (shape {tuple(kv.shape)})")


@kv_norm_rope.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    w = randn((D["d"],), gen, torch.float32, device) + 1.0
    yield from _rope_cases(shapes, dtype, device, gen, lambda T: randn((T, D["d"]), gen, dtype, device, 2.0),
                           dict(weight=w, eps=1e-6), "kv")
    yield Case("noncontig-actweight", dict(kv=noncontig(randn((6, D["d"]), gen, dtype, device, 1e-3)),
                                           weight=w.to(dtype), positions=positions(6, gen, device),
                                           inv_freq=main_inv_freq(D["d_r"], 10000.0).to(device), eps=1e-6),
               ("noncontig", "extreme"))
    yield Case("eps-visible", dict(kv=randn((3, D["d"]), gen, dtype, device, 3e-2), weight=w,
                                   positions=positions(3, gen, device),
                                   inv_freq=main_inv_freq(D["d_r"], 10000.0).to(device), eps=1e-3), ("eps",))
    # the official KV row (FP8 non-rope channels per 64): 40 tokens (a quantised call may differ
    # in 1 row of 32) and a decode token; a norm weight whose 64-blocks differ by powers of two
    # (block scales that differ within a row: a kernel applying one block's scale to another
    # block's codes diverges)
    wq = block_varied(w[None], levels=5, block=64)[0]
    for label, f in (("main", main_inv_freq(D["d_r"], 10000.0)),
                     ("yarn", yarn_inv_freq(D["d_r"], 160000.0, 16.0, 65536, 32.0, 1.0))):
        yield Case(f"fp8-row-{label}", dict(kv=randn((40, D["d"]), gen, dtype, device, 2.0), weight=wq,
                                            positions=positions(40, gen, device), inv_freq=f.to(device), eps=1e-6,
                                            nope_quant_block=64), ("fp8-row",))
    yield Case("fp8-row-T1", dict(kv=randn((1, D["d"]), gen, dtype, device, 2.0), weight=wq,
                                  positions=positions(1, gen, device), inv_freq=main_inv_freq(D["d_r"], 10000.0).to(device),
                                  eps=1e-6, nope_quant_block=64), ("fp8-row",))
    # the official row with an eps that shows (small rows): a quantised kernel of its own that
    # hard-codes eps = 1e-6 fails
    yield Case("fp8-row-eps-visible", dict(kv=randn((3, D["d"]), gen, dtype, device, 3e-2), weight=wq,
                                           positions=positions(3, gen, device),
                                           inv_freq=main_inv_freq(D["d_r"], 10000.0).to(device), eps=1e-3,
                                           nope_quant_block=64), ("fp8-row", "eps"))
