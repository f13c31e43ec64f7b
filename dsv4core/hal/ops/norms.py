"""Normalisations (SPEC.md section 2, rms_norm)."""

from __future__ import annotations

import torch

from ..spec import ACT_DTYPES, F32, Case, Dims, Tolerance, compute_dtype, op
from ._cases import TOKENS, dims, noncontig, randn


def rms(xf: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, in ``xf``'s dtype (no cast)."""
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.to(xf.dtype)


@op(family="norms", tolerance=Tolerance(
    k=2.0, floor=1e-6,
    why="one reduction of length D then an elementwise scale: a correct fp32 kernel is within a "
        "couple of roundings of the reference; 2x leaves room for another summation order"))
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the last dim (weight optional); fp32 math,
    one cast to ``x.dtype``."""
    return rms(x.to(compute_dtype(x)), weight, eps).to(x.dtype)


@rms_norm.check
def _(x, weight, eps):
    d = Dims("rms_norm").tensor("x", x, dtypes=ACT_DTYPES + (torch.float64,), min_rank=1)
    d.tensor("weight", weight, (x.shape[-1],), ACT_DTYPES + F32, optional=True)


@rms_norm.cases
def _(shapes, dtype, device, gen):
    D = dims(shapes)
    for T in TOKENS[shapes]:
        for width, label in ((D["H"], "hidden"), (D["q_lora"], "q_lora"), (D["d"], "head")):
            yield Case(f"T{T}-{label}{width}", dict(x=randn((T, width), gen, dtype, device, 3.0),
                                                    weight=randn((width,), gen, torch.float32, device) + 1.0,
                                                    eps=1e-6))
    yield Case("unweighted-3d", dict(x=randn((3, D["heads"], D["d"]), gen, dtype, device), weight=None, eps=1e-6))
    x = randn((9, 2 * D["H"]), gen, dtype, device)[:, ::2]  # non-contiguous rows and columns
    yield Case("strided", dict(x=x, weight=randn((D["H"],), gen, torch.float32, device), eps=1e-6), ("noncontig",))
    yield Case("large-magnitude", dict(x=randn((4, D["H"]), gen, dtype, device, 1e4), weight=None, eps=1e-6), ("extreme",))
    # mean(x^2) ~ eps: a backend that drops eps or adds it after the sqrt fails here
    yield Case("eps-dominant", dict(x=randn((5, D["d"]), gen, dtype, device, 1e-3),
                                    weight=randn((D["d"],), gen, torch.float32, device) + 1.0, eps=1e-6), ("extreme",))
    yield Case("act-weight-offset", dict(x=noncontig(randn((3, 4, D["d"]), gen, dtype, device)),
                                         weight=(randn((D["d"],), gen, torch.float32, device) + 1.0).to(dtype),
                                         eps=1e-5), ("noncontig",))
