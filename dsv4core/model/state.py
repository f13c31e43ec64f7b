"""Explicit per-request decoding state (the "cache").

One `RequestState` per request, one `LayerState` per decoder layer. Nothing is hidden in the
modules: the forward reads and writes only these objects, so an engine can keep, move, drop or
batch requests freely.

    LayerState
      window       [<= W-1, d]   raw K=V rows (after kv norm + rope) of the last W-1 positions
      comp         CompressorState at d (CSA / HCA layers)
      index_comp   CompressorState at d_I (CSA layers: the lightning indexer's keys)

    CompressorState (window m, c = 2 for CSA overlap else 1)
      buf_kv, buf_score   [< m, c*d'] fp32   projections of the tokens of the open (partial) window
      prev_kv, prev_score [m, d'] fp32       A halves (no ape) of the last complete window (CSA only;
                                             None before the first complete window)
      entries             [N_c, d']          compressed rows emitted so far (after norm + rope): a
                                             view of `store [capacity, d']`, rows `[:count]`

Compressed entries grow in place: `append` writes into the spare capacity of `store` and
reallocates only when it is full (capacity x GROWTH), so a decode step copies no old entries
(amortised O(1) row copies per appended entry). A state owns its storage: fork a request with
`copy.deepcopy`, never by sharing a `CompressorState` (appends would write into the same store).

Memory per request is bounded by W-1 raw rows + (m-1) buffered rows (+ m overlap rows) per
compressor + one entry per m tokens (+ unused capacity, < (GROWTH-1) x the entries): see
`state_bytes()` for the computed figure; `nbytes()` counts capacity, i.e. what is held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import CSA, HCA, SLIDING, DSV4Config

#: Capacity factor when a compressed-entry store is full: at most 1/5 of a store is unused and
#: reallocations copy an entry fewer than GROWTH / (GROWTH - 1) = 5 times on average.
GROWTH = 1.25


def growth_capacity(old: int, needed: int) -> int:
    """Capacity after a store of `old` rows must hold `needed` > old rows."""
    return max(needed, math.ceil(GROWTH * old))


@dataclass
class CompressorState:
    buf_kv: torch.Tensor
    buf_score: torch.Tensor
    store: torch.Tensor  # [capacity, d'] entry storage; rows [:count] are the entries
    count: int = 0
    prev_kv: torch.Tensor | None = None
    prev_score: torch.Tensor | None = None

    @classmethod
    def empty(cls, width: int, dim: int, dtype: torch.dtype, device: torch.device) -> "CompressorState":
        f = dict(dtype=torch.float32, device=device)
        return cls(buf_kv=torch.empty(0, width, **f), buf_score=torch.empty(0, width, **f),
                   store=torch.empty(0, dim, dtype=dtype, device=device))

    @property
    def entries(self) -> torch.Tensor:
        """The compressed entries emitted so far, [count, d'] (a view of `store`)."""
        return self.store[:self.count]

    def append(self, rows: torch.Tensor) -> None:
        """Append entries [k, d'], in place while capacity lasts (old entries are never moved
        otherwise)."""
        n, k = self.count, rows.shape[0]
        if n + k > self.store.shape[0]:
            grown = self.store.new_empty(growth_capacity(self.store.shape[0], n + k), self.store.shape[1])
            grown[:n] = self.store[:n]
            self.store = grown
        self.store[n:n + k] = rows
        self.count = n + k

    def nbytes(self) -> int:
        ts = [self.buf_kv, self.buf_score, self.store, self.prev_kv, self.prev_score]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass
class LayerState:
    window: torch.Tensor
    comp: CompressorState | None = None
    index_comp: CompressorState | None = None

    def nbytes(self) -> int:
        n = self.window.numel() * self.window.element_size()
        for c in (self.comp, self.index_comp):
            if c is not None:
                n += c.nbytes()
        return n


@dataclass
class RequestState:
    """Decoding state of one request: `length` tokens consumed so far, plus per-layer state."""

    layers: list[LayerState]
    length: int = 0

    @classmethod
    def new(cls, config: DSV4Config, dtype: torch.dtype, device: torch.device | str) -> "RequestState":
        device = torch.device(device)
        d, dI = config.head_dim, config.index_head_dim
        layers = []
        for t in config.layer_types:
            ls = LayerState(window=torch.empty(0, d, dtype=dtype, device=device))
            if t == CSA:
                ls.comp = CompressorState.empty(2 * d, d, dtype, device)
                ls.index_comp = CompressorState.empty(2 * dI, dI, dtype, device)
            elif t == HCA:
                ls.comp = CompressorState.empty(d, d, dtype, device)
            layers.append(ls)
        return cls(layers=layers)

    def nbytes(self) -> int:
        """Bytes of tensor state currently held."""
        return sum(layer.nbytes() for layer in self.layers)


def state_bytes(config: DSV4Config, tokens: int, act_bytes: int = 2) -> dict[str, int]:
    """Computed (not allocated) upper bound of one request's state after `tokens` tokens.

    Raw rows and compressed entries are in the activation dtype (`act_bytes`), compressor
    buffers and overlap rows in fp32 (the worst case m-1 buffered rows is counted).
    `entry_capacity_slack`: the worst case unused capacity of the entry stores (compressed
    entries + indexer keys) left by in-place growth (see `CompressorState.append`).
    """
    d, dI, W = config.head_dim, config.index_head_dim, config.sliding_window
    out = {"window": 0, "compressor_buffers": 0, "compressed_entries": 0, "indexer_keys": 0,
           "entry_capacity_slack": 0}

    def slack(n: int) -> int:  # the last growth was to hold some needed <= n rows
        return max(0, growth_capacity(n - 1, n) - n) if n else 0

    for i, t in enumerate(config.layer_types):
        out["window"] += min(tokens, W - 1) * d * act_bytes
        if t == SLIDING:
            continue
        m = config.compress_ratio(i)
        c = 2 if t == CSA else 1
        buf = min(tokens, m - 1) * 2 * c * d * 4
        if t == CSA:
            buf += 2 * m * d * 4  # overlap A halves (kv + score)
        out["compressor_buffers"] += buf
        out["compressed_entries"] += (tokens // m) * d * act_bytes
        out["entry_capacity_slack"] += slack(tokens // m) * d * act_bytes
        if t == CSA:
            out["compressor_buffers"] += min(tokens, m - 1) * 2 * 2 * dI * 4 + 2 * m * dI * 4
            out["indexer_keys"] += (tokens // m) * dI * act_bytes
            out["entry_capacity_slack"] += slack(tokens // m) * dI * act_bytes
    out["total"] = sum(out.values())
    return out
