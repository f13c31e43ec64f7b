"""CUDA graph capture for the cuda backend (dsv4core.hal.graphs.GraphCapture)."""

from __future__ import annotations

import torch


class CudaGraphCapture:
    """torch.cuda graphs; one memory pool shared by every graph this object records (replays
    of different graphs never overlap: one model steps one batch at a time)."""

    def __init__(self) -> None:
        self.pool = None

    def capture(self, fn, device):
        device = torch.device(device)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):          # warm-up: lazy packing, Triton compilation, library handles
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = fn()
        return g.replay, out
