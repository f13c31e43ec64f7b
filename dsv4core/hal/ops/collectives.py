"""Collectives over a process group (SPEC.md section 2): ``torch.distributed`` semantics when a
process group with more than one rank is initialised, identities otherwise."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..spec import Case, Dims, Tolerance, expect, op
from ._cases import dims, noncontig, randn

_EXACT = Tolerance(k=1.0, floor=0.0, metric="max_abs",
                   why="data movement (and in-order sums in a single process): exact")
_SUM = Tolerance(k=4.0, floor=1e-6, why="a world-size-term sum whose order the transport chooses")


def world_size(group=None) -> int:
    """Ranks in ``group`` (1 when torch.distributed is not initialised)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


@op(family="collectives", tolerance=_SUM)
def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Elementwise sum of ``x`` over the ranks of ``group``; returns a new tensor (``x`` itself
    when there is a single rank: do not modify the result in place)."""
    if world_size(group) == 1:
        return x
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y


@op(family="collectives", tolerance=_EXACT)
def all_gather(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    ws = world_size(group)
    if ws == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(ws)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


@op(family="collectives", tolerance=_SUM)
def reduce_scatter(x: torch.Tensor, dim: int = 0, group=None) -> torch.Tensor:
    """Sum ``x`` over ranks, then keep this rank's equal chunk along ``dim``.

    Implemented as all_reduce + chunk: the plainest correct form on every process-group backend
    (it moves world-size times more data than a native reduce-scatter; plugins may do better).
    """
    ws = world_size(group)
    if ws == 1:
        return x
    return all_reduce(x, group).chunk(ws, dim=dim)[dist.get_rank(group)].contiguous()


@op(family="collectives", tolerance=_EXACT)
def all_to_all(x: torch.Tensor, output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None, group=None) -> torch.Tensor:
    """Scatter dim-0 slices of ``x`` to the ranks (``input_split_sizes`` rows each, equal by
    default) and concatenate what every rank sent here (``output_split_sizes`` rows each)."""
    if world_size(group) == 1:
        return x
    rows = sum(output_split_sizes) if output_split_sizes is not None else x.shape[0]
    out = x.new_empty((rows, *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group)
    return out


def _check_x(op_name):
    def check(x, *rest, **kw):
        Dims(op_name).tensor("x", x)
    return check


for _spec in (all_reduce, all_gather):
    _spec._check = _check_x(_spec.name)


@reduce_scatter.check
def _(x, dim=0, group=None):
    Dims("reduce_scatter").tensor("x", x, min_rank=1)
    expect("reduce_scatter", "dim", isinstance(dim, int) and -x.dim() <= dim < x.dim(),
           f"a dim of x (rank {x.dim()})", dim)
    ws = world_size(group)
    expect("reduce_scatter", "x", x.shape[dim] % ws == 0, f"dim {dim} divisible by the world size {ws}",
           f"shape {tuple(x.shape)}")


@all_to_all.check
def _(x, output_split_sizes=None, input_split_sizes=None, group=None):
    Dims("all_to_all").tensor("x", x, min_rank=1)
    if input_split_sizes is not None:
        expect("all_to_all", "input_split_sizes", sum(input_split_sizes) == x.shape[0],
               f"sizes summing to x.shape[0] = {x.shape[0]}", input_split_sizes)


def _collective_cases(shapes, dtype, device, gen):
    D = dims(shapes)
    for T in (0, 1, 9):
        yield Case(f"T{T}", dict(x=randn((T, D["H"]), gen, dtype, device)))
    yield Case("noncontig", dict(x=noncontig(randn((4, D["H"]), gen, dtype, device))), ("noncontig",))


for _spec in (all_reduce, all_gather, reduce_scatter, all_to_all):
    _spec.cases(_collective_cases)
