"""Collectives over a process group (SPEC.md section 2): ``torch.distributed`` semantics when a
process group with more than one rank is initialised, identities otherwise.

``group`` is a ``torch.distributed`` ProcessGroup (``None``: the default group); "rank" below is
this process's rank IN ``group`` and "world size" its size. The fp64 formulas the multi-process
conformance run checks against are in :mod:`dsv4core.conformance.distributed` (``expected``).
Uneven splits (HAL 1.2): ``all_gather(..., sizes=)`` gathers per-rank extents that differ (a
vocabulary or a token batch that does not divide by the world size), ``reduce_scatter(...,
sizes=)`` keeps per-rank extents that differ; ``all_to_all`` has taken split sizes since 1.0.
"""

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


def rank_in(group=None) -> int:
    """This process's rank in ``group`` (0 when torch.distributed is not initialised)."""
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


@op(family="collectives", tolerance=_SUM)
def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Elementwise sum of ``x`` over the ranks of ``group``; returns a new tensor (``x`` itself
    when there is a single rank: do not modify the result in place)."""
    if world_size(group) == 1:
        return x
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
    return y


@op(family="collectives", tolerance=_EXACT, params_since={"sizes": (1, 2)})
def all_gather(x: torch.Tensor, dim: int = 0, group=None, sizes: list[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order.

    ``sizes`` (HAL 1.2): the extent of every rank's ``x`` along ``dim`` (one int per rank; this
    rank's ``x.shape[dim] == sizes[rank]``; other dims equal); ``None``: all equal to this rank's.
    """
    ws = world_size(group)
    if ws == 1:
        return x
    if sizes is None:
        parts = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)
    pad = max(sizes)
    shape = list(x.shape)
    shape[dim] = pad
    buf = x.new_zeros(shape)
    buf.narrow(dim, 0, x.shape[dim]).copy_(x)
    parts = [torch.empty_like(buf) for _ in range(ws)]
    dist.all_gather(parts, buf, group=group)
    return torch.cat([p.narrow(dim, 0, n) for p, n in zip(parts, sizes)], dim=dim)


@op(family="collectives", tolerance=_SUM, params_since={"sizes": (1, 2)})
def reduce_scatter(x: torch.Tensor, dim: int = 0, group=None, sizes: list[int] | None = None) -> torch.Tensor:
    """Sum ``x`` over ranks, then keep this rank's chunk along ``dim``: the equal chunk, or with
    ``sizes`` (HAL 1.2, one int per rank, summing to ``x.shape[dim]``) the ``sizes[rank]`` entries
    after the first ``sum(sizes[:rank])``.

    Implemented as all_reduce + slice: the plainest correct form on every process-group backend
    (it moves world-size times more data than a native reduce-scatter; plugins may do better).
    """
    ws = world_size(group)
    if ws == 1:
        return x
    r = rank_in(group)
    total = all_reduce(x, group)
    if sizes is None:
        return total.chunk(ws, dim=dim)[r].contiguous()
    return total.narrow(dim, sum(sizes[:r]), sizes[r]).contiguous()


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


def _check_sizes(op_name: str, arg: str, sizes, ws: int) -> None:
    if sizes is None:
        return
    expect(op_name, arg, isinstance(sizes, (list, tuple)) and len(sizes) == ws
           and all(isinstance(s, int) and s >= 0 for s in sizes),
           f"a list of {ws} non-negative ints (one per rank of the group)", sizes)


def _check_dim(op_name: str, x, dim) -> None:
    expect(op_name, "dim", isinstance(dim, int) and -x.dim() <= dim < x.dim(), f"a dim of x (rank {x.dim()})", dim)


@all_reduce.check
def _(x, group=None):
    Dims("all_reduce").tensor("x", x)


@all_gather.check
def _(x, dim=0, group=None, sizes=None):
    Dims("all_gather").tensor("x", x, min_rank=1)
    _check_dim("all_gather", x, dim)
    ws = world_size(group)
    _check_sizes("all_gather", "sizes", sizes, ws)
    if sizes is not None:
        r = rank_in(group)
        expect("all_gather", "x", x.shape[dim] == sizes[r], f"dim {dim} = sizes[{r}] = {sizes[r]} (this rank's size)",
               f"shape {tuple(x.shape)}")


@reduce_scatter.check
def _(x, dim=0, group=None, sizes=None):
    Dims("reduce_scatter").tensor("x", x, min_rank=1)
    _check_dim("reduce_scatter", x, dim)
    ws = world_size(group)
    _check_sizes("reduce_scatter", "sizes", sizes, ws)
    if sizes is None:
        expect("reduce_scatter", "x", x.shape[dim] % ws == 0, f"dim {dim} divisible by the world size {ws}",
               f"shape {tuple(x.shape)}")
    else:
        expect("reduce_scatter", "sizes", sum(sizes) == x.shape[dim], f"sizes summing to x.shape[{dim}] = {x.shape[dim]}",
               sizes)


@all_to_all.check
def _(x, output_split_sizes=None, input_split_sizes=None, group=None):
    Dims("all_to_all").tensor("x", x, min_rank=1)
    ws = world_size(group)
    _check_sizes("all_to_all", "input_split_sizes", input_split_sizes, ws)
    _check_sizes("all_to_all", "output_split_sizes", output_split_sizes, ws)
    if input_split_sizes is not None:
        expect("all_to_all", "input_split_sizes", sum(input_split_sizes) == x.shape[0],
               f"sizes summing to x.shape[0] = {x.shape[0]}", input_split_sizes)
    elif ws > 1:
        expect("all_to_all", "x", x.shape[0] % ws == 0, f"dim 0 divisible by the world size {ws} (equal splits)",
               f"shape {tuple(x.shape)}")


def _collective_cases(shapes, dtype, device, gen):
    """Single-process cases (world size 1: every collective is the identity). The multi-process
    cases (2 and 4 ranks, subgroups, uneven splits) are in dsv4core.conformance.distributed."""
    D = dims(shapes)
    for T in (0, 1, 9):
        yield Case(f"T{T}", dict(x=randn((T, D["H"]), gen, dtype, device)))
    yield Case("noncontig", dict(x=noncontig(randn((4, D["H"]), gen, dtype, device))), ("noncontig",))


for _spec in (all_reduce, all_gather, reduce_scatter, all_to_all):
    _spec.cases(_collective_cases)
