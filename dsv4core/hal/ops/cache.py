"""Writing rows into the model's state pools (SPEC.md section 2, "Pool writes").

The pools (sliding-window rows, compressed entries, indexer keys, compressor rings) are owned by
the model's cache (dsv4core/model/kvcache.py); an op that writes into one takes the pool and the flat
destination rows explicitly and returns nothing.
"""

from __future__ import annotations

import torch

from ..errors import OpInputError
from ..spec import ACT_DTYPES, INT_DTYPES, Case, Dims, Tolerance, expect, op
from ..paged import blocks_of, num_rows, put
from ..rowformats import FORMATS, check_row_format, pack, row_bytes
from ._cases import dims, noncontig, randn


@op(family="cache", since=(1, 1), writes=("pool",), params_since={"row_format": (1, 3), "paged": (1, 4)}, tolerance=Tolerance(
    k=0.0, floor=0.0, metric="bitwise",
    why="a store: each written row is rows[i] cast once to the pool dtype (round to nearest even), "
        "or encoded once with the exact rule of its row format; every other row of the pool keeps "
        "its bits"))
def cache_store(pool: torch.Tensor, index: torch.Tensor, rows: torch.Tensor, row_format: str | None = None,
                paged: bool = False) -> None:
    """``pool[index[i]] = rows[i]`` (cast to pool.dtype) for every ``index[i] >= 0``; ``-1`` skips
    row i. pool [R, D] (any row stride), index [E] int, rows [E, D]. The valid destinations are
    distinct. Writes in place; returns None. Capturable: no host synchronisation, fixed shapes.

    ``row_format`` (HAL 1.3; None = rows as they are): ``"fp8"`` (the FP8 KV row) or ``"fp4"`` (the
    FP4 indexer key) of ``hal.rowformats``: pool is uint8 [R, row_bytes(row_format, D)] and row i
    is stored as ``rowformats.pack(row_format, rows[i])``.

    ``paged`` (HAL 1.4; False = pool is [R, D] rows): pool is [B, J, D] (or [B, J, row bytes]),
    blocks of J rows with any strides (`hal.paged`): row r is ``pool[r // J, r % J]``, R = B * J."""
    E = index.shape[0]
    if E == 0 or num_rows(pool, paged) == 0:
        return None
    idx = index.long()
    valid = idx >= 0
    # Skipped rows are redirected to the first valid destination carrying that destination's own
    # value (or to row 0 carrying row 0's current value when none is valid), so every duplicate
    # destination receives identical bits whatever order the writes land in. One-element index
    # tensors throughout: indexing with a 0-dim tensor would read it back to the host.
    first = torch.argmax(valid.to(torch.int8)).reshape(1)
    any_valid = valid.index_select(0, first)                                   # [1]
    src = rows.to(pool.dtype) if row_format is None else pack(row_format, rows)
    fallback_idx = torch.where(any_valid, idx.index_select(0, first), torch.zeros_like(first))
    fallback_row = torch.where(any_valid[:, None], src.index_select(0, first), pool[0, :1] if paged else pool[:1])
    tgt = torch.where(valid, idx, fallback_idx)
    val = torch.where(valid[:, None], src, fallback_row)
    put(pool, tgt, val, paged)
    return None


@cache_store.check
def _(pool, index, rows, row_format=None, paged=False):
    d = Dims("cache_store")
    expect("cache_store", "paged", isinstance(paged, bool), "a bool", repr(paged))
    lead = ("B", "J") if paged else ("R",)
    if row_format is None:
        d.tensor("pool", pool, lead + ("D",), ACT_DTYPES + (torch.float64,))
        d.tensor("rows", rows, ("E", "D"), ACT_DTYPES + (torch.float64,))
    else:
        check_row_format("cache_store", "row_format", row_format, rows.shape[-1], FORMATS)
        d.tensor("rows", rows, ("E", "D"), ACT_DTYPES)
        d.tensor("pool", pool, lead + ("W",), (torch.uint8,))
        expect("cache_store", "pool", pool.shape[-1] == row_bytes(row_format, rows.shape[1]),
               f"{row_bytes(row_format, rows.shape[1])} bytes a row ({row_format!r} rows of {rows.shape[1]} values)",
               f"{pool.shape[-1]}")
    d.tensor("index", index, ("E",), INT_DTYPES)
    R = num_rows(pool, paged)
    if index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < -1 or hi >= R:
            raise OpInputError("cache_store", "index", f"values in [-1, {R - 1}]", f"range [{lo}, {hi}]")
        v = index[index >= 0]
        expect("cache_store", "index", v.unique().numel() == v.numel(), "distinct destination rows",
               f"{v.numel() - v.unique().numel()} repeated")


