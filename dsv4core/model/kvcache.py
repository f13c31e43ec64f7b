"""The model's state at run time: preallocated device pools, block tables and request handles.

One `KVCache` owns every request's state (DESIGN.md section 4.1, ENGINES.md section 4). Per layer:

    rows[i]       [Rw + Rc_i, d]  act dtype   the row store `sparse_mqa_attention` reads
                  (kv_dtype="fp8": uint8 [Rw + Rc_i, row_bytes("fp8", d)], the FP8 KV row):
                                              rows [0, Rw): sliding-window rows, paged in
                                              `window_block`-token blocks (window block table);
                                              rows [Rw, Rw + Rc_i): compressed entries (CSA, HCA),
                                              paged in `block_tokens`-token blocks of
                                              block_tokens / m entries (compressed block table)
    keys[i]       [Rc_i, d_I]     act dtype   the lightning indexer's keys (CSA), same rows as the
                                              layer's compressed entries (kv_dtype="fp8": uint8
                                              [Rc_i, row_bytes("fp4", d_I)], the FP4 key)
    ring_kv[i], ring_score[i]   [S * cap_i, c*d]  fp32   per-request compressor rings: the raw
                                              projections `kv` and `score + ape[pos % m]` of the
                                              last cap_i positions, row `slot * cap_i + pos % cap_i`
                                              (cap = (1 + overlap) * m + max_rollback)
    iring_kv[i], iring_score[i] [S * cap_i, 2*d_I]  fp32  the indexer compressor's rings (CSA)
                                              (each pair: the two column halves of one tensor)

Block 0 of each block pool is a null block: never handed out, table entries of unheld blocks point
at it. A request is a slot (its ring rows) plus two block tables (one row each in
`window_table` / `comp_table`, host tensors mirrored on the device). Blocks are reference
counted: `fork` shares them, a write into a shared block copies it first (copy-on-write).

Everything is sized at construction (`CacheConfig`); nothing is reallocated afterwards. A step
is prepared on host metadata only (`prepare`): allocations and copy-on-write are staged and
undone if the step fails; the step's own writes land only in rows no committed state reads,
except the compressor rings, which the model writes last (see DSV4ForCausalLM.forward_batch).

Sizes, row formats and the byte accounting are in `dsv4core.model.cache_layout` (`CacheConfig`,
`state_bytes`, `KVCache.components()` / `bytes_report()`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from dsv4core.hal.rowformats import row_bytes

from .cache_layout import CacheAccounting, CacheConfig, default_block_tokens, kv_formats, ring_capacity
from .config import CSA, SLIDING, DSV4Config
from .staging import Uploads


class CacheError(RuntimeError):
    """A request or step the cache cannot serve (pool full, released request, bad truncate/fork)."""


class PoolFullError(CacheError):
    """No free block or request slot is left."""


class _Blocks:
    """Reference-counted block ids 1..n-1 (0 is the null block)."""

    def __init__(self, n: int, what: str) -> None:
        self.n, self.what = n, what
        self.ref = np.zeros(n, dtype=np.int64)   # numpy: a step checks the blocks it writes at once
        self.free = list(range(n - 1, 0, -1))   # pop() hands out low ids first

    def alloc(self) -> int:
        if not self.free:
            raise PoolFullError(f"the {self.what} pool is full ({self.n - 1} blocks in use)")
        b = self.free.pop()
        self.ref[b] = 1
        return b

    def incref(self, b: int) -> None:
        self.ref[b] += 1

    def decref(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.free.append(b)


class RequestState:
    """A request's handle: a slot of the cache plus its block tables; `length` tokens consumed.

    `fork()` shares the prefix (copy-on-write), `truncate(n)` rolls back to the first n tokens,
    `release()` frees everything (also done when the handle is garbage-collected).
    `mtp_length`: None, or (a request that tracks a model's MTP block, whose state is one more
    layer of the cache, advanced after the main layers by `mtp_draft`) how many of the first
    positions the MTP block's rows hold (<= length). Window blocks stay held until the MTP rows
    caught up with them too."""

    __slots__ = ("cache", "slot", "length", "win_lo", "ring_hi", "released", "mtp_length", "__weakref__",
                 "_finalizer")

    def __init__(self, cache: "KVCache", slot: int) -> None:
        self.cache, self.slot = cache, slot
        self.length = 0
        self.win_lo = 0       # lowest position whose window block is still held
        self.ring_hi = 0      # highest length reached since the slot was taken (ring high-water mark)
        self.released = False
        self.mtp_length: int | None = None
        self._finalizer = weakref.finalize(self, KVCache._free_slot_rows, weakref.ref(cache), slot)

    def _alive(self, what: str) -> None:
        if self.released:
            raise CacheError(f"{what}: request (slot {self.slot}) was released")

    def fork(self) -> "RequestState":
        """A new request continuing from this one's tokens (blocks shared copy-on-write, rings copied)."""
        self._alive("fork")
        return self.cache.fork(self)

    def truncate(self, n: int) -> None:
        """Roll back to the first `n` tokens (0 <= n <= length, within what the rings keep)."""
        self._alive("truncate")
        self.cache.truncate(self, n)

    def release(self) -> None:
        """Free the slot and the blocks (idempotent)."""
        if not self.released:
            self.released = True
            self._finalizer.detach()
            self.cache._release(self.slot)

    def nbytes(self) -> int:
        """Bytes of pool memory this request holds (a shared block counts for every holder)."""
        return 0 if self.released else self.cache.request_bytes(self.slot)

    def __copy__(self):
        raise CacheError("a request cannot be copied: use state.fork() (shares its blocks copy-on-write)")

    def __deepcopy__(self, memo):
        raise CacheError("a request cannot be copied: use state.fork() (shares its blocks copy-on-write)")

    def __repr__(self) -> str:
        return f"RequestState(slot={self.slot}, length={self.length}{', released' if self.released else ''})"


