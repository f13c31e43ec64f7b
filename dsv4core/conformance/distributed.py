"""The collectives over real process groups: spawned ranks, subgroups, uneven splits, fp64 formulas.

In one process every collective is the identity, so the single-process cases prove little. Here
``world_size`` processes are spawned (2 and 4 by default; ``gloo`` on CPU tensors, or with
``dist_backend`` / ``device`` the backend's own transport on its device) and each checks, for
every case, its output of the backend's ``all_reduce`` / ``all_gather`` / ``reduce_scatter`` /
``all_to_all`` against :func:`expected` - the fp64 formula evaluated from every rank's inputs
(each rank can rebuild every rank's inputs: they are drawn from per-rank seeds) - with the op's
tolerance (``k x`` the reference's own error + floor, like every other op).

Cases (per world size and dtype) cover empty and non-contiguous inputs, ``dim`` 0, 1 and -1,
uneven ``sizes`` / split sizes with zero extents, and subgroups: every rank runs the subgroup
cases in its own block of a partition of the world (pairs ``{0,1},{2,3}``; uneven blocks
``{0,2,3},{1}``), so a kernel that ignores ``group`` sums or gathers over the wrong ranks.

Lockstep: all ranks run the same cases in the same order. Whether the backend's ``supports``
accepts a case, and whether the op raised, are agreed over a separate gloo control group before
anything else is communicated, so a decline or a raise on one rank is reported, not a hang; after
a raise the remaining cases of that world size are not run (the data group may be out of step).

:func:`mutation_results` proves these cases distinguish every parameter of every collective,
``group`` and the split sizes included (the mutants of :mod:`.mutation`, evaluated with the fp64
formulas in one process: no spawning, no hangs).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dsv4core.hal import catalogue
from dsv4core.hal.spec import Case
from dsv4core.hal import compare
from dsv4core.hal.compare import Check, Mismatch, dtype_name

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
WORLD_SIZES = (2, 4)
H = 24      # feature width of the cases (small: the transport, not the arithmetic, is under test)


@dataclass(frozen=True)
class Partition:
    """A ``group`` argument in a case: the world split into blocks; each rank uses its own block."""

    blocks: tuple[tuple[int, ...], ...]

    def ranks_of(self, rank: int) -> tuple[int, ...]:
        return next(b for b in self.blocks if rank in b)


def group_ranks(group: Partition | None, rank: int, world: int) -> tuple[int, ...]:
    return tuple(range(world)) if group is None else group.ranks_of(rank)


@dataclass
class DistCase:
    """One multi-rank case: ``kwargs[r]`` are rank r's arguments (``group`` as a Partition or None)."""

    op: str
    name: str
    world: int
    kwargs: list[dict[str, Any]]
    tags: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------
# Cases and the fp64 formulas
# ---------------------------------------------------------------------------------------------

def _gen(seed: int, *parts) -> torch.Generator:
    from .cases import mix_seed

    return torch.Generator().manual_seed(mix_seed(seed, *parts))


def _x(seed, case, rank, shape, dtype, noncontig=False):
    x = torch.randn(shape, generator=_gen(seed, case, rank)).to(dtype)
    if noncontig:
        from dsv4core.hal.ops._cases import noncontig as nc
        x = nc(x)
    return x


def _partitions(world: int) -> list[tuple[str, Partition]]:
    if world < 4:
        return []
    return [("pairs", Partition(((0, 1), (2, 3)) + tuple((r,) for r in range(4, world)))),
            ("uneven-groups", Partition(((0, 2, 3), (1,)) + tuple((r,) for r in range(4, world))))]


def _uneven(n: int, salt: int = 0) -> list[int]:
    """Per-rank extents that differ and include a zero for n >= 3: [1, 3, 0, 2, 4, 1, ...]."""
    return [(2 * i + 1 + salt) % 5 for i in range(n)]


