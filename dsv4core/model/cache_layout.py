"""The layout of the model's state, as data: capacities, row formats and byte counts.

`CacheConfig` sizes a `KVCache` (`dsv4core.model.kvcache`) at construction; `state_bytes` computes
(without allocating) what one request of a given length holds in such a cache, and
`ring_capacity` / `default_block_tokens` are the sizing rules both share. `CacheAccounting` (a part
of `KVCache`) reports the allocated pools: `components()` (one `Component` a pool: what an engine's
allocator needs to own the memory), `bytes_report()`, `request_bytes(slot)`.

The row format is described as data (`components()`, `Component.format`): the FP8 format
(`CacheConfig(kv_dtype="fp8")`, `dsv4core.hal.rowformats`; `kv_formats` names the formats a
`kv_dtype` stores) changes a row's width and dtype, not the addressing. It stores exactly the values
the official numerics produce (lossless), so it is refused for a model that does not compute them
(see `KVCache.check_numerics`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dsv4core.hal.rowformats import ROPE_DIM, format_problem, row_bytes

from .config import CSA, SLIDING, DSV4Config


#: the storage choices of `CacheConfig.kv_dtype`
KV_DTYPES = (None, "bf16", "fp8")


def kv_formats(config: DSV4Config, kv_dtype: str | None) -> tuple[str | None, str | None]:
    """The HAL row formats (`hal.rowformats`) of the KV rows and of the indexer keys that
    `kv_dtype` stores; (None, None) for rows in the activation dtype. Raises ValueError naming the
    dimension when the config's rows cannot take the format."""
    if kv_dtype != "fp8":
        return None, None
    bad = []
    if config.qk_rope_head_dim != ROPE_DIM:
        bad.append(f"qk_rope_head_dim = {config.qk_rope_head_dim} (the FP8 row keeps {ROPE_DIM} bf16 rope channels)")
    if format_problem("fp8", config.head_dim):
        bad.append(f"head_dim = {config.head_dim}: {format_problem('fp8', config.head_dim)}")
    if CSA in config.layer_types and format_problem("fp4", config.index_head_dim):
        bad.append(f"index_head_dim = {config.index_head_dim}: {format_problem('fp4', config.index_head_dim)}")
    if bad:
        raise ValueError("CacheConfig(kv_dtype='fp8') cannot store this model's rows: " + "; ".join(bad))
    return "fp8", "fp4"