@dataclass
class StepPlan:
    """Staged host-side changes of one step: undone by `rollback`, made final by `commit`.
    `slots` / `new_lengths`: per request (numpy int64, in `states` order)."""

    cache: "KVCache"
    states: list[RequestState]
    slots: np.ndarray
    new_lengths: np.ndarray
    undo: list = field(default_factory=list)   # (table, slot, j, old_block, new_block, pool)

    def rollback(self) -> None:
        c = self.cache
        for table, slot, j, old, new, pool in reversed(self.undo):
            table[slot, j] = old            # the shared block kept its reference (see _stage)
            pool.decref(new)
        self.undo.clear()
        c._touch(0, c.cc.max_requests)

    def commit(self) -> None:
        c = self.cache
        keep, Bw = c.window_keep, c.window_block
        for st, E in zip(self.states, self.new_lengths.tolist()):
            st.length = E
            if E > st.ring_hi:
                st.ring_hi = E
            F = E if st.mtp_length is None else min(E, st.mtp_length)    # the MTP rows lag the others
            if (F - keep) // Bw > st.win_lo // Bw:     # a window block fell out of reach
                c._free_window_below(st, F)
        for _, _, _, old, _, pool in self.undo:     # the copied-from shared blocks: one holder less
            if old:
                pool.decref(old)
        self.undo.clear()


