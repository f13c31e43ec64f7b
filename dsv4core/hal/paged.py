"""Paged pools (HAL 1.4): a state pool given as blocks of rows in memory another owner pages.

A pool op's pool is ``[R, W]`` rows (any row stride), or, with the op's paged argument
(``cache_store(..., paged=True)``, ``sparse_mqa_attention(..., kv_paged=True)``,
``indexer_scores_rows(..., k_paged=True)``), ``[B, J, W]``: B blocks of J rows, any strides. Row r
of a paged pool is ``pool[r // J, r % J]``, so the flat row indices an op takes address it as they
address ``[B * J, W]`` rows. The block stride need not be a multiple of the row stride, and the
bytes between two blocks' rows are never read or written: an engine's block whose other bytes hold
other caches (vLLM's packed blocks of DeepSeek-V4) is a pool as it is.
"""

from __future__ import annotations

import torch


def num_rows(pool: torch.Tensor, paged: bool) -> int:
    """The rows a pool holds: R, or B * J when paged."""
    return pool.shape[0] * pool.shape[1] if paged else pool.shape[0]


def gather(pool: torch.Tensor, idx: torch.Tensor, paged: bool) -> torch.Tensor:
    """``pool``'s rows ``idx`` (integers in [0, num_rows)), shape ``idx.shape + (W,)``."""
    if not paged:
        return pool[idx]
    J = pool.shape[1]
    return pool[idx // J, idx % J]


def put(pool: torch.Tensor, idx: torch.Tensor, values: torch.Tensor, paged: bool) -> None:
    """``pool``'s rows ``idx`` [E] = ``values`` [E, W], in place (duplicate rows carry equal values)."""
    if not paged:
        pool.index_copy_(0, idx, values)
    else:
        J = pool.shape[1]
        pool.index_put_((idx // J, idx % J), values)


def blocks_of(rows: torch.Tensor, J: int, gap: int = 8, pad: int = 8, offset: int = 16) -> torch.Tensor:
    """A paged copy of ``rows`` [R, W] (R a multiple of J): ``[R / J, J, W]`` whose rows are ``W +
    pad`` elements apart and whose blocks are ``J (W + pad) + gap`` apart (a block stride that is
    not a multiple of the row stride for ``0 < gap < W + pad``), in a larger buffer at storage
    offset ``offset``; the elements outside the rows hold other values. The defaults keep every
    stride a multiple of 8 elements, as an engine's blocks are (its pages start at whole rows)."""
    R, W = rows.shape
    if R % J:
        raise ValueError(f"blocks_of: {R} rows are not whole blocks of {J}")
    B, rs = R // J, W + pad
    bs = J * rs + gap
    buf = torch.full((offset + B * bs,), 0x5A if rows.dtype == torch.uint8 else -7, dtype=rows.dtype,
                     device=rows.device)
    view = torch.as_strided(buf, (B, J, W), (bs, rs, 1), offset)
    view.copy_(rows.reshape(B, J, W))
    return view
