"""Step metadata: where each token of a flattened step reads and writes in the cache pools.

Pure functions of device tensors (no host synchronisation, shapes fixed by their arguments), so
a captured decode step records them and replays them with new inputs. Conventions: a row index
is a flat row of a pool view; -1 means "skip" (writes) or "no row" (reads).

Per token t of a step: `slot[t]` (the request's slot), `pos[t]` (its position), `start[t]` (the
request's length before the step: positions >= start[t] are this step's tokens, which sit at
flat index `t + (q - pos[t])`), `valid[t]` (False for bucket padding).
"""

from __future__ import annotations

import torch


def paged_rows(table: torch.Tensor, slot: torch.Tensor, index: torch.Tensor, per_block: int,
               base: int = 0) -> torch.Tensor:
    """Flat pool rows of item `index` (a position or an entry number, any shape [T, ...]) of the
    request in `slot[t]`: ``base + table[slot, index // per_block] * per_block + index % per_block``;
    -1 where index < 0."""
    ok = index >= 0
    i = index.clamp_min(0)
    s = slot.reshape(slot.shape + (1,) * (index.dim() - slot.dim())).expand_as(index)
    blk = table[s, torch.div(i, per_block, rounding_mode="floor")].long()
    rows = base + blk * per_block + i % per_block
    return torch.where(ok, rows, -1)


def window_writes(table: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                  block: int) -> torch.Tensor:
    """[T] the window row each token's K=V row is stored at (-1 for padding)."""
    return torch.where(valid, paged_rows(table, slot, pos, block), -1)


def window_reads(table: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                 block: int, window: int) -> torch.Tensor:
    """[T, window] rows of positions pos-window+1 .. pos (the sliding window, the token itself
    included); -1 before position 0 and for padding."""
    q = pos[:, None] - (window - 1) + torch.arange(window, device=pos.device)[None, :]
    q = torch.where(valid[:, None], q, -1)
    return paged_rows(table, slot, q, block)


def entry_reads(table: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
                ratio: int, per_block: int, width: int, base: int = 0) -> torch.Tensor:
    """[T, width] rows of the compressed entries a query at `pos` sees: entry w for
    w < (pos+1) // ratio (windows complete at or before pos), -1 beyond and for padding.
    `width` must be >= the largest visible count (a static capacity in captured steps)."""
    w = torch.arange(width, device=pos.device)[None, :]
    visible = torch.where(valid, torch.div(pos + 1, ratio, rounding_mode="floor"), 0)
    w = torch.where(w < visible[:, None], w, -1)
    return paged_rows(table, slot, w, per_block, base)


def visible_entries(pos: torch.Tensor, valid: torch.Tensor, ratio: int) -> torch.Tensor:
    """[T] how many compressed entries each query sees."""
    return torch.where(valid, torch.div(pos + 1, ratio, rounding_mode="floor"), 0)


def emissions(table: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor,
              emit_tok: torch.Tensor, ratio: int, per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the candidate tokens `emit_tok` [E]: (entry number [E], destination entry row [E]).
    A token emits entry e = (pos+1)/ratio - 1 when its position completes a window
    ((pos+1) % ratio == 0); other candidates get destination -1 (captured steps pass every token
    as a candidate, eager steps only the emitting ones)."""
    p = pos[emit_tok]
    e = torch.div(p + 1, ratio, rounding_mode="floor") - 1
    emits = ((p + 1) % ratio == 0) & valid[emit_tok]
    dest = paged_rows(table, slot[emit_tok], torch.where(emits, e, -1), per_block)
    return e, dest


def window_sources(slot: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, emit_tok: torch.Tensor,
                   entry: torch.Tensor, ratio: int, overlap: bool, cap: int):
    """Where the slots of each candidate's pooling window come from: positions
    ``entry*ratio - overlap*ratio + s`` for s < (1+overlap)*ratio. Returns (new [E, S], ring [E, S],
    from_new [E, S], masked [E, S]): the flat index of the slot's token in this step (positions
    >= start), its compressor-ring row ``slot*cap + q % cap`` (earlier positions), and positions < 0."""
    S = (1 + int(overlap)) * ratio
    q = (entry * ratio - int(overlap) * ratio)[:, None] + torch.arange(S, device=pos.device)[None, :]
    t = emit_tok[:, None]
    from_new = q >= start[emit_tok][:, None]
    new = t + (q - pos[emit_tok][:, None])
    ring = slot[emit_tok][:, None] * cap + q.clamp_min(0) % cap
    return new, ring, from_new, q < 0


def ring_writes(slot: torch.Tensor, pos: torch.Tensor, end: torch.Tensor, valid: torch.Tensor,
                tok: torch.Tensor, cap: int) -> torch.Tensor:
    """[len(tok)] ring rows the tokens `tok` store their compressor projections at: only the last
    `cap` positions of each request (``pos >= end - cap``; earlier ones would share a ring row with
    a later token of the same step), -1 otherwise and for padding."""
    p = pos[tok]
    keep = valid[tok] & (p >= end[tok] - cap)
    return torch.where(keep, slot[tok] * cap + p % cap, -1)
