"""The model's caches as an engine's paged allocator sees them (no vLLM needed).

Per layer, the caches dsv4core's forward reads and writes, each paged in blocks of tokens with its
own block table (docs/vllm.md):

    part          paging    block (tokens)   rows a block        row
    window        sliding   window_block     window_block        a KV row (head_dim values)
    entries       full      block_tokens     block_tokens / m    a KV row (compressed entry)
    keys          full      block_tokens     block_tokens / m    an indexer key (CSA)
    state         sliding   state_block(m)   state_block(m)      fp32 [kv | score] (c * d each)
    index_state   sliding   state_block(m)   state_block(m)      fp32 [kv | score] (2 * d_I each)

"sliding" parts are read only within a window behind each token (W for the window rows, (1 + o) m
for a compressor's state: o = 1 for CSA), so an engine releases their blocks below it; "full"
parts keep every block. Compressed entry e of a request (positions [e m, (e + 1) m)) sits in the
block of its tokens: row e % (block_tokens / m) of block table entry e // (block_tokens / m).

`kv_bytes_per_token` and `request_bytes` are what an engine allocates for these parts; they
equal `dsv4core.model.cache_layout.state_bytes` for the growing caches (tests/test_vllm_adapter.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import torch

from dsv4core.hal.rowformats import row_bytes
from dsv4core.model.cache_layout import kv_formats
from dsv4core.model.config import CSA, SLIDING, DSV4Config

#: the parts of a layer, in the order `cache_parts` lists them
PARTS = ("window", "entries", "keys", "state", "index_state")


def default_state_block(ratio: int) -> int:
    """Tokens a compressor-state block covers: 4 at rate 4, 8 at rate 128 (vLLM's DeepSeek-V4
    choice: a state page then lines up with the KV pages), min(ratio, 8) in general."""
    return min(ratio, 8)


@dataclass(frozen=True)
class CachePart:
    """One cache of one layer, described as an engine's allocator needs it."""

    layer: int
    part: str                 # one of PARTS
    paging: str               # "sliding" (blocks below `window` released) or "full"
    block_tokens: int         # tokens a block covers
    tokens_per_row: int       # 1, or the compression rate m (entries, keys)
    row_width: int            # elements of `dtype` a row
    dtype: torch.dtype
    window: int | None = None  # sliding parts: positions behind a token that stay readable
    format: str | None = None  # the `hal.rowformats` format of a row (None: plain values)

    @property
    def rows_per_block(self) -> int:
        return self.block_tokens // self.tokens_per_row

    @property
    def row_bytes(self) -> int:
        return self.row_width * self.dtype.itemsize

    @property
    def page_bytes(self) -> int:
        return self.rows_per_block * self.row_bytes

    @property
    def key(self) -> str:
        """`layers.<i>.<part>`: the part's name (an engine's layer name for it)."""
        return f"layers.{self.layer}.{self.part}"


