"""One step over flattened tokens: what the layers need to know about it (index lists, widths,
positions, the cache it reads and writes) and the memo of what its layers share. Built by
`DSV4ForCausalLM` (eager steps) and by the decode graphs (`graphs.py`) from host metadata."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import indexing as ix
from .kvcache import KVCache

@dataclass
class Step:
    """One step over flattened tokens (DSV4ForCausalLM builds it from host metadata, then copies
    its vectors to the device once). Per token: `input_ids`, `positions`, `slot` (the request's
    cache slot), `start` / `end` (the request's length before / after the step), `pad` (True for
    bucket padding; None when the step has none). Host-chosen index lists, widths and flags (static
    in captured decode steps): `emit_tok[m]` the candidate tokens for compressor emission at rate
    m, `ring_tok` the tokens whose compressor projections are kept (both sorted, distinct),
    `widths[m]` the entry-table width at rate m, `decode` (one token a request: each is its
    request's last, end = position + 1; `end` may then be None).

    Compressor-ring writes are deferred (`deferred`) and applied after the last layer: a step
    that fails part way leaves the rings as they were (`keep_ring_rows`: the rows a write replaces
    are kept until every write has landed; off in a recorded decode step, whose replay cannot
    fail half way and whose recording writes nothing)."""

    cache: KVCache
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor | None
    pad: torch.Tensor | None
    emit_tok: dict[int, torch.Tensor]
    ring_tok: torch.Tensor
    widths: dict[int, int]
    inv_freq: dict[str, torch.Tensor]
    deferred: list = field(default_factory=list)
    keep_ring_rows: bool = True
    decode: bool = False
    _memo: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def memo(self, key, build):
        """Metadata shared by the layers of one kind (built once per step)."""
        v = self._memo.get(key)
        if v is None:
            v = self._memo[key] = build()
        return v

    def no_padding(self, ids: torch.Tensor) -> torch.Tensor:
        """Expert ids [T, k] with -1 (skipped by `moe_experts`) in the padding rows."""
        return ids if self.pad is None else ids.masked_fill(self.pad[:, None], -1)

    def for_layer(self, layer: int) -> "Step":
        """The step as layer `layer` sees it: the step itself here (an engine adapter's step, whose
        pools and block tables differ per layer, returns that layer's view; dsv4core.engines)."""
        return self

    def window_writes(self) -> torch.Tensor:
        """[T] the window row of each token (-1 for padding): the last column of `window_reads`
        (window >= 1), a strided view."""
        return self.window_reads()[:, -1]

    def window_reads(self) -> torch.Tensor:
        c = self.cache
        return self.memo("wr", lambda: ix.window_reads(c.window_table_dev, self.slot, self.positions, self.pad,
                                                      c.window_block, c.W))

    def visible(self, ratio: int) -> torch.Tensor:
        """[T] compressed entries each query sees at rate m."""
        return self.memo(("vis", ratio), lambda: ix.visible_entries(self.positions, self.pad, ratio))

    def entry_reads(self, ratio: int, per_block: int, base: int = 0, pool: str = "rows") -> torch.Tensor:
        """[T, width] rows of the visible entries, plus `base`. `pool` (here, and in `emissions`,
        `sources`, `ring_rows`): the pool the rows index, "rows" (the layer's row pool, its
        compressor's ring) or "keys" (the indexer's keys, its compressor's ring); one numbering in
        the cache's own pools, so it is not read here."""
        c = self.cache
        return self.memo(("er", ratio, base), lambda: ix.entry_reads(
            c.comp_table_dev, self.slot, self.positions, self.pad, ratio, per_block, self.widths[ratio], base,
            self.visible(ratio)))

    def attention_rows(self, ratio: int = 0, per_block: int = 0) -> torch.Tensor:
        """int32 [T, W (+ width)] the rows a sliding (ratio 0) or HCA layer's attention reads in
        its row pool: the window, then every visible entry (entry region at `cache.Rw`)."""
        def build():
            win = self.window_reads()
            if not ratio:
                return win.to(torch.int32)
            return torch.cat([win, self.entry_reads(ratio, per_block, self.cache.Rw)], dim=1).to(torch.int32)
        return self.memo(("ar", ratio), build)

    def token_col(self) -> torch.Tensor:
        """int64 [T, 1] the token numbers 0..T-1 (row selector for per-token gathers)."""
        return self.memo("tok", lambda: torch.arange(self.num_tokens, device=self.positions.device)[:, None])

    def csa_rows(self, topk: int) -> torch.Tensor:
        """int32 [T, W + topk] a CSA layer's attention rows: the window, filled once per step, then
        `topk` columns each CSA layer overwrites with its picks before its attention reads them
        (the layers run one after another on one stream, so they share the buffer)."""
        def build():
            win = self.window_reads()
            out = torch.empty(win.shape[0], win.shape[1] + topk, dtype=torch.int32, device=win.device)
            out[:, :win.shape[1]] = win
            return out
        return self.memo(("csa", topk), build)

    def pos_mod(self, ratio: int) -> torch.Tensor:
        """positions % ratio (the compressors' position-bias rows)."""
        return self.memo(("pm", ratio), lambda: self.positions % ratio)

    def emissions(self, ratio: int, per_block: int, pool: str = "rows"):
        """(entry number [E], destination entry row [E]) of the emission candidates at rate m."""
        c = self.cache
        return self.memo(("em", ratio, per_block), lambda: ix.emissions(
            c.comp_table_dev, self.slot, self.positions, self.pad, self.emit_tok[ratio], ratio, per_block,
            self.visible(ratio), self.pos_mod(ratio)))

    def entry_starts(self, ratio: int, per_block: int) -> torch.Tensor:
        """[E] the first position of each candidate's entry (its rope position)."""
        return self.memo(("es", ratio), lambda: self.emissions(ratio, per_block)[0] * ratio)

    def sources(self, ratio: int, overlap: bool, cap: int, per_block: int, pool: str = "rows"):
        return self.memo(("src", ratio, overlap, cap), lambda: ix.window_sources(
            self.slot, self.positions, self.start, self.emit_tok[ratio], self.entry_starts(ratio, per_block), ratio,
            overlap, cap, self.decode))

    def ring_rows(self, cap: int, pool: str = "rows") -> torch.Tensor:
        return self.memo(("rw", cap), lambda: ix.ring_writes(self.slot, self.positions, None if self.decode else self.end,
                                                             self.pad, self.ring_tok, cap))


# --------------------------------------------------------------------------------------------
# compressors


