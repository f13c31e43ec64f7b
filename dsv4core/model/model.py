"""The DSV4 causal LM: one step = one forward over the flattened tokens of several requests, whose
state lives in the model's `KVCache` pools; greedy generation with continuous batching.

The module tree and `state_dict()` keys equal transformers 5.23.0 `DeepseekV4ForCausalLM`
(`model.embed_tokens`, `model.layers.N....`, `model.norm`, `model.hc_head`, `lm_head`), so a
transformers checkpoint loads with no renaming.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from .cache_layout import CacheConfig
from .kvcache import CacheError, KVCache, RequestState
from .config import DSV4Config
from .graphs import DecodeGraphs
from .step_graphs import DEFAULT_STEP_BUCKETS, StepGraphs
from .inputs import DeviceTokens, InputError, _host_long, checked_prompts, checked_rows, eos_ids, token_ids
from .modules import FP32, DecoderLayer, HyperHead, MTPLayer, RMSNorm
from .opsref import SAMPLED, OpsRef, UnverifiedCapture, name_sites, sampled_step
from .sampling import StepDraw
from .step import Step
from .parallel import SINGLE, Parallel


_ZERO = np.zeros(1, dtype=np.int64)


class DSV4Model(nn.Module):
    def __init__(self, cfg: DSV4Config, dtype: torch.dtype, ops: OpsRef, par: Parallel = SINGLE,
                 mtp: bool = False) -> None:
        super().__init__()
        v0, v1 = par.vocab(cfg)
        self.embed_tokens = nn.Embedding(v1 - v0, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, dtype, ops, par) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.hc_head = HyperHead(cfg, ops)
        #: the multi-token-prediction block (`model.mtp.0.*`; empty when the model has none)
        self.mtp = nn.ModuleList([MTPLayer(cfg.with_mtp_layer(), cfg.num_hidden_layers, dtype, ops, par)] if mtp else [])


#: Decode batch sizes recorded as device graphs (a batch is padded up to the next one).
DEFAULT_GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class DSV4ForCausalLM(nn.Module):
    """DSV4 with a device-neutral forward on HAL ops. Build with `load_model` (dsv4core.model.api)
    or directly: `DSV4ForCausalLM(config, ops, dtype=...)` then load weights.

    Request state lives in the model's `KVCache` (`model.cache`, created on first use with
    `CacheConfig()` defaults, or explicitly with `configure_cache`); `new_state()` hands out a
    request, `forward_batch` runs one step over any mix of prefill chunks and decode tokens.

    `parallel` (`dsv4core.model.parallel.Parallel`, from `parallel.setup`): this rank's place
    in a tensor x expert parallel layout; its parameters are then this rank's slices (same
    names, smaller shapes: `parallel.shard_state_dict`) and every rank runs the same steps on
    the same inputs, getting the same full logits.

    `mtp`: build the multi-token-prediction block (`model.model.mtp[0]`, used by speculative
    decoding, `dsv4core.model.speculative`): None = when the config declares one
    (num_nextn_predict_layers = 1) and the model is not split over ranks; False = never.
    `speculation_why` says why a model has none ('' when it has one)."""

    def __init__(self, config: DSV4Config, ops=None, *, dtype: torch.dtype = torch.float32,
                 parallel: Parallel | None = None, mtp: bool | None = None) -> None:
        super().__init__()
        self.config = config
        self.act_dtype = dtype
        self.parallel = par = parallel if parallel is not None else SINGLE
        self._ops = OpsRef(ops)
        if not config.num_nextn_predict_layers:
            why = "the model's config declares no MTP layer (num_nextn_predict_layers = 0)"
        elif par.world > 1:
            why = f"the MTP layer is not built for a model split over {par.world} ranks (tp / ep)"
        elif mtp is False:
            why = "the MTP layer was not built (mtp=False)"
        else:
            why = ""
        self.speculation_why = why
        self.model = DSV4Model(config, dtype, self._ops, par, mtp=not why)
        name_sites(self.model, self._ops)           # each module calls the ops as its own call site
        #: the call sites of the ops this class calls itself (verify coverage: dsv4core.model.opsref)
        self._site = {k: self._ops.site(k) for k in ("embed", "lm_head", "ring_store")}
        v0, v1 = par.vocab(config)
        self.lm_head = nn.Linear(config.hidden_size, v1 - v0, bias=False, dtype=dtype)
        self.lm_head.weight.requires_grad_(False)
        self._inv_freq: dict[tuple, dict[str, torch.Tensor]] = {}
        self.backend = None  # informational: the backend request the op table was bound with
        self._quantization: dict | None = None  # set by load_model (see quantization_report)
        self._cache: KVCache | None = None
        self._graphs: DecodeGraphs | None = None
        self._graph_why: tuple | None = None     # (op table and device, graph_status, capture)
        #: Graph decode: on where the device and every bound op allow it (see graph_status()).
        self.use_graphs = True
        self.graph_buckets: tuple[int, ...] = DEFAULT_GRAPH_BUCKETS
        #: Token counts of the recorded prefill / mixed / verify steps (`step_graphs.py`).
        self.step_graph_buckets: tuple[int, ...] = DEFAULT_STEP_BUCKETS
        self._step_graphs: StepGraphs | None = None   # valid while its decode graphs are self._graphs
        self._step_why = "no step has run"            # why the last step ran eagerly ('' replayed)

    # ------------------------------------------------------------------ plumbing
    @property
    def ops(self):
        return self._ops.t

    def bind_ops(self, ops) -> None:
        """Swap the op table (e.g. after moving to another device). Captured graphs are dropped."""
        self._ops.t = ops
        self._graphs = None
        self._graph_why = None

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def numerics(self) -> str:
        """"exact" or "official" (`dsv4core.model.numerics`; set with `set_numerics`)."""
        return self._ops.numerics

    def set_numerics(self, numerics: str) -> None:
        """Compute with "exact" or "official" numerics from the next step on (graphs re-captured)."""
        from .numerics import apply

        apply(self, numerics)

    def hal_report(self):
        """The binding table of the op table this model calls (op -> implementation), each row
        with the model's ``numerics``."""
        return [dict(row, numerics=self._ops.numerics) for row in self._ops.t.report()]

    def quantization_report(self) -> dict:
        """Which weights are kept FP8 (+ block scale) and why each FP8-capable projection was or was
        not: ``{"mode", "kept": [names], "kept_bytes", "decisions": [{weight, op, backend, kept, reason}]}``
        (set by ``load_model``; a model built otherwise keeps nothing)."""
        from .fp8 import report

        return self._quantization if self._quantization is not None else report(self, "dequantize", [])

    def _freqs(self, device: torch.device) -> dict[str, torch.Tensor]:
        key = (device.type, device.index)
        if key not in self._inv_freq:
            self._inv_freq[key] = {k: self.config.inv_freq(k, device) for k in ("main", "compress")}
        return self._inv_freq[key]

    @property
    def has_mtp(self) -> bool:
        """Whether the model has its multi-token-prediction block (speculative decoding)."""
        return len(self.model.mtp) > 0

    @property
    def cache_layers(self) -> DSV4Config:
        """The layers the cache holds state for: the config's, plus the MTP block as one more
        sliding-window layer when the model has it (`DSV4Config.with_mtp_layer`)."""
        return self.config.with_mtp_layer() if self.has_mtp else self.config

    # ------------------------------------------------------------------ state
    def configure_cache(self, cache_config: CacheConfig | None = None, **kwargs) -> KVCache:
        """Build the model's cache (all request state) with `CacheConfig(**kwargs)` or the given
        config; replaces the previous one, which must have no live request."""
        if self._cache is not None and self._cache.live:
            raise CacheError(f"configure_cache: {len(self._cache.live)} request(s) still live in the current cache; "
                             f"release them first")
        cc = cache_config if cache_config is not None else CacheConfig(**kwargs)
        cache = KVCache(self.cache_layers, self.act_dtype, self.device, cc)
        cache.check_numerics(self.numerics)
        self._cache = cache
        self._graphs = None
        return self._cache

    @property
    def cache(self) -> KVCache:
        """The model's cache (built with `CacheConfig()` defaults on first use)."""
        if self._cache is None or self._cache.device != self.device:
            self.configure_cache()
        return self._cache

    def new_state(self, mtp: bool = False) -> RequestState:
        """A new request backed by the cache's pools (release it when done, or drop it). `mtp`:
        it also tracks the MTP block's state (speculative decoding: `mtp_draft`)."""
        if mtp and not self.has_mtp:
            raise InputError(f"new_state(mtp=True): speculative decoding is unavailable: {self.speculation_why}")
        return self.cache.new_request(track_mtp=mtp)

    def graph_status(self, last_step: bool = False) -> str:
        """'' when steps are recorded as device graphs and replayed, else why they run eagerly
        (graphs disabled, no graph capture for the device, an op not capturable). Decided once per
        op table and device (a step only reads the cached answer). `last_step`: why the last
        `forward_batch` step ran eagerly ('' when it replayed a graph): that reason, or the step's
        own (no bucket holds it, its graph could not be recorded)."""
        if not self.use_graphs:
            return "disabled (model.use_graphs = False)"
        if last_step:
            return self.graph_status() or self._step_why
        key = (id(self._ops.t), self.device)
        if self._graph_why is None or self._graph_why[0] != key:
            from dsv4core.hal import graph_capture

            cap, why = graph_capture(self.device.type)
            steps = self.ops.whole_steps() if cap is not None else None    # verify on: whole steps sampled
            bad = (self.ops if steps is None else steps.plain).capturable() if cap is not None else {}
            if bad:
                why = "ops not capturable: " + "; ".join(f"{k}: {v}" for k, v in bad.items())
            elif steps is not None:     # the graphs record the plain ops
                cap = UnverifiedCapture(cap, self._ops, steps.plain)
            self._graph_why = (key, why, cap)
        return self._graph_why[1]

    def graph_failures(self) -> dict[tuple, str]:
        """{(graph kind, batch bucket, context bucket): why} of each graph whose recording failed (its
        steps run eagerly): the decode step's ("decode") and the MTP draft step's ("mtp_draft")."""
        return {} if self._graphs is None else self._graphs.failures()

    # ------------------------------------------------------------------ validation
    def _segments(self, T, ids, pos, rid, states):
        """Validate a step on host metadata (numpy int64 vectors, vectorised over the tokens; ids
        None: `DeviceTokens`, in range by construction); returns (starts, counts, segment states,
        start lengths), numpy but for the states."""
        if pos.shape[0] != T or rid.shape[0] != T:
            raise InputError(f"input_ids ({T}), positions ({pos.shape[0]}) and request_ids "
                             f"({rid.shape[0]}) must have the same length")
        V = self.config.vocab_size
        if ids is not None and (int(ids.min()) < 0 or int(ids.max()) >= V):
            bad = ids[(ids < 0) | (ids >= V)][:5].tolist()
            raise InputError(f"input_ids: token ids out of vocabulary [0, {V}): {bad}")
        starts = np.concatenate((_ZERO, np.flatnonzero(rid[1:] != rid[:-1]) + 1))
        decode = starts.size == T                 # one token a request
        if decode:
            counts, rids = np.ones(T, dtype=np.int64), rid
        else:
            counts = np.diff(starts, append=T)
            rids = rid[starts]
        n = len(states)
        if int(rids.min()) < 0 or int(rids.max()) >= n:
            raise InputError(f"request_ids must index states (0..{n - 1}); got {sorted(set(rids.tolist()))}")
        if starts.size > 1 and int(np.bincount(rids, minlength=n).max()) > 1:
            raise InputError("each request's tokens must be contiguous in the flattened batch")
        seg_states = [states[r] for r in rids.tolist()]
        cache = self.cache
        lens = []
        for r, s in zip(rids.tolist(), seg_states):
            if not isinstance(s, RequestState) or s.cache is not cache:
                raise InputError(f"request {r}: not a request of this model's cache (use model.new_state())")
            if s.released:
                raise InputError(f"request {r} (slot {s.slot}) was released")
            lens.append(s.length)
        if len({id(s) for s in seg_states}) != len(seg_states):
            raise InputError("two request_ids refer to the same RequestState object")
        start_len = np.array(lens, dtype=np.int64)
        if decode:
            bad = np.flatnonzero(pos != start_len)
        else:
            bad = np.flatnonzero(pos != np.repeat(start_len - starts, counts) + np.arange(T))
        if bad.size:
            t = int(bad[0])
            k = int(np.searchsorted(starts, t, side="right")) - 1
            s0, c, L = int(starts[k]), int(counts[k]), int(start_len[k])
            raise InputError(f"request {rids[k]}: positions must continue its state ({L}..{L + c - 1}); "
                             f"got {int(pos[s0])}..{int(pos[s0 + c - 1])}")
        ends = start_len + counts
        maxpos = self.config.max_position_embeddings
        if int(ends.max()) > maxpos:
            k = int(np.argmax(ends))
            raise InputError(f"request {rids[k]}: length {int(ends[k])} exceeds max_position_embeddings={maxpos}")
        return starts, counts, seg_states, start_len

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, request_ids: torch.Tensor,
                      states: Sequence[RequestState], logits_rows: torch.Tensor | None = None,
                      hidden_rows: torch.Tensor | None = None, sample=None):
        """One step over flattened tokens.

        input_ids, positions, request_ids: [T] int64 (input_ids may also be `DeviceTokens`, from
        `greedy_tokens`: then the host does not wait for them). `request_ids[t]` indexes `states`; each
        request's tokens are contiguous and their positions are `state.length, state.length+1, ...`
        (prefill: many tokens; decode: one; any mix of requests in one call).
        logits_rows: which flattened rows to return logits for (default all). Returns float32
        logits [len(logits_rows), vocab]. Everything is validated on host metadata before the
        forward; a step that raises (bad input, full pool, an op error) leaves every request as
        it was. Decode steps (one token per request) replay a recorded device graph when possible.
        hidden_rows: rows (as logits_rows) whose residual stream before the hc_head [N, hc_mult,
        hidden] (the MTP block's input, `mtp_draft`) is returned too: then (logits, hidden); such
        a step runs eagerly.
        sample: a `sampling.RowSampling` (an entry per logits row): then the next tokens, drawn on
        the device (`sampling.StepDraw`; in the decode graph's replay, where one runs), not the logits.
        """
        if isinstance(input_ids, DeviceTokens):
            if input_ids.vocab != self.config.vocab_size or input_ids.tensor.device != self.device:
                raise InputError(f"input_ids: DeviceTokens of vocabulary {input_ids.vocab} on "
                                 f"{input_ids.tensor.device}; this model has vocabulary {self.config.vocab_size} "
                                 f"on {self.device}")
            ids = input_ids.tensor
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
                got = f"{ids.dtype} {tuple(ids.shape)}" if isinstance(ids, torch.Tensor) else type(ids).__name__
                raise InputError(f"input_ids: DeviceTokens must hold a 1-D int64 / int32 tensor; got {got}")
            T = ids.shape[0]
        else:
            ids = _host_long(input_ids, "input_ids")
            T = ids.shape[0]
        limit = self.cache.cc.max_step_tokens
        if T > limit:
            raise InputError(f"forward_batch: {T} tokens in one step exceed the cache's max_step_tokens={limit} "
                             f"(split the step, e.g. prefill in chunks, or configure the cache with a larger "
                             f"max_step_tokens)")
        pos, rid = (_host_long(a, w) for a, w in ((positions, "positions"), (request_ids, "request_ids")))
        rows, hrows = checked_rows(logits_rows, "logits_rows", T), checked_rows(hidden_rows, "hidden_rows", T)
        draw = None if sample is None else StepDraw(sample, T, rows, hrows, self.config.vocab_size)   # checked
        if T == 0:
            if pos.shape[0] or rid.shape[0]:
                raise InputError(f"input_ids (0), positions ({pos.shape[0]}) and request_ids "
                                 f"({rid.shape[0]}) must have the same length")
            if draw is not None:
                return draw.tokens(torch.zeros(0, self.config.vocab_size, device=self.device), pos, self.cache.uploads)
            n = 0 if rows is None else rows.size
            out = torch.zeros(n, self.config.vocab_size, dtype=torch.float32, device=self.device)
            if hrows is None:
                return out
            H = self.config.hidden_size
            return out, torch.zeros(hrows.size, self.config.hc_mult, H, dtype=self.act_dtype, device=self.device)
        starts, counts, seg_states, start_len = self._segments(T, None if isinstance(ids, torch.Tensor) else ids,
                                                               pos, rid, states)
        cache = self.cache
        plan = cache.prepare(seg_states, counts)     # raises with nothing changed
        try:
            cache.sync_tables()
            logits, graphs = None, not self.graph_status()
            checked = sampled_step(self.ops) if graphs else None    # a sampled step runs eagerly, checked
            graphs = graphs and checked is None
            if graphs and self._graphs is None:
                self._graphs = DecodeGraphs(self, self.graph_buckets, self._graph_why[2])
            if starts.size == T and hrows is None and graphs:     # decode: one token a request
                logits = self._graphs.run(ids, pos, plan.slots, rows, draw)   # with draw: DeviceTokens
            if logits is None and graphs:             # prefill / mixed / verify, or no decode graph
                if self._step_graphs is None or self._step_graphs.decode is not self._graphs:
                    self._step_graphs = StepGraphs(self, self._graphs, self._graph_why[2])
                logits = self._step_graphs.run_batch(ids, pos, counts, plan.slots, start_len, rows, hrows)
            self._step_why = ("" if logits is not None else self._step_graphs.why if graphs else
                              SAMPLED if checked is not None else self.graph_status())
            if logits is None:                        # no graph for this step
                with self._ops.using(checked):
                    logits = self._eager(ids, pos, counts, plan.slots, start_len, rows, hrows)
        except BaseException:
            plan.rollback()
            raise
        plan.commit()
        return logits if draw is None or isinstance(logits, DeviceTokens) else draw.tokens(logits, pos, cache.uploads)

    def _eager(self, ids, pos, counts, slots, start_len, rows, hrows=None):
        """Build the step's metadata on the host (numpy), copy it to the device once (queued), run
        the layers. ids: host numpy, or a device tensor (`DeviceTokens`), used as it is."""
        step, (r, h) = self._make_step(ids, pos, counts, slots, start_len, (rows, hrows))
        return self._forward(step, r, h)

    def _make_step(self, ids, pos, counts, slots, start_len, extra=()):
        """The eager step over host metadata, and the host int64 vectors `extra` (None: absent)
        on the device, copied with the step's metadata."""
        cache, dev = self.cache, self.device
        T = ids.shape[0]
        end_len = start_len + counts
        if counts.size == T:                     # one token a request: nothing to repeat
            slot, start, end = slots, start_len, end_len
        else:
            slot, start, end = (np.repeat(a, counts) for a in (slots, start_len, end_len))
        emit = [np.flatnonzero((pos + 1) % m == 0) for m in cache.ratios]
        caps = [c for c in cache.ring_cap if c]
        ring_tok = np.flatnonzero(pos >= end - max(caps)) if caps else _ZERO[:0]
        widths = {m: int(end_len.max()) // m for m in cache.ratios}
        on_dev = isinstance(ids, torch.Tensor)
        more = [e for e in extra if e is not None]
        parts = ([] if on_dev else [ids]) + [pos, slot, start, end, ring_tok, *emit] + more
        packed = cache.uploads.to_device(np.concatenate(parts))    # one host->device copy per step
        v = torch.split(packed, [p.shape[0] for p in parts])
        if on_dev:
            v = (ids, *v)
        got = iter(v[len(v) - len(more):])
        extra_dev = [None if e is None else next(got) for e in extra]
        # every eager step keeps the ring rows it replaces (keep_ring_rows): even a one-token step
        # overwrites position start - cap, which a truncation to `truncate_limit` may read again
        step = Step(cache=cache, input_ids=v[0], positions=v[1], slot=v[2], start=v[3], end=v[4], pad=None,
                    ring_tok=v[5], emit_tok=dict(zip(cache.ratios, v[6:6 + len(cache.ratios)])), widths=widths,
                    inv_freq=self._freqs(dev), decode=counts.size == T)
        return step, extra_dev

    @torch.no_grad()
    def forward_step(self, step: Step, logits_rows: torch.Tensor | None = None, *, head: bool = True) -> torch.Tensor:
        """The layers over a `Step` an engine adapter built (its own pools and block tables,
        `dsv4core.engines`; no validation, no cache bookkeeping here): float32 logits of the rows
        `logits_rows` (device int64, default all), or with head=False the final hidden states
        [rows, hidden] (then `head_logits` gives their logits)."""
        return self._forward(step, logits_rows, head=head)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of final hidden states [N, hidden] (`forward_step(head=False)`)."""
        return self._lm_head(hidden)

    def _forward(self, step: Step, rows: torch.Tensor | None = None, hrows: torch.Tensor | None = None,
                 head: bool = True):
        """The layers over a prepared step; the deferred compressor-ring writes last. With `hrows`
        (rows of the step): (logits, the residual stream of those rows before the hc_head).
        head=False: the final hidden states instead of the logits."""
        T, n = step.num_tokens, self.config.hc_mult
        h = self._embed(step.input_ids)
        X = h.unsqueeze(1).expand(T, n, h.shape[-1]).contiguous()
        for i, layer in enumerate(self.model.layers):
            X = layer(X, step.for_layer(i))
        hidden = X[hrows] if hrows is not None else None
        if rows is not None:
            X = X[rows]
        y = self.model.norm(self.model.hc_head(X))
        logits = self._lm_head(y) if head else y
        # the compressor-ring writes, last: a step overwrites ring rows the committed state may
        # still read (a prefill chunk; a decode step followed by the deepest truncation), so the
        # rows about to be replaced are kept (a few rows per request) and put back if a write fails
        saved = []
        try:
            for pool, index, values in step.deferred:
                if step.keep_ring_rows:
                    saved.append((pool, index, pool[index.clamp_min(0)]))
                self._site["ring_store"].t.cache_store(pool, index, values)
        except BaseException:
            for pool, index, old in reversed(saved):   # glue, error path only
                keep = index >= 0
                pool[index[keep]] = old[keep]
            raise
        finally:
            step.deferred.clear()
        return logits if hrows is None else (logits, hidden)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup (glue). Vocabulary-parallel: rows of this rank's vocabulary chunk,
        zeros for the others, summed over the tp group."""
        w, par = self.model.embed_tokens.weight, self.parallel
        if par.tp == 1:
            return w[ids]
        v0, v1 = par.vocab(self.config)
        local = ids - v0
        mine = (local >= 0) & (local < v1 - v0)
        h = w[local.clamp(0, max(v1 - v0 - 1, 0))] * mine.unsqueeze(-1).to(w.dtype)
        return self._site["embed"].t.all_reduce(h, par.tp_group)

    def _lm_head(self, y: torch.Tensor) -> torch.Tensor:
        """float32 logits [T, V]. Vocabulary-parallel: this rank's chunk, padded to ceil(V/tp)
        columns, all-gathered over the tp group and trimmed to V."""
        logits = self._site["lm_head"].t.linear(y, self.lm_head.weight, None, FP32)
        par = self.parallel
        if par.tp == 1:
            return logits
        pad = par.vocab_chunk(self.config) - logits.shape[-1]
        if pad:
            logits = torch.nn.functional.pad(logits, (0, pad))
        return self._site["lm_head"].t.all_gather(logits, -1, par.tp_group)[:, :self.config.vocab_size].contiguous()

    # ------------------------------------------------------------------ public API
    def greedy_tokens(self, logits: torch.Tensor) -> DeviceTokens:
        """The argmax of each row of `logits` [N, vocab] (as `forward_batch` returns them), left on
        the device: pass it as the next step's input_ids and the host does not wait for this step."""
        V = self.config.vocab_size
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[1] != V:
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise InputError(f"greedy_tokens: logits must be [N, {V}]; got {got}")
        if logits.device != self.device:
            raise InputError(f"greedy_tokens: logits on {logits.device}; the model is on {self.device}")
        return DeviceTokens(logits.argmax(-1), V)

    @torch.no_grad()
    def logits(self, input_ids) -> torch.Tensor:
        """One full prefill of one sequence from a fresh state: float32 logits [seq, vocab] (in
        steps of at most the cache's max_step_tokens tokens)."""
        ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0:
            raise InputError("empty input_ids")
        st = self.new_state()
        try:
            T, step = ids.numel(), self.cache.cc.max_step_tokens
            out = [self.forward_batch(ids[a:a + step], torch.arange(a, min(T, a + step)),
                                      torch.zeros(min(T, a + step) - a, dtype=torch.int64), [st])
                   for a in range(0, T, step)]
            return out[0] if len(out) == 1 else torch.cat(out)
        finally:
            st.release()

    def _cache_for(self, lengths: list[int]) -> KVCache:
        """The cache `generate` runs in: the model's (`CacheConfig()` defaults unless configured),
        rebuilt with a larger max_request_tokens (the next power of two, and room for the
        requests) when the longest request does not fit and no request is live."""
        longest = max(lengths)
        c = self.cache
        if c.max_request_tokens >= longest:
            return c
        if c.live:
            raise InputError(f"a request of {longest} tokens exceeds the cache's max_request_tokens="
                             f"{c.max_request_tokens}, and live requests prevent rebuilding it")
        cap = min(1 << (longest - 1).bit_length(), self.config.max_position_embeddings)
        total = sum(sorted(lengths, reverse=True)[:c.cc.max_requests])
        return self.configure_cache(dataclasses.replace(c.cc, max_request_tokens=cap,
                                                        max_tokens=max(c.cc.max_tokens, total, cap)))

    @torch.no_grad()
    def generate(self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int, *,
                 eos_token_id: int | Sequence[int] | None = None, prefill_chunk: int | None = None,
                 progress: Callable[[int, int], None] | None = None, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 on_token: Callable[[int, int], None] | None = None, speculative_tokens: int = 0,
                 proposer=None) -> list[list[int]]:
        """Generation with continuous batching: every step is one forward over the decode
        tokens of the running requests plus prefill chunks (at most `prefill_chunk` tokens of a
        prompt per step; default the cache's max_step_tokens) of newly admitted ones. Requests are
        admitted while the cache has a free slot and blocks for their whole length; a finished
        request (max_new_tokens, or `eos_token_id` emitted) leaves the batch and its blocks are
        reused (`eos_token_id`: an int or a list of ints, any of which ends a request). Returns
        only the new tokens of each prompt. `progress(done, total)` counts tokens.
        A prompt is token ids or a str (encoded with `self.tokenizer`). The next token is the argmax
        (temperature 0, the default) or drawn with temperature / top_k / top_p from a generator
        with the seed `sampling.request_seed(seed, i)` for prompt i (`dsv4core.model.sampling`: the
        formula; on the device, inside the decode graphs; seed None: a fresh one).
        `on_token(i, token)` is called for each new token of prompt i as the host reads it (in
        order per prompt): streaming.

        speculative_tokens = k >= 1: speculative decoding (greedy only; `dsv4core.model.speculative`):
        each step verifies, for every decoding request, k tokens drafted by `proposer` (default
        the model's MTP block, `MTPProposer`) in one `forward_batch` of 1 + k tokens a request and
        rolls back the rejected ones; the tokens equal plain greedy decoding. k is at most the
        cache's max_rollback. The result (a list, `speculative.Generation`) then carries the
        acceptance statistics in `.speculation` (mean acceptance length, per position)."""
        from .sampling import SamplingParams
        from .speculative import Generation, MTPProposer

        try:
            sampling = SamplingParams(temperature, top_p, top_k, seed)
        except ValueError as e:
            raise InputError(f"generate: {e}") from None
        eos = eos_ids(eos_token_id)
        prompts = checked_prompts(prompts, max_new_tokens, self.config, self._encode)
        if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 0:
            raise InputError(f"speculative_tokens must be an int >= 0; got {speculative_tokens!r}")
        if proposer is not None and not speculative_tokens:
            raise InputError("generate: a proposer is given but speculative_tokens = 0")
        if speculative_tokens:
            if not sampling.greedy:
                raise InputError(f"generate: speculative decoding is greedy only (temperature 0); got "
                                 f"temperature={temperature}")
            proposer = proposer if proposer is not None else MTPProposer()
            proposer.check(self)
        out = Generation([] for _ in prompts)
        if not prompts or max_new_tokens == 0:
            return out
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise InputError(f"prefill_chunk must be an int >= 1; got {prefill_chunk!r}")
        cache = self._cache_for([len(p) + max_new_tokens for p in prompts])
        from .scheduler import Scheduler
        from .speculative import SpeculativeScheduler

        chunk = min(prefill_chunk or cache.cc.max_step_tokens, cache.cc.max_step_tokens)
        if speculative_tokens:
            if speculative_tokens > cache.cc.max_rollback:
                raise InputError(f"speculative_tokens={speculative_tokens} exceeds the cache's max_rollback="
                                 f"{cache.cc.max_rollback} (how far a request can be rolled back)")
            if on_token is not None:
                raise InputError("generate: on_token (streaming) is not supported with speculative_tokens")
            sched = SpeculativeScheduler(self, cache, prompts, max_new_tokens, eos, chunk, progress,
                                         proposer, speculative_tokens)
        else:
            sched = Scheduler(self, cache, prompts, max_new_tokens, eos, chunk, progress, sampling, on_token)
        try:
            sched.run(out)
        finally:
            sched.release_all()
        if speculative_tokens:
            out.speculation = sched.stats.as_dict()
        return out

    def mtp_draft(self, states, tokens, hidden, k):
        """The MTP block's draft call (`dsv4core.model.speculative.mtp_draft`): advance each
        request's MTP state to its length and draft k tokens."""
        from .speculative import mtp_draft

        return mtp_draft(self, states, tokens, hidden, k)

    def _encode(self, p, i: int) -> list[int]:
        """One prompt as token ids: a str through the tokenizer, else a sequence of ints."""
        if isinstance(p, str):
            tok = getattr(self, "tokenizer", None)
            if tok is None:
                why = getattr(self, "tokenizer_why", "") or "this model has no tokenizer"
                raise InputError(f"prompt {i} is text but the model has no tokenizer ({why}); give token ids")
            return tok.encode(p)
        return token_ids(p, f"prompt {i}")