def _distinct(E: int, R: int, gen: torch.Generator, skip: float) -> torch.Tensor:
    idx = torch.randperm(R, generator=gen)[:E].long()
    idx[torch.rand(E, generator=gen) < skip] = -1
    return idx


@cache_store.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    for width, label in ((D["d"], "rows"), (D["dI"], "keys"), (2 * D["d"], "ring")):
        R = 64
        for E, skip in ((0, 0.0), (1, 0.0), (7, 0.3), (33, 0.5)):
            pool_dt = torch.float32 if label == "ring" else dtype
            yield Case(f"{label}-E{E}", dict(pool=randn((R, width), gen, pool_dt, device),
                                             index=_distinct(E, R, gen, skip).to(device),
                                             rows=randn((E, width), gen, torch.float32, device, 3.0)))
    d = D["d"]
    # every row skipped (nothing may change, row 0 included); a write into row 0 beside skipped rows;
    # int32 indices into a strided pool view (a layer's region of a larger buffer); rows in bf16
    # written into an fp32 pool and fp32 rows into a bf16 pool (one rounding)
    yield Case("all-skipped", dict(pool=randn((16, d), gen, dtype, device), index=torch.full((5,), -1, device=device),
                                   rows=randn((5, d), gen, dtype, device)), ("masked",))
    idx = torch.tensor([-1, 0, -1, 9], device=device)
    yield Case("row0-beside-skips", dict(pool=randn((16, d), gen, dtype, device), index=idx,
                                         rows=randn((4, d), gen, dtype, device)), ("masked",))
    big = randn((40, 2 * d + 1), gen, dtype, device)
    yield Case("strided-pool-int32", dict(pool=big[3:35, 1:d + 1], index=_distinct(9, 32, gen, 0.2).to(device, torch.int32),
                                          rows=noncontig(randn((9, d), gen, torch.float32, device))), ("noncontig",))
    yield Case("cast-into-pool", dict(pool=randn((16, d), gen, torch.float32, device),
                                      index=_distinct(6, 16, gen, 0.0).to(device),
                                      rows=randn((6, d), gen, dtype, device)))
    # the stored row formats (HAL 1.3): the FP8 KV row and the FP4 indexer key. Groups scaled by
    # different powers of two (a kernel applying one group's scale to another fails), a zero group
    # (the amax clamp), skipped rows, int32 indices, and a pool whose other rows hold random bytes
    # that must keep their bits.
    for fmt, width, group in (("fp8", D["d"], 64), ("fp4", D["dI"], 32)):
        R, E = 32, 9
        pool = torch.randint(0, 256, (R, row_bytes(fmt, width)), generator=gen, dtype=torch.uint8).to(device)
        rows = randn((E, width), gen, torch.float32, device, 3.0)
        levels = 2.0 ** (torch.arange(width, device=device) // group % 5 - 2).to(torch.float32)
        rows = rows * levels
        rows[1, :group] = 0.0
        yield Case(f"{fmt}-E{E}", dict(pool=pool, index=_distinct(E, R, gen, 0.2).to(device, torch.int32),
                                       rows=rows.to(dtype), row_format=fmt), ("format",))
    # paged pools (HAL 1.4): blocks of J rows whose block stride is not a multiple of the row stride,
    # other bytes between the blocks (they must keep their bits), plain rows and both row formats
    for fmt, width, J in ((None, d, 4), ("fp8", D["d"], 4), ("fp4", D["dI"], 8), (None, 2 * d, 2)):
        R, E = 24, 7
        flat = (randn((R, width), gen, torch.float32 if J == 2 else dtype, device) if fmt is None else
                torch.randint(0, 256, (R, row_bytes(fmt, width)), generator=gen, dtype=torch.uint8).to(device))
        rows = randn((E, width), gen, torch.float32, device, 3.0)
        extra = {} if fmt is None else dict(row_format=fmt)
        yield Case(f"paged-{fmt or 'rows'}-J{J}", dict(pool=blocks_of(flat, J), index=_distinct(E, R, gen, 0.3).to(device),
                                                     rows=rows if fmt is None else rows.to(dtype), paged=True, **extra),
                   ("paged",))
