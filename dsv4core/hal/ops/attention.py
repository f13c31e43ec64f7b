"""Shared-KV multi-query attention over per-query row lists, with a per-head sink (SPEC.md section 2)."""

from __future__ import annotations

import torch

from ..paged import blocks_of, gather, num_rows
from ..rowformats import check_row_format, pack, row_bytes, unpack
from ..spec import ACT_DTYPES, F32, Case, Dims, Tolerance, compute_dtype, expect, op
from ._cases import TOKENS, dims, noncontig, randn

#: Rows gathered per chunk of queries (bounds the reference's memory: T * K * d floats at once).
_GATHER_BUDGET = 1 << 24


@op(family="attention", params_since={"kv_format": (1, 3), "kv_paged": (1, 4)}, tolerance=Tolerance(
    k=4.0, floor=1e-6,
    why="a length-d dot product per logit, a softmax over up to K rows and a weighted sum of K "
        "rows: three reductions whose order a kernel is free to choose (online softmax, split K)"))
def sparse_mqa_attention(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor,
                         scale: float, kv_format: str | None = None, kv_paged: bool = False) -> torch.Tensor:
    """Attention of q [T, h, d] over the rows ``kv[indices[t]]`` (K = V), -1 entries ignored.

    ``o_h = sum_u exp(l_u) kv_u / (sum_u exp(l_u) + exp(sink_h))`` with ``l_u = scale * q_h . kv_u``.
    The sink is a raw logit (not scaled, no value). An empty row list gives 0. fp32 math.

    ``kv_format`` (HAL 1.3; None = kv holds [N, d] rows in q's dtype): ``"fp8"``, the FP8 KV row of
    ``hal.rowformats``; kv is uint8 [N, row_bytes("fp8", d)] and ``kv_u`` is
    ``rowformats.unpack("fp8", kv[u], d)`` rounded to q's dtype (for the official rows, exactly the
    values a plain pool would hold).

    ``kv_paged`` (HAL 1.4; False = kv is [N, d] rows): kv is [B, J, d] (or [B, J, row bytes]),
    blocks of J rows with any strides (`hal.paged`): row u is ``kv[u // J, u % J]``, N = B * J.
    """
    T, h, d = q.shape
    ct = compute_dtype(q)
    K = indices.shape[1]
    if K == 0 or num_rows(kv, kv_paged) == 0:               # no row for any query: every S_t is empty -> 0
        return torch.zeros((T, h, d), dtype=q.dtype, device=q.device)
    out = torch.empty((T, h, d), dtype=q.dtype, device=q.device)
    chunk = max(1, _GATHER_BUDGET // max(1, K * d))
    sink_c = sink.to(ct)
    for s in range(0, T, chunk):
        idx = indices[s:s + chunk].long()
        valid = idx >= 0
        rows = gather(kv, idx.clamp_min(0), kv_paged)
        rows = (rows if kv_format is None else unpack(kv_format, rows, d, q.dtype)).to(ct)   # [t, K, d]
        logits = torch.einsum("thd,tkd->thk", q[s:s + chunk].to(ct), rows) * scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        m = torch.maximum(logits.amax(-1), sink_c[None, :])                 # sink joins the max
        p = torch.exp(logits - m[..., None])
        denom = p.sum(-1) + torch.exp(sink_c[None, :] - m)
        out[s:s + chunk] = (torch.einsum("thk,tkd->thd", p, rows) / denom[..., None]).to(q.dtype)
    return out


@sparse_mqa_attention.check
def _(q, kv, indices, sink, scale, kv_format=None, kv_paged=False):
    d = Dims("sparse_mqa_attention").tensor("q", q, ("T", "h", "d"), ACT_DTYPES + (torch.float64,))
    expect("sparse_mqa_attention", "kv_paged", isinstance(kv_paged, bool), "a bool", repr(kv_paged))
    lead = ("B", "J") if kv_paged else ("N",)
    if kv_format is None:
        d.tensor("kv", kv, lead + ("d",), (q.dtype,))
    else:
        check_row_format("sparse_mqa_attention", "kv_format", kv_format, q.shape[-1], ("fp8",))
        expect("sparse_mqa_attention", "q", q.dtype in ACT_DTYPES, f"one of {ACT_DTYPES} with kv_format", q.dtype)
        d.tensor("kv", kv, lead + ("W",), (torch.uint8,))
        W = row_bytes(kv_format, q.shape[-1])
        expect("sparse_mqa_attention", "kv", kv.shape[-1] == W,
               f"{W} bytes a row ({kv_format!r} rows of d = {q.shape[-1]})", kv.shape[-1])
    d.tensor("indices", indices, ("T", "K"), (torch.int32, torch.int64))
    d.tensor("sink", sink, ("h",), F32)
    if indices.numel():
        lo, hi, N = int(indices.min()), int(indices.max()), num_rows(kv, kv_paged)
        if lo < -1 or hi >= N:
            from ..errors import OpInputError
            raise OpInputError("sparse_mqa_attention", "indices", f"values in [-1, {N - 1}]",
                               f"range [{lo}, {hi}]")


def _window_indices(T: int, N: int, K: int, gen: torch.Generator, device, empty_rows: int = 0) -> torch.Tensor:
    """Distinct random rows per query, a random number of trailing -1 sentinels, some empty rows."""
    idx = torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(T)]) if T else torch.empty(0, K)
    idx = idx.long()
    if T:
        keep = torch.randint(1, K + 1, (T,), generator=gen)
        idx[torch.arange(K)[None, :] >= keep[:, None]] = -1
        idx[:empty_rows] = -1
    return idx.to(device=device, dtype=torch.int32)


