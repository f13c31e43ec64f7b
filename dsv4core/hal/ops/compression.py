"""KV compression and the lightning indexer: compress_pool, compress_windows, indexer_scores,
indexer_scores_rows, indexer_topk (SPEC.md section 2)."""

from __future__ import annotations

import torch

from ..errors import OpInputError
from ..quant import FP4_GROUP, OFFICIAL_ACT_DTYPE, fake_quant, hadamard, hadamard_matrix
from ..paged import blocks_of, gather, num_rows
from ..rowformats import check_row_format, pack, row_bytes, unpack
from ..spec import ACT_DTYPES, F32, INT_DTYPES, Case, Dims, Tolerance, compute_dtype, expect, op
from ._cases import TOKENS, dims, noncontig, randn

_GATHER_BUDGET = 1 << 24


@op(family="compression", deprecated="the model calls compress_windows since HAL 1.1", tolerance=Tolerance(
    k=2.0, floor=1e-6, why="a softmax over at most 2m slots and a weighted sum per channel, fp32"))
def compress_pool(kv: torch.Tensor, score: torch.Tensor, ape: torch.Tensor, overlap: bool,
                  prev_kv: torch.Tensor | None = None, prev_score: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax-gated pooling of complete windows. kv, score [Wn, m, c*d'] (c = 2 if overlap);
    ape [m, c*d'] f32. Returns [Wn, d'] in kv.dtype.

    overlap=False (HCA): window w pools its own m slots. overlap=True (CSA): entry w pools the A
    halves (``[..., :d']``) of window w-1 (``prev_*`` for w = 0; kv 0 and score -inf when None)
    and the B halves (``[..., d':]``) of window w, each with its half of ape. ``prev_kv`` and
    ``prev_score`` [m, d'] are the raw A halves of the previous call's last window (score without
    ape: the op adds ``ape[:, :d']``). fp32 math.
    """
    ct = compute_dtype(kv)
    kv_c, s_c, ape_c = kv.to(ct), score.to(ct) + ape.to(ct), ape.to(ct)
    if overlap:
        Wn, m, two_d = kv.shape
        dp = two_d // 2
        if prev_kv is None:
            first_kv = torch.zeros((1, m, dp), dtype=ct, device=kv.device)
            first_s = torch.full((1, m, dp), float("-inf"), dtype=ct, device=kv.device)
        else:
            first_kv = prev_kv.to(ct)[None]
            first_s = (prev_score.to(ct) + ape_c[:, :dp])[None]
        a_kv = torch.cat((first_kv, kv_c[:-1, :, :dp]), 0)[:Wn]    # window w-1's A halves
        a_s = torch.cat((first_s, s_c[:-1, :, :dp]), 0)[:Wn]
        kv_c = torch.cat((a_kv, kv_c[:, :, dp:]), 1)                 # [Wn, 2m, d']
        s_c = torch.cat((a_s, s_c[:, :, dp:]), 1)
    weights = torch.softmax(s_c, dim=1)
    return (weights * kv_c).sum(1).to(kv.dtype)


@compress_pool.check
def _(kv, score, ape, overlap, prev_kv=None, prev_score=None):
    d = Dims("compress_pool").tensor("kv", kv, ("Wn", "m", "cd"), ACT_DTYPES + (torch.float64,))
    d.tensor("score", score, ("Wn", "m", "cd"), ACT_DTYPES + (torch.float64,))
    d.tensor("ape", ape, ("m", "cd"), F32)
    if overlap:
        expect("compress_pool", "kv", kv.shape[2] % 2 == 0, "an even last dim (A|B halves) with overlap=True",
               kv.shape[2])
        if (prev_kv is None) != (prev_score is None):
            raise OpInputError("compress_pool", "prev_score" if prev_score is None else "prev_kv",
                               "both prev_kv and prev_score, or neither", "only one of them")
        half = kv.shape[2] // 2
        d.tensor("prev_kv", prev_kv, ("m", half), ACT_DTYPES + (torch.float64,), optional=True)
        d.tensor("prev_score", prev_score, ("m", half), ACT_DTYPES + (torch.float64,), optional=True)
    else:
        expect("compress_pool", "prev_kv", prev_kv is None and prev_score is None,
               "None when overlap=False", "a tensor")


@compress_pool.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    for dp, label in ((D["d"], "main"), (D["dI"], "indexer")):
        for Wn in (0, 1, 5):
            yield Case(f"hca-{label}-W{Wn}", dict(kv=randn((Wn, 128, dp), gen, dtype, device),
                                                  score=randn((Wn, 128, dp), gen, dtype, device, 2.0),
                                                  ape=randn((128, dp), gen, torch.float32, device), overlap=False))
            args = dict(kv=randn((Wn, 4, 2 * dp), gen, dtype, device),
                        score=randn((Wn, 4, 2 * dp), gen, dtype, device, 2.0),
                        ape=randn((4, 2 * dp), gen, torch.float32, device), overlap=True)
            yield Case(f"csa-{label}-W{Wn}-first", dict(args))
            yield Case(f"csa-{label}-W{Wn}-carry", dict(args, prev_kv=randn((4, dp), gen, dtype, device),
                                                        prev_score=randn((4, dp), gen, dtype, device)))
    dp = D["dI"]
    # peaked gates (scores ~ +-40): the softmax max-subtraction matters; non-contiguous views
    yield Case("csa-peaked-noncontig", dict(kv=noncontig(randn((3, 4, 2 * dp), gen, dtype, device, 100.0)),
                                            score=noncontig(randn((3, 4, 2 * dp), gen, dtype, device, 40.0)),
                                            ape=randn((4, 2 * dp), gen, torch.float32, device), overlap=True,
                                            prev_kv=noncontig(randn((4, dp), gen, dtype, device)),
                                            prev_score=randn((4, dp), gen, dtype, device, 40.0)),
               ("extreme", "noncontig"))
    yield Case("hca-peaked", dict(kv=randn((2, 128, dp), gen, dtype, device),
                                  score=randn((2, 128, dp), gen, dtype, device, 40.0),
                                  ape=randn((128, dp), gen, torch.float32, device), overlap=False), ("extreme",))


@op(family="compression", since=(1, 1), tolerance=Tolerance(
    k=2.0, floor=1e-6, why="a softmax over at most 2m slots and a weighted sum per channel, fp32"))
def compress_windows(kv: torch.Tensor, score: torch.Tensor, overlap: bool) -> torch.Tensor:
    """Softmax-gated pooling of gathered windows, one entry per row: kv, score [E, S, c*d'] f32
    (c = 2 if overlap), score already holding the position bias (``score + ape[pos % m]``), masked
    slots scored ``-inf``. Returns [E, d'] f32.

    overlap=False (HCA, S = m): entry e pools its S slots. overlap=True (CSA, S = 2m): slots
    ``[0, m)`` (the previous window) contribute their A halves ``[..., :d']``, slots ``[m, 2m)``
    (the entry's own window) their B halves ``[..., d':]``; one softmax over the 2m slots per
    channel. A row whose slots are all masked pools to 0. fp32 math.
    """
    ct = compute_dtype(kv)
    kv_c, s_c = kv.to(ct), score.to(ct)
    E, S, cd = kv.shape
    if overlap:
        m, dp = S // 2, cd // 2
        kv_c = torch.cat((kv_c[:, :m, :dp], kv_c[:, m:, dp:]), 1)          # [E, 2m, d']
        s_c = torch.cat((s_c[:, :m, :dp], s_c[:, m:, dp:]), 1)
    mx = s_c.amax(1, keepdim=True)
    mx = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))      # all-masked rows pool to 0
    p = torch.exp(s_c - mx)
    den = p.sum(1)
    num = (p * kv_c).sum(1)
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))


@compress_windows.check
def _(kv, score, overlap):
    d = Dims("compress_windows").tensor("kv", kv, ("E", "S", "cd"), F32)
    d.tensor("score", score, ("E", "S", "cd"), F32)
    expect("compress_windows", "overlap", isinstance(overlap, bool), "a bool", overlap)
    if overlap:
        expect("compress_windows", "kv", kv.shape[1] % 2 == 0 and kv.shape[2] % 2 == 0,
               "even slot count (previous | own window) and even last dim (A|B halves) with overlap=True",
               tuple(kv.shape))


@compress_windows.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    f32 = torch.float32
    for dp, label in ((D["d"], "main"), (D["dI"], "indexer")):
        for E in (0, 1, 5):
            yield Case(f"hca-{label}-E{E}", dict(kv=randn((E, 128, dp), gen, f32, device),
                                                 score=randn((E, 128, dp), gen, f32, device, 2.0), overlap=False))
            sc = randn((E, 8, 2 * dp), gen, f32, device, 2.0)
            if E:
                sc[0, :4] = float("-inf")               # the first window of a request: no previous window
            yield Case(f"csa-{label}-E{E}", dict(kv=randn((E, 8, 2 * dp), gen, f32, device), score=sc, overlap=True))
    dp = D["dI"]
    # peaked gates (scores ~ +-40: the max subtraction matters), a fully masked row, non-contiguous views
    sc = randn((4, 8, 2 * dp), gen, f32, device, 40.0)
    sc[2] = float("-inf")
    yield Case("csa-peaked-masked-noncontig", dict(kv=noncontig(randn((4, 8, 2 * dp), gen, f32, device, 100.0)),
                                                   score=noncontig(sc), overlap=True), ("extreme", "noncontig", "masked"))
    # masked slots inside the A half only (prefix of a request), and the B half decides
    sc = randn((3, 8, 2 * dp), gen, f32, device, 3.0)
    sc[:, :2, :dp] = float("-inf")
    yield Case("csa-partial-prev", dict(kv=randn((3, 8, 2 * dp), gen, f32, device), score=sc, overlap=True), ("masked",))


@op(family="compression", deprecated="the model calls indexer_scores_rows since HAL 1.1", tolerance=Tolerance(
    k=4.0, floor=1e-5,
    why="a length-dI dot product per (head, key), ReLU, then a weighted sum over nI heads: two "
        "reductions in fp32; the floor absorbs cancellation when the weighted sum is near zero"))
def indexer_scores(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, k_offsets: torch.Tensor,
                   k_lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """``score[t, w] = scale * sum_h weights[t, h] * relu(q[t, h] . k[k_offsets[t] + w])`` for
    ``w < k_lengths[t]``, ``-inf`` beyond. q [T, nI, dI]; k [N, dI]; returns [T, max(k_lengths)] f32."""
    T = q.shape[0]
    L = int(k_lengths.max()) if T else 0
    ct = compute_dtype(q)
    out = torch.full((T, L), float("-inf"), dtype=torch.promote_types(ct, torch.float32), device=q.device)
    if L == 0 or k.shape[0] == 0:
        return out
    w_pos = torch.arange(L, device=q.device)
    chunk = max(1, _GATHER_BUDGET // (L * q.shape[2]))
    for s in range(0, T, chunk):
        lengths, offsets = k_lengths[s:s + chunk], k_offsets[s:s + chunk]
        valid = w_pos[None, :] < lengths[:, None]
        rows = (offsets[:, None] + w_pos[None, :]).clamp(0, k.shape[0] - 1)
        keys = k[rows].to(ct)                                                    # [t, L, dI]
        dots = torch.relu(torch.einsum("thd,tld->thl", q[s:s + chunk].to(ct), keys))
        sc = torch.einsum("th,thl->tl", weights[s:s + chunk].to(ct), dots) * scale
        out[s:s + chunk] = sc.masked_fill(~valid, float("-inf"))
    return out


@indexer_scores.check
def _(q, k, weights, k_offsets, k_lengths, scale):
    d = Dims("indexer_scores").tensor("q", q, ("T", "nI", "dI"), ACT_DTYPES + (torch.float64,))
    d.tensor("k", k, ("N", "dI"), (q.dtype,))
    d.tensor("weights", weights, ("T", "nI"), F32)
    d.tensor("k_offsets", k_offsets, ("T",), INT_DTYPES)
    d.tensor("k_lengths", k_lengths, ("T",), INT_DTYPES)
    if q.shape[0]:
        end = int((k_offsets + k_lengths).max())
        expect("indexer_scores", "k_lengths", int(k_lengths.min()) >= 0 and int(k_offsets.min()) >= 0
               and end <= k.shape[0], f"offsets/lengths within the {k.shape[0]} rows of k",
               f"a key range ending at {end}")


@indexer_scores.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    nI, dI = D["nI"], D["dI"]
    N = 40 if shapes == "small" else 2048
    for T in TOKENS[shapes]:
        lengths = torch.randint(0, N // 2, (T,), generator=gen)
        offsets = torch.randint(0, N // 2, (T,), generator=gen)
        if T > 1:
            lengths[0] = 0                                   # a query with no keys at all
            lengths[1], offsets[1] = N - offsets[1], offsets[1]  # one reaching the last key
        yield Case(f"T{T}-N{N}", dict(q=randn((T, nI, dI), gen, dtype, device), k=randn((N, dI), gen, dtype, device),
                                      weights=randn((T, nI), gen, torch.float32, device, nI ** -0.5),
                                      k_offsets=offsets.to(device), k_lengths=lengths.to(device), scale=dI ** -0.5))
    # causal prefill layout: query t sees keys [0, t/4] (int32 offsets/lengths), non-contiguous q
    T = 9
    lengths = (torch.arange(T) // 4 + 1).to(torch.int32)
    yield Case("causal-int32-noncontig", dict(q=noncontig(randn((T, nI, dI), gen, dtype, device)),
                                              k=randn((T // 4 + 1, dI), gen, dtype, device),
                                              weights=randn((T, nI), gen, torch.float32, device, nI ** -0.5),
                                              k_offsets=torch.zeros(T, dtype=torch.int32, device=device),
                                              k_lengths=lengths.to(device), scale=dI ** -0.5), ("noncontig",))
    yield Case("all-empty", dict(q=randn((3, nI, dI), gen, dtype, device), k=randn((4, dI), gen, dtype, device),
                                 weights=randn((3, nI), gen, torch.float32, device),
                                 k_offsets=torch.zeros(3, dtype=torch.int64, device=device),
                                 k_lengths=torch.zeros(3, dtype=torch.int64, device=device), scale=dI ** -0.5),
               ("masked",))
    # a scale other than dI^-0.5 (the scale multiplies every score: a hard-coded one fails)
    yield Case("scale-other", dict(q=randn((4, nI, dI), gen, dtype, device), k=randn((12, dI), gen, dtype, device),
                                   weights=randn((4, nI), gen, torch.float32, device, nI ** -0.5),
                                   k_offsets=torch.tensor([0, 2, 4, 1], device=device),
                                   k_lengths=torch.tensor([12, 10, 5, 9], device=device), scale=0.3), ("scale",))


@op(family="compression", since=(1, 1), params_since={"k_format": (1, 3), "k_paged": (1, 4)}, tolerance=Tolerance(
    k=4.0, floor=1e-5,
    why="a length-dI dot product per (head, key), ReLU, then a weighted sum over nI heads: two "
        "reductions in fp32; the floor absorbs cancellation when the weighted sum is near zero"))
def indexer_scores_rows(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                        scale: float, k_format: str | None = None, k_paged: bool = False) -> torch.Tensor:
    """``score[t, w] = scale * sum_h weights[t, h] * relu(q[t, h] . k[rows[t, w]])`` for
    ``rows[t, w] >= 0``, ``-inf`` where ``rows[t, w] = -1``. q [T, nI, dI]; k [N, dI] (a key pool:
    any rows, any order); rows [T, L] int. Returns [T, L] f32. Fixed output shape (capturable).

    ``k_format`` (HAL 1.3; None = k holds [N, dI] keys in q's dtype): ``"fp4"``, the FP4 key of
    ``hal.rowformats``; k is uint8 [N, row_bytes("fp4", dI)] and key u is
    ``rowformats.unpack("fp4", k[u], dI)`` rounded to q's dtype (for the official keys, exactly
    the values a plain pool would hold).

    ``k_paged`` (HAL 1.4; False = k is [N, dI] keys): k is [B, J, dI] (or [B, J, row bytes]),
    blocks of J keys with any strides (`hal.paged`): key u is ``k[u // J, u % J]``, N = B * J."""
    T, L = rows.shape
    ct = compute_dtype(q)
    out = torch.full((T, L), float("-inf"), dtype=torch.promote_types(ct, torch.float32), device=q.device)
    if L == 0 or T == 0 or num_rows(k, k_paged) == 0:
        return out
    chunk = max(1, _GATHER_BUDGET // (L * q.shape[2]))
    for s in range(0, T, chunk):
        r = rows[s:s + chunk].long()
        valid = r >= 0
        keys = gather(k, r.clamp_min(0), k_paged)
        keys = (keys if k_format is None else unpack(k_format, keys, q.shape[2], q.dtype)).to(ct)   # [t, L, dI]
        dots = torch.relu(torch.einsum("thd,tld->thl", q[s:s + chunk].to(ct), keys))
        sc = torch.einsum("th,thl->tl", weights[s:s + chunk].to(ct), dots) * scale
        out[s:s + chunk] = sc.masked_fill(~valid, float("-inf"))
    return out


@indexer_scores_rows.check
def _(q, k, weights, rows, scale, k_format=None, k_paged=False):
    d = Dims("indexer_scores_rows").tensor("q", q, ("T", "nI", "dI"), ACT_DTYPES + (torch.float64,))
    expect("indexer_scores_rows", "k_paged", isinstance(k_paged, bool), "a bool", repr(k_paged))
    lead = ("B", "J") if k_paged else ("N",)
    if k_format is None:
        d.tensor("k", k, lead + ("dI",), (q.dtype,))
    else:
        check_row_format("indexer_scores_rows", "k_format", k_format, q.shape[-1], ("fp4",))
        expect("indexer_scores_rows", "q", q.dtype in ACT_DTYPES, f"one of {ACT_DTYPES} with k_format", q.dtype)
        d.tensor("k", k, lead + ("W",), (torch.uint8,))
        W = row_bytes(k_format, q.shape[-1])
        expect("indexer_scores_rows", "k", k.shape[-1] == W, f"{W} bytes a key ({k_format!r} keys of dI = {q.shape[-1]})",
               k.shape[-1])
    d.tensor("weights", weights, ("T", "nI"), F32)
    d.tensor("rows", rows, ("T", "L"), INT_DTYPES)
    if rows.numel():
        lo, hi, N = int(rows.min()), int(rows.max()), num_rows(k, k_paged)
        if lo < -1 or hi >= N:
            raise OpInputError("indexer_scores_rows", "rows", f"values in [-1, {N - 1}]",
                               f"range [{lo}, {hi}]")


@indexer_scores_rows.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    nI, dI = D["nI"], D["dI"]
    N = 40 if shapes == "small" else 2048
    for T in TOKENS[shapes]:
        L = 24 if shapes == "small" else 1024
        rows = torch.stack([torch.randperm(N, generator=gen)[:L] for _ in range(T)]) if T else torch.zeros(0, L)
        rows = rows.long()
        if T:
            keep = torch.randint(0, L + 1, (T,), generator=gen)
            keep[0] = 0                                                   # a query with no keys
            rows[torch.arange(L)[None, :] >= keep[:, None]] = -1
        yield Case(f"T{T}-L{L}-N{N}", dict(q=randn((T, nI, dI), gen, dtype, device), k=randn((N, dI), gen, dtype, device),
                                           weights=randn((T, nI), gen, torch.float32, device, nI ** -0.5),
                                           rows=rows.to(device), scale=dI ** -0.5))
    # paged layout: keys of one request scattered over blocks, -1 in the middle, int32, non-contiguous q
    T, L = 6, 12
    rows = torch.randint(0, N, (T, L), generator=gen)
    rows[:, 5] = -1
    yield Case("scattered-int32-noncontig", dict(q=noncontig(randn((T, nI, dI), gen, dtype, device)),
                                                 k=randn((N, dI), gen, dtype, device),
                                                 weights=randn((T, nI), gen, torch.float32, device, nI ** -0.5),
                                                 rows=rows.to(device, torch.int32), scale=0.37), ("noncontig",))
    yield Case("all-masked", dict(q=randn((3, nI, dI), gen, dtype, device), k=randn((4, dI), gen, dtype, device),
                                  weights=randn((3, nI), gen, torch.float32, device),
                                  rows=torch.full((3, 5), -1, dtype=torch.int64, device=device), scale=dI ** -0.5),
               ("masked",))
    # the FP4 key (HAL 1.3): a uint8 pool of official keys (Hadamard-rotated and FP4-simulated)
    # whose 32-value groups differ by powers of two (ignoring the scales, one group's scale for
    # another, or the nibbles swapped fails), -1 entries, a query with no keys
    levels = 2.0 ** (torch.arange(dI) // 32 % 4 - 1).to(torch.float32)
    for T in (1, 5):
        L = 24 if shapes == "small" else 256
        keys = hadamard(randn((N, dI), gen, torch.float32, "cpu")) * levels
        rows = torch.stack([torch.randperm(N, generator=gen)[:L] for _ in range(T)]).long()
        rows[:, L // 2:] = -1 if T == 1 else rows[:, L // 2:]
        rows[-1, 3] = -1
        yield Case(f"fp4-T{T}-L{L}", dict(q=randn((T, nI, dI), gen, dtype, device), k=pack("fp4", keys).to(device),
                                          weights=randn((T, nI), gen, torch.float32, device, nI ** -0.5),
                                          rows=rows.to(device), scale=dI ** -0.5, k_format="fp4"), ("format",))
    # the FP4 keys with a scale other than dI^-0.5 (an FP4-key kernel that hard-codes it fails)
    keys = hadamard(randn((N, dI), gen, torch.float32, "cpu")) * levels
    rows = torch.stack([torch.randperm(N, generator=gen)[:12] for _ in range(3)]).long()
    yield Case("fp4-scale", dict(q=randn((3, nI, dI), gen, dtype, device), k=pack("fp4", keys).to(device),
                                 weights=randn((3, nI), gen, torch.float32, device, nI ** -0.5),
                                 rows=rows.to(device), scale=0.37, k_format="fp4"), ("format",))
    # paged key pools (HAL 1.4): blocks of 8 keys whose block stride is not a multiple of the key
    # stride, plain and FP4 keys
    rows = torch.stack([torch.randperm(N, generator=gen)[:12] for _ in range(4)]).long()
    rows[1, 4:] = -1
    yield Case("paged", dict(q=randn((4, nI, dI), gen, dtype, device), k=blocks_of(randn((N, dI), gen, dtype, device), 8),
                             weights=randn((4, nI), gen, torch.float32, device, nI ** -0.5),
                             rows=rows.to(device), scale=dI ** -0.5, k_paged=True), ("paged",))
    keys = hadamard(randn((N, dI), gen, torch.float32, "cpu")) * levels
    yield Case("paged-fp4", dict(q=randn((4, nI, dI), gen, dtype, device), k=blocks_of(pack("fp4", keys).to(device), 8),
                                 weights=randn((4, nI), gen, torch.float32, device, nI ** -0.5),
                                 rows=rows.to(device, torch.int32), scale=dI ** -0.5, k_format="fp4", k_paged=True),
               ("paged", "format"))


@op(family="compression", tolerance=Tolerance(
    k=0.0, floor=0.0, metric="index_set",
    why="integer output from given scores (no arithmetic): compared per query as an index set, order "
        "free; a swap is allowed only between exactly equal scores (floor = the score tie tolerance, 0); "
        "the number of valid indices (min(topk, k_lengths)) and the -1 padding must match exactly"))
def indexer_topk(scores: torch.Tensor, k_lengths: torch.Tensor, topk: int) -> torch.Tensor:
    """Indices of the ``min(topk, k_lengths[t])`` largest scores among each query's valid entries
    ``w < k_lengths[t]``; remaining slots are -1. Returns [T, topk] int32 (order unspecified)."""
    T, L = scores.shape
    out = torch.full((T, topk), -1, dtype=torch.int32, device=scores.device)
    kk = min(topk, L)
    if T == 0 or kk == 0:
        return out
    pos = torch.arange(L, device=scores.device)
    valid = pos[None, :] < k_lengths[:, None]
    # a valid entry scored -inf must still beat every masked one: lift it to the lowest finite value
    lifted = torch.where(valid & (scores == float("-inf")), torch.finfo(scores.dtype).min, scores)
    picked = lifted.masked_fill(~valid, float("-inf")).topk(kk, dim=-1).indices
    keep = picked < k_lengths[:, None]        # too-early picks (fewer valid entries than kk) -> -1
    out[:, :kk] = torch.where(keep, picked, -1).to(torch.int32)
    return out


@indexer_topk.check
def _(scores, k_lengths, topk):
    d = Dims("indexer_topk").tensor("scores", scores, ("T", "L"), F32)
    d.tensor("k_lengths", k_lengths, ("T",), INT_DTYPES)
    expect("indexer_topk", "topk", isinstance(topk, int) and topk >= 1, "an int >= 1", topk)
    if scores.shape[0]:
        expect("indexer_topk", "k_lengths", int(k_lengths.max()) <= scores.shape[1] and int(k_lengths.min()) >= 0,
               f"values in [0, {scores.shape[1]}]", f"range [{int(k_lengths.min())}, {int(k_lengths.max())}]")


@indexer_topk.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    topk = D["topk"]
    for T, L in ((0, 0), (1, 3), (7, 4 * topk), (5, topk // 2), (33, 2 * topk + 1)):
        lengths = torch.randint(0, L + 1, (T,), generator=gen)
        yield Case(f"T{T}-L{L}", dict(scores=randn((T, L), gen, torch.float32, device),
                                      k_lengths=lengths.to(device), topk=topk))
    ties = torch.randint(0, 3, (4, 3 * topk), generator=gen).float()   # many exact ties
    yield Case("ties", dict(scores=ties.to(device), k_lengths=torch.full((4,), 3 * topk, device=device), topk=topk),
               ("ties",))
    # causal prefill: query t sees t+1 keys (fewer than topk early on: -1 padding); the best scores sit
    # at the END of each query's valid range, so a causal threshold off by one picks a wrong key
    T, L = 2 * topk, 2 * topk
    sc = randn((T, L), gen, torch.float32, device).cpu()
    lengths = torch.arange(1, T + 1)
    pos = torch.arange(L)
    sc = sc + 10.0 * (pos[None, :] >= lengths[:, None] - 1).float()    # the last valid and beyond: high
    sc = sc + 20.0 * (pos[None, :] >= lengths[:, None]).float()        # beyond the valid range: highest
    yield Case("causal-ramp", dict(scores=sc.to(device), k_lengths=lengths.to(device), topk=topk), ("causal",))
    yield Case("int32-lengths-ties-inf", dict(scores=torch.where(ties[:, :topk + 2] > 1, float("-inf"),
                                                                 ties[:, :topk + 2]).to(device),
                                              k_lengths=torch.tensor([0, 1, topk, topk + 2], dtype=torch.int32,
                                                                     device=device), topk=topk), ("ties",))
    # another topk than the model's (output width and the number of picks both follow it)
    lengths = torch.tensor([0, 3, topk, 2 * topk, 3 * topk])
    yield Case("topk-other", dict(scores=randn((5, 3 * topk), gen, torch.float32, device), k_lengths=lengths.to(device),
                                  topk=topk + 3))


@op(family="compression", since=(1, 2), tolerance=Tolerance(
    k=2.0, floor=1e-6, quantized_rows=32, quantized_step=1.0 / 3.0,
    why="a length-d fp32 Hadamard sum per value, rounded to bf16, then FP4 e2m1 codes: a legal fp32 "
        "difference crosses a bf16 boundary with probability ~2^-15 a value, and that moves its e2m1 "
        "code (one step: at most 2 of a group's 6, a third of the group maximum) ~1 time in 64; 1 token "
        "row in 32 may differ in a moved code"))
def indexer_rotate_quant(x: torch.Tensor) -> torch.Tensor:
    """The official indexer's query / key simulation: ``fake_quant(bf16(hadamard(x)), "fp4", 32)``
    over the last dim d (a power of two, a multiple of 32): the Sylvester-ordered Hadamard rotation
    scaled by d^-0.5 (fp32 math), rounded to bfloat16 (the official activation dtype), then FP4
    e2m1 fake-quantisation per 32 values with power-of-two scales ``2^ceil(log2(amax / 6))``
    (``hal.quant``). x [..., d] (queries [T, heads, d] after rope, keys [T, d] after norm and rope);
    the result in x's dtype. The values are exact e2m1 codes times UE8M0 scales: an FP4 key store
    of them is lossless."""
    y = hadamard(x.to(compute_dtype(x))).to(OFFICIAL_ACT_DTYPE)
    return fake_quant(y, "fp4", FP4_GROUP).to(x.dtype)


@indexer_rotate_quant.check
def _(x):
    Dims("indexer_rotate_quant").tensor("x", x, dtypes=ACT_DTYPES + (torch.float64,), min_rank=1)
    d = x.shape[-1]
    expect("indexer_rotate_quant", "x", d > 0 and d & (d - 1) == 0 and d % FP4_GROUP == 0,
           f"last dim a power of two and a multiple of {FP4_GROUP}", f"shape {tuple(x.shape)}")


@indexer_rotate_quant.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    nI, dI = D["nI"], D["dI"]
    yield Case("queries-T40", dict(x=randn((40, nI, dI), gen, dtype, device, 2.0)))
    yield Case("keys-T40", dict(x=randn((40, dI), gen, dtype, device, 0.5)))
    # a row concentrated in one Sylvester basis vector: an unscaled or differently ordered (or
    # unrotated) transform puts its energy elsewhere; spread magnitudes per token
    basis = torch.zeros(33, dI)
    basis[torch.arange(33), torch.randint(0, dI, (33,), generator=gen)] = float(dI) ** 0.5
    x = (hadamard_matrix(dI) @ basis.T).T * 2.0 ** torch.randint(-8, 8, (33, 1), generator=gen)
    yield Case("basis-rows", dict(x=(x + randn((33, dI), gen, torch.float32, "cpu", 0.01)).to(device, dtype)))
    yield Case("T0-empty", dict(x=torch.zeros((0, dI), device=device, dtype=dtype)))
