"""The step-metadata builder: an engine's per-step inputs -> the `Step` dsv4core's layers run on.

The inputs are vLLM's (docs/vllm.md): the flattened tokens' `input_ids` and `positions` (padded to
any length T), `query_start_loc` [R + 1] and `seq_lens` [R] (a request's length after the step), a
block table [R, blocks] per cache group (block 0: the engine's null block, never written), and
optionally a slot mapping [T] per cache group (`block * block_tokens + offset` of each token's
position, -1 to skip). Tokens past ``query_start_loc[-1]`` are padding.

The builder checks the inputs on the host, then `EngineStep` computes each layer's row indices
from the block tables (`pools.Addr`: ``base + table[r, i // n] * stride + i % n``), memoised per
group of layers whose parts share their tables and bases. The compressor states are addressed by
position (the engine keeps each state window's blocks), not by a per-request ring.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv4core.model.step import Step

from .pools import Addr, EnginePools


def _paged(table: torch.Tensor, req: torch.Tensor, index: torch.Tensor, a: Addr,
           skip: torch.Tensor | None = None) -> torch.Tensor:
    """int64 rows ``a.base + table[req, index // n] * a.stride + index % n`` (n = a.rows_per_block)
    of items `index` (>= 0, [K, ...]) of the requests `req` [K]; -1 where `skip`."""
    r = req.reshape(req.shape + (1,) * (index.dim() - req.dim()))
    n = a.rows_per_block
    blk = table[r, torch.div(index, n, rounding_mode="floor")].to(torch.int64)
    rows = blk * a.stride + index % n + a.base
    return rows if skip is None else rows.masked_fill(skip, -1)


@dataclass
class EngineStep(Step):
    """A `Step` over engine-owned pools: `slot[t]` is the request index of token t (its block
    tables' row), `tables[group]` the block tables, `slots[group]` the slot mappings (or None).
    `for_layer(i)` is the step as layer i sees it (its pools, its parts' tables)."""

    pools: EnginePools | None = None
    tables: dict = field(default_factory=dict)
    slots: dict | None = None
    addr: dict | None = None
    _shared: dict = field(default_factory=dict, repr=False)

    def for_layer(self, layer: int) -> "EngineStep":
        p = self.pools
        memo = self._shared.setdefault(p.signature[layer], {})
        return dataclasses.replace(self, cache=p.views[layer], addr=p.addr[layer], _memo=memo)

    def _rows(self, part: str, req: torch.Tensor, index: torch.Tensor, skip=None, base: int = 0) -> torch.Tensor:
        a = self.addr[part]
        return _paged(self.tables[a.group], req, index, dataclasses.replace(a, base=a.base + base) if base else a, skip)

    def _slot_rows(self, part: str, tok: torch.Tensor | None = None) -> torch.Tensor | None:
        """The rows of the tokens `tok` (all: None) from the part's slot mapping (None: none given)."""
        a = self.addr[part]
        sm = None if self.slots is None else self.slots.get(a.group)
        if sm is None:
            return None
        s = (sm if tok is None else sm[tok]).to(torch.int64)
        blk, off = torch.div(s, a.block_tokens, rounding_mode="floor"), s % a.block_tokens
        return (blk * a.stride + off + a.base).masked_fill(s < 0, -1)

    def window_reads(self) -> torch.Tensor:
        def build():
            pos = self.positions
            q = pos[:, None] + torch.arange(1 - self.cache.W, 1, device=pos.device)[None, :]
            skip = q < 0
            if self.pad is not None:
                skip |= self.pad[:, None]
            return self._rows("window", self.slot, q.clamp_min(0), skip)
        return self.memo("wr", build)

    def window_writes(self) -> torch.Tensor:
        def build():
            rows = self._slot_rows("window")
            return self.window_reads()[:, -1] if rows is None else rows
        return self.memo("ww", build)

    def entry_reads(self, ratio: int, per_block: int, base: int = 0, pool: str = "rows") -> torch.Tensor:
        def build():
            part = "entries" if pool == "rows" else "keys"
            a, width = self.addr[part], self.widths[ratio]
            cap = self.tables[a.group].shape[1] * a.rows_per_block
            if width > cap:
                raise ValueError(f"entry_reads: {width} entries exceed the block table {a.group!r} "
                                 f"({self.tables[a.group].shape[1]} blocks of {a.rows_per_block})")
            w = torch.arange(width, device=self.positions.device)[None, :]
            return self._rows(part, self.slot, w.expand(self.num_tokens, width), w >= self.visible(ratio)[:, None], base)
        return self.memo(("er", ratio, base, pool), build)

    def emissions(self, ratio: int, per_block: int, pool: str = "rows"):
        def build():
            tok = self.emit_tok[ratio]
            e = (self.visible(ratio)[tok] - 1).clamp_min_(0)
            skip = self.pos_mod(ratio)[tok] != ratio - 1
            if self.pad is not None:
                skip |= self.pad[tok]
            return e, self._rows("entries" if pool == "rows" else "keys", self.slot[tok], e, skip)
        return self.memo(("em", ratio, pool), build)

    def sources(self, ratio: int, overlap: bool, cap: int, per_block: int, pool: str = "rows"):
        def build():
            tok = self.emit_tok[ratio]
            S, lo = (1 + int(overlap)) * ratio, int(overlap) * ratio
            q = self.entry_starts(ratio, per_block)[:, None] + torch.arange(-lo, S - lo, device=tok.device)[None, :]
            from_new = q >= self.start[tok][:, None]
            if self.decode:
                new = tok[:, None]
            else:
                new = (q - self.positions[tok][:, None] + tok[:, None]).clamp_(0, max(self.num_tokens - 1, 0))
            ring = self._rows("state" if pool == "rows" else "index_state", self.slot[tok], q.clamp_min(0))
            if not self.decode:
                new, from_new = self._written_here(ring, new, from_new, cap, pool)
            return new, ring, from_new, q < 0
        return self.memo(("src", ratio, overlap, pool), build)

    def _written_here(self, ring: torch.Tensor, new: torch.Tensor, from_new: torch.Tensor, cap: int, pool: str):
        """Window slots read from a state row this step writes (another request's token: an
        engine's prefix cache can hand a request blocks a request scheduled in the same step
        computes, e.g. vLLM's hit on the prefix of a running prefill) take that token's row of this
        step: the state writes land after the last layer."""
        written = self.ring_rows(cap, pool)
        if not written.numel():
            return new, from_new
        order = torch.argsort(written)
        ws, flat = written[order], ring.reshape(-1)
        at = torch.searchsorted(ws, flat).clamp_max_(ws.numel() - 1)
        hit = (ws[at] == flat) & (flat >= 0) & ~from_new.reshape(-1)
        if not bool(hit.any()):
            return new, from_new
        tok = self.ring_tok[order][at]
        new = torch.where(hit, tok, new.expand(ring.shape).reshape(-1)).view(ring.shape)
        return new, from_new | hit.view(ring.shape)

    def ring_rows(self, cap: int, pool: str = "rows") -> torch.Tensor:
        def build():
            part, tok = ("state" if pool == "rows" else "index_state"), self.ring_tok
            rows = self._slot_rows(part, tok)
            return self._rows(part, self.slot[tok], self.positions[tok]) if rows is None else rows
        return self.memo(("rw", pool), build)


def _host(x, name: str) -> np.ndarray:
    a = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"build_step: {name} must be a 1-D integer vector; got {a.dtype} {a.shape}")
    return a.astype(np.int64)


def build_step(model, pools: EnginePools, input_ids: torch.Tensor, positions: torch.Tensor,
               query_start_loc, seq_lens, block_tables: dict[str, torch.Tensor],
               slot_mappings: dict[str, torch.Tensor] | None = None) -> EngineStep:
    """The `EngineStep` of one engine step (module docstring) for `model` (a `DSV4ForCausalLM`)
    over `pools`. Raises ValueError naming the input on inconsistent inputs (nothing is changed)."""
    dev = model.device
    qsl, lens = _host(query_start_loc, "query_start_loc"), _host(seq_lens, "seq_lens")
    pos_h = _host(positions, "positions")
    T, R = pos_h.shape[0], lens.shape[0]
    if input_ids.shape != (T,):
        raise ValueError(f"build_step: input_ids {tuple(input_ids.shape)} and positions ({T},) must match")
    if qsl.shape != (R + 1,) or qsl[0] != 0 or (np.diff(qsl) < 0).any() or qsl[-1] > T:
        raise ValueError(f"build_step: query_start_loc must be [{R + 1}] non-decreasing from 0 to at most "
                         f"{T} tokens; got {qsl.tolist()[:8]}")
    counts = np.diff(qsl)
    start_len = lens - counts
    if (start_len < 0).any():
        r = int(np.argmax(start_len < 0))
        raise ValueError(f"build_step: request {r}: seq_lens {int(lens[r])} < its {int(counts[r])} query tokens")
    n = int(qsl[-1])
    req = np.repeat(np.arange(R), counts)
    start, end = start_len[req], lens[req]
    bad = np.flatnonzero(pos_h[:n] != start + np.arange(n) - qsl[:-1][req])
    if bad.size:
        t = int(bad[0])
        raise ValueError(f"build_step: request {int(req[t])}: token {t} has position {int(pos_h[t])}, expected "
                         f"{int(start[t] + t - qsl[req[t]])} (seq_lens - query length + its index)")
    need = int(lens.max()) if R else 0
    for p_addr in {a for layer in pools.addr for a in layer.values()}:
        bt = block_tables.get(p_addr.group)
        if bt is None or bt.dim() != 2 or bt.shape[0] < R or bt.shape[1] * p_addr.block_tokens < need:
            got = None if bt is None else tuple(bt.shape)
            raise ValueError(f"build_step: block table {p_addr.group!r} must be [>= {R}, >= "
                             f"{-(-need // p_addr.block_tokens)}] (blocks of {p_addr.block_tokens} tokens); got {got}")
    pad_n = T - n
    if pad_n:                                     # padding: request 0's table, never written or read
        req = np.concatenate((req, np.zeros(pad_n, dtype=np.int64)))
        start = np.concatenate((start, np.zeros(pad_n, dtype=np.int64)))
        end = np.concatenate((end, np.ones(pad_n, dtype=np.int64)))
    live = np.arange(T) < n
    ratios = sorted({model.config.compress_ratio(i) for i in range(model.config.num_hidden_layers)} - {0})
    emit = [np.flatnonzero(((pos_h + 1) % m == 0) & live) for m in ratios]
    caps = [c for c in pools.ring_cap if c]
    # every token's compressor-state rows, not only those a later step of this request reads (the
    # last max(caps) tokens, as dsv4core's own ring keeps): an engine's prefix cache hands a later
    # request any full state block as computed (vLLM: the blocks just before a hit), and a block
    # a chunk crossed in its middle must hold its rows too
    ring_tok = np.flatnonzero(live) if caps else np.zeros(0, dtype=np.int64)
    parts = [pos_h, req, start, end, ring_tok, *emit]
    v = torch.split(torch.from_numpy(np.concatenate(parts)).to(dev), [p.shape[0] for p in parts])
    pad = None if not pad_n else torch.from_numpy(~live).to(dev)
    tables = {g: t.to(dev).clamp_min(0) for g, t in block_tables.items()}   # -1 (unused) entries: the null block
    slots = None
    if slot_mappings is not None:
        slots = {}
        for g, sm in slot_mappings.items():
            if sm.dim() != 1 or sm.shape[0] < n or sm.dtype.is_floating_point:
                raise ValueError(f"build_step: slot mapping {g!r} must be a 1-D integer vector of at least the {n} "
                                 f"tokens; got {sm.dtype} {tuple(sm.shape)}")
            sm = sm[:T].to(dev)     # a mapping of the real tokens only: the padding gets -1
            slots[g] = sm if sm.shape[0] == T else torch.cat((sm, sm.new_full((T - sm.shape[0],), -1)))
    return EngineStep(cache=pools.views[0], input_ids=input_ids.to(dev), positions=v[0], slot=v[1], start=v[2],
                      end=v[3], pad=pad, ring_tok=v[4], emit_tok=dict(zip(ratios, v[5:])),
                      widths={m: need // m for m in ratios}, inv_freq=model._freqs(dev), keep_ring_rows=False,
                      decode=bool(R) and n == R == T, pools=pools, tables=tables, slots=slots)

