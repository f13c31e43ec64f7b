"""Reference collectives: identities in one process; torch.distributed semantics with 2 gloo ranks."""

from __future__ import annotations

import os
import sys
import tempfile
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _fp64ref import ops  # noqa: E402,F401


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("shape", [(4, 8), (0, 8), (3, 2, 5)])
def test_collectives_identity_single_process(ops, dtype, shape):
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())
    x = (torch.arange(int(torch.tensor(shape).prod())) - 7).reshape(shape).to(dtype)
    x0 = x.clone()
    for out in (ops.all_reduce(x), ops.all_gather(x), ops.all_gather(x, dim=-1), ops.reduce_scatter(x),
                ops.reduce_scatter(x, dim=-1), ops.all_to_all(x),
                ops.all_to_all(x, [shape[0]], [shape[0]])):
        assert out.shape == x0.shape and out.dtype == dtype
        assert torch.equal(out, x0)
    assert torch.equal(x, x0)  # input untouched


def _rank_tensor(rank, shape, dtype):
    # distinct, exactly representable values per rank (sums stay exact in bf16 too)
    n = int(torch.tensor(shape).prod())
    return ((torch.arange(n) % 17) + 32 * rank - 8).reshape(shape).to(dtype)


def _worker(rank, world, init_file, dtype_names):
    import torch.distributed as dist

    from dsv4core.hal import bind

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        ops = bind(device="cpu", backend="reference", policy="strict")
        for dtype_name in dtype_names:
            _check_rank(ops, rank, world, getattr(torch, dtype_name))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _check_rank(ops, rank, world, dtype):
    xs = [_rank_tensor(r, (4, 6), dtype) for r in range(world)]
    x = xs[rank].clone()
    total = sum(t.to(torch.float64) for t in xs)

    out = ops.all_reduce(x)
    assert torch.equal(out.to(torch.float64), total), ("all_reduce", rank, out)
    assert out.dtype == dtype
    for dim in (0, 1):
        out = ops.all_gather(x, dim=dim)
        assert torch.equal(out, torch.cat(xs, dim=dim)), ("all_gather", dim, rank)
        out = ops.reduce_scatter(x, dim=dim)
        want = total.chunk(world, dim=dim)[rank]
        assert torch.equal(out.to(torch.float64), want), ("reduce_scatter", dim, rank, out)
    assert torch.equal(x, xs[rank]), "input modified"

    # all_to_all, equal splits along dim 0: rank r receives chunk r of every rank, in rank order
    out = ops.all_to_all(x)
    assert torch.equal(out, torch.cat([t.chunk(world, 0)[rank] for t in xs])), ("all_to_all", rank)
    # uneven splits: rank r sends in_splits[r][j] rows to rank j
    in_splits = [[1, 3], [2, 2]]
    out_splits = [in_splits[j][rank] for j in range(world)]
    out = ops.all_to_all(x, out_splits, in_splits[rank])
    want = torch.cat([t.split(in_splits[j])[rank] for j, t in enumerate(xs)])
    assert torch.equal(out, want), ("all_to_all uneven", rank, out, want)


def test_collectives_two_process_gloo():
    """all_reduce / all_gather / reduce_scatter / all_to_all through a real 2-rank gloo group
    (exact comparisons: integer-valued data, sums exact in fp32 and bf16)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg")
        t0 = time.time()
        ctx = mp.start_processes(_worker, args=(2, init_file, ["float32", "bfloat16"]), nprocs=2, join=False,
                                 start_method="spawn")
        while not ctx.join(timeout=5):
            if time.time() - t0 > 60:
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                pytest.fail("2-process gloo collectives did not finish within 60 s")
