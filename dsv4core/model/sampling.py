"""Next-token choice for `generate`: greedy (temperature 0, the default) or sampling with
temperature, top-k and top-p (nucleus), in torch ops on the logits' device.

For a row of float32 logits z (vocabulary V):
  - temperature 0: argmax(z) (`greedy_tokens`, bit-identical to plain greedy generation);
  - otherwise q = z / temperature; top_k > 0 keeps the k largest q (ties with the k-th kept too),
    top_p < 1 keeps the smallest set of largest-probability tokens whose softmax mass reaches
    top_p (the most likely token always stays); the rest get -inf; the token is drawn from
    softmax(q) over what is kept, with a `torch.Generator` on the device seeded by `seed`
    (the same seed, prompts and model give the same tokens).
The draw runs eagerly after each step's logits (decode graphs end at the logits)."""

from __future__ import annotations

import dataclasses

import torch


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


def masked_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """float32 [N, V]: logits / temperature with the tokens top-k / top-p exclude set to -inf."""
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


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator(device=device)
    if params.seed is None:
        g.seed()
    else:
        g.manual_seed(params.seed)
    return g


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """int64 [N] next tokens, on the logits' device."""
    if params.greedy:
        return logits.argmax(-1)
    probs = masked_logits(logits, params).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
