"""Graph decode: one recorded device graph per batch-size bucket, replayed with new inputs.

A decode step (one token per request) has shapes that depend only on the bucket size and the
cache's static capacities: the host pads the batch to the bucket, writes token ids, positions and
slots into one static device buffer, and replays. Padding tokens are marked invalid: every pool
write they would make is skipped (-1), so padding never changes state. Warm-up and recording run
with padding only, which is why recording changes no request either.

Backend-neutral: the recording itself comes from the HAL (`dsv4core.hal.graph_capture`: a
plugin serving the device type provides it), and the model records only when every bound op
declares itself capturable (`OpTable.capturable()`).
"""

from __future__ import annotations

import torch

from .modules import Step


class DecodeGraphs:
    """Lazily recorded decode graphs of one model + cache, keyed by bucket size."""

    def __init__(self, model, buckets, capture) -> None:
        self.model, self.capture = model, capture
        self.cache = model.cache
        self.buckets = tuple(sorted({int(b) for b in buckets if int(b) >= 1}))
        self.graphs: dict[int, tuple] = {}     # bucket -> (replay, static inputs, static logits)
        self.replays = 0
        self.eager = 0                          # decode steps larger than the largest bucket

    def bucket(self, B: int) -> int | None:
        for b in self.buckets:
            if b >= B:
                return b
        return None

    def _step(self, inputs: torch.Tensor, b: int) -> Step:
        """The step of a recorded graph, built from its static input buffer [4, b]: ids, positions,
        slots, valid (decode: start = position, end = position + 1; every token is a candidate
        for compressor emission and ring writes; entry tables at their static capacity)."""
        c, m = self.cache, self.model
        ids, pos, slot, valid = inputs[0], inputs[1], inputs[2], inputs[3].bool()
        every = torch.arange(b, device=inputs.device)
        return Step(cache=c, input_ids=ids, positions=pos, slot=slot, start=pos, end=pos + 1, valid=valid,
                    emit_tok={r: every for r in c.ratios}, ring_tok=every,
                    widths={r: c.max_request_tokens // r for r in c.ratios}, inv_freq=m._freqs(inputs.device))

    def _record(self, b: int):
        inputs = torch.zeros(4, b, dtype=torch.int64, device=self.model.device)   # valid = 0: padding only
        replay, logits = self.capture.capture(lambda: self.model._forward(self._step(inputs, b)), self.model.device)
        return replay, inputs, logits

    def run(self, ids: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor) -> torch.Tensor | None:
        """Replay the decode step for B = len(ids) requests (host int64 vectors); None when B is
        larger than the largest bucket (the caller runs it eagerly)."""
        B = ids.shape[0]
        b = self.bucket(B)
        if b is None:
            self.eager += 1
            return None
        if b not in self.graphs:
            self.graphs[b] = self._record(b)
        replay, inputs, logits = self.graphs[b]
        host = torch.zeros(4, b, dtype=torch.int64)
        host[0, :B], host[1, :B], host[2, :B], host[3, :B] = ids, pos, slot, 1
        inputs.copy_(host)
        replay()
        self.replays += 1
        return logits[:B].clone()
