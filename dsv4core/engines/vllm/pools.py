"""dsv4core's pools over memory an engine allocated.

An engine hands each cache part (`layout.CachePart`) of each layer a block tensor
``[num_blocks, rows_per_block, row]`` (vLLM: ``[B, 1, N, C]``, squeezed) whose block stride is the
engine's physical block stride, not the page size: one backing allocation holds, per block, a page
of every part. dsv4core's ops read and write pools as ``[rows, row]`` with flat row indices and one
row stride (`cache_store`, `sparse_mqa_attention`, `indexer_scores_rows`), so a block tensor is
viewed as the row sequence of that memory: row ``b * s + o`` is row o of block b, with
``s = block stride / row stride`` (`rows_view`; the rows between two blocks' pages belong to other
parts and are never indexed). That needs the block stride to be a multiple of the row stride
(`layout.block_stride_alignment` gives one that is).

A layer's attention reads its window rows and its compressed entries through one index list, so
both parts of a layer are viewed as one row sequence starting at the lower of the two pages
(`layer_rows_view`): the window rows at `window_base + b * s + o`, the entries at `Rw + ...`, the
entries' base in the layer's pool (the attribute the layers read, as of `KVCache`).

Rows in a stored format (the FP8 KV row, the FP4 key: uint8) are viewed paged instead (HAL 1.4,
`hal.paged`): the ops take ``[B, J, row]`` with any strides, so the block stride need not be a
multiple of 584 / 68 B. A layer's window and entries are one ``[B, J, row]`` view from the lower of
its two pages (`paged_layer_view`, J rows covering both), the window rows at ``b * J + window base
+ o``, the entries at ``b * J + entry base + o`` (`Rw` 0); the keys are their block tensor as it is.

`EnginePools` holds these views and, per layer, the object the layers read as `step.cache` (the
attributes of `KVCache` that `dsv4core.model.modules` uses) and where each part's rows are
(`Addr`), which the step builder (`metadata.py`) turns into row indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import lcm

import torch

from dsv4core.hal.rowformats import row_bytes
from dsv4core.model.config import DSV4Config

from .layout import CachePart, block_stride_alignment


@dataclass(frozen=True)
class Addr:
    """Where one part's rows are: the block table of `group`, blocks of `block_tokens` tokens and
    `rows_per_block` rows, `stride` rows between two blocks, row 0 of block 0 at row `base`."""

    group: str
    block_tokens: int
    rows_per_block: int
    stride: int
    base: int = 0


def _blocks3(blocks: torch.Tensor, what: str) -> torch.Tensor:
    if blocks.dim() == 4 and blocks.shape[1] == 1:
        blocks = blocks.squeeze(1)
    if blocks.dim() != 3 or blocks.stride(2) != 1 or blocks.stride(1) < blocks.shape[2]:
        raise ValueError(f"{what}: an engine block tensor is [blocks, rows, row] (or [blocks, 1, rows, row]) with "
                         f"rows of contiguous values; got shape {tuple(blocks.shape)}, strides {blocks.stride()}")
    return blocks


def rows_view(blocks: torch.Tensor, what: str = "pool") -> tuple[torch.Tensor, int]:
    """(the rows of `blocks` as a ``[R, row]`` view of the same memory, rows between two blocks).
    Raises ValueError naming `what` when the block stride is not a multiple of the row stride."""
    b = _blocks3(blocks, what)
    s0, rs = b.stride(0), b.stride(1)
    if b.shape[0] > 1 and s0 % rs:
        es = b.element_size()
        raise ValueError(f"{what}: block stride {s0 * es} B is not a multiple of the row stride {rs * es} B "
                         f"(declare the caches with a block stride alignment of the row bytes)")
    per = s0 // rs if b.shape[0] > 1 else b.shape[1]
    n = (b.shape[0] - 1) * per + b.shape[1] if b.shape[0] else 0
    return torch.as_strided(b, (n, b.shape[2]), (rs, 1), b.storage_offset()), per


def layer_rows_view(window: torch.Tensor, entries: torch.Tensor | None, what: str):
    """(one ``[R, row]`` view over a layer's window and entry blocks, (window base, rows between
    window blocks), (entry base, rows between entry blocks)); entries None: the window's view."""
    w = _blocks3(window, f"{what} window")
    if entries is None:
        view, per = rows_view(w, f"{what} window")
        return view, (0, per), None
    e = _blocks3(entries, f"{what} entries")
    if (w.dtype, w.shape[2], w.stride(1)) != (e.dtype, e.shape[2], e.stride(1)) or \
            w.untyped_storage().data_ptr() != e.untyped_storage().data_ptr():
        raise ValueError(f"{what}: the window and entry blocks must be rows of one dtype, width and stride in "
                         f"one allocation; got {w.dtype} [{w.shape[2]}] / {e.dtype} [{e.shape[2]}], strides "
                         f"{w.stride()} / {e.stride()}")
    rs = w.stride(1)
    start = min(w.storage_offset(), e.storage_offset())
    bases, pers, n = [], [], 0
    for b, name in ((w, "window"), (e, "entries")):
        _, per = rows_view(b, f"{what} {name}")
        delta = b.storage_offset() - start
        if delta % rs:
            raise ValueError(f"{what}: the {name} pages start {delta * b.element_size()} B after the layer's first "
                             f"page, not a multiple of the row stride {rs * b.element_size()} B")
        bases.append(delta // rs)
        pers.append(per)
        n = max(n, delta // rs + ((b.shape[0] - 1) * per + b.shape[1] if b.shape[0] else 0))
    view = torch.as_strided(w, (n, w.shape[2]), (rs, 1), start)
    return view, (bases[0], pers[0]), (bases[1], pers[1])


def paged_layer_view(window: torch.Tensor, entries: torch.Tensor | None, what: str):
    """(one paged ``[B, J, row]`` view over a layer's window and entry blocks, (window base, J),
    (entry base, J) or None): row ``b * J + base + o`` is row o of block b of that part. For pools
    the HAL ops take paged (HAL 1.4: `cache_store(..., paged=True)`, `sparse_mqa_attention(...,
    kv_paged=True)`): the block stride need not be a multiple of the row stride, only the offset
    between the two parts' pages must be."""
    w = _blocks3(window, f"{what} window")
    if entries is None:
        return w, (0, w.shape[1]), None
    e = _blocks3(entries, f"{what} entries")
    if (w.dtype, w.shape[2], w.stride(1)) != (e.dtype, e.shape[2], e.stride(1)) or \
            w.untyped_storage().data_ptr() != e.untyped_storage().data_ptr() or \
            (min(w.shape[0], e.shape[0]) > 1 and w.stride(0) != e.stride(0)) or w.shape[0] != e.shape[0]:
        raise ValueError(f"{what}: the window and entry blocks must be rows of one dtype, width and stride in "
                         f"one allocation with one block stride; got {w.dtype} {tuple(w.shape)} / {e.dtype} "
                         f"{tuple(e.shape)}, strides {w.stride()} / {e.stride()}")
    rs, es = w.stride(1), w.element_size()
    start = min(w.storage_offset(), e.storage_offset())
    bases = []
    for b, name in ((w, "window"), (e, "entries")):
        delta = b.storage_offset() - start
        if delta % rs:
            raise ValueError(f"{what}: the {name} pages start {delta * es} B after the layer's first page, not a "
                             f"multiple of the row stride {rs * es} B")
        bases.append(delta // rs)
    J = max(bases[0] + w.shape[1], bases[1] + e.shape[1])
    if w.shape[0] > 1 and J * rs > w.stride(0):
        raise ValueError(f"{what}: the window and entry pages span {J * rs * es} B, more than the block stride "
                         f"{w.stride(0) * es} B")
    view = torch.as_strided(w, (w.shape[0], J, w.shape[2]), (w.stride(0), rs, 1), start)
    return view, (bases[0], J), (bases[1], J)


class LayerPools:
    """What one layer reads as `step.cache` (the `KVCache` attributes the layers use), over engine
    memory: `rows`, `keys`, `ring_pairs`, `ring_cap`, `epb` are indexed by layer (this layer's
    entry filled), `Rw` is this layer's entry base in its row pool."""

    def __init__(self, pools: "EnginePools", Rw: int) -> None:
        self.rows, self.keys, self.ring_pairs = pools.rows, pools.keys, pools.ring_pairs
        self.ring_cap, self.epb, self.W, self.Rw = pools.ring_cap, pools.epb, pools.W, Rw
        self.row_store, self.key_store = pools.row_store, pools.key_store
        self.row_read, self.key_read = pools.row_read, pools.key_read
        self._fill = pools.fill

    def ring_fill(self, width: int) -> torch.Tensor:
        return self._fill[width]


class EnginePools:
    """The model's pools over engine memory. `tensors[part.key]`: the engine's block tensor of each
    part; `groups[part.key]`: the name of the block table (cache group) that part's blocks are
    listed in. Per layer: `views[i]` (what the layer reads) and `addr[i]` (part -> `Addr`)."""

    def __init__(self, config: DSV4Config, parts: list[CachePart], tensors: dict[str, torch.Tensor],
                 groups: dict[str, str]) -> None:
        missing = sorted({p.key for p in parts} - set(tensors)) + sorted({p.key for p in parts} - set(groups))
        if missing:
            raise ValueError(f"EnginePools: no block tensor / cache group for {missing[:6]}")
        L = config.num_hidden_layers
        self.config, self.parts, self.W = config, parts, config.sliding_window
        by = {(p.layer, p.part): p for p in parts}
        for p in parts:
            t = _blocks3(tensors[p.key], p.key)
            if t.dtype != p.dtype or tuple(t.shape[1:]) != (p.rows_per_block, p.row_width):
                raise ValueError(f"EnginePools: {p.key} must be {p.dtype} [blocks, {p.rows_per_block}, "
                                 f"{p.row_width}]; got {t.dtype} {tuple(t.shape)}")
        fmt = next((p.format for p in parts if p.part == "window"), None)
        kfmt = next((p.format for p in parts if p.part == "keys"), None)
        # stored row formats (uint8 rows): paged views (HAL 1.4), so the block stride need not be
        # a multiple of the 584 B / 68 B rows
        self.paged = fmt is not None
        self.row_store = {"row_format": fmt, "paged": True} if fmt else {}
        self.key_store = {"row_format": kfmt, "paged": True} if kfmt else {}
        self.row_read = {"kv_format": fmt, "kv_paged": True} if fmt else {}
        self.key_read = {"k_format": kfmt, "k_paged": True} if kfmt else {}
        self.rows: list = [None] * L
        self.keys: list = [None] * L
        self.ring_pairs: list = [None] * L
        self.ring_cap, self.epb = [0] * L, [0] * L
        self.addr: list[dict[str, Addr]] = [{} for _ in range(L)]
        self.views: list[LayerPools] = []
        self.signature: list[tuple] = []
        widths = set()
        for i in range(L):
            win, ent = by[(i, "window")], by.get((i, "entries"))
            views = paged_layer_view if self.paged else layer_rows_view
            view, (wb, wper), e = views(tensors[win.key], tensors[ent.key] if ent else None, f"layers.{i}")
            self.rows[i] = view
            a = self.addr[i]
            a["window"] = Addr(groups[win.key], win.block_tokens, win.rows_per_block, wper, wb)
            Rw = 0
            if ent is not None:
                # flat views: the entries from row Rw of the layer's view on; paged: Rw = 0 and the
                # entries' base within a block in their Addr
                Rw = 0 if self.paged else e[0]
                a["entries"] = Addr(groups[ent.key], ent.block_tokens, ent.rows_per_block, e[1],
                                    e[0] if self.paged else 0)
                self.epb[i] = ent.rows_per_block
            if (i, "keys") in by:
                k = by[(i, "keys")]
                if self.paged:      # a padded key row (`cache_parts(..., align_key_pages=True)`): the key first
                    kb = row_bytes(kfmt, config.index_head_dim)
                    self.keys[i], per = _blocks3(tensors[k.key], k.key)[..., :kb], k.rows_per_block
                else:
                    self.keys[i], per = rows_view(tensors[k.key], k.key)
                a["keys"] = Addr(groups[k.key], k.block_tokens, k.rows_per_block, per)
            for part, name in (("state", "kv"), ("index_state", "ikv")):
                if (i, part) in by:
                    s = by[(i, part)]
                    ring, per = rows_view(tensors[s.key], s.key)
                    self.ring_pairs[i] = {**(self.ring_pairs[i] or {}), name: ring}
                    a[part] = Addr(groups[s.key], s.block_tokens, s.rows_per_block, per)
                    self.ring_cap[i] = s.window
                    widths.add(s.row_width // 2)
            self.signature.append((tuple(sorted(a.items())), Rw))
        self.fill = {w: torch.cat([torch.zeros(w), torch.full((w,), float("-inf"))]).to(self.rows[0].device)
                     for w in widths}
        self.views = [LayerPools(self, s[1]) for s in self.signature]


def allocate_packed(parts: list[CachePart], num_blocks: int, device="cpu", *, alignment: int | None = None,
                    fill: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One backing allocation of `num_blocks` blocks, block-outermost: block b holds one page of
    every part, side by side in `parts` order, the block stride rounded up to `alignment` (default
    `block_stride_alignment(parts)`, and a multiple of 8 bytes). The layout an engine that packs
    pages of several sizes into one pool uses (vLLM for DeepSeek-V4); returns (the byte buffer,
    part key -> block tensor [num_blocks, rows_per_block, row_width] of the part's dtype).
    `fill`: the byte every cell starts with (0xFF: NaN in float rows, so a read of a row no step
    wrote shows)."""
    align = lcm(alignment or block_stride_alignment(parts), 8)
    offs, o = {}, 0
    for p in parts:
        if o % p.row_bytes:
            o += p.row_bytes - o % p.row_bytes      # a page starts at a multiple of its row bytes
        offs[p.key] = o
        o += p.page_bytes
    stride = -(-o // align) * align
    buf = torch.full((num_blocks * stride,), fill, dtype=torch.uint8, device=device)
    out = {}
    for p in parts:
        es = p.dtype.itemsize
        typed = buf.view(p.dtype)
        out[p.key] = torch.as_strided(typed, (num_blocks, p.rows_per_block, p.row_width),
                                      (stride // es, p.row_width, 1), offs[p.key] // es)
    return buf, out
