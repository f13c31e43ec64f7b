"""Graph decode: one recorded device graph per batch-size bucket, replayed with new inputs.

A decode step (one token per request) has shapes that depend only on the bucket size and a
context bucket: the host pads the batch to the bucket, writes token ids, positions and slots into
one static device buffer, and replays. The context bucket (a power of two >= the longest request
of the batch, at least 256 tokens, at most the cache's max_request_tokens) sets the width of the
entry tables, so a step over short requests does not pay for the cache's full capacity. Padding tokens are marked invalid: every pool
write they would make is skipped (-1), so padding never changes state. Warm-up and recording run
with padding only, which is why recording changes no request either.

Backend-neutral: the recording itself comes from the HAL (`dsv4core.hal.graph_capture`: a
plugin serving the device type provides it), and the model records only when every bound op
declares itself capturable (`OpTable.capturable()`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .step import Step

log = logging.getLogger("dsv4core.model")


class DecodeGraphs:
    """Lazily recorded decode graphs of one model + cache, keyed by bucket size."""

    def __init__(self, model, buckets, capture) -> None:
        self.model, self.capture = model, capture
        self.cache = model.cache
        self.buckets = tuple(sorted({int(b) for b in buckets if int(b) >= 1}))
        self.graphs: dict[tuple, tuple] = {}   # (bucket, context) -> (replay, static inputs, static logits)
        self.replays = 0
        self.eager = 0                          # decode steps run eagerly (no bucket, or no graph)
        self.failed: dict[tuple, str] = {}      # (bucket, context) whose recording failed -> why
        self.pool = None                        # the memory these graphs share (made at the first recording)
        self._host: dict[int, np.ndarray] = {}    # bucket -> host values of the static inputs

    def bucket(self, B: int) -> int | None:
        for b in self.buckets:
            if b >= B:
                return b
        return None

    def context_bucket(self, longest: int) -> int:
        cap = self.cache.max_request_tokens
        return min(cap, max(256, 1 << max(0, longest - 1).bit_length()))

    def _step(self, inputs: torch.Tensor, b: int, ctx: int | None = None) -> Step:
        """The step of a recorded graph, built from its static input buffer [>= 4, b]: ids, positions,
        slots, valid (decode: start = position, end = position + 1, left implicit; every token is a candidate
        for compressor emission and ring writes; entry tables `ctx // m` wide)."""
        c, m = self.cache, self.model
        ids, pos, slot, pad = inputs[0], inputs[1], inputs[2], inputs[3] == 0
        every = torch.arange(b, device=inputs.device)
        return Step(cache=c, input_ids=ids, positions=pos, slot=slot, start=pos, end=None, pad=pad,
                    emit_tok={r: every for r in c.ratios}, ring_tok=every,
                    widths={r: (ctx or c.max_request_tokens) // r for r in c.ratios}, inv_freq=m._freqs(inputs.device),
                    decode=True, keep_ring_rows=False)

    def _record(self, b: int, ctx: int):
        # rows: ids, positions, slots, valid (0: padding only while recording), and the logits
        # rows to return (read after the replay, not by the graph)
        inputs = torch.zeros(5, b, dtype=torch.int64, device=self.model.device)
        if self.pool is None:
            self.pool = self.capture.new_pool(self.model.device)
        replay, logits = self.capture.capture(lambda: self.model._forward(self._step(inputs, b, ctx)),
                                              self.model.device, self.pool)
        return replay, inputs, logits

    def run(self, ids, pos, slot, rows=None) -> torch.Tensor | None:
        """Replay the decode step for B = len(ids) requests (host int64 numpy vectors: positions,
        slots; ids host numpy too, or a device tensor (`DeviceTokens`) copied on the device;
        `rows`: the logits rows to return, default all); None when B is larger than the largest
        bucket (the caller runs it eagerly). Nothing here waits for the device: the inputs go
        over in one queued copy (`KVCache.uploads`), the replay is queued after it."""
        B = ids.shape[0]
        b = self.bucket(B)
        if b is None:
            self.eager += 1
            return None
        key = (b, self.context_bucket(int(pos.max()) + 1))
        if key in self.failed:
            self.eager += 1
            return None
        if key not in self.graphs:
            try:
                self.graphs[key] = self._record(*key)
            except Exception as e:  # e.g. a fallback that synchronises was reached while recording
                self.failed[key] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                log.warning("decode graph for batch bucket %d, context %d not recorded (%s); running eagerly",
                            b, key[1], self.failed[key])
                self.eager += 1
                return None
        replay, inputs, logits = self.graphs[key]
        h = self._host.get(b)
        if h is None:
            h = self._host[b] = np.zeros((5, b), dtype=np.int64)
        on_dev = isinstance(ids, torch.Tensor)
        h[0, :B] = 0 if on_dev else ids
        h[1, :B], h[2, :B] = pos, slot
        h[3, :B] = 1
        h[:4, B:] = 0                              # padding: every write skipped
        R = b + 1 if rows is None else rows.shape[0]
        if R <= b:
            h[4, :R] = np.where(rows < 0, rows + B, rows)
        self.cache.uploads.copy(inputs, h)         # one host->device copy, queued
        if on_dev:
            inputs[0, :B].copy_(ids)               # device ids: a device-side copy, in stream order
        replay()
        self.replays += 1
        if rows is None:
            return logits[:B].clone()
        if R <= b:
            return logits.index_select(0, inputs[4, :R])
        return logits[:B][self.cache.uploads.to_device(rows)]