def cache_parts(config: DSV4Config, dtype: torch.dtype, kv_dtype: str | None = None, *, window_block: int = 64,
                block_tokens: int = 256, state_block=default_state_block,
                align_key_pages: bool = False) -> list[CachePart]:
    """Every cache part of the model's layers (`config.layer_types`). `dtype`: the activation dtype
    (rows stored in it unless `kv_dtype` is "fp8": the FP8 KV row and FP4 key of
    `hal.rowformats`, uint8); `state_block(m)`: tokens a state block covers at rate m.
    `align_key_pages` (fp8): the key rows padded (`row_width` > the key's bytes, the key first) so a
    key page is a whole number of KV rows: an engine that packs a group's pages side by side (vLLM)
    then starts every entry page a whole number of KV rows after a window page (`pools.paged_layer_view`)."""
    kv_fmt, key_fmt = kv_formats(config, kv_dtype)
    d, dI, W = config.head_dim, config.index_head_dim, config.sliding_window
    ratios = sorted({config.compress_ratio(i) for i in range(config.num_hidden_layers)} - {0})
    bad = [m for m in ratios if block_tokens % m]
    if bad:
        raise ValueError(f"cache_parts: block_tokens={block_tokens} must be a multiple of every compression rate; "
                         f"{bad} do not divide it")
    if window_block < 1:
        raise ValueError(f"cache_parts: window_block must be >= 1; got {window_block}")
    row = (row_bytes(kv_fmt, d), torch.uint8) if kv_fmt else (d, dtype)
    key = (row_bytes(key_fmt, dI), torch.uint8) if key_fmt else (dI, dtype)
    if key_fmt and align_key_pages:
        n = block_tokens // config.compress_ratio(next(i for i, t in enumerate(config.layer_types) if t == CSA)) \
            if CSA in config.layer_types else 1
        pitch = key[0]
        while (n * pitch) % row[0]:
            pitch += 1
        key = (pitch, torch.uint8)
    out = []
    for i, t in enumerate(config.layer_types):
        out.append(CachePart(i, "window", "sliding", window_block, 1, *row, window=W, format=kv_fmt))
        if t == SLIDING:
            continue
        m = config.compress_ratio(i)
        overlap = t == CSA
        c, sb = 2 if overlap else 1, state_block(m)
        if not isinstance(sb, int) or sb < 1:
            raise ValueError(f"cache_parts: state_block({m}) must be an int >= 1; got {sb!r}")
        out.append(CachePart(i, "entries", "full", block_tokens, m, *row, format=kv_fmt))
        if overlap:
            out.append(CachePart(i, "keys", "full", block_tokens, m, *key, format=key_fmt))
        out.append(CachePart(i, "state", "sliding", sb, 1, 2 * c * d, torch.float32, window=(1 + overlap) * m))
        if overlap:
            out.append(CachePart(i, "index_state", "sliding", sb, 1, 4 * dI, torch.float32, window=2 * m))
    return out


def sliding_blocks(part: CachePart, tokens: int, in_flight: int = 1) -> int:
    """Blocks a request of `tokens` tokens holds at most in a sliding part while `in_flight` tokens
    are being computed: the window behind the computed tokens plus the tokens in flight, plus one
    block the window may start inside of (vLLM's sliding-window manager bound), and no more than
    the tokens span."""
    held = min(part.window - 1 + in_flight, tokens)
    return min(-(-tokens // part.block_tokens), -(-held // part.block_tokens) + 1)


def request_bytes(parts: list[CachePart], tokens: int, in_flight: int = 1) -> dict[str, int]:
    """Bytes a request of `tokens` tokens holds in an engine paging `parts`, per kind, as in
    `state_bytes`: window rows, compressed entries, indexer keys, compressor states; and the total."""
    out = {"window_rows": 0, "compressed_entries": 0, "indexer_keys": 0, "compressor_states": 0}
    kind = {"window": "window_rows", "entries": "compressed_entries", "keys": "indexer_keys",
            "state": "compressor_states", "index_state": "compressor_states"}
    for p in parts:
        n = sliding_blocks(p, tokens, in_flight) if p.paging == "sliding" else -(-tokens // p.block_tokens)
        out[kind[p.part]] += n * p.page_bytes
    out["total"] = sum(out.values())
    return out


def kv_bytes_per_token(parts: list[CachePart]) -> dict[str, Fraction]:
    """Bytes each token adds: "compressed" (entries and keys, kept for the whole request: a page's
    bytes over its tokens), "window" (the window rows, while the token is in the window) and
    "state" (compressor-state rows, while in a state window); exact fractions."""
    out = {"compressed": Fraction(0), "window": Fraction(0), "state": Fraction(0)}
    for p in parts:
        k = "compressed" if p.paging == "full" else ("window" if p.part == "window" else "state")
        out[k] += Fraction(p.page_bytes, p.block_tokens)
    return out


def block_stride_alignment(parts: list[CachePart]) -> int:
    """The least multiple of the row bytes of every part viewed as flat rows: a physical block
    stride that is one lets a pool view address each such part's rows as one strided row sequence
    (`pools.rows_view`). Parts in a stored row format (FP8 rows, FP4 keys) are viewed paged
    (`pools.paged_layer_view`, HAL 1.4) and ask nothing of the block stride."""
    from math import lcm

    flat = {p.row_bytes for p in parts if p.format is None}
    return lcm(*flat) if flat else 1
