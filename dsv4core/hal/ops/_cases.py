"""Shared helpers for the op modules' sample-case generators.

Shape sets: ``small`` (CPU-friendly), ``flash`` and ``pro`` (the published models' real dims).
"""

from __future__ import annotations

import torch

#: Real model dimensions (SPEC.md / PEERS.md table 1.1).
DIMS = {
    "small": dict(H=256, n=4, heads=8, d=128, d_r=64, q_lora=128, G=2, R=64, E=8, k=2, I=64,
                  nI=4, dI=64, window=16, topk=8),
    "flash": dict(H=4096, n=4, heads=64, d=512, d_r=64, q_lora=1024, G=8, R=1024, E=256, k=6, I=2048,
                  nI=64, dI=128, window=128, topk=512, V=129280),
    "pro": dict(H=7168, n=4, heads=128, d=512, d_r=64, q_lora=1536, G=16, R=1024, E=384, k=6, I=3072,
                nI=64, dI=128, window=128, topk=1024, V=129280),
}
# V: the vocabulary (the lm_head's rows); only the published sets have it (its cases are heavy)
#: Token counts exercised per shape set (0 and 1 always; an odd count; a larger one).
TOKENS = {"small": (0, 1, 7, 33), "flash": (0, 1, 5, 64), "pro": (0, 1, 5, 64)}


def dims(shapes: str) -> dict:
    if shapes not in DIMS:
        raise ValueError(f"unknown shape set {shapes!r}; expected one of {', '.join(DIMS)}")
    return DIMS[shapes]


def randn(shape, gen: torch.Generator, dtype: torch.dtype, device, scale: float = 1.0) -> torch.Tensor:
    """Deterministic normal samples (drawn on the CPU in fp32, then moved and cast)."""
    return (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)


def positions(T: int, gen: torch.Generator, device, max_pos: int = 70000) -> torch.Tensor:
    return torch.randint(0, max_pos, (T,), generator=gen).to(device)


# ---------------------------------------------------------------------------------------------
# Shared case builders
# ---------------------------------------------------------------------------------------------


def noncontig(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in a non-contiguous, storage-offset view (every other column of a
    wider buffer, starting at column 1)."""
    buf = torch.zeros((*t.shape[:-1], 2 * t.shape[-1] + 1), dtype=t.dtype, device=t.device)
    view = buf[..., 1::2]
    view.copy_(t)
    return view


def block_varied(w: torch.Tensor, levels: int, block: int = 128) -> torch.Tensor:
    """``w [.., N, K]`` with its block (i, j) (``block`` x ``block``) multiplied by
    ``2^((i + 2j) mod levels - (levels - 1) / 2)`` (``levels`` odd: 3 gives 0.5 / 1 / 2, 7 gives
    2^-3 .. 2^3). Every row of blocks and every column of blocks then holds different factors
    (for any seed), so FP8 block scales drawn from it differ along both directions: a kernel
    applying them per row, per column or one for all diverges. The factors are powers of two,
    exact in ``w``'s dtype."""
    if levels % 2 != 1:
        raise ValueError(f"block_varied: levels must be odd, got {levels}")
    nb, kb = -(-w.shape[-2] // block), -(-w.shape[-1] // block)
    i, j = torch.arange(nb)[:, None], torch.arange(kb)[None, :]
    f = 2.0 ** (((i + 2 * j) % levels) - (levels - 1) // 2).to(torch.float32)
    f = f.repeat_interleave(block, 0)[:w.shape[-2]].repeat_interleave(block, 1)[:, :w.shape[-1]]
    return w * f.to(device=w.device, dtype=w.dtype)
