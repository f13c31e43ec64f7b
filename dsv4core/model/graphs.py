"""CUDA-graph decode: one captured graph per batch-size bucket, replayed with new inputs.

A decode step (one token per request) has shapes that depend only on the bucket size and the
cache's static capacities: the host pads the batch to the bucket, writes token ids, positions and
slots into one static device buffer, and replays. Padding tokens are marked invalid: every pool
write they would make is skipped (-1), so padding never changes state. Warm-up and capture run
with padding only, which is why capturing changes no request either.

Backend-neutral: the model asks the op table whether every bound op is capturable
(`OpTable.capturable()`); this module only knows torch.cuda's graph API, which the device type
"cuda" provides (ROCm builds of torch included).
"""

from __future__ import annotations

import torch

from .modules import Step


class _Captured:
    __slots__ = ("graph", "inputs", "logits")

    def __init__(self, graph, inputs, logits) -> None:
        self.graph, self.inputs, self.logits = graph, inputs, logits


class DecodeGraphs:
    """Lazily captured decode graphs of one model + cache, keyed by bucket size."""

    def __init__(self, model, buckets) -> None:
        self.model = model
        self.cache = model.cache
        self.buckets = tuple(sorted({int(b) for b in buckets if int(b) >= 1}))
        self.graphs: dict[int, _Captured] = {}
        self.pool = None
        self.replays = 0
        self.eager = 0          # decode steps larger than the largest bucket

    def bucket(self, B: int) -> int | None:
        for b in self.buckets:
            if b >= B:
                return b
        return None

    def _step(self, inputs: torch.Tensor, b: int) -> Step:
        """The step of a captured graph, built from its static input buffer [4, b]: ids, positions,
        slots, valid (decode: start = position, end = position + 1; every token is a candidate
        for compressor emission and ring writes; entry tables at their static capacity)."""
        c, m = self.cache, self.model
        ids, pos, slot, valid = inputs[0], inputs[1], inputs[2], inputs[3].bool()
        every = torch.arange(b, device=inputs.device)
        return Step(cache=c, input_ids=ids, positions=pos, slot=slot, start=pos, end=pos + 1, valid=valid,
                    emit_tok={r: every for r in c.ratios}, ring_tok=every,
                    widths={r: c.max_request_tokens // r for r in c.ratios}, inv_freq=m._freqs(inputs.device))

    def _capture(self, b: int) -> _Captured:
        dev = self.model.device
        inputs = torch.zeros(4, b, dtype=torch.int64, device=dev)     # valid = 0: padding only
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):           # warm-up: lazy packing, kernel compilation, library handles
                self.model._forward(self._step(inputs, b))
        torch.cuda.current_stream(dev).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            logits = self.model._forward(self._step(inputs, b))
        return _Captured(g, inputs, logits)

    def run(self, ids: torch.Tensor, pos: torch.Tensor, slot: torch.Tensor) -> torch.Tensor | None:
        """Replay the decode step for B = len(ids) requests (host int64 vectors); None when B is
        larger than the largest bucket (the caller runs it eagerly)."""
        B = ids.shape[0]
        b = self.bucket(B)
        if b is None:
            self.eager += 1
            return None
        cap = self.graphs.get(b)
        if cap is None:
            cap = self.graphs[b] = self._capture(b)
        host = torch.zeros(4, b, dtype=torch.int64)
        host[0, :B], host[1, :B], host[2, :B], host[3, :B] = ids, pos, slot, 1
        cap.inputs.copy_(host)
        cap.graph.replay()
        self.replays += 1
        return cap.logits[:B].clone()