def cases(op: str, world: int, dtype: torch.dtype, seed: int = 0) -> list[DistCase]:
    """The multi-rank cases of ``op`` for ``world`` ranks."""
    out: list[DistCase] = []

    def add(name, make, tags=(), group=None):
        kw = []
        for r in range(world):
            g = group_ranks(group, r, world)
            d = make(r, g.index(r), len(g), f"{op}/{name}")
            if group is not None:
                d["group"] = group
            kw.append(d)
        out.append(DistCase(op, name, world, kw, tags))

    groups = [("world", None)] + _partitions(world)
    if op == "all_reduce":
        add("T0", lambda r, i, n, c: dict(x=_x(seed, c, r, (0, H), dtype)))
        add("T5", lambda r, i, n, c: dict(x=_x(seed, c, r, (5, H), dtype)))
        add("noncontig-3d", lambda r, i, n, c: dict(x=_x(seed, c, r, (2, 3, H), dtype, noncontig=True)), ("noncontig",))
        for gname, g in groups[1:]:
            add(f"group-{gname}", lambda r, i, n, c: dict(x=_x(seed, c, r, (3, H), dtype)), ("group",), g)
    elif op == "all_gather":
        for gname, g in groups:
            sfx = "" if g is None else f"-group-{gname}"
            add(f"dim0{sfx}", lambda r, i, n, c: dict(x=_x(seed, c, r, (3, H), dtype), dim=0), (), g)
            add(f"uneven-dim0{sfx}", lambda r, i, n, c: dict(x=_x(seed, c, r, (_uneven(n)[i], H), dtype), dim=0,
                                                              sizes=_uneven(n)), ("uneven",), g)
        add("dim1", lambda r, i, n, c: dict(x=_x(seed, c, r, (4, 5), dtype), dim=1))
        add("uneven-dim-1-noncontig", lambda r, i, n, c: dict(x=_x(seed, c, r, (2, 3, _uneven(n, 1)[i]), dtype,
                                                                       noncontig=True), dim=-1, sizes=_uneven(n, 1)),
            ("uneven", "noncontig"))
        add("T0", lambda r, i, n, c: dict(x=_x(seed, c, r, (0, H), dtype), dim=0))
    elif op == "reduce_scatter":
        for gname, g in groups:
            sfx = "" if g is None else f"-group-{gname}"
            add(f"dim0{sfx}", lambda r, i, n, c: dict(x=_x(seed, c, r, (2 * n, H), dtype), dim=0), (), g)
            add(f"uneven-dim0{sfx}", lambda r, i, n, c: dict(x=_x(seed, c, r, (sum(_uneven(n)), H), dtype), dim=0,
                                                              sizes=_uneven(n)), ("uneven",), g)
        # dim 1 with a row count that divides by the world size too (a kernel scattering along
        # dim 0 instead returns a wrong slice rather than failing to split)
        add("dim1", lambda r, i, n, c: dict(x=_x(seed, c, r, (2 * n, 3 * n), dtype), dim=1))
        add("uneven-dim-1-noncontig", lambda r, i, n, c: dict(x=_x(seed, c, r, (n, sum(_uneven(n, 2))), dtype,
                                                                       noncontig=True), dim=-1, sizes=_uneven(n, 2)),
            ("uneven", "noncontig"))
    elif op == "all_to_all":
        def splits(n, sender):           # rows sender sends to each receiver: differ, include zeros
            return [(sender + 2 * j) % 3 for j in range(n)]

        for gname, g in groups:
            sfx = "" if g is None else f"-group-{gname}"
            add(f"equal{sfx}", lambda r, i, n, c: dict(x=_x(seed, c, r, (2 * n, H), dtype)), (), g)
            add(f"uneven{sfx}", lambda r, i, n, c: dict(
                x=_x(seed, c, r, (sum(splits(n, i)), H), dtype),
                output_split_sizes=[splits(n, s)[i] for s in range(n)], input_split_sizes=splits(n, i)),
                ("uneven",), g)
        add("noncontig-3d", lambda r, i, n, c: dict(x=_x(seed, c, r, (n, 2, H), dtype, noncontig=True)), ("noncontig",))
    else:
        raise ValueError(f"{op!r} is not a collective (expected one of {', '.join(OPS)})")
    return out