@dataclass(frozen=True)
class CacheConfig:
    """Capacities of a `KVCache`. `max_tokens`: tokens of all live requests together (sizes the
    compressed pools); `max_request_tokens`: the longest request (sizes block tables and the
    static widths of captured decode steps; default min(max_position_embeddings, max_tokens));
    `block_tokens`: tokens per compressed block (default: the smallest multiple of every
    compression rate that is >= 256); `window_block`: tokens per sliding-window block;
    `max_rollback`: how many tokens `truncate` can always take back; `max_step_tokens`: the most
    new tokens one step may hold (sizes the window blocks in flight).

    `kv_dtype`: how window rows, compressed entries and indexer keys are stored. None: rows in the
    model's activation dtype; "bf16": the same, stated (a bfloat16 model only); "fp8": DeepSeek-V4's
    FP8 rows (`hal.rowformats`: 448 e4m3 + 64 bf16 rope values + 7 UE8M0 scales + 1 pad byte = 584
    B at head_dim 512, against 1,024 B in bf16) and FP4 indexer keys (68 B at index_head_dim 128,
    against 256 B). "fp8" is lossless, and accepted only, for a bfloat16 model computing the
    official numerics."""

    max_requests: int = 64
    max_tokens: int = 131072
    max_request_tokens: int | None = None
    block_tokens: int | None = None
    window_block: int = 64
    max_rollback: int = 16
    max_step_tokens: int = 8192
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"CacheConfig.kv_dtype must be one of {', '.join(map(repr, KV_DTYPES))}; "
                             f"got {self.kv_dtype!r}")
        for name in ("max_requests", "max_tokens", "window_block", "max_step_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"CacheConfig.{name} must be an int >= 1; got {v!r}")
        if not isinstance(self.max_rollback, int) or self.max_rollback < 0:
            raise ValueError(f"CacheConfig.max_rollback must be an int >= 0; got {self.max_rollback!r}")
        for name in ("max_request_tokens", "block_tokens"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"CacheConfig.{name} must be None or an int >= 1; got {v!r}")


@dataclass(frozen=True)
class Component:
    """One pool, described as data (what an engine's allocator needs to own the memory)."""

    name: str            # "rows", "keys", "ring_kv", ...
    layer: int
    kind: str            # "window+entries", "indexer_keys", "ring"
    block_tokens: int    # tokens a block (or ring) covers
    rows_per_block: int
    row_width: int       # elements of `dtype` a row (bytes for a stored format)
    dtype: torch.dtype
    nbytes: int
    format: str | None = None   # the `hal.rowformats` format of a row (None: values in `dtype`)


def _lcm(*xs: int) -> int:
    out = 1
    for x in xs:
        out = out * x // math.gcd(out, x)
    return out


def ring_capacity(ratio: int, overlap: bool, max_rollback: int) -> int:
    """Positions a compressor ring keeps: the window being filled and, with overlap (CSA), the
    previous one, plus what `truncate` may take back."""
    return (1 + int(overlap)) * ratio + max_rollback


def default_block_tokens(config: DSV4Config) -> int:
    """The smallest multiple of every compression rate that is >= 256 tokens."""
    ratios = sorted({config.compress_ratio(i) for i in range(config.num_hidden_layers)} - {0})
    base = _lcm(*ratios) if ratios else 256
    return base * max(1, -(-256 // base))


def state_bytes(config: DSV4Config, tokens: int, cache_config: CacheConfig | None = None,
                act_bytes: int = 2) -> dict[str, int]:
    """Computed (not allocated) upper bound of the pool memory one request of `tokens` tokens holds
    in a `KVCache` built with `cache_config`: window blocks (W-1 + max_rollback rows behind the
    length, block-rounded, plus one partial block), compressed blocks (ceil(tokens / block_tokens)
    blocks of entries and indexer keys), and its compressor-ring slot (fixed size, fp32). Rows are
    `act_bytes` a value, or stored in `cache_config.kv_dtype`'s format ("fp8": 584 B a KV row and
    68 B an indexer key at the Flash dims)."""
    cc = cache_config or CacheConfig()
    kv_fmt, key_fmt = kv_formats(config, cc.kv_dtype)
    Bc = cc.block_tokens or default_block_tokens(config)
    Bw = cc.window_block
    d, dI, W = config.head_dim, config.index_head_dim, config.sliding_window
    held = min(tokens, max(W - 1, 0) + cc.max_rollback)
    win_blocks = min(-(-tokens // Bw), -(-held // Bw) + 1)
    comp_blocks = -(-tokens // Bc)
    row = row_bytes(kv_fmt, d) if kv_fmt else d * act_bytes
    key = row_bytes(key_fmt, dI) if key_fmt else dI * act_bytes
    out = {"window_rows": 0, "compressed_entries": 0, "indexer_keys": 0, "compressor_rings": 0}
    for i, t in enumerate(config.layer_types):
        out["window_rows"] += win_blocks * Bw * row
        if t == SLIDING:
            continue
        m = config.compress_ratio(i)
        overlap = t == CSA
        c = 2 if overlap else 1
        cap = ring_capacity(m, overlap, cc.max_rollback)
        out["compressed_entries"] += comp_blocks * (Bc // m) * row
        out["compressor_rings"] += cap * 2 * c * d * 4
        if overlap:
            out["indexer_keys"] += comp_blocks * (Bc // m) * key
            out["compressor_rings"] += cap * 2 * 2 * dI * 4
    out["total"] = sum(out.values())
    return out


class CacheAccounting:
    """The pools of a `KVCache` described as data and counted in bytes. A part of `KVCache`, whose
    constructor sets what is read here: `rows`, `keys`, `rings`, `ring_cap`, `epb`, `layer_kind`,
    `Rw`, `block_tokens`, `window_block`, `window_table`, `comp_table`, `kv_format`, `key_format`."""

    def components(self) -> list[Component]:
        out = []
        Bc, Bw = self.block_tokens, self.window_block
        for i, t in enumerate(self.layer_kind):
            r = self.rows[i]
            out.append(Component("rows", i, "window+entries", Bw, Bw, r.shape[1], r.dtype, r.numel() * r.element_size(),
                                 self.kv_format))
            if self.keys[i] is not None:
                k = self.keys[i]
                out.append(Component("keys", i, "indexer_keys", Bc, self.epb[i], k.shape[1], k.dtype,
                                     k.numel() * k.element_size(), self.key_format))
            for name, ring in (self.rings[i] or {}).items():
                out.append(Component(f"ring_{name}", i, "ring", self.ring_cap[i], self.ring_cap[i], ring.shape[1],
                                     ring.dtype, ring.numel() * ring.element_size()))
        return out

    def bytes_report(self) -> dict[str, int]:
        """Bytes allocated per component kind: window rows, compressed entries, indexer keys,
        compressor rings, block tables; and the total."""
        out = {"window_rows": 0, "compressed_entries": 0, "indexer_keys": 0, "compressor_rings": 0}
        for i in range(len(self.layer_kind)):
            es = self.rows[i].element_size() * self.rows[i].shape[1]
            out["window_rows"] += self.Rw * es
            out["compressed_entries"] += (self.rows[i].shape[0] - self.Rw) * es
            if self.keys[i] is not None:
                out["indexer_keys"] += self.keys[i].numel() * self.keys[i].element_size()
            for ring in (self.rings[i] or {}).values():
                out["compressor_rings"] += ring.numel() * ring.element_size()
        out["block_tables"] = 2 * (self.window_table.size + self.comp_table.size) * 4
        out["total"] = sum(out.values())
        return out

    def request_bytes(self, slot: int) -> int:
        wb = sum(self.rows[i].shape[1] * self.rows[i].element_size() * self.window_block
                 for i in range(len(self.layer_kind)))
        cb = sum(self.epb[i] * (self.rows[i].shape[1] * self.rows[i].element_size()
                                + (self.keys[i].shape[1] * self.keys[i].element_size() if self.keys[i] is not None else 0))
                 for i in range(len(self.layer_kind)))
        ring = sum(self.ring_cap[i] * sum(r.shape[1] * r.element_size() for r in self.rings[i].values())
                   for i in range(len(self.layer_kind)) if self.rings[i] is not None)
        nw = int(np.count_nonzero(self.window_table[slot]))
        nc = int(np.count_nonzero(self.comp_table[slot]))
        return nw * wb + nc * cb + ring
