"""Next-token choice for `generate`: greedy (temperature 0, the default) or sampling with
temperature, top-k and top-p (nucleus), in torch ops of fixed shapes on the logits' device, so the
draw can be recorded inside a decode graph (`graphs.DecodeGraphs`) and replayed.

The distribution, for a row of float32 logits z (vocabulary V):
  - temperature 0: argmax(z) (`greedy_tokens`, bit-identical to plain greedy generation);
  - otherwise q = z / temperature; top_k > 0 keeps the k largest q (ties with the k-th kept too),
    top_p < 1 keeps the smallest set of largest-probability tokens whose softmax mass reaches
    top_p (the most likely token always stays); the rest get -inf (`masked_logits`, the
    reference formula); the token is drawn from softmax(q) over what is kept.

The draw (`draw`): the Gumbel-max form, argmax_j (q_j + G_j) over the kept tokens, with
G_j = -log(-log u_j) and u_j uniform in (0, 1); it picks token j with probability softmax(q)_j
over the kept set. u_j is a counter-based hash (murmur3's 32-bit finaliser, evaluated in int64
lanes that never overflow) of the row's seed, its counter and j, so a row's noise is a pure
function of (seed, counter): no generator state, no host sync, the same on the eager path and in a
graph replay. `generate` seeds request i with `request_seed(seed, i)` and uses as counter the
position of the token being drawn, so the same seed, prompts and model give the same tokens
however the requests are batched. u_j has 23 random bits (u = (m + 1/2) / 2^23): G_j lies in
[-2.81, 16.6], which changes the drawn probabilities by less than 1e-6 (a token whose tempered
logit is more than 19 below the row's largest, probability < 4e-9, is never drawn).

Per-row parameters travel as one int64 array [4, R] (`RowSampling.pack`): temperature and top_p
as a float32 pair in row 0's bits, top_k, the seed and the counter; a decode graph holds them in
its static input buffer, written before each replay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from .inputs import DeviceTokens, InputError

_M32 = 0xFFFFFFFF
_MASK63 = (1 << 63) - 1


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p, k = self.temperature, self.top_p, self.top_k
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy); got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = no limit); got {k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an int or None; got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def request_seed(seed: int, i: int) -> int:
    """The seed (63 bits) of request i of a `generate` call seeded `seed` (any int)."""
    return _splitmix64(_splitmix64(seed % (1 << 64)) ^ i) & _MASK63


def masked_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 [N, V]: logits / temperature with the tokens top-k / top-p exclude set to -inf
    (the reference formula of the keep set; `draw` computes the same set in fixed shapes)."""
    q = logits.float() / params.temperature
    V = q.shape[-1]
    if 0 < params.top_k < V:
        kth = q.topk(params.top_k, dim=-1).values[:, -1:]
        q = q.masked_fill(q < kth, float("-inf"))
    if params.top_p < 1:
        sq, order = q.sort(dim=-1, descending=True)
        probs = sq.softmax(-1)
        before = probs.cumsum(-1) - probs            # mass of the strictly more likely tokens
        drop_sorted = before >= params.top_p         # the mass already reached top_p without it
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        q = q.masked_fill(drop, float("-inf"))
    return q


