"""Mixture of experts: routing (sqrtsoftplus top-k with selection-only bias, or hash) and the
SwiGLU-with-clamp experts with a weighted combine (SPEC.md section 2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant import (E8M0, FP4_GROUP, FP4_PACKED_DTYPES, OFFICIAL_ACT_DTYPE, fake_quant, quantize_fp4,
                     quantize_fp8_block, scale_to_float32, unpack_fp4)
from ..spec import ACT_DTYPES, F32, INT_DTYPES, Case, Dims, Tolerance, compute_dtype, expect, op
from ._cases import TOKENS, dims, noncontig, randn
from .projections import (BLOCK as FP8_BLOCK, FP8, SCALE_DTYPES as FP8_SCALE_DTYPES, check_act_block,
                          dequant_block_fp8, quantized_activation)

#: scale dtypes of packed FP4 weights: UE8M0 (float8_e8m0fnu, or its raw bytes as uint8)
FP4_SCALE_DTYPES = tuple(d for d in (E8M0, torch.uint8) if d is not None)

RENORM_EPS = 1e-20


@op(family="moe", tolerance=Tolerance(
    k=2.0, floor=1e-6, metric="route",
    why="ids compared as sets (swaps allowed among keys equal within fp32 rounding); weights "
        "elementwise after matching ids: softplus, sqrt and a k-term sum, a few roundings"))
def moe_route(logits: torch.Tensor, topk: int, scaling: float, correction_bias: torch.Tensor | None = None,
              hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = sqrt(softplus(logits))``; ids = ``topk(s + correction_bias)`` (the bias only selects)
    or ``hash_ids``; weights = ``s[ids] / (sum s[ids] + 1e-20) * scaling``. Returns
    (weights [T, k] f32, ids [T, k] int32)."""
    s = torch.sqrt(F.softplus(logits.to(compute_dtype(logits))))
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        key = s if correction_bias is None else s + correction_bias.to(s.dtype)
        ids = key.topk(topk, dim=-1).indices
    w = s.gather(-1, ids)
    return w / (w.sum(-1, keepdim=True) + RENORM_EPS) * scaling, ids.to(torch.int32)


@moe_route.check
def _(logits, topk, scaling, correction_bias=None, hash_ids=None):
    d = Dims("moe_route").tensor("logits", logits, ("T", "E"), F32)
    expect("moe_route", "topk", isinstance(topk, int) and 1 <= topk <= logits.shape[1],
           f"an int in [1, {logits.shape[1]}]", topk)
    d.tensor("correction_bias", correction_bias, ("E",), F32, optional=True)
    d.tensor("hash_ids", hash_ids, ("T", topk), INT_DTYPES, optional=True)
    if hash_ids is not None and hash_ids.numel():
        expect("moe_route", "hash_ids", 0 <= int(hash_ids.min()) and int(hash_ids.max()) < logits.shape[1],
               f"expert ids in [0, {logits.shape[1]})", f"range [{int(hash_ids.min())}, {int(hash_ids.max())}]")


