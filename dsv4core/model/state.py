"""Explicit per-request decoding state (the "cache").

One `RequestState` per request, one `LayerState` per decoder layer. Nothing is hidden in the
modules: the forward reads and writes only these objects, so an engine can keep, move, drop or
batch requests freely.

    LayerState
      window       [<= W-1, d]   raw K=V rows (after kv norm + rope) of the last W-1 positions
      comp         CompressorState at d (CSA / HCA layers)
      index_comp   CompressorState at d_I (CSA layers: the lightning indexer's keys)

    CompressorState (window m, c = 2 for CSA overlap else 1)
      buf_kv, buf_score   [< m, c*d'] fp32   projections of the tokens of the open (partial) window
      prev_kv, prev_score [m, d'] fp32       A halves (no ape) of the last complete window (CSA only;
                                             None before the first complete window)
      entries             [N_c, d']          compressed rows emitted so far (after norm + rope)

Memory per request is bounded by W-1 raw rows + (m-1) buffered rows (+ m overlap rows) per
compressor + one entry per m tokens: see `state_bytes()` for the computed figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import CSA, HCA, SLIDING, DSV4Config


@dataclass
class CompressorState:
    buf_kv: torch.Tensor
    buf_score: torch.Tensor
    entries: torch.Tensor
    prev_kv: torch.Tensor | None = None
    prev_score: torch.Tensor | None = None

    @classmethod
    def empty(cls, width: int, dim: int, dtype: torch.dtype, device: torch.device) -> "CompressorState":
        f = dict(dtype=torch.float32, device=device)
        return cls(buf_kv=torch.empty(0, width, **f), buf_score=torch.empty(0, width, **f),
                   entries=torch.empty(0, dim, dtype=dtype, device=device))

    def nbytes(self) -> int:
        ts = [self.buf_kv, self.buf_score, self.entries, self.prev_kv, self.prev_score]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass
class LayerState:
    window: torch.Tensor
    comp: CompressorState | None = None
    index_comp: CompressorState | None = None

    def nbytes(self) -> int:
        n = self.window.numel() * self.window.element_size()
        for c in (self.comp, self.index_comp):
            if c is not None:
                n += c.nbytes()
        return n


@dataclass
class RequestState:
    """Decoding state of one request: `length` tokens consumed so far, plus per-layer state."""

    layers: list[LayerState]
    length: int = 0

    @classmethod
    def new(cls, config: DSV4Config, dtype: torch.dtype, device: torch.device | str) -> "RequestState":
        device = torch.device(device)
        d, dI = config.head_dim, config.index_head_dim
        layers = []
        for t in config.layer_types:
            ls = LayerState(window=torch.empty(0, d, dtype=dtype, device=device))
            if t == CSA:
                ls.comp = CompressorState.empty(2 * d, d, dtype, device)
                ls.index_comp = CompressorState.empty(2 * dI, dI, dtype, device)
            elif t == HCA:
                ls.comp = CompressorState.empty(d, d, dtype, device)
            layers.append(ls)
        return cls(layers=layers)

    def nbytes(self) -> int:
        """Bytes of tensor state currently held."""
        return sum(layer.nbytes() for layer in self.layers)


def state_bytes(config: DSV4Config, tokens: int, act_bytes: int = 2) -> dict[str, int]:
    """Computed (not allocated) upper bound of one request's state after `tokens` tokens.

    Raw rows and compressed entries are in the activation dtype (`act_bytes`), compressor
    buffers and overlap rows in fp32 (the worst case m-1 buffered rows is counted).
    """
    d, dI, W = config.head_dim, config.index_head_dim, config.sliding_window
    out = {"window": 0, "compressor_buffers": 0, "compressed_entries": 0, "indexer_keys": 0}
    for i, t in enumerate(config.layer_types):
        out["window"] += min(tokens, W - 1) * d * act_bytes
        if t == SLIDING:
            continue
        m = config.compress_ratio(i)
        c = 2 if t == CSA else 1
        buf = min(tokens, m - 1) * 2 * c * d * 4
        if t == CSA:
            buf += 2 * m * d * 4  # overlap A halves (kv + score)
        out["compressor_buffers"] += buf
        out["compressed_entries"] += (tokens // m) * d * act_bytes
        if t == CSA:
            out["compressor_buffers"] += min(tokens, m - 1) * 2 * 2 * dI * 4 + 2 * m * dI * 4
            out["indexer_keys"] += (tokens // m) * dI * act_bytes
    out["total"] = sum(out.values())
    return out