def expected(op: str, kwargs: list[dict[str, Any]], rank: int) -> torch.Tensor:
    """fp64 result of ``op`` on ``rank`` given every rank's arguments (independent of
    torch.distributed). Arguments the op cannot take (extents that disagree with ``sizes`` or the
    split sizes, unequal extents without them) raise ValueError, as the transport would fail."""
    world = len(kwargs)
    kw = kwargs[rank]
    ranks = group_ranks(kw.get("group"), rank, world)
    me = ranks.index(rank)
    xs = [kwargs[j]["x"].to(torch.float64) for j in ranks]
    n = len(ranks)

    def need(ok: bool, what: str):
        if not ok:
            raise ValueError(f"{op}: {what}")

    if op == "all_reduce":
        need(len({x.shape for x in xs}) == 1, "shapes differ across ranks")
        return torch.stack(xs).sum(0)
    if op == "all_gather":
        dim = kw.get("dim", 0)
        sizes = kw.get("sizes")
        extents = [x.shape[dim] for x in xs]
        need(extents == (list(sizes) if sizes is not None else [xs[me].shape[dim]] * n),
             f"extents {extents} along dim {dim} != sizes {sizes}")
        return torch.cat(xs, dim=dim)
    if op == "reduce_scatter":
        dim = kw.get("dim", 0)
        need(len({x.shape for x in xs}) == 1, "shapes differ across ranks")
        total = torch.stack(xs).sum(0)
        sizes = kw.get("sizes")
        if sizes is None:
            need(total.shape[dim] % n == 0, f"dim {dim} extent {total.shape[dim]} not divisible by {n}")
            return total.chunk(n, dim=dim)[me]
        need(len(sizes) == n and sum(sizes) == total.shape[dim], f"sizes {sizes} for extent {total.shape[dim]}")
        return total.narrow(dim, sum(sizes[:me]), sizes[me])
    if op == "all_to_all":
        rows = []
        for s, j in enumerate(ranks):
            ins = kwargs[j].get("input_split_sizes")
            if ins is None:
                need(xs[s].shape[0] % n == 0, f"rank {j}: {xs[s].shape[0]} rows not divisible by {n}")
                ins = [xs[s].shape[0] // n] * n
            need(len(ins) == n and sum(ins) == xs[s].shape[0], f"rank {j}: input splits {ins}")
            rows.append(xs[s].narrow(0, sum(ins[:me]), ins[me]))
        outs = kw.get("output_split_sizes")
        got = [r.shape[0] for r in rows]
        need(got == (list(outs) if outs is not None else [xs[me].shape[0] // n] * n),
             f"rows received {got} != output splits {outs}")
        return torch.cat(rows, dim=0)
    raise ValueError(op)


# ---------------------------------------------------------------------------------------------
# Mutation check of the cases (one process, fp64 formulas)
# ---------------------------------------------------------------------------------------------

@dataclass
class DistMutant:
    name: str
    param: str
    killed_by: str = ""


def mutation_results(op: str, world: int = 4, seed: int = 0) -> list[DistMutant]:
    """Every mutant of ``op``'s parameters (``group``, ``dim``, split sizes, ``x``'s axes) applied
    to every rank's arguments, evaluated with :func:`expected`: killed when some rank's result
    differs from the unmutated one in some case (or the mutated arguments cannot be evaluated)."""
    from .mutation import mutants

    spec = catalogue()[op]
    dcases = cases(op, world, torch.float32, seed)
    proxy = [Case(c.name, dict(c.kwargs[0])) for c in dcases]     # rank 0's view: the usual values
    out = []
    for m in mutants(spec, proxy):
        res = DistMutant(m.name, m.param)
        for c in dcases:
            mutated = [dict(kw, **{m.param: m.transform(kw.get(m.param, spec.signature.parameters[m.param].default))})
                       for kw in c.kwargs]
            for r in range(world):
                want = expected(op, c.kwargs, r)
                try:
                    got = expected(op, mutated, r)
                    same = got.shape == want.shape and bool(torch.equal(got, want))
                except Exception:  # noqa: BLE001 - arguments the formula cannot take: distinguished
                    same = False
                if not same:
                    res.killed_by = f"{op}[ws{world}-{c.name}] rank {r}"
                    break
            if res.killed_by:
                break
        out.append(res)
    return out


# ---------------------------------------------------------------------------------------------
# The spawned run
# ---------------------------------------------------------------------------------------------

def resolve_backend(ref: str, device: str = "cpu"):
    """A backend from ``ref``: a discovered backend name, or ``"module:function"`` returning a
    Backend (how in-process test backends reach the spawned ranks)."""
    if ":" in ref:
        import importlib

        mod, fn = ref.split(":", 1)
        return getattr(importlib.import_module(mod), fn)()
    from .cases import load_backend

    return load_backend(ref, device)


@dataclass
class _Flags:
    """Agreement over the control group: any rank True -> True everywhere."""

    group: Any

    def any(self, flag: bool) -> bool:
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())


def _realize(kw: dict, groups: dict, rank: int, device: str) -> dict:
    out = {}
    for k, v in kw.items():
        if isinstance(v, Partition):
            v = groups[v][v.ranks_of(rank)]
        elif isinstance(v, torch.Tensor) and device != "cpu":
            v = v.to(device)
        out[k] = v
    return out


def _judge_rank(spec, impl, case: DistCase, rank: int, groups: dict, flags: _Flags, device: str,
                dtype: torch.dtype) -> tuple[dict, bool]:
    """One case on this rank (every rank calls this in lockstep). Returns (result dict, stop)."""
    from .cases import _exc, _modified, _snapshot
    from .results import DECLINED, PASSED, CaseResult

    res = CaseResult(spec.name, dtype_name(dtype), f"ws{case.world}", case.name, PASSED, case.tags)
    kw = _realize(case.kwargs[rank], groups, rank, device)
    tol = spec.tolerance
    floor = tol.floor_for(dtype)
    t0 = time.perf_counter()
    spec.validate(**kw)                                       # a suite bug if this raises
    ok = True
    if impl.supports is not None:
        try:
            ok = impl.supports(**kw) is True
        except Exception:  # noqa: BLE001
            ok = False
    if flags.any(not ok):
        res.status, res.message = DECLINED, ("supports() declined on this rank" if not ok else
                                             "supports() declined on another rank")
        return res.as_dict(), False
    ref = spec.reference(**kw)
    snap = _snapshot(kw)
    raised = None
    try:
        got = impl.fn(**kw)
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        raised = e
    if flags.any(raised is not None):
        if raised is not None:
            res.fail("raised", f"rank {rank}: the op raised {_exc(raised)}")
        else:
            res.fail("raised", f"another rank raised (rank {rank} completed the call)")
        res.seconds = time.perf_counter() - t0
        return res.as_dict(), True
    try:
        changed = _modified(kw, snap)
        if changed:
            raise Mismatch(f"rank {rank}: modified its input(s) {', '.join(changed)} in place", "modified input")
        exact = expected(spec.name, case.kwargs, rank)
        if not isinstance(got, torch.Tensor):
            raise Mismatch(f"rank {rank}: returned {type(got).__name__}, expected a torch.Tensor", "structure")
        compare.check_structure(f"rank {rank} output", got, ref)
        msg = compare.nonfinite_problem(f"rank {rank} output", got, exact)
        if msg:
            raise Mismatch(msg, "non-finite")
        res.checks.append(compare.tolerance_check(f"rank {rank} output", tol, floor, got, ref, exact))
        if not res.checks[-1].ok:
            res.fail("numeric", compare.describe_check(res.checks[-1], tol.k, floor))
    except Mismatch as e:
        res.fail(e.kind, str(e))
    res.seconds = time.perf_counter() - t0
    return res.as_dict(), False


def _worker(rank, world, init_file, plan, dtypes, seed, device, dist_backend, queue):
    import torch.distributed as dist

    torch.set_num_threads(1)
    results: list[dict] = []
    error = ""
    try:
        if torch.device(device).type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(dist_backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        flags = _Flags(dist.new_group(backend="gloo"))
        specs = catalogue()
        groups: dict = {}
        for _, part in _partitions(world):              # every rank creates every group, same order
            groups[part] = {b: dist.new_group(list(b)) for b in part.blocks}
        for backend_ref, ops in plan:
            be = resolve_backend(backend_ref, device)
            stop = False
            for op in ops:
                for dt in dtypes:
                    for case in cases(op, world, dt, seed):
                        if stop:
                            break
                        r, stop = _judge_rank(specs[op], be.impls[op], case, rank, groups, flags, device, dt)
                        r["backend_ref"] = backend_ref
                        results.append(r)
        dist.barrier(group=flags.group)
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - reported by the parent
        error = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"
    queue.put((rank, results, error))


def run_distributed(backend_ref: str, **kw) -> dict[str, list]:
    """Spawn each world size's ranks and check the backend's collectives; returns
    ``{op: [CaseResult, ...]}`` (case ids ``op[ws<N>-<dtype>-<case>]``; a case passes when it
    passed on every rank; a failure message names the rank). Keywords: see :func:`run_many`."""
    return run_many([backend_ref], **kw)[backend_ref]


def run_many(backend_refs, *, world_sizes=WORLD_SIZES, ops=None, dtypes=("float32", "bfloat16"),
             seed: int = 0, device: str = "cpu", dist_backend: str = "gloo", timeout: float = 180.0,
             progress: Callable[[str], None] | None = None) -> dict[str, dict[str, list]]:
    """:func:`run_distributed` for several backends, one after the other in the SAME spawned ranks
    (one start-up per world size): ``{backend_ref: {op: [CaseResult, ...]}}``."""
    import torch.multiprocessing as mp

    from .cases import parse_dtypes
    from .results import DECLINED, FAILED, PASSED, CaseResult, ConformanceError

    plan = []
    for ref in backend_refs:
        be = resolve_backend(ref, device)
        plan.append((ref, [o for o in (ops or OPS) if o in OPS and o in be.impls]))
    dts = parse_dtypes([d if isinstance(d, str) else dtype_name(d) for d in dtypes]
                       if not isinstance(dtypes, str) else dtypes)
    every: dict[str, dict[str, list]] = {ref: {o: [] for o in o_list} for ref, o_list in plan}
    if not any(o_list for _, o_list in plan):
        return every
    ctx = mp.get_context("spawn")
    for world in world_sizes:
        t0 = time.perf_counter()
        queue = ctx.Queue()
        with tempfile.TemporaryDirectory(prefix="dsv4core-dist-") as tmp:
            procs = [ctx.Process(target=_worker, daemon=True,
                                 args=(r, world, os.path.join(tmp, "rendezvous"), plan, dts, seed, device,
                                       dist_backend, queue)) for r in range(world)]
            for p in procs:
                p.start()
            per_rank: dict[int, tuple] = {}
            deadline = time.time() + timeout
            while len(per_rank) < world and time.time() < deadline:
                try:
                    rank, results, error = queue.get(timeout=1.0)
                    per_rank[rank] = (results, error)
                except Exception:  # noqa: BLE001 - queue.Empty: keep waiting unless every rank died
                    if not any(p.is_alive() for p in procs) and queue.empty():
                        break
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.terminate()
        errors = [f"rank {r}: {e}" for r, (_, e) in sorted(per_rank.items()) if e]
        for r, p in enumerate(procs):
            if r not in per_rank:
                errors.append(f"rank {r} exited with status {p.exitcode} without a result" if p.exitcode is not None
                              else f"rank {r} did not report within {timeout:.0f} s")
        if errors and not any(res for res, _ in per_rank.values()):
            raise ConformanceError(f"distributed collectives run with {world} ranks ({dist_backend}, {device}) "
                                   f"failed to start: " + "; ".join(errors))
        merged: dict[tuple, CaseResult] = {}
        for r in sorted(per_rank):
            for d in per_rank[r][0]:
                key = (d["backend_ref"], d["id"])
                c = merged.get(key)
                if c is None:
                    c = merged[key] = CaseResult(d["op"], d["dtype"], d["shapes"], d["case"], PASSED,
                                                 tuple(d["tags"]))
                if d["status"] == FAILED and c.status != FAILED:
                    c.status, c.failure, c.message = FAILED, d["failure"], d["message"]
                elif d["status"] == DECLINED and c.status == PASSED:
                    c.status, c.message = DECLINED, d["message"]
                c.seconds = max(c.seconds, d["seconds"])
                for ch in d["checks"]:
                    c.checks.append(Check(ch["what"], ch["metric"], ch["err"] or 0.0, ch["err_ref"] or 0.0,
                                          ch["bound"] or 0.0, ch["ok"], ch["detail"]))
        for (ref, _), c in merged.items():
            every[ref][c.op].append(c)
        if errors:
            for ref, o_list in plan:
                for o in o_list:
                    every[ref][o].append(CaseResult(o, "-", f"ws{world}", "<ranks>", FAILED, failure="harness",
                                                    message="; ".join(errors)[:2000]))
        if progress:
            n = len(merged)
            bad = sum(1 for c in merged.values() if c.status == FAILED)
            progress(f"collectives over {world} spawned ranks ({dist_backend}, {device}): {n} cases, {bad} failed "
                     f"({time.perf_counter() - t0:.1f}s)")
    return every