@sparse_mqa_attention.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    h, d = D["heads"], D["d"]
    K = D["window"] + (D["topk"] if shapes != "small" else 8)
    N = 2 * K
    scale = d ** -0.5
    for T in TOKENS[shapes]:
        yield Case(f"T{T}-K{K}", dict(q=randn((T, h, d), gen, dtype, device), kv=randn((N, d), gen, dtype, device),
                                      indices=_window_indices(T, N, K, gen, device, empty_rows=min(T, 1)),
                                      sink=randn((h,), gen, torch.float32, device), scale=scale))
    for label, sink_scale in (("sink-large", 30.0), ("sink-small", -30.0)):
        yield Case(label, dict(q=randn((3, h, d), gen, dtype, device), kv=randn((N, d), gen, dtype, device),
                               indices=_window_indices(3, N, K, gen, device),
                               sink=torch.full((h,), sink_scale, device=device), scale=scale), ("extreme",))
    # sinks comparable to the logits (the sink's share of the softmax is O(1) per head): ignoring or
    # scaling the sink changes every output
    yield Case("sink-mid", dict(q=randn((5, h, d), gen, dtype, device, 2.0), kv=randn((N, d), gen, dtype, device),
                                indices=_window_indices(5, N, K, gen, device),
                                sink=randn((h,), gen, torch.float32, device, 2.0) + 1.0, scale=scale))
    # every row masked (-1 only): output 0 for all heads; rows with a single valid entry
    yield Case("all-masked", dict(q=randn((4, h, d), gen, dtype, device), kv=randn((N, d), gen, dtype, device),
                                  indices=torch.full((4, K), -1, dtype=torch.int32, device=device),
                                  sink=randn((h,), gen, torch.float32, device), scale=scale), ("masked",))
    one = torch.full((5, K), -1, dtype=torch.int64)
    one[:, K // 2] = torch.randint(0, N, (5,), generator=gen)
    yield Case("single-row-int64", dict(q=randn((5, h, d), gen, dtype, device), kv=randn((N, d), gen, dtype, device),
                                        indices=one.to(device), sink=randn((h,), gen, torch.float32, device),
                                        scale=scale), ("masked",))
    # sentinels scattered (not only trailing), non-contiguous q and kv (rows stay distinct: the
    # spec makes distinct row indices a precondition, so a repeated row is not a legal case)
    idx = _window_indices(6, N, K, gen, device).long().cpu()
    idx = idx[:, torch.randperm(K, generator=gen)]
    yield Case("scattered-noncontig", dict(q=noncontig(randn((6, h, d), gen, dtype, device)),
                                           kv=noncontig(randn((N, d), gen, dtype, device)),
                                           indices=idx.to(device=device, dtype=torch.int32),
                                           sink=randn((h,), gen, torch.float32, device), scale=scale), ("noncontig",))
    yield Case("large-logits", dict(q=randn((3, h, d), gen, dtype, device, 8.0), kv=randn((N, d), gen, dtype, device, 8.0),
                                    indices=_window_indices(3, N, K, gen, device),
                                    sink=randn((h,), gen, torch.float32, device), scale=scale), ("extreme",))
    # softmax scales other than d^-0.5 (a kernel that hard-codes d^-0.5, or applies the scale to
    # the sink too, fails here): sharper and flatter distributions than the model's
    for label, sc in (("scale-sharp", 4.0 * scale), ("scale-flat", 0.05)):
        yield Case(label, dict(q=randn((4, h, d), gen, dtype, device), kv=randn((N, d), gen, dtype, device),
                               indices=_window_indices(4, N, K, gen, device),
                               sink=randn((h,), gen, torch.float32, device), scale=sc), ("scale",))
    # the FP8 KV row (HAL 1.3): a uint8 pool of official rows whose 64-channel groups differ by
    # powers of two (a kernel that ignores the scales, or applies one group's scale to another, or
    # reads the rope channels as e4m3, fails), decode and prefill token counts
    if d > 64 and (d - 64) % 64 == 0:
        levels = 2.0 ** (torch.arange(d) // 64 % 4 - 1).to(torch.float32)
        for T in (1, 7):
            rows = randn((N, d), gen, torch.float32, "cpu") * levels
            yield Case(f"fp8-T{T}", dict(q=randn((T, h, d), gen, dtype, device), kv=pack("fp8", rows).to(device),
                                         indices=_window_indices(T, N, K, gen, device, empty_rows=min(T - 1, 1)),
                                         sink=randn((h,), gen, torch.float32, device), scale=scale, kv_format="fp8"),
                       ("format",))
        # the FP8 rows with a softmax scale other than d^-0.5 (an FP8-row kernel of its own that
        # hard-codes the model's scale fails)
        rows = randn((N, d), gen, torch.float32, "cpu") * levels
        yield Case("fp8-scale-sharp", dict(q=randn((4, h, d), gen, dtype, device), kv=pack("fp8", rows).to(device),
                                           indices=_window_indices(4, N, K, gen, device),
                                           sink=randn((h,), gen, torch.float32, device), scale=4.0 * scale,
                                           kv_format="fp8"), ("format", "scale"))
    # paged pools (HAL 1.4): kv as blocks of J rows whose block stride is not a multiple of the row
    # stride (a kernel that addresses row u at u * row stride reads the wrong bytes), plain and FP8 rows
    J = 8 if N % 8 == 0 else 1
    for T in (1, 6):
        yield Case(f"paged-T{T}", dict(q=randn((T, h, d), gen, dtype, device),
                                       kv=blocks_of(randn((N, d), gen, dtype, device), J),
                                       indices=_window_indices(T, N, K, gen, device),
                                       sink=randn((h,), gen, torch.float32, device), scale=scale, kv_paged=True),
                   ("paged",))
    if d > 64 and (d - 64) % 64 == 0:
        rows = randn((N, d), gen, torch.float32, "cpu") * levels
        yield Case("paged-fp8", dict(q=randn((5, h, d), gen, dtype, device), kv=blocks_of(pack("fp8", rows).to(device), J),
                                     indices=_window_indices(5, N, K, gen, device),
                                     sink=randn((h,), gen, torch.float32, device), scale=scale, kv_format="fp8",
                                     kv_paged=True), ("paged", "format"))
