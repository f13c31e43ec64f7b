"""Graph steps of any shape: prefill chunks, mixed steps (chunks next to decodes), speculative
verification (1 + k tokens a request), and decode batches larger than the decode buckets.

A step over T flattened tokens is recorded once per key

    (token bucket, context bucket, logits-rows bucket, hidden)

and replayed with new inputs. Every shape in the recorded step is a function of the key only:

- token bucket Tb: the smallest of `model.step_graph_buckets` (default :data:`DEFAULT_STEP_BUCKETS`:
  four a power of two, 16, 20, 24, 28, 32, 40, ..., 7168, 8192) >= T.
  The step's tokens fill positions 0..T-1 of the static buffer, in the order given; T..Tb-1 are
  padding. All metadata is per token (token id, position, slot, the request's length before and
  after the step, valid), so the number of requests needs no key of its own.
- context bucket: as the decode graphs' (`DecodeGraphs.context_bucket`: a power of two >= the
  longest request's length after the step, at least 256, at most max_request_tokens); it sets
  the width of the compressed-entry tables.
- logits-rows bucket Rb: the smallest power of two >= the number of logits rows asked for
  (<= Tb); 0 ("all rows": logits of every token) when the step asks for all of them or for more
  rows than Tb (rows may repeat). The rows are gathered inside the graph, so the head runs on
  Rb rows only; padding rows read token 0 and are dropped. A graph computes at most
  `MAX_LOGITS_ROWS` rows (its logits output is held with it); a step that needs more runs eagerly.
- hidden: whether the step returns the residual stream before the hc_head (`hidden_rows`: the
  MTP proposer's input); then the graph returns the stream of every token and the host picks
  the rows asked for (a device gather).

Padding rule: a padding token has valid = 0, position 0, slot 0. It is marked in `Step.pad`, so
its window write, compressed-entry emission, indexer-key emission and compressor-ring write all
get the row -1 (skipped by `cache_store`), its reads see no entry, its expert ids are -1 (no
expert work: `Step.no_padding`), and no request's state changes; every real token reads only rows of its own request and this step's rows of its own
request (flat index t + (q - pos[t]), unchanged by the padding after it). Every token is a
candidate for compressor emission and for a ring write (the eager step pre-selects the ones that
write; here the index builder turns the others into -1), so those lists are static too.

All per-step values go to the device in one queued host -> device copy (`KVCache.uploads`) into
one static int64 buffer; the replay is queued after it. Recording (and the capture's warm-up)
runs with padding only, which is why it changes no request. A step that fits no key runs eagerly,
and `StepGraphs.why` says why (reported by `model.graph_status(last_step=True)`).

The graphs share the decode graphs' memory pool (`DecodeGraphs.pool`): every replay's outputs
are copied out before the next replay is queued.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .step import Step

log = logging.getLogger("dsv4core.model")

#: Token counts of the recorded prefill / mixed steps (a step is padded up to the next one): four
#: a power of two (2^e x 1, 1.25, 1.5, 1.75), so padding adds at most 25 % of a step's tokens. With
#: powers of two alone a common step just past one (31 decodes + a 512-token chunk: 543 tokens)
#: padded to twice its work: on the H200, 43 layers, it replayed in 118 ms for 86 ms of eager
#: device time, and 31 decodes + 2,048 replayed slower than eager (388 against 232 ms)
#: (benchmarks/results/h200/2026-12-03_5eef776/bench/step-kinds-flash-43layers-bf16-pow2-buckets.json);
#: with these buckets 94 and 290 ms (benchmarks/results/h200/2026-12-03_9db9c25/bench/step-kinds-flash-43layers-bf16.json).
DEFAULT_STEP_BUCKETS = tuple(sorted({m << e for e in range(2, 11) for m in (4, 5, 6, 7)} | {8192}))

_ROWS = 6   # rows of the static buffer: ids, positions, slots, start, end, valid (then the logits rows)

#: The most logits rows a step graph computes (its logits output stays allocated with the graph:
#: rows x vocab fp32); a step asking for more (e.g. every row of a long prefill) runs eagerly.
MAX_LOGITS_ROWS = 1024


class StepGraphs:
    """Lazily recorded graphs of prefill / mixed / verify steps of one model + cache (see the
    module docstring), keyed by (token bucket, context bucket, rows bucket, hidden)."""

    def __init__(self, model, decode, capture) -> None:
        self.model, self.decode, self.capture = model, decode, capture
        self.cache = model.cache
        self.graphs: dict[tuple, tuple] = {}   # key -> (replay, static inputs, static outputs)
        self.replays = 0
        self.eager = 0                          # steps offered here that ran eagerly
        self.failed: dict[tuple, str] = {}      # keys whose recording failed -> why
        self.why = ""                           # why the last step offered here ran eagerly ('' replayed)
        self._host: dict[tuple, np.ndarray] = {}   # (Tb, Rb) -> host values of the static inputs
        self.max_rows = MAX_LOGITS_ROWS

    @property
    def buckets(self) -> tuple[int, ...]:
        """The token buckets: `model.step_graph_buckets`, read at every step (a graph recorded
        for a bucket no longer listed stays valid; it is just not chosen)."""
        return tuple(sorted({int(b) for b in self.model.step_graph_buckets if int(b) >= 1}))

    def bucket(self, T: int) -> int | None:
        return next((b for b in self.buckets if b >= T), None)

    @staticmethod
    def rows_bucket(R: int | None, Tb: int) -> int:
        """Rb for R logits rows (None: every token) in a step of token bucket Tb; 0 = all rows."""
        if R is None or R > Tb:
            return 0
        return min(Tb, 1 << max(0, R - 1).bit_length())

    def key(self, T: int, longest: int, R: int | None, hidden: bool):
        """The key of a step of T tokens whose longest request ends at `longest` tokens, or the
        reason (a str) none fits."""
        Tb = self.bucket(T)
        if Tb is None:
            return (f"a step of {T} tokens exceeds the largest step graph bucket (model.step_graph_buckets = "
                    f"{self.buckets})")
        Rb = self.rows_bucket(R, Tb)
        if (Rb or Tb) > self.max_rows:
            return (f"a step graph computes at most {self.max_rows} logits rows; this step over {T} tokens "
                    f"asks for {'every row' if R is None else R}")
        return (Tb, self.decode.context_bucket(longest), Rb, bool(hidden))

    def _step(self, inputs: torch.Tensor, Tb: int, ctx: int) -> Step:
        """The step of a recorded graph, read from its static input buffer (see `_ROWS`)."""
        c, m = self.cache, self.model
        v = inputs[:_ROWS * Tb].view(_ROWS, Tb)
        every = torch.arange(Tb, device=inputs.device)
        return Step(cache=c, input_ids=v[0], positions=v[1], slot=v[2], start=v[3], end=v[4], pad=v[5] == 0,
                    emit_tok={r: every for r in c.ratios}, ring_tok=every,
                    widths={r: ctx // r for r in c.ratios}, inv_freq=m._freqs(inputs.device),
                    decode=False, keep_ring_rows=False)

    def _record(self, key):
        Tb, ctx, Rb, hidden = key
        inputs = torch.zeros(_ROWS * Tb + Rb, dtype=torch.int64, device=self.model.device)
        rows = inputs[_ROWS * Tb:] if Rb else None
        every = torch.arange(Tb, device=inputs.device) if hidden else None
        if self.decode.pool is None:
            self.decode.pool = self.capture.new_pool(self.model.device)
        replay, out = self.capture.capture(lambda: self.model._forward(self._step(inputs, Tb, ctx), rows, every),
                                           self.model.device, self.decode.pool)
        return replay, inputs, out, every     # every: read by the graph, kept with it

    def run_batch(self, ids, pos, counts, slots, start_len, rows=None, hrows=None):
        """`run` for a step given per request (as `forward_batch` has it): counts[k] tokens of
        the request in slot slots[k], whose length before the step is start_len[k]."""
        end_len = start_len + counts
        if counts.size == pos.shape[0]:           # one token a request: nothing to repeat
            return self.run(ids, pos, slots, start_len, end_len, rows, hrows)
        return self.run(ids, pos, *(np.repeat(a, counts) for a in (slots, start_len, end_len)), rows, hrows)

    def run(self, ids, pos, slots, start, end, rows=None, hrows=None):
        """Replay the step over T = len(pos) tokens (host int64 numpy per token: positions, slots,
        the request's length before / after the step; ids host numpy, or a device tensor
        (`DeviceTokens`) copied on the device; `rows` / `hrows`: host numpy logits / hidden rows
        (>= -T, < T), None: every token / no hidden). Returns what `_forward` returns for them,
        or None (and `why` set) when no graph serves the step (the caller runs it eagerly)."""
        T = pos.shape[0]
        key = self.key(T, int(end.max()), None if rows is None else rows.shape[0], hrows is not None)
        if isinstance(key, str):
            return self._eager(key)
        if key in self.failed:
            return self._eager(f"the step graph {key} could not be recorded: {self.failed[key]}")
        if key not in self.graphs:
            try:
                self.graphs[key] = self._record(key)
            except Exception as e:  # e.g. a fallback that synchronises was reached while recording
                self.failed[key] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                log.warning("step graph %s not recorded (%s); running eagerly", key, self.failed[key])
                return self._eager(f"the step graph {key} could not be recorded: {self.failed[key]}")
        Tb, _, Rb, _ = key
        replay, inputs, out, _ = self.graphs[key]
        h = self._host.get((Tb, Rb))
        if h is None:
            h = self._host[(Tb, Rb)] = np.zeros(_ROWS * Tb + Rb, dtype=np.int64)
        v = h[:_ROWS * Tb].reshape(_ROWS, Tb)
        on_dev = isinstance(ids, torch.Tensor)
        v[0, :T] = 0 if on_dev else ids
        v[1, :T], v[2, :T], v[3, :T], v[4, :T] = pos, slots, start, end
        v[5, :T] = 1
        v[:, T:] = 0                               # padding: every write skipped
        if Rb:
            R = rows.shape[0]
            h[_ROWS * Tb:_ROWS * Tb + R] = np.where(rows < 0, rows + T, rows)
            h[_ROWS * Tb + R:] = 0
        self.cache.uploads.copy(inputs, h)         # one host->device copy, queued
        if on_dev:
            inputs[:T].copy_(ids)                  # device ids: a device-side copy, in stream order
        replay()
        self.replays += 1
        self.why = ""
        logits, hidden = out if hrows is not None else (out, None)
        if Rb:
            logits = logits[:rows.shape[0]].clone()
        elif rows is None:
            logits = logits[:T].clone()
        else:
            logits = logits[:T][self.cache.uploads.to_device(np.where(rows < 0, rows + T, rows))]
        if hrows is None:
            return logits
        return logits, hidden[:T][self.cache.uploads.to_device(np.where(hrows < 0, hrows + T, hrows))]

    def _eager(self, why: str) -> None:
        self.eager += 1
        self.why = why
        return None
