"""Step metadata: where each token of a flattened step reads and writes in the cache pools.

Pure functions of device tensors (no host synchronisation, shapes fixed by their arguments), so
a captured decode step records them and replays them with new inputs. Conventions: a row index
is a flat row of a pool view; -1 means "skip" (writes) or "no row" (reads).

Per token t of a step: `slot[t]` (the request's slot), `pos[t]` (its position), `start[t]` (the
request's length before the step: positions >= start[t] are this step's tokens, which sit at
flat index `t + (q - pos[t])`), `pad[t]` (True for bucket padding; `pad=None`: the step has none).
Token lists `tok` (emission candidates, ring writers) are sorted and distinct, so one holding
every token is the identity and is not gathered through.

Every op here is a device kernel in a captured step (a few microseconds each, whatever the
size), so the functions are written for few ops: masks built once, `-1` applied by one
`masked_fill`, constant index patterns from one `arange`.
"""

from __future__ import annotations

import torch


def take(x: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """x[tok] for a sorted, distinct token list; x itself when `tok` holds every token."""
    return x if tok.shape[0] == x.shape[0] else x[tok]


def paged_rows(table: torch.Tensor, slot: torch.Tensor, index: torch.Tensor, per_block: int, base: int = 0,
               skip: torch.Tensor | None = None) -> torch.Tensor:
    """int64 flat pool rows of item `index` (>= 0: a position or an entry number, any shape [T, ...],
    or broadcastable to `skip`'s shape) of the request in `slot[t]`:
    ``base + table[slot, index // per_block] * per_block + index % per_block``; -1 where `skip`."""
    shape = skip.shape if skip is not None else index.shape
    s = slot.reshape(slot.shape + (1,) * (len(shape) - slot.dim()))
    blk = table[s, torch.div(index, per_block, rounding_mode="floor")]
    off = index % per_block
    rows = torch.add(off + base if base else off, blk, alpha=per_block)   # int64 (index is), table int32
    return rows if skip is None else rows.masked_fill(skip, -1)


def window_reads(table: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor | None,
                 block: int, window: int) -> torch.Tensor:
    """[T, window] rows of positions pos-window+1 .. pos (the sliding window, the token itself
    included); -1 before position 0 and for padding. The last column is where each token's own
    row is written."""
    q = pos[:, None] + torch.arange(1 - window, 1, device=pos.device)[None, :]
    skip = q < 0
    if pad is not None:
        skip |= pad[:, None]
    return paged_rows(table, slot, q.clamp_min(0), block, skip=skip)


def visible_entries(pos: torch.Tensor, pad: torch.Tensor | None, ratio: int) -> torch.Tensor:
    """[T] how many compressed entries each query sees: (pos+1) // ratio (windows complete at or
    before pos), 0 for padding."""
    n = torch.div(pos + 1, ratio, rounding_mode="floor")
    return n if pad is None else n.masked_fill(pad, 0)


def entry_reads(table: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor | None,
                ratio: int, per_block: int, width: int, base: int = 0,
                visible: torch.Tensor | None = None) -> torch.Tensor:
    """[T, width] rows of the compressed entries a query at `pos` sees: entry w for
    w < visible_entries(pos) (`visible`, when the caller has it), -1 beyond and for padding.
    `width` must be >= the largest visible count (a static capacity in captured steps) and fit the
    table (the entries beyond the visible ones are looked up, then dropped)."""
    if width > table.shape[1] * per_block:
        raise ValueError(f"entry_reads: width {width} exceeds the block table's {table.shape[1]} blocks of "
                         f"{per_block} entries")
    if visible is None:
        visible = visible_entries(pos, pad, ratio)
    w = torch.arange(width, device=pos.device)[None, :]
    return paged_rows(table, slot, w, per_block, base, skip=w >= visible[:, None])


def emissions(table: torch.Tensor, slot: torch.Tensor, pos: torch.Tensor, pad: torch.Tensor | None,
              emit_tok: torch.Tensor, ratio: int, per_block: int, visible: torch.Tensor | None = None,
              pos_mod: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For the candidate tokens `emit_tok` [E]: (entry number [E], destination entry row [E]). A
    token emits entry e = (pos+1)/ratio - 1 when its position completes a window
    ((pos+1) % ratio == 0); other candidates get destination -1 (captured steps pass every token
    as a candidate, eager steps only the emitting ones) and entry max(e, 0). `visible`
    (visible_entries) and `pos_mod` (pos % ratio): the same values, when the caller has them."""
    if visible is None:
        visible = visible_entries(pos, pad, ratio)
    if pos_mod is None:
        pos_mod = pos % ratio
    e = (take(visible, emit_tok) - 1).clamp_min_(0)
    skip = take(pos_mod, emit_tok) != ratio - 1
    if pad is not None:
        skip |= take(pad, emit_tok)
    return e, paged_rows(table, take(slot, emit_tok), e, per_block, skip=skip)


def window_sources(slot: torch.Tensor, pos: torch.Tensor, start: torch.Tensor, emit_tok: torch.Tensor,
                   first: torch.Tensor, ratio: int, overlap: bool, cap: int, decode: bool = False):
    """Where the slots of each candidate's pooling window come from: positions
    ``first - overlap*ratio + s`` for s < (1+overlap)*ratio, `first` [E] the first position of the
    candidate's entry (entry * ratio). Returns (new [E, S], ring [E, S],
    from_new [E, S], masked [E, S]): the flat index of the slot's token in this step (positions
    >= start; clamped into [0, T-1], so it is a valid index also where `from_new` is False), its
    compressor-ring row ``slot*cap + q % cap`` (earlier positions; floor modulo, so a row of the
    request's own ring also where q < 0), and positions < 0.
    `decode` (one token a request, start = pos): `new` is [E, 1], the candidate itself, the one
    slot of its window in the step (slots past pos only occur in windows nothing emits)."""
    S, lo = (1 + int(overlap)) * ratio, int(overlap) * ratio
    q = first[:, None] + torch.arange(-lo, S - lo, device=pos.device)[None, :]
    from_new = q >= take(start, emit_tok)[:, None]
    if decode:
        new = emit_tok[:, None]
    else:
        new = (q - take(pos, emit_tok)[:, None] + emit_tok[:, None]).clamp_(0, max(pos.shape[0] - 1, 0))
    ring = torch.add(q % cap, take(slot, emit_tok)[:, None], alpha=cap)   # q < 0: a row of its own ring, unused
    return new, ring, from_new, q < 0


def ring_writes(slot: torch.Tensor, pos: torch.Tensor, end: torch.Tensor | None, pad: torch.Tensor | None,
                tok: torch.Tensor, cap: int) -> torch.Tensor:
    """[len(tok)] ring rows the tokens `tok` store their compressor projections at: only the last
    `cap` positions of each request (``pos >= end - cap``; earlier ones would share a ring row with
    a later token of the same step), -1 otherwise and for padding. `end=None`: every token is its
    request's last (a decode step), so each is kept."""
    p = take(pos, tok)
    skip = None if end is None else p < take(end, tok) - cap
    if pad is not None:
        skip = take(pad, tok) if skip is None else skip | take(pad, tok)
    rows = torch.add(p % cap, take(slot, tok), alpha=cap)
    return rows if skip is None else rows.masked_fill(skip, -1)