class KVCache(CacheAccounting):
    """Preallocated pools for up to `max_requests` concurrent requests (see module docstring)."""

    def __init__(self, config: DSV4Config, dtype: torch.dtype, device: torch.device | str,
                 cache_config: CacheConfig | None = None) -> None:
        cc = cache_config or CacheConfig()
        self.config, self.cc, self.dtype, self.device = config, cc, dtype, torch.device(device)
        cfg = config
        d, dI, W = cfg.head_dim, cfg.index_head_dim, cfg.sliding_window
        self.W = W
        if cc.kv_dtype == "bf16" and dtype != torch.bfloat16:
            raise ValueError(f"CacheConfig(kv_dtype='bf16') stores the rows of a bfloat16 model; this model computes "
                             f"in {dtype} (leave kv_dtype unset to store rows in the activation dtype)")
        if cc.kv_dtype == "fp8" and dtype != torch.bfloat16:
            raise ValueError(f"CacheConfig(kv_dtype='fp8') stores the official rows of a bfloat16 model (its rope "
                             f"channels are bf16); this model computes in {dtype}")
        #: the HAL row formats of the KV rows / indexer keys (None: values in the activation dtype)
        self.kv_format, self.key_format = kv_formats(cfg, cc.kv_dtype)
        #: the format arguments of the ops that write / read the pools (empty: the plain rows)
        self.row_store = {"row_format": self.kv_format} if self.kv_format else {}
        self.key_store = {"row_format": self.key_format} if self.key_format else {}
        self.row_read = {"kv_format": self.kv_format} if self.kv_format else {}
        self.key_read = {"k_format": self.key_format} if self.key_format else {}
        row_w, row_dt = (row_bytes(self.kv_format, d), torch.uint8) if self.kv_format else (d, dtype)
        key_w, key_dt = (row_bytes(self.key_format, dI), torch.uint8) if self.key_format else (dI, dtype)
        ratios = sorted({cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers)} - {0})
        self.ratios = ratios
        if cc.block_tokens is not None:
            bad = [m for m in ratios if cc.block_tokens % m]
            if bad:
                raise ValueError(f"CacheConfig.block_tokens={cc.block_tokens} must be a multiple of every "
                                 f"compression rate; {bad} do not divide it")
            self.block_tokens = cc.block_tokens
        else:
            self.block_tokens = default_block_tokens(config)
        self.window_block = cc.window_block
        self.window_keep = max(W - 1, 0) + cc.max_rollback   # window rows kept behind a request's length
        self.max_request_tokens = cc.max_request_tokens or min(cfg.max_position_embeddings, cc.max_tokens)
        S = cc.max_requests
        Bc, Bw = self.block_tokens, self.window_block
        self.comp_blocks_per_request = -(-self.max_request_tokens // Bc)
        self.win_blocks_per_request = -(-self.max_request_tokens // Bw)
        # max_tokens tokens however they split over the requests: each may hold one partial block
        n_comp = -(-cc.max_tokens // Bc) + S + 1
        # held window blocks: W-1 + max_rollback rows behind the length (no more than a request's
        # length), block-rounded, per request, plus the blocks of the largest step in flight (and
        # one partial block per request); with compressed layers, also no more than the blocks
        # the tokens the compressed pool can hold span (a window block lies in at most two
        # compressed blocks' token ranges of its holder)
        per_req = -(-min(max(W - 1, 0) + cc.max_rollback, self.max_request_tokens) // Bw) + 1
        held = S * (per_req + 1)
        if ratios:
            held = min(held, (n_comp - 1) * (-(-Bc // Bw) + 1) + S)
        n_win = held + -(-cc.max_step_tokens // Bw) + 1
        self.win_pool = _Blocks(n_win, "sliding-window block")
        self.comp_pool = _Blocks(n_comp if ratios else 1, "compressed-entry block")
        self.Rw = n_win * Bw

        f = dict(device=self.device)
        self.layer_kind = list(cfg.layer_types)
        self.rows: list[torch.Tensor] = []
        self.keys: list[torch.Tensor | None] = []
        self.rings: list[dict[str, torch.Tensor] | None] = []
        self.ring_cap: list[int] = []
        self.ring_pairs: list[dict[str, torch.Tensor] | None] = []   # "kv" / "ikv": [kv | score] tensors
        self.epb: list[int] = []            # compressed entries per block (0 for sliding layers)
        for i, t in enumerate(cfg.layer_types):
            m = cfg.compress_ratio(i)
            epb = Bc // m if m else 0
            self.epb.append(epb)
            self.rows.append(torch.zeros(self.Rw + self.comp_pool.n * epb, row_w, dtype=row_dt, **f))
            if t == SLIDING:
                self.keys.append(None)
                self.rings.append(None)
                self.ring_pairs.append(None)
                self.ring_cap.append(0)
                continue
            overlap = t == CSA
            c = 2 if overlap else 1
            cap = ring_capacity(m, overlap, cc.max_rollback)
            self.ring_cap.append(cap)
            # a compressor's two rings are the halves of one tensor [kv | score]: a step writes
            # both with one store
            both = torch.zeros(S * cap, 2 * c * d, dtype=torch.float32, **f)
            r = {"kv": both[:, :c * d], "score": both[:, c * d:]}
            self.ring_pairs.append({"kv": both})
            if overlap:
                self.keys.append(torch.zeros(self.comp_pool.n * epb, key_w, dtype=key_dt, **f))
                iboth = torch.zeros(S * cap, 4 * dI, dtype=torch.float32, **f)
                r["ikv"], r["iscore"] = iboth[:, :2 * dI], iboth[:, 2 * dI:]
                self.ring_pairs[-1]["ikv"] = iboth
            else:
                self.keys.append(None)
            self.rings.append(r)

        # per ring width w: the [kv | score] value of a window slot before position 0 (0 | -inf)
        self._ring_fill = {w: torch.cat([torch.zeros(w, **f), torch.full((w,), float("-inf"), **f)])
                           for w in {r.shape[1] // 2 for rp in self.ring_pairs if rp for r in rp.values()}}

        # host block tables (numpy: cheap element access in per-step bookkeeping), device mirrors
        self.window_table = np.zeros((S, self.win_blocks_per_request), dtype=np.int32)
        self.comp_table = np.zeros((S, self.comp_blocks_per_request), dtype=np.int32)
        self.window_table_dev = torch.zeros(self.window_table.shape, dtype=torch.int32, device=self.device)
        self.comp_table_dev = torch.zeros(self.comp_table.shape, dtype=torch.int32, device=self.device)
        self._dirty = (S, 0)               # slots [lo, hi) whose table rows changed since the last sync
        self.uploads = Uploads(self.device)   # a step's host->device copies, queued (no host wait)
        self.free_slots = list(range(S - 1, -1, -1))
        self.live: dict[int, weakref.ref] = {}

    def check_numerics(self, numerics: str) -> None:
        """Raise ValueError unless a model computing `numerics` can use this cache: the "fp8" rows
        hold exactly what the official numerics write; other values would be quantised on store."""
        if self.kv_format and numerics != "official":
            raise ValueError(f"CacheConfig(kv_dtype={self.cc.kv_dtype!r}) stores the official numerics' FP8 / FP4 rows "
                             f"losslessly; a model computing {numerics!r} numerics would lose precision in its state. "
                             f"Use numerics='official', or leave kv_dtype unset")

    # ------------------------------------------------------------------ description
    def ring_fill(self, width: int) -> torch.Tensor:
        """float32 [2 * width]: what a compressor window slot before position 0 holds in a ring
        `[kv | score]` of kv width `width` (0 for kv, -inf for the score: it pools to nothing).
        Built with the cache, so a recorded step only reads it."""
        return self._ring_fill[width]

    # ------------------------------------------------------------------ requests
    def new_request(self, track_mtp: bool = False) -> RequestState:
        """A request in a free slot; `track_mtp`: it tracks the MTP block's rows (the cache's last
        layer; `RequestState.mtp_length` starts at 0)."""
        if not self.free_slots:
            raise PoolFullError(f"no free request slot: all {self.cc.max_requests} are in use "
                                f"(release finished requests, or build the cache with a larger max_requests)")
        slot = self.free_slots.pop()
        st = RequestState(self, slot)
        if track_mtp:
            st.mtp_length = 0
        self.live[slot] = weakref.ref(st)
        return st

    @staticmethod
    def _free_slot_rows(cache_ref, slot: int) -> None:
        """Finalizer of a garbage-collected handle: free its blocks and slot."""
        cache = cache_ref()
        if cache is not None:
            cache._release(slot)

    def _release(self, slot: int) -> None:
        if slot not in self.live:
            return
        for table, pool in ((self.window_table, self.win_pool), (self.comp_table, self.comp_pool)):
            row = table[slot]
            for b in row[row > 0].tolist():
                pool.decref(b)
            row[:] = 0
        del self.live[slot]
        self.free_slots.append(slot)
        self._touch(slot)

    def fork(self, st: RequestState) -> RequestState:
        child = self.new_request()
        s, t = st.slot, child.slot
        for table, pool in ((self.window_table, self.win_pool), (self.comp_table, self.comp_pool)):
            table[t] = table[s]
            for b in table[s][table[s] > 0].tolist():
                pool.incref(b)
        for i, rings in enumerate(self.rings):
            if rings is None:
                continue
            cap = self.ring_cap[i]
            for ring in rings.values():
                ring[t * cap:(t + 1) * cap] = ring[s * cap:(s + 1) * cap]
        child.length, child.win_lo, child.ring_hi = st.length, st.win_lo, st.ring_hi
        child.mtp_length = st.mtp_length
        self._touch(t)
        return child

    def truncate_limit(self, st: RequestState) -> int:
        """The smallest n that `truncate(n)` accepts now."""
        lo = 0
        W, m_lo = self.W, 0
        if st.win_lo > 0:
            lo = max(lo, st.win_lo + max(W - 1, 0))
        for i, t in enumerate(self.layer_kind):
            if t == SLIDING:
                continue
            cap, m = self.ring_cap[i], self.config.compress_ratio(i)
            held = st.ring_hi - cap           # ring rows of positions >= held survive
            if held <= 0:
                continue
            back = m if t == CSA else 0       # CSA pools the previous window's A halves too
            # need (n // m) * m - back >= held  <=>  n >= the smallest multiple-of-m bound
            need = -(-(held + back) // m) * m
            m_lo = max(m_lo, need)
        return max(lo, m_lo)

    def truncate(self, st: RequestState, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool):
            raise CacheError(f"truncate: n must be an int; got {n!r}")
        if n < 0 or n > st.length:
            raise CacheError(f"truncate: request (slot {st.slot}) has {st.length} tokens; cannot truncate to {n}")
        lo = self.truncate_limit(st)
        if n < lo:
            raise CacheError(f"truncate: request (slot {st.slot}) can roll back to {lo} tokens at the earliest "
                             f"(its rings and window keep max_rollback={self.cc.max_rollback} tokens); asked for {n}")
        for table, pool, B in ((self.window_table, self.win_pool, self.window_block),
                               (self.comp_table, self.comp_pool, self.block_tokens)):
            first_dead = -(-n // B)
            tail = table[st.slot, first_dead:]
            for b in tail[tail > 0].tolist():
                pool.decref(b)
            tail[:] = 0
        st.length = n
        if st.mtp_length is not None:
            st.mtp_length = min(st.mtp_length, n)
        self._touch(st.slot)

    # ------------------------------------------------------------------ steps
    def prepare(self, states: list[RequestState], counts, starts=None) -> StepPlan:
        """Stage the blocks a step writes (allocate, or copy-on-write a shared one): `counts[k]`
        new tokens for `states[k]`. Raises PoolFullError / CacheError with nothing changed.
        `starts[k]` (default the request's length): the first position written, at most the
        length; positions below it rewrite rows of the request's own blocks (a layer run after
        the others, e.g. the MTP block); the length becomes max(length, start + count).
        Vectorised over the requests: only the blocks that need an allocation are visited one
        by one (in decode, a request crossing a block boundary)."""
        states = list(states)
        slots, lens = np.empty(len(states), dtype=np.int64), np.empty(len(states), dtype=np.int64)
        for k, st in enumerate(states):
            if st.released:
                st._alive("step")
            slots[k], lens[k] = st.slot, st.length
        n = np.asarray(counts, dtype=np.int64).reshape(-1)
        if starts is not None:
            first = np.asarray(starts, dtype=np.int64).reshape(-1)
            if first.shape != lens.shape or (first > lens).any() or (first < 0).any():
                raise CacheError(f"prepare: starts {first.tolist()[:8]} must be one position per request, "
                                 f"0 <= start <= length {lens.tolist()[:8]}")
            E = np.maximum(lens, first + n)
            lens, stop = first, first + n
        else:
            E = stop = lens + n
        if E.size and int(E.max()) > self.max_request_tokens:
            k = int(np.argmax(E))
            raise CacheError(f"request (slot {int(slots[k])}): length {int(E[k])} exceeds the cache's "
                             f"max_request_tokens={self.max_request_tokens}")
        plan = StepPlan(self, states, slots, E)
        act = n > 0
        if not act.all():
            slots, lens, stop = slots[act], lens[act], stop[act]
        try:
            self._stage(plan, self.window_table, self.win_pool, slots, lens // self.window_block,
                        (stop - 1) // self.window_block, self._copy_window_block)
            if self.ratios:
                self._stage(plan, self.comp_table, self.comp_pool, slots, lens // self.block_tokens,
                            (stop - 1) // self.block_tokens, self._copy_comp_block)
        except Exception:
            plan.rollback()
            raise
        return plan

    def _stage(self, plan, table, pool, slots, j0, j1, copy) -> None:
        """Blocks j0[k]..j1[k] of request slot slots[k]: each one not held alone gets a new block."""
        cnt = j1 - j0 + 1
        if cnt.size and int(cnt.max()) == 1:         # decode: one block a request
            s, js = slots, j0
        else:
            s = np.repeat(slots, cnt)
            js = np.repeat(j0 - np.cumsum(cnt) + cnt, cnt) + np.arange(int(cnt.sum()))
        held = table[s, js]
        todo = (held == 0) | (pool.ref[held] != 1)
        if not todo.any():
            return
        # A shared block keeps its reference until commit, so every holder this step writes gets
        # its own copy: none writes the shared block in place, which a failed step could not undo
        # (another holder may have committed rows there beyond the writer's length).
        for slot, j in zip(s[todo].tolist(), js[todo].tolist()):
            old = int(table[slot, j])
            new = pool.alloc()
            if old:
                copy(old, new)              # shared: copy-on-write (into a block no one reads yet)
            table[slot, j] = new
            plan.undo.append((table, slot, j, old, new, pool))
            self._touch(slot)

    def _copy_window_block(self, src: int, dst: int) -> None:
        B = self.window_block
        for r in self.rows:
            r[dst * B:(dst + 1) * B] = r[src * B:(src + 1) * B]

    def _copy_comp_block(self, src: int, dst: int) -> None:
        for i, r in enumerate(self.rows):
            e = self.epb[i]
            if not e:
                continue
            r[self.Rw + dst * e:self.Rw + (dst + 1) * e] = r[self.Rw + src * e:self.Rw + (src + 1) * e]
            if self.keys[i] is not None:
                self.keys[i][dst * e:(dst + 1) * e] = self.keys[i][src * e:(src + 1) * e]

    def _free_window_below(self, st: RequestState, E: int) -> None:
        keep_from = max(0, E - self.window_keep)
        j_end = keep_from // self.window_block          # blocks [0, j_end) hold only dead rows
        j_lo = st.win_lo // self.window_block          # blocks below were freed before
        if j_end > j_lo:
            row = self.window_table[st.slot]
            for j in range(j_lo, j_end):
                if row[j]:
                    self.win_pool.decref(int(row[j]))
                    row[j] = 0
                    self._touch(st.slot)
            st.win_lo = j_end * self.window_block

    def _touch(self, lo: int, hi: int | None = None) -> None:
        """Table rows of slots [lo, hi) (default: slot lo) changed: the next sync copies them."""
        d = self._dirty
        self._dirty = (min(d[0], lo), max(d[1], lo + 1 if hi is None else hi))

    def sync_tables(self) -> None:
        """Queue copies of the host block-table rows that changed to the device (one contiguous
        range of slots per table; before a forward, never inside)."""
        lo, hi = self._dirty
        if lo < hi:
            self.uploads.copy(self.window_table_dev[lo:hi], self.window_table[lo:hi])
            self.uploads.copy(self.comp_table_dev[lo:hi], self.comp_table[lo:hi])
            self._dirty = (self.cc.max_requests, 0)