@moe_route.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    E, k = D["E"], D["k"]
    bias = randn((E,), gen, torch.float32, device, 0.1)
    for T in TOKENS[shapes]:
        logits = randn((T, E), gen, torch.float32, device, 2.0)
        yield Case(f"T{T}-topk", dict(logits=logits, topk=k, scaling=1.5, correction_bias=bias))
        hid = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
        yield Case(f"T{T}-hash", dict(logits=logits, topk=k, scaling=2.5, hash_ids=hid.long().to(device)))
    yield Case("no-bias", dict(logits=randn((5, E), gen, torch.float32, device), topk=k, scaling=1.0))
    # exact ties in the selection key (duplicated expert columns): either tied expert is correct
    lg = randn((6, E // 2), gen, torch.float32, device)
    yield Case("ties", dict(logits=torch.cat((lg, lg), -1), topk=k, scaling=1.0), ("ties",))
    # a large bias that reorders the selection but must not enter the weights; large logits
    yield Case("bias-dominates", dict(logits=randn((7, E), gen, torch.float32, device, 30.0), topk=k, scaling=1.5,
                                      correction_bias=randn((E,), gen, torch.float32, device, 50.0)), ("extreme",))
    yield Case("hash-int32-noncontig", dict(logits=noncontig(randn((4, E), gen, torch.float32, device)), topk=k,
                                            scaling=1.0,
                                            hash_ids=torch.stack([torch.randperm(E, generator=gen)[:k]
                                                                  for _ in range(4)]).to(device, torch.int32)),
               ("noncontig",))
    # logits ~ -86.5: s ~ 1.6e-19 (softplus ~ 2.7e-38, still a normal fp32), so sum(s) over k is
    # ~1e-18 and the spec's +1e-20 in the renormalisation changes every weight by ~1%
    yield Case("renorm-eps", dict(logits=-86.5 + 0.5 * torch.rand((3, E), generator=gen).to(device), topk=k,
                                  scaling=1.5), ("extreme",))
    # another topk than the model's, with and without a bias
    yield Case("topk-other", dict(logits=randn((5, E), gen, torch.float32, device, 2.0), topk=k + 1, scaling=1.5,
                                  correction_bias=bias))


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(g, L)) * clamp(u, -L, L)`` for ``gate_up = [g | u]`` (gate clamped from above only)."""
    g, u = gate_up.chunk(2, dim=-1)
    return F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit)


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int, ct: torch.dtype) -> torch.Tensor:
    """Expert ``e`` of a [E, rows, cols] weight as ``ct`` values: exact dequantisation (an e4m3 or
    e2m1 code times its scale, computed in ``ct``) of the FP8 / packed FP4 formats, else a cast."""
    if scale is None:
        return w[e].to(ct)
    if w.dtype == FP8:
        return dequant_block_fp8(w[e], scale[e], ct)
    vals = unpack_fp4(w[e]).to(ct)  # e2m1 values, low nibble = even column
    return vals * scale_to_float32(scale[e]).to(ct).repeat_interleave(FP4_GROUP, -1)


# capturable=False: the reference loops over the experts present (torch.unique + nonzero: host
# syncs, data-dependent shapes); a gathered formulation would read T*k expert weights per call.
# converts_per_use: the fp64 evaluation converts only the experts a call uses (_expert_weight).
@op(family="moe", capturable=False, params_since={"w13_scale": (1, 2), "w2_scale": (1, 2), "act_block": (1, 2)},
    converts_per_use=("w13", "w2"), tolerance=Tolerance(
    k=4.0, floor=1e-6,
    why="two chained fp32 GEMMs (length H then I) and a k-term weighted sum: more roundings "
        "than linear, ordered freely by grouped kernels; quantised weights are dequantised exactly. "
        "The official math (act_block) rounds gate / up to bf16 and quantises h to e4m3: a legal fp32 "
        "difference can move a fragile h value to a neighbouring code, so each output value may in "
        "addition be off by the moved codes' effect (moved_code_allowance: from the fp64 evaluation, "
        "only the values whose code changes within the legal error of g, u and h)"))
def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, swiglu_limit: float, w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None, act_block: int | None = None) -> torch.Tensor:
    """``sum_i weights[t, i] * expert_{ids[t, i]}(x[t])`` with SwiGLU experts
    ``(silu(min(x W1^T, L)) * clamp(x W3^T, -L, L)) W2^T``; w13 [E, 2I, H] holds W1 rows then W3
    rows; w2 [E, H, I]; negative ids are skipped. fp32 math and accumulation, result in x.dtype.
    Each expert weight is an act dtype (scale None), or quantised with its scale: float8_e4m3fn
    with 128x128 block multipliers [E, ceil(rows/128), ceil(cols/128)] (fp32 or e8m0), or packed
    FP4 e2m1 (int8/uint8 [E, rows, cols/2], column 2j in the low nibble of byte j, 2j+1 in the
    high one) with one UE8M0 scale per 32 columns [E, rows, cols/32] (e8m0 or raw uint8 bytes).
    Quantised weights are dequantised exactly, then the same formula.

    ``act_block`` (HAL 1.2): None = the formula above (exact numerics); 128 = the official expert
    math (W8A8 in both GEMMs): ``x`` is quantised per token per 128 columns (``linear``'s rule);
    gate and up are rounded to bfloat16 (the official activation dtype), clamped and combined in
    fp32 as ``h = silu(min(g, L)) * clamp(u, -L, L) * weights[t, i]`` (the routing weight applied
    BEFORE the down projection), rounded to bfloat16 and quantised again per 128 for ``w2``; the
    experts' outputs are summed in fp32 and cast once to x.dtype."""
    ct = compute_dtype(x)
    xf = quantized_activation(x, act_block, ct)
    out = torch.zeros(x.shape, dtype=ct, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = xf[tok] @ _expert_weight(w13, w13_scale, e, ct).T
        if act_block is None:
            h = swiglu(gu, swiglu_limit)
            y = h @ _expert_weight(w2, w2_scale, e, ct).T
            out.index_add_(0, tok, y * weights[tok, slot].to(ct)[:, None])
            continue
        h = _official_h(gu, weights[tok, slot].to(ct), swiglu_limit, act_block, ct)
        out.index_add_(0, tok, h @ _expert_weight(w2, w2_scale, e, ct).T)
    return out.to(x.dtype)


def _official_h(gu: torch.Tensor, w: torch.Tensor, limit: float, act_block: int, ct: torch.dtype) -> torch.Tensor:
    """The official down-projection input of pairs with raw gate / up sums ``gu`` and routing weights
    ``w``: g and u rounded to bf16, the SwiGLU times the routing weight, rounded to bf16 and
    fake-quantised per ``act_block`` columns to e4m3 (values in ``ct``)."""
    h = swiglu(gu.to(OFFICIAL_ACT_DTYPE).to(ct), limit) * w[:, None]
    return fake_quant(h.to(OFFICIAL_ACT_DTYPE), "fp8", act_block).to(ct)


#: the legal error of a fp32 gate / up sum of K products, in standard deviations of a random-walk
#: rounding error (sqrt(K) * 2^-24 * ||products||_2 each): a statistical bound, not a worst case.
#: It assumes round-to-nearest fp32 accumulation in any order, FMA or not (errors of either sign);
#: under that model a legal sum leaves the box with probability ~1e-15 per value. The worst case
#: (K * 2^-24 * sum |products|) would mark nearly every value fragile and judge nothing.
GU_SIGMAS = 8.0
#: the legal relative error of h before its bf16 rounding (silu's exp and two products: a few fp32 ulps)
H_REL = 2.0 ** -20


def moved_code_allowance(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None,
                         act_block=None) -> torch.Tensor | None:
    """How far a legal computation of the official expert math may be from the fp64 evaluation
    beyond rounding (float64 [T, H], absolute, per output value; None for exact numerics).

    h is quantised from computed values: g and u are rounded to bf16 and h to e4m3, so two legal
    fp32 computations (another summation order, another exp) now and then put a value on the other
    side of a decision boundary, which moves that h value to a neighbouring code. Such a value is
    *fragile*: its code changes when g and u move by their legal error (GU_SIGMAS random-walk
    deviations of a fp32 sum) and h by H_REL. Each pair's h is recomputed at the corners of that
    box (its corners: silu's one turning point, at g ~ -1.28, is flat at this scale, and an amax
    that moves a group's scale against a value's own move is not covered); ``delta`` is the
    largest code change of each value found there (0 for all but the fragile ones), and
    output n of token t may move by ``sum over its pairs and columns j of delta * |W2_e[n, j]|``.
    A wrong computation (a scale off by two, the routing weight after the projection, a missed
    rounding) moves values that are not fragile and fails."""
    if act_block is None:
        return None
    ct = torch.float64
    xf = quantized_activation(x.to(ct), act_block, ct)
    allow = torch.zeros(x.shape, dtype=ct, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        w13e = _expert_weight(w13, w13_scale, e, ct)
        gu = xf[tok] @ w13e.T
        eps = GU_SIGMAS * w13e.shape[1] ** 0.5 * 2.0 ** -24 * ((xf[tok] ** 2) @ (w13e ** 2).T).sqrt()
        w = weights[tok, slot].to(ct)
        h0 = _official_h(gu, w, swiglu_limit, act_block, ct)
        delta = torch.zeros_like(h0)
        g, u = gu.chunk(2, -1)
        eg, eu = eps.chunk(2, -1)
        for sg in (-1.0, 1.0):
            for su in (-1.0, 1.0):
                for sh in (1.0 - H_REL, 1.0 + H_REL):
                    h = _official_h(torch.cat((g + sg * eg, u + su * eu), -1), w * sh, swiglu_limit, act_block, ct)
                    delta = torch.maximum(delta, (h - h0).abs())
        allow.index_add_(0, tok, delta @ _expert_weight(w2, w2_scale, e, ct).abs().T)
    return allow


def _check_expert(d: Dims, arg: str, w, scale, rows: str, cols: str) -> tuple:
    """Check one expert weight (and its scale); returns its logical shape (E, rows, cols)."""
    sarg = arg + "_scale"
    if scale is None:
        expect("moe_experts", sarg, w is None or not isinstance(w, torch.Tensor) or (
            w.dtype != FP8 and w.dtype not in FP4_PACKED_DTYPES),
               f"a scale tensor for a quantised {arg} (float8_e4m3fn or packed FP4)", None)
        d.tensor(arg, w, ("E", rows, cols), ACT_DTYPES + (torch.float64,))
        return tuple(w.shape)
    if isinstance(w, torch.Tensor) and w.dtype == FP8:
        d.tensor(arg, w, ("E", rows, cols), (FP8,))
        E, R, C = w.shape
        d.tensor(sarg, scale, (E, -(-R // FP8_BLOCK), -(-C // FP8_BLOCK)), FP8_SCALE_DTYPES)
        return (E, R, C)
    d.tensor(arg, w, ("E", rows, None), FP4_PACKED_DTYPES)
    E, R, Cp = w.shape
    C = 2 * Cp
    expect("moe_experts", arg, C % FP4_GROUP == 0,
           f"packed FP4 columns (2 * dim 2) a multiple of {FP4_GROUP}", f"shape {tuple(w.shape)} ({C} columns)")
    if cols in d.sizes:
        expect("moe_experts", arg, d.sizes[cols] == C,
               f"2 * dim 2 ({cols}) = {d.sizes[cols]} to match the other arguments", f"shape {tuple(w.shape)}")
    d.sizes[cols] = C
    d.tensor(sarg, scale, (E, R, C // FP4_GROUP), FP4_SCALE_DTYPES)
    return (E, R, C)


@moe_experts.check
def _(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None, act_block=None):
    d = Dims("moe_experts").tensor("x", x, ("T", "H"), ACT_DTYPES + (torch.float64,))
    d.tensor("ids", ids, ("T", "k"), INT_DTYPES)
    d.tensor("weights", weights, ("T", "k"), F32)
    s13 = _check_expert(d, "w13", w13, w13_scale, "2I", "H")
    s2 = _check_expert(d, "w2", w2, w2_scale, "H", "I")
    expect("moe_experts", "w13", s13[1] == 2 * s2[2], f"dim 1 = 2 * I = {2 * s2[2]} (I from w2)",
           f"shape {tuple(w13.shape)}")
    if ids.numel():
        expect("moe_experts", "ids", int(ids.max()) < s13[0], f"expert ids < {s13[0]}", int(ids.max()))
    check_act_block("moe_experts", act_block, x)
    if act_block is not None:
        expect("moe_experts", "w2", s2[2] % act_block == 0, f"I (dim 2) a multiple of act_block {act_block}",
               f"shape {tuple(w2.shape)}")
@moe_experts.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    E, k, H, I = min(D["E"], 16), D["k"], D["H"], D["I"]
    w13 = randn((E, 2 * I, H), gen, dtype, device, H ** -0.5 * 4)
    w2 = randn((E, H, I), gen, dtype, device, I ** -0.5)
    for T in TOKENS[shapes]:
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]) if T else torch.zeros(0, k)
        yield Case(f"T{T}-E{E}", dict(x=randn((T, H), gen, dtype, device, 3.0), ids=ids.long().to(device),
                                      weights=torch.rand((T, k), generator=gen).to(device), w13=w13, w2=w2,
                                      swiglu_limit=10.0))
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(4)]).long()
    ids[0, 0] = -1
    yield Case("skip-negative-ids", dict(x=randn((4, H), gen, dtype, device, 3.0), ids=ids.to(device),
                                         weights=torch.rand((4, k), generator=gen).to(device), w13=w13, w2=w2,
                                         swiglu_limit=10.0))
    # gate/up pre-activations mostly beyond the limit (the clamp decides the result); int32 ids, one
    # token with every slot skipped, all tokens routed to the same expert, non-contiguous x
    ids = torch.randint(0, E, (5, k), generator=gen).to(torch.int32)
    ids[:, 0] = 3
    ids[2] = -1
    yield Case("clamp-heavy", dict(x=noncontig(randn((5, H), gen, dtype, device, 6.0)), ids=ids.to(device),
                                   weights=torch.rand((5, k), generator=gen).to(device), w13=w13, w2=w2,
                                   swiglu_limit=2.0), ("extreme", "noncontig"))
    # the model's expert count (256 flash, 384 pro) with narrow experts: routing over many experts
    # (a kernel's expert sort / tile map at full width), decode-sized batch, some slots skipped
    En, Hn, In = max(D["E"], 64), 64, 32
    ids = torch.stack([torch.randperm(En, generator=gen)[:k] for _ in range(24)]).long()
    ids[::5, -1] = -1
    yield Case(f"many-experts-E{En}", dict(x=randn((24, Hn), gen, dtype, device, 3.0), ids=ids.to(device),
                                           weights=torch.rand((24, k), generator=gen).to(device),
                                           w13=randn((En, 2 * In, Hn), gen, dtype, device, Hn ** -0.5 * 4),
                                           w2=randn((En, Hn, In), gen, dtype, device, In ** -0.5), swiglu_limit=10.0))
    # quantised experts: FP8 e4m3 with 128x128 block scales (fp32 and e8m0), packed FP4 e2m1 with
    # one UE8M0 scale per 32 columns; mixed formats (FP4 w13 with an FP8 w2) and a skipped slot
    wf13 = randn((E, 2 * I, H), gen, torch.float32, device, H ** -0.5 * 4)
    wf2 = randn((E, H, I), gen, torch.float32, device, I ** -0.5)
    q8 = {sd: (quantize_fp8_block(wf13, sd, FP8_BLOCK, pow2=True), quantize_fp8_block(wf2, sd, FP8_BLOCK, pow2=True))
          for sd in FP8_SCALE_DTYPES}
    q4 = (quantize_fp4(wf13, FP4_GROUP, E8M0), quantize_fp4(wf2, FP4_GROUP, E8M0))
    # FP4 at T = 1 too: a decode batch takes the kernels' decode tiles (rows per tile, K step and
    # N blocks chosen for few row tiles), which the largest T does not reach
    quantised = [("fp8-e8m0", q8[E8M0]), ("fp8-f32scale", q8[torch.float32]), ("fp4", q4),
                 ("fp4-w13-fp8-w2", (q4[0], q8[torch.float32][1])), ("fp4", q4)]
    for T, (name, ((a13, s13), (a2, s2))) in zip((1, 6, TOKENS[shapes][-1], 3, 1), quantised):
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).long()
        ids[0, -1] = -1
        yield Case(f"{name}-T{T}", dict(x=randn((T, H), gen, dtype, device, 3.0), ids=ids.to(device),
                                        weights=torch.rand((T, k), generator=gen).to(device), w13=a13, w2=a2,
                                        swiglu_limit=10.0, w13_scale=s13, w2_scale=s2),
                   ("fp8",) if name.startswith("fp8") else ("fp4",))
    # the shared expert as the model runs it: one expert, every token routed to it with weight 1 (a
    # grid of few N blocks: on a GPU at flash / pro shapes the Triton kernels' split-K launch; at the
    # small shapes their parts would be too short, so it stays unsplit there); last, so the cases
    # above keep their generator draws
    w13s, w2s = w13[:1].clone(), w2[:1].clone()
    for T in (1, 8):
        yield Case(f"shared-expert-T{T}", dict(x=randn((T, H), gen, dtype, device, 3.0),
                                               ids=torch.zeros((T, 1), dtype=torch.long, device=device),
                                               weights=torch.ones((T, 1), device=device), w13=w13s, w2=w2s,
                                               swiglu_limit=10.0))
    yield from _official_cases(shapes, dtype, device, gen)
    # the routed experts as the published models store them (packed FP4, a UE8M0 scale per 32
    # columns) at their expert count (256 flash, 384 pro), narrow (H = I = 128), exact and official
    # math: a kernel's expert offsets into packed weights and scales at full width; last, so the
    # cases above keep their generator draws; only in the published sets (the small set's 8 experts
    # are no model's count, and the default CPU runs stay as they were)
    if shapes == "small":
        return
    Hn = In = 128
    wf13 = randn((En, 2 * In, Hn), gen, torch.float32, device, Hn ** -0.5 * 4)
    wf2 = randn((En, Hn, In), gen, torch.float32, device, In ** -0.5)
    (p13, g13), (p2, g2) = quantize_fp4(wf13, FP4_GROUP, E8M0), quantize_fp4(wf2, FP4_GROUP, E8M0)
    for name, act_block in (("fp4", None), ("official-fp4", 128)):
        ids = torch.stack([torch.randperm(En, generator=gen)[:k] for _ in range(24)]).long()
        ids[::5, -1] = -1
        yield Case(f"many-experts-{name}-E{En}", dict(x=randn((24, Hn), gen, dtype, device, 3.0), ids=ids.to(device),
                                                      weights=torch.rand((24, k), generator=gen).to(device), w13=p13,
                                                      w2=p2, swiglu_limit=10.0, w13_scale=g13, w2_scale=g2,
                                                      act_block=act_block),
                   ("fp4",) if act_block is None else ("official", "fp4"))


def _official_cases(shapes, dtype, device, gen):
    """The official expert math (act_block=128), 40 tokens a case and a decode token: FP4 w13 / w2
    as the routed experts are stored, FP8 as the shared expert, bf16 weights holding dequantised
    values; routing weights far from 1 and spread (applying them after w2 quantises a different
    h); per-token magnitudes 2^-6 .. 2^6."""
    D = dims(shapes)
    E, k, H, I = min(D["E"], 16), D["k"], D["H"], max(D["I"], 128)     # I: a multiple of act_block
    wf13 = randn((E, 2 * I, H), gen, torch.float32, device, H ** -0.5 * 4)
    wf2 = randn((E, H, I), gen, torch.float32, device, I ** -0.5)
    q4 = (quantize_fp4(wf13, FP4_GROUP, E8M0), quantize_fp4(wf2, FP4_GROUP, E8M0))
    q8 = (quantize_fp8_block(wf13, E8M0, FP8_BLOCK, pow2=True), quantize_fp8_block(wf2, E8M0, FP8_BLOCK, pow2=True))
    for name, ((w13, w13s), (w2, w2s)) in (("fp4", q4), ("fp8", q8)):
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(40)]).long()
        ids[::7, -1] = -1
        x = randn((40, H), gen, torch.float32, device, 2.0) * 2.0 ** torch.randint(-6, 7, (40, 1), generator=gen).to(device)
        wts = (0.05 + 3 * torch.rand((40, k), generator=gen)).to(device)
        yield Case(f"official-{name}", dict(x=x.to(dtype), ids=ids.to(device), weights=wts, w13=w13, w2=w2,
                                            swiglu_limit=10.0, w13_scale=w13s, w2_scale=w2s, act_block=128),
                   ("official", name))
    ids = torch.randperm(E, generator=gen)[:k][None].long()
    yield Case("official-fp4-T1", dict(x=randn((1, H), gen, dtype, device, 2.0), ids=ids.to(device),
                                       weights=(0.05 + 3 * torch.rand((1, k), generator=gen)).to(device),
                                       w13=q4[0][0], w2=q4[1][0], swiglu_limit=10.0, w13_scale=q4[0][1],
                                       w2_scale=q4[1][1], act_block=128), ("official", "fp4"))
    w13, w2 = wf13.to(dtype), wf2.to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(40)]).long()
    yield Case("official-dense-weights-clamp", dict(x=randn((40, H), gen, dtype, device, 6.0), ids=ids.to(device),
                                                    weights=(0.05 + 3 * torch.rand((40, k), generator=gen)).to(device),
                                                    w13=w13, w2=w2, swiglu_limit=2.0, act_block=128),
               ("official", "extreme"))