class RowSampling:
    """The sampling parameters of each logits row of one step (host values): `params[r]` and the
    seed `seeds[r]` (an int; `request_seed` gives `generate`'s). `forward_batch(sample=...)` takes
    one and returns the drawn tokens; `select(idx)` picks rows (one a request, in step order)."""

    def __init__(self, params: SamplingParams | Sequence[SamplingParams], seeds: Sequence[int]) -> None:
        seeds = list(seeds)
        params = [params] * len(seeds) if isinstance(params, SamplingParams) else list(params)
        if len(params) != len(seeds):
            raise InputError(f"sampling: {len(params)} parameter sets for {len(seeds)} seeds; give one of each per row")
        for r, (p, s) in enumerate(zip(params, seeds)):
            if not isinstance(p, SamplingParams):
                raise InputError(f"sampling: row {r}: expected SamplingParams, got {type(p).__name__}")
            if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
                raise InputError(f"sampling: row {r}: the seed must be an int; got {s!r}")
        tp = np.array([(p.temperature, p.top_p) for p in params], dtype=np.float32).reshape(-1, 2)
        self.tp_bits = np.ascontiguousarray(tp).view(np.int64).reshape(-1)
        self.top_k = np.array([p.top_k for p in params], dtype=np.int64)
        self.seed = np.array([int(s) & _MASK63 for s in seeds], dtype=np.int64)
        #: some sampled row limits the keep set (top-k / top-p): `draw` then sorts the logits
        self.filtered = any(not p.greedy and (p.top_k > 0 or p.top_p < 1) for p in params)
        self.greedy = all(p.greedy for p in params)

    def __len__(self) -> int:
        return self.seed.shape[0]

    def select(self, idx: Sequence[int]) -> "RowSampling":
        out = object.__new__(RowSampling)
        idx = np.asarray(idx, dtype=np.int64)
        out.tp_bits, out.top_k, out.seed = self.tp_bits[idx], self.top_k[idx], self.seed[idx]
        t, p = out.tp_bits.view(np.float32).reshape(-1, 2).T
        out.greedy = bool((t == 0).all())
        out.filtered = bool(((t > 0) & ((out.top_k > 0) | (p < 1))).any())
        return out

    def pack(self, counters: np.ndarray) -> np.ndarray:
        """int64 [4, R]: the rows `draw` reads (counters: int64 [R], e.g. the drawn tokens' positions)."""
        return np.stack([self.tp_bits, self.top_k, self.seed, np.asarray(counters, dtype=np.int64)])


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2^32 for int64 x in [0, 2^32): in 16-bit halves of c, no product reaches 2^49."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser (a bijection of [0, 2^32) with full avalanche)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def gumbel_noise(seed: torch.Tensor, counter: torch.Tensor, V: int) -> torch.Tensor:
    """float32 [R, V]: G = -log(-log u), u[r, j] = (hash(seed[r], counter[r], j) >> 9 + 1/2) / 2^23."""
    row = _mix32(_mix32(_mix32((seed & _M32) ^ 0x2545F491) ^ ((seed >> 32) & _M32)) ^ (counter & _M32))
    tok = _mix32(torch.arange(V, dtype=torch.int64, device=seed.device) ^ 0x68E31DA4)
    u = ((_mix32(row.unsqueeze(-1) ^ tok) >> 9).float() + 0.5) * 2.0 ** -23
    return -torch.log(-torch.log(u))


def _keep(q: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """bool [R, V]: the tokens top-k (per row, 0 = all) and top-p (per row, [R, 1]; 1 = all) keep."""
    V = q.shape[-1]
    sq, order = q.sort(dim=-1, descending=True, stable=True)     # stable: ties in token order, on every device
    k = torch.where((top_k > 0) & (top_k < V), top_k, V)
    keep = sq >= sq.gather(-1, (k - 1).unsqueeze(-1))            # the k largest, ties with the k-th
    probs = sq.masked_fill(~keep, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs                              # mass of the strictly more likely kept
    keep = keep & ~((before >= top_p) & (top_p < 1))
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(-1, order, keep)


def draw(logits: torch.Tensor, packed: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """int64 [R]: the next token of each row of `logits` [R, V] under `packed` (int64 [4, R] on the
    device, `RowSampling.pack`): argmax for temperature 0 rows, else the Gumbel-max draw over the
    top-k / top-p keep set. filtered=False skips the keep set (valid when no sampled row sets
    top_k or top_p < 1: the result is the same). Fixed shapes, no host sync: graph-capturable."""
    z = logits.float()
    R, V = z.shape
    tp = packed[0].contiguous().view(torch.float32).view(R, 2)
    temp, top_p = tp[:, :1], tp[:, 1:]
    greedy = temp <= 0
    q = z / torch.where(greedy, torch.ones_like(temp), temp)
    if filtered:
        q = q.masked_fill(~_keep(q, packed[1], top_p), float("-inf"))
    sampled = (q + gumbel_noise(packed[2], packed[3], V)).argmax(-1)
    return torch.where(greedy[:, 0], z.argmax(-1), sampled)


class StepDraw:
    """`forward_batch(sample=...)`: a `RowSampling` checked against the step's logits rows (one
    entry a row, no hidden_rows). Row r's counter is the position of the token it draws (the
    position of its logits row + 1)."""

    def __init__(self, sample, T: int, rows: np.ndarray | None, hrows, vocab: int) -> None:
        R = T if rows is None else rows.size
        if not isinstance(sample, RowSampling):
            raise InputError(f"forward_batch: sample must be a RowSampling; got {type(sample).__name__}")
        if hrows is not None or len(sample) != R:
            also = " and hidden_rows" if hrows is not None else ""
            raise InputError(f"forward_batch: sample must hold one entry per logits row ({R}) and come without "
                             f"hidden_rows; got {len(sample)} entries{also}")
        self.sample, self.rows, self.vocab, self.filtered = sample, rows, vocab, sample.filtered

    def pack(self, pos: np.ndarray) -> np.ndarray:
        """int64 [4, R] (`RowSampling.pack`) for the step's positions (host int64 [T])."""
        return self.sample.pack((pos if self.rows is None else pos[self.rows]) + 1)

    def tokens(self, logits: torch.Tensor, pos: np.ndarray, uploads) -> DeviceTokens:
        """The eager draw of the logits rows (`draw`, the decode graph's formula), on the device."""
        return DeviceTokens(draw(logits, uploads.to_device(self.pack(pos)), self.filtered), self.vocab)
