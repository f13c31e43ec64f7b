"""CUDA graph capture for the cuda backend (dsv4core.hal.graphs.GraphCapture)."""

from __future__ import annotations

import torch


class CudaGraphCapture:
    """torch.cuda graphs. The caller passes the memory pool its graphs share (``new_pool()``):
    graphs replayed one at a time may share one; a pool is never reused once the graphs recorded
    into it are gone."""

    def new_pool(self, device):
        return torch.cuda.graph_pool_handle()

    def capture(self, fn, device, pool=None):
        device = torch.device(device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):          # warm-up: lazy packing, Triton compilation, library handles
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            out = fn()

        def replay(_g=g, _fn=fn):
            # _fn is held so that every tensor it closes over (static inputs made before the
            # recording) lives as long as the graph that reads its memory
            _g.replay()
        return replay, out
