"""The conformance runner: every op x dtype x case of a backend against the fp64 evaluation.

A case's outcome is one of

* ``passed``   every output component is within ``k * err_reference + floor`` of the fp64
               evaluation (metric per the op's Tolerance), every structural check holds;
* ``failed``   an output is out of bound, has the wrong type/shape/dtype/device, is NaN/Inf where the
               fp64 evaluation is finite, an input was modified in place, or the op raised;
* ``declined`` the backend's ``supports`` predicate said no. The binding hands such calls to the next
               backend (finally the reference), so a decline is safe but it is NOT a pass: it is
               counted separately, shown in every report, and fails the run under ``require_all``;
* ``not implemented`` (per op) the backend has no implementation of the op (strict mode: no
               fallback to the reference is ever taken by the runner).

Nothing here imports a backend's module other than through :func:`dsv4core.hal.discover`.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Callable, Sequence

import torch

from dsv4core.hal import Backend, catalogue, oracle
from dsv4core.hal.compare import dtype_name

from .cases import _exc, iter_cases, load_backend, parse_dtypes, parse_ops, parse_shapes, run_case
from .provenance import source_digests
from .results import DECLINED, FAILED, PASSED, CaseResult, ConformanceError, OpResult, OracleChanged, Report




# ---------------------------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------------------------

def run(backend: str | Backend, *, ops: str | Sequence[str] | None = None, shapes: str | Sequence[str] = "small",
        dtypes: str | Sequence[Any] = ("float32", "bfloat16"), device: str = "cpu", seed: int = 0,
        progress: Callable[[str], None] | None = None, world_sizes: Sequence[int] = (),
        dist_backend: str = "gloo", dist_device: str = "cpu", dist_ref: str | None = None,
        isolate: bool = False, jobs: int = 1) -> Report:
    """Run the op conformance suite for ``backend`` (a discovered backend name or a
    :class:`~dsv4core.hal.Backend` object, e.g. one built in a test) and return the Report.

    ``world_sizes`` (the CLI's default: 2, 4): also check the backend's collectives over that many
    spawned ranks (``dist_backend`` on ``dist_device``; see :mod:`.distributed`). The spawned
    ranks find the backend by name, or through ``dist_ref`` (``"module:function"``) for an
    in-process Backend. Without it the collectives are checked in one process only, which the
    report lists as a gap (not complete).

    ``isolate``: take the cases and their expected outputs from a process that loads no plugin
    (:mod:`.isolate`; its cost is described there).

    ``jobs`` > 1: run the (op, shape set) pieces in that many spawned worker processes, each loading
    the backend by name (``dist_ref``); the report is the one a single process writes, its cases in
    the same order. For a slow backend compile (Triton JIT) or a big case set; the workers share the
    device.

    Before judging and again after, the live oracle is compared with the installed files
    (:mod:`dsv4core.hal.oracle`): if a plugin (or anything else) changed it, the run raises
    :class:`OracleChanged` (a ConformanceError: exit code 2) instead of judging.

    Raises ConformanceError for an unknown/unloadable backend or bad arguments.
    """
    if isinstance(backend, Backend):
        be = backend
    else:
        be = load_backend(backend, device)
        dist_ref = dist_ref or backend
    op_names = parse_ops(ops)
    shape_sets = parse_shapes(shapes)
    dts = parse_dtypes([d if isinstance(d, str) else dtype_name(d) for d in dtypes] if not isinstance(dtypes, str)
                       else dtypes)
    try:
        torch.device(device)
    except Exception as e:
        raise ConformanceError(f"bad --device {device!r}: {e}") from None
    refusal = oracle.refusal()
    if refusal:
        raise OracleChanged(refusal)
    specs = catalogue()
    expected, oracle_digest = None, oracle.digest(oracle.expected())
    if jobs > 1 and (isolate or dist_ref is None):
        raise ConformanceError(f"jobs={jobs} needs a backend found by name (workers load it) and no isolate"
                               f" (got {'isolate' if isolate else 'an in-process Backend'})")
    if isolate:
        todo = [n for n in op_names if n in be.impls]
        child_digest, expected = _isolated(todo, shape_sets, dts, device, seed)
        if child_digest != oracle_digest:
            raise OracleChanged(f"the isolated oracle process has oracle digest {child_digest}, this process "
                                f"{oracle_digest} (refusing to judge)")
    report = Report(be.name, be.version, device, shape_sets, tuple(dtype_name(d) for d in dts), seed,
                    all_ops=set(op_names) == set(specs), sources=source_digests(be),
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    t_all = time.perf_counter()
    if jobs > 1:
        report.ops += _run_parallel(dist_ref, op_names, shape_sets, dts, device, seed, jobs, progress)
    else:
        for name in op_names:
            t0 = time.perf_counter()
            opres = _run_op(be, specs[name], shape_sets, dts, device, seed, expected)
            report.ops.append(opres)
            if progress:
                progress(_progress_line(opres, time.perf_counter() - t0))
    dist_ops = [o for o in report.ops if o.implemented and catalogue()[o.op].family == "collectives"]
    if dist_ops and world_sizes:
        if dist_ref is None:
            raise ConformanceError("world_sizes given for an in-process Backend: pass dist_ref='module:function' "
                                   "so the spawned ranks can build it")
        from .distributed import run_distributed

        found = run_distributed(dist_ref, world_sizes=tuple(world_sizes), ops=[o.op for o in dist_ops], dtypes=dts,
                                seed=seed, device=dist_device, dist_backend=dist_backend, progress=progress)
        for o in dist_ops:
            o.cases += found.get(o.op, [])
        report.world_sizes = tuple(world_sizes)
    elif dist_ops:
        report.single_process_collectives = [o.op for o in dist_ops]
    report.seconds = time.perf_counter() - t_all
    refusal = oracle.refusal(f"it changed while backend {be.name!r} ran")
    if refusal:
        raise OracleChanged(refusal)
    report.oracle = {"digest": oracle_digest, "isolated": bool(isolate)}
    return report


def _run_op(be, spec, shape_sets, dts, device, seed, expected=None, registration=True) -> OpResult:
    """Every case of one op under ``shape_sets`` x ``dts`` (``registration``: include the failed
    contract check of a rejected op; a parallel run's later pieces leave it to the first)."""
    name = spec.name
    impl = be.impls.get(name)
    rejected = None if impl is not None else getattr(be, "rejected", {}).get(name)
    opres = OpResult(name, impl is not None or rejected is not None, spec.tolerance)
    if rejected is not None and registration:   # registered, but its contract check failed: left out
        opres.cases.append(CaseResult(name, "-", "-", "<registration>", FAILED, message=rejected,
                                      failure="contract"))
    if impl is None:
        return opres
    for sh in shape_sets:
        for dt in dts:
            if expected is not None:
                opres.cases += _run_expected(spec, impl, expected[f"{name}/{sh}/{dtype_name(dt)}"], dt, sh)
                continue
            try:
                for case in iter_cases(spec, sh, dt, device, seed):
                    opres.cases.append(run_case(spec, impl, case, dt, sh))
            except Exception as e:  # the case generator itself failed
                opres.cases.append(CaseResult(name, dtype_name(dt), sh, "<generate cases>", FAILED,
                                              message=f"conformance harness error: {_exc(e)}", failure="harness"))
    return opres


_WORKER_BACKEND: dict[tuple[str, str], Backend] = {}


def _job(backend: str, name: str, shape: str, dts, device: str, seed: int, first: bool):
    """One (op, shape set) piece in a worker process: (implemented, cases), seconds, an oracle refusal."""
    key = (backend, device)
    if key not in _WORKER_BACKEND:
        _WORKER_BACKEND[key] = load_backend(backend, device)
    t0 = time.perf_counter()
    res = _run_op(_WORKER_BACKEND[key], catalogue()[name], (shape,), dts, device, seed, registration=first)
    return (res.implemented, res.cases), time.perf_counter() - t0, oracle.refusal(f"it changed in a worker running {name}")


def _run_parallel(backend, op_names, shape_sets, dts, device, seed, jobs, progress) -> list[OpResult]:
    """The ops' pieces over ``jobs`` spawned processes; results merged per op in shape order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed
    from concurrent.futures.process import BrokenProcessPool

    # the larger shape sets first: their pieces are the long ones, started while the rest fill in
    pieces = {(n, sh): None for sh in reversed(shape_sets) for n in op_names}
    secs = dict.fromkeys(op_names, 0.0)
    done: list[OpResult] = []
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"))
    try:
        futs = {pool.submit(_job, backend, n, sh, dts, device, seed, sh == shape_sets[0]): (n, sh) for n, sh in pieces}
        left = {n: len(shape_sets) for n in op_names}
        for fut in as_completed(futs):
            n, sh = futs[fut]
            try:
                res, s, refusal = fut.result()
            except BrokenProcessPool as e:
                raise ConformanceError(f"a conformance worker died while running {n} at shapes {sh} "
                                       f"(a crash in the backend, or out of memory): {e}") from None
            if refusal:
                raise OracleChanged(refusal)
            pieces[(n, sh)], left[n] = res, left[n] - 1
            secs[n] += s
            if left[n] == 0:
                parts = [pieces[(n, x)] for x in shape_sets]
                op = OpResult(n, parts[0][0], catalogue()[n].tolerance, [c for p in parts for c in p[1]])
                done.append(op)
                if progress:
                    progress(_progress_line(op, secs[n]))
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)   # an error ends the run now, not after the queue
        raise
    pool.shutdown()
    order = {n: i for i, n in enumerate(op_names)}
    return sorted(done, key=lambda o: order[o.op])


def _isolated(op_names, shape_sets, dts, device, seed):
    from .isolate import expected_cases

    return expected_cases(op_names, shape_sets, [dtype_name(d) for d in dts], device, seed)


def _run_expected(spec, impl, entries, dt, sh) -> list[CaseResult]:
    """The cases of one (op, shapes, dtype) judged against the isolated oracle's outputs."""
    if isinstance(entries, str):
        return [CaseResult(spec.name, dtype_name(dt), sh, "<generate cases>", FAILED,
                           message=f"conformance harness error: {entries}", failure="harness")]
    out = []
    for case, exp, err in entries:
        if exp is None:
            out.append(CaseResult(spec.name, dtype_name(dt), sh, case.name, FAILED, tuple(case.tags), failure="harness",
                                  message=f"conformance harness error (isolated oracle): {err}"))
        else:
            out.append(run_case(spec, impl, case, dt, sh, expected=exp))
    return out


def _progress_line(o: OpResult, secs: float) -> str:
    if not o.implemented:
        return f"{o.op:<22} not implemented"
    worst = "" if o.worst == "-" else f"  worst err/bound {o.worst}"
    s = (f"{o.op:<22} {o.status.upper():<8} {o.count(PASSED)} passed, {o.count(FAILED)} failed, "
         f"{o.count(DECLINED)} declined{worst}  ({secs:.1f}s)")
    for c in o.cases:
        if c.status == FAILED:
            s += f"\n    FAIL {c.id}: {c.message}"
    return s
