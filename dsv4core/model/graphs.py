"""Graph decode: one recorded device graph per batch-size bucket, replayed with new inputs.

A decode step (one token per request) has shapes that depend only on the bucket size and a
context bucket: the host pads the batch to the bucket, writes token ids, positions and slots into
one static device buffer, and replays. The context bucket (a power of two >= the longest request
of the batch, at least 256 tokens, at most the cache's max_request_tokens) sets the width of the
entry tables, so a step over short requests does not pay for the cache's full capacity. Padding tokens are marked invalid: every pool
write they would make is skipped (-1), so padding never changes state. Warm-up and recording run
with padding only, which is why recording changes no request either.

Sampled decoding (`generate` with a temperature) records the draw too: a graph keyed
(bucket, context, "draw" | "draw-filtered") ends at the next tokens, `sampling.draw` over the
logits rows, with each row's sampling parameters, seed and counter in four more rows of the static
input buffer (padding rows: temperature 0); "draw-filtered" also computes the top-k / top-p keep
set (a sort of each row), recorded only for batches that ask for one. The eager path calls the same
`draw` on the same values, so a replay and an eager step draw the same tokens from the same logits.

Other decode-shaped forwards over the same cache (the MTP block's draft step) are recorded the
same way by a variant (`DecodeGraphs.variant`): its own forward, one more static input (the
stream the block continues, [bucket, hc_mult, hidden]), the same buckets, padding rule and memory
pool.

Backend-neutral: the recording itself comes from the HAL (`dsv4core.hal.graph_capture`: a
plugin serving the device type provides it), and the model records only when every bound op
declares itself capturable (`OpTable.capturable()`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from .inputs import DeviceTokens
from .sampling import draw
from .step import Step

log = logging.getLogger("dsv4core.model")

_ROWS = 9   # rows of the static input buffer: ids, positions, slots, valid, logits rows, 4 sampling rows


class DecodeGraphs:
    """Lazily recorded decode graphs of one model + cache, keyed by bucket size (and context bucket)."""

    def __init__(self, model, buckets, capture) -> None:
        self.model, self.capture = model, capture
        self.cache = model.cache
        self.buckets = tuple(sorted({int(b) for b in buckets if int(b) >= 1}))
        #: (bucket, context[, draw]) -> (replay, static inputs, static outputs[, stream])
        self.graphs: dict[tuple, tuple] = {}
        self.replays = 0
        self.eager = 0                          # decode steps run eagerly (no bucket, or no graph)
        self.failed: dict[tuple, str] = {}      # (bucket, context) whose recording failed -> why
        self.pool = None                        # the memory these graphs share (made at the first recording)
        self._host: dict[int, np.ndarray] = {}    # bucket -> host values of the static inputs ([_ROWS, bucket])
        self.forward = lambda step, *stream: model._forward(step)   # what a graph records: the logits
        self.name, self.root, self.contexts = "decode", self, True
        self.variants: dict[str, DecodeGraphs] = {}

    def variant(self, name: str, forward, contexts: bool = True) -> "DecodeGraphs":
        """The graphs (made once per name) of another decode-shaped forward over this cache, sharing
        this one's memory pool: `forward(step, stream)` -> a tuple of tensors [bucket, ...], `stream`
        the static input [bucket, hc_mult, hidden] (act dtype); `contexts` False: the forward reads no
        entry table (sliding-window layers only), one recording per batch bucket."""
        v = self.variants.get(name)
        if v is None:
            v = self.variants[name] = DecodeGraphs(self.model, self.buckets, self.capture)
            v.forward, v.name, v.root, v.contexts = forward, name, self, contexts
        return v

    def failures(self) -> dict[tuple, str]:
        """{(name, bucket, context): why} of every recording that failed, variants included (those
        steps run eagerly)."""
        out = {(self.name, *k): why for k, why in self.failed.items()}
        for v in self.variants.values():
            out.update(v.failures())
        return out

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

    def _record(self, b: int, ctx: int | None, drawn: str | None = None):
        # rows: ids, positions, slots, valid (0: padding only while recording), the logits rows
        # (read after the replay; a drawing graph gathers them itself), the sampling rows
        # (`RowSampling.pack`, read by a drawing graph only); a variant: the stream too
        m = self.model
        inputs = torch.zeros(_ROWS, b, dtype=torch.int64, device=m.device)
        stream = () if self.root is self else (
            torch.zeros(b, m.config.hc_mult, m.config.hidden_size, dtype=m.act_dtype, device=m.device),)
        if self.root.pool is None:
            self.root.pool = self.capture.new_pool(m.device)

        def fn():
            out = self.forward(self._step(inputs, b, ctx), *stream)
            return out if drawn is None else draw(out.index_select(0, inputs[4]), inputs[5:], drawn == "draw-filtered")
        replay, out = self.capture.capture(fn, m.device, self.root.pool)
        return (replay, inputs, out, *stream)

    def _replay(self, ids, pos, slot, rows=None, sample=None):
        """Stage the inputs of B = len(ids) requests in the graph of their bucket (recorded on first
        use), queued: (bucket, graph entry) to replay, or None (no bucket, or no graph: eager).
        sample: a `sampling.StepDraw`, for a drawing graph."""
        B = ids.shape[0]
        b = self.bucket(B)
        R = B if rows is None else rows.shape[0]
        if b is None or (sample is not None and R > b):
            self.eager += 1
            return None
        key = (b, self.context_bucket(int(pos.max()) + 1) if self.contexts else None)
        if sample is not None:
            key += ("draw-filtered" if sample.filtered else "draw",)
        if key in self.failed:
            self.eager += 1
            return None
        if key not in self.graphs:
            try:
                self.graphs[key] = self._record(*key)
            except Exception as e:  # e.g. a fallback that synchronises was reached while recording
                self.failed[key] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
                log.warning("%s graph for batch bucket %d, context %s not recorded (%s); running eagerly",
                            self.name, b, key[1], self.failed[key])
                self.eager += 1
                return None
        g = self.graphs[key]
        inputs = g[1]
        h = self._host.get(b)
        if h is None:
            h = self._host[b] = np.zeros((_ROWS, b), dtype=np.int64)
        on_dev = isinstance(ids, torch.Tensor)
        h[0, :B] = 0 if on_dev else ids
        h[1, :B], h[2, :B] = pos, slot
        h[3, :B] = 1
        h[:4, B:] = 0                              # padding: every write skipped
        if rows is not None and rows.shape[0] <= b:
            h[4, :rows.shape[0]] = np.where(rows < 0, rows + B, rows)
        if sample is not None:                     # every row read: the logits rows, then padding (row 0)
            if rows is None:
                h[4, :R] = np.arange(R)
            h[4, R:] = 0
            h[5:, :R], h[5:, R:] = sample.pack(pos), 0    # padding rows: temperature 0 (argmax, dropped)
        self.cache.uploads.copy(inputs, h)         # one host->device copy, queued
        if on_dev:
            inputs[0, :B].copy_(ids)               # device ids: a device-side copy, in stream order
        return b, g

    def run(self, ids, pos, slot, rows=None, sample=None) -> torch.Tensor | None:
        """Replay the decode step for B = len(ids) requests (host int64 numpy vectors: positions,
        slots; ids host numpy too, or a device tensor (`DeviceTokens`) copied on the device;
        `rows`: the logits rows to return, default all); None when B is larger than the largest
        bucket (the caller runs it eagerly). Nothing here waits for the device: the inputs go
        over in one queued copy (`KVCache.uploads`), the replay is queued after it.
        sample: a `sampling.StepDraw`: the replay draws, and this returns the `DeviceTokens` of the
        logits rows instead of their logits (None: no graph, or more rows than the bucket)."""
        got = self._replay(ids, pos, slot, rows, sample)
        if got is None:
            return None
        b, (replay, inputs, logits) = got
        B = ids.shape[0]
        replay()
        self.replays += 1
        if sample is not None:
            return DeviceTokens(logits[:len(sample.sample)].clone(), sample.vocab)
        if rows is None:
            return logits[:B].clone()
        if rows.shape[0] <= b:
            return logits.index_select(0, inputs[4, :rows.shape[0]])
        return logits[:B][self.cache.uploads.to_device(rows)]

    def run_stream(self, ids, pos, slot, stream: torch.Tensor) -> tuple | None:
        """A variant's replay (as `run`) with its stream input [B, hc_mult, hidden] (on the device;
        the padding rows are zeroed): the first B rows of each output (copies), or None (eager)."""
        got = self._replay(ids, pos, slot)
        if got is None:
            return None
        B = ids.shape[0]
        _, (replay, _, outs, buf) = got
        buf[:B].copy_(stream)
        buf[B:].zero_()
        replay()
        self.replays += 1
        return tuple(o[:B].clone() for o in outs)
