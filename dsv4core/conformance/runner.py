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
import hashlib
import math
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from dsv4core.hal import Backend, catalogue, discover
from dsv4core.hal.backend import Impl
from dsv4core.hal.spec import Case, OpSpec

from . import compare
from .compare import Check, Mismatch, dtype_name

SHAPE_SETS = ("small", "flash", "pro")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

PASSED, FAILED, DECLINED, NOT_IMPLEMENTED = "passed", "failed", "declined", "not implemented"
#: An implemented op none of whose cases apply to this run (e.g. fp32-only inputs under --dtype
#: bfloat16): nothing was checked, so it is not reported as passed.
NO_CASES = "no cases"


#: Exit codes of a run (``Report.exit_code``; the CLI's exit status).
EXIT_PASSED, EXIT_FAILED, EXIT_USAGE, EXIT_NOTHING_VERIFIED = 0, 1, 2, 3

#: ``CaseResult.failure`` values: why a failed case failed. ``numeric`` failures have an
#: err/bound ratio; the others have none (their ``message`` says what was wrong).
FAILURE_KINDS = ("numeric", "discrete", "structure", "dtype", "shape", "device", "non-finite",
                 "modified input", "raised", "supports", "harness", "contract")

#: The JSON report's schema (docs/conformance.md, "JSON report"); ``merge`` refuses other versions.
REPORT_SCHEMA, REPORT_SCHEMA_VERSION = "dsv4core.conformance.report", 2


class ConformanceError(Exception):
    """Bad arguments or a backend that cannot be loaded (exit code 2)."""


@dataclass
class CaseResult:
    op: str
    dtype: str
    shapes: str
    case: str
    status: str
    tags: tuple[str, ...] = ()
    checks: list[Check] = field(default_factory=list)
    message: str = ""
    seconds: float = 0.0
    failure: str = ""           # one of FAILURE_KINDS when status is failed

    @property
    def id(self) -> str:
        return f"{self.op}[{self.shapes}-{self.dtype}-{self.case}]"

    @property
    def worst(self) -> Check | None:
        return max(self.checks, key=lambda c: c.ratio, default=None)

    def fail(self, kind: str, message: str) -> "CaseResult":
        self.status, self.failure, self.message = FAILED, kind, message
        return self

    def as_dict(self) -> dict:
        w = self.worst
        return {"id": self.id, "op": self.op, "dtype": self.dtype, "shapes": self.shapes, "case": self.case,
                "tags": list(self.tags), "status": self.status, "failure": self.failure or None,
                "message": self.message, "seconds": round(self.seconds, 4),
                "worst_ratio": None if w is None else compare._num(w.ratio),
                "checks": [c.as_dict() for c in self.checks]}


@dataclass
class OpResult:
    op: str
    implemented: bool
    tolerance: Any
    cases: list[CaseResult] = field(default_factory=list)

    def count(self, status: str) -> int:
        return sum(1 for c in self.cases if c.status == status)

    @property
    def status(self) -> str:
        if not self.implemented:
            return NOT_IMPLEMENTED
        if not self.cases:
            return NO_CASES
        if self.count(FAILED):
            return FAILED
        if self.count(DECLINED) == len(self.cases):
            return DECLINED
        return PASSED

    @property
    def worst_ratio(self) -> float | None:
        ratios = [c.worst.ratio for c in self.cases if c.worst is not None]
        return max(ratios) if ratios else None

    @property
    def failure_kinds(self) -> list[str]:
        """The kinds of this op's failures that carry no err/bound ratio (a wrong dtype, an
        input modified in place, an exception...), in first-seen order."""
        return list(dict.fromkeys(c.failure for c in self.cases
                                  if c.status == FAILED and c.failure not in ("", "numeric")))

    @property
    def worst(self) -> str:
        """What the report's 'worst err/bound' column shows: the ratio, or the reason of a failure
        that has no ratio ('-' when nothing was measured)."""
        kinds = self.failure_kinds
        if kinds:
            return "failed: " + ", ".join(kinds)
        wr = self.worst_ratio
        return "-" if wr is None else ("inf" if not math.isfinite(wr) else f"{wr:.3g}")

    def as_dict(self) -> dict:
        t = self.tolerance
        wr = self.worst_ratio
        return {"op": self.op, "status": self.status, "implemented": self.implemented,
                "passed": self.count(PASSED), "failed": self.count(FAILED), "declined": self.count(DECLINED),
                "worst_ratio": None if wr is None else compare._num(wr), "failure_kinds": self.failure_kinds,
                "tolerance": {"k": t.k, "floor": t.floor, "floors": dict(t.floors),
                              "metric": t.metric, "why": t.why},
                "cases": [c.as_dict() for c in self.cases]}


@dataclass
class Report:
    backend: str
    backend_version: str
    device: str
    shapes: tuple[str, ...]
    dtypes: tuple[str, ...]
    seed: int
    ops: list[OpResult] = field(default_factory=list)
    model: dict | None = None
    seconds: float = 0.0
    #: ops of the catalogue this run selected (``--ops``); all of them by default
    all_ops: bool = True
    #: when the run started (UTC, ISO 8601)
    date: str = ""
    #: judge completeness (``--require-all``): an incomplete run fails
    require_all: bool = False
    #: world sizes the collectives were checked with over spawned ranks (() = not)
    world_sizes: tuple[int, ...] = ()
    #: implemented collectives checked in one process only (identities: a gap)
    single_process_collectives: list[str] = field(default_factory=list)
    #: which code ran: a digest of the Python sources of each package involved (source_digests)
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return any(o.status == FAILED for o in self.ops) or bool(self.model and self.model.get("status") == FAILED)

    @property
    def verified(self) -> int:
        """Cases that ran to a verdict of passed (0: the run proved nothing)."""
        return sum(o.count(PASSED) for o in self.ops)

    @property
    def complete(self) -> bool:
        """Every SELECTED op implemented and checked, no case declined, and (when the model check
        ran) no model-check call handed to the reference: what ``--require-all`` requires."""
        return not self.gaps()

    def gaps(self) -> list[str]:
        """Why the run is not complete, one phrase per reason ([] when complete)."""
        out = []
        missing = [o.op for o in self.ops if not o.implemented]
        if missing:
            out.append(f"{len(missing)} op(s) not implemented ({', '.join(missing)})")
        empty = [o.op for o in self.ops if o.implemented and not o.cases]
        if empty:
            out.append(f"{len(empty)} op(s) with no case in this run ({', '.join(empty)})")
        n_dec = sum(o.count(DECLINED) for o in self.ops)
        if n_dec:
            out.append(f"{n_dec} case(s) declined")
        if self.single_process_collectives:
            out.append(f"collectives checked in one process only ({', '.join(self.single_process_collectives)}; "
                       f"--world-sizes spawns real ranks)")
        fb = (self.model or {}).get("fallbacks") or {}
        if fb:
            out.append(f"model check: {sum(fb.values())} call(s) served by the reference "
                       f"({', '.join(f'{k} {v}' for k, v in fb.items())})")
        return out

    def exit_code(self, require_all: bool | None = None) -> int:
        """0 passed; 1 a case (or the model check) failed, or ``require_all`` and the run is not
        complete; 3 nothing was verified (every selected op not implemented / declined)."""
        require_all = self.require_all if require_all is None else require_all
        if self.failed:
            return EXIT_FAILED
        if not self.verified:
            return EXIT_NOTHING_VERIFIED
        return EXIT_FAILED if require_all and not self.complete else EXIT_PASSED

    def verdict(self, require_all: bool | None = None) -> str:
        """The one-line result, consistent with :meth:`exit_code`."""
        require_all = self.require_all if require_all is None else require_all
        scope = "every op" if self.all_ops else f"the {len(self.ops)} selected op(s)"
        if self.failed:
            n = len(self.failures())
            return f"FAILED ({n} failing case(s)" + (", model check failed)" if (self.model or {}).get(
                "status") == FAILED else ")")
        if not self.verified:
            return ("NOTHING VERIFIED: no case passed (" + "; ".join(self.gaps() or ["no cases"]) +
                    f"); exit status {EXIT_NOTHING_VERIFIED}")
        if self.complete:
            return f"PASSED (complete for {scope}: implemented, nothing declined)"
        if require_all:
            return "INCOMPLETE under --require-all: " + "; ".join(self.gaps())
        return (f"PASSED for the implemented ops ({self.verified} case(s) verified); partial: "
                + "; ".join(self.gaps()))

    def failures(self) -> list[CaseResult]:
        return [c for o in self.ops for c in o.cases if c.status == FAILED]

    def as_dict(self) -> dict:
        import dsv4core

        return {"schema": REPORT_SCHEMA, "schema_version": REPORT_SCHEMA_VERSION,
                "backend": self.backend, "backend_version": self.backend_version, "device": self.device,
                "shapes": list(self.shapes), "dtypes": list(self.dtypes), "seed": self.seed,
                "dsv4core_version": dsv4core.__version__, "torch_version": torch.__version__,
                "date": self.date, "sources": self.sources,
                "failed": self.failed, "complete": self.complete, "verified": self.verified,
                "all_ops": self.all_ops, "require_all": self.require_all, "world_sizes": list(self.world_sizes), "verdict": self.verdict(),
                "exit_code": self.exit_code(), "seconds": round(self.seconds, 2),
                "summary": {o.op: {"status": o.status, "passed": o.count(PASSED), "failed": o.count(FAILED),
                                   "declined": o.count(DECLINED)} for o in self.ops},
                "model": self.model, "ops": [o.as_dict() for o in self.ops]}


def tree_digest(root) -> str:
    """sha256 (first 16 hex digits) over the ``*.py`` files under ``root`` (a folder; or one file):
    their paths relative to it and their bytes, in path order. Identifies the code a report
    verified where no git checkout is at hand (an installed package on a lent GPU machine)."""
    root = Path(root)
    files = [root] if root.is_file() else sorted(root.rglob("*.py"))
    h = hashlib.sha256()
    for f in files:
        rel = f.name if f == root else f.relative_to(root).as_posix()
        h.update(rel.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _source_root(name: str):
    """The folder of package ``name`` (its first search location), the file of a plain module, or
    None (not imported, or no file: a namespace package, a module built in memory)."""
    mod = sys.modules.get(name)
    spec = getattr(mod, "__spec__", None)
    locations = list(getattr(spec, "submodule_search_locations", None) or ())
    if locations:
        return Path(locations[0])
    f = getattr(mod, "__file__", None)
    return Path(f) if f else None


def source_digests(backend: Backend) -> dict[str, str]:
    """{package: tree_digest} for dsv4core, the package whose entry point made ``backend`` (a
    plugin: its launch tables) and each top-level package or module holding one of its op
    implementations; a package whose sources cannot be read gets the reason instead of a digest
    (``__main__``, a script's backend, is left out)."""
    st = discover().get(backend.name)           # a plugin's source: "<distribution> (<module>[:attr])"
    entry = st.source.rpartition("(")[2].rstrip(")") if st is not None and "(" in st.source else ""
    names = ["dsv4core"]
    for mod_name in (entry, *(getattr(impl.fn, "__module__", None) or "" for impl in backend.impls.values())):
        top = mod_name.split(":")[0].split(".")[0]
        if top and top != "__main__" and top not in names:
            names.append(top)
    out = {}
    for name in names:
        root = _source_root(name)
        try:
            out[name] = tree_digest(root) if root is not None else "unknown (no source file)"
        except OSError as e:
            out[name] = f"unknown ({type(e).__name__}: {e})"
    return dict(sorted(out.items()))


def format_sources(sources: dict) -> str:
    """A report's ``sources`` as one line: "package digest, ..." ("" when there are none)."""
    return ", ".join(f"{k} {v}" for k, v in (sources or {}).items())


# ---------------------------------------------------------------------------------------------
# Argument parsing helpers (shared by the CLI and the pytest plugin)
# ---------------------------------------------------------------------------------------------

def load_backend(name: str, device: str = "cpu") -> Backend:
    """The discovered backend ``name``; ConformanceError if unknown, broken, unavailable or not
    serving ``device``'s type."""
    statuses = discover()
    st = statuses.get(name)
    if st is None:
        raise ConformanceError(f"unknown backend {name!r}; installed: {', '.join(sorted(statuses))}")
    if st.backend is None or not st.available:
        cause = f" ({type(st.error).__name__}: {st.error})" if st.error is not None and str(st.error) not in st.reason else ""
        raise ConformanceError(f"backend {name!r} cannot be loaded: {st.reason or 'unavailable'}{cause}")
    dev_type = torch.device(device).type
    if not st.backend.serves(dev_type):
        raise ConformanceError(f"backend {name!r} does not serve device type {dev_type!r} "
                               f"(it serves {', '.join(st.backend.device_types)})")
    return st.backend


def parse_ops(text: str | Sequence[str] | None) -> list[str]:
    specs = catalogue()
    if text is None:
        return list(specs)
    names = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    families = {}
    for s in specs.values():
        families.setdefault(s.family, []).append(s.name)
    out: list[str] = []
    for n in names:
        if n in specs:
            out.append(n)
        elif n in families:
            out.extend(families[n])
        else:
            raise ConformanceError(f"unknown op {n!r}; ops: {', '.join(specs)}; families: {', '.join(families)}")
    if not out:
        raise ConformanceError("--ops selected no op")
    return list(dict.fromkeys(out))


def parse_shapes(text: str | Sequence[str]) -> tuple[str, ...]:
    items = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    out: list[str] = []
    for s in items:
        if s == "all":
            out.extend(SHAPE_SETS)
        elif s in SHAPE_SETS:
            out.append(s)
        else:
            raise ConformanceError(f"unknown shape set {s!r}; expected small, flash, pro or all")
    return tuple(dict.fromkeys(out))


def parse_dtypes(text: str | Sequence[str]) -> tuple[torch.dtype, ...]:
    items = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    out = []
    for s in items:
        key = s.replace("torch.", "")
        key = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16"}.get(key, key)
        if key not in DTYPES:
            raise ConformanceError(f"unsupported dtype {s!r}; expected {' or '.join(DTYPES)}")
        out.append(DTYPES[key])
    if not out:
        raise ConformanceError("no dtype given")
    return tuple(dict.fromkeys(out))


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``"2,4"`` -> (2, 4); ``"none"`` / ``"0"`` -> () (collectives in one process only)."""
    if text.strip().lower() in ("none", "0", ""):
        return ()
    try:
        sizes = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise ConformanceError(f"--world-sizes: expected comma-separated ints >= 2 or 'none', got {text!r}") from None
    if any(n < 2 for n in sizes):
        raise ConformanceError(f"--world-sizes: every size must be >= 2 (got {text!r}); 'none' disables the spawned run")
    return sizes


def mix_seed(seed: int, *parts) -> int:
    """A generator seed derived from the suite's ``seed`` and the ``parts`` naming what it draws
    (joined with "/"): reproducible, and different for different parts."""
    return (seed * 1_000_003 + zlib.crc32("/".join(map(str, parts)).encode())) % (2 ** 63)


def case_seed(seed: int, op: str, shapes: str, dtype: torch.dtype) -> int:
    """The generator seed of one (op, shape set, dtype) case list: reproducible from ``seed``."""
    return mix_seed(seed, op, shapes, dtype_name(dtype))


def iter_cases(spec: OpSpec, shapes: str, dtype: torch.dtype, device: str, seed: int) -> Iterator[Case]:
    """The op's cases for one shape set and dtype. Cases with no tensor of ``dtype`` (ops whose
    inputs are float32 by contract, e.g. moe_route) are only run under float32."""
    for case in spec.sample_cases(shapes, dtype, device, case_seed(seed, spec.name, shapes, dtype)):
        if dtype != torch.float32:
            has = any(isinstance(v, torch.Tensor) and v.dtype == dtype for v in case.kwargs.values())
            if not has:
                continue
        yield case


# ---------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------

def _floor(tol, dtype: torch.dtype) -> float:
    return tol.floor_for(dtype)


def _snapshot(kwargs: dict) -> dict:
    return {k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (bitwise comparison: NaN == NaN, works for fp8 / e8m0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _modified(kwargs: dict, snap: dict) -> list[str]:
    bad = []
    for k, before in snap.items():
        now = kwargs[k]
        if now.shape != before.shape or now.dtype != before.dtype or not torch.equal(_bits(now), _bits(before)):
            bad.append(k)
    return bad


def _exc(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:500]}{where}"


def run_case(spec: OpSpec, impl: Impl, case: Case, dtype: torch.dtype, shapes: str = "") -> CaseResult:
    """Run one case of one op implementation and judge it."""
    res = CaseResult(spec.name, dtype_name(dtype), shapes, case.name, PASSED, tuple(case.tags))
    kw = case.kwargs
    tol = spec.tolerance
    floor = _floor(tol, dtype)
    t0 = time.perf_counter()
    try:
        # 1. the case must be valid input (else the suite itself is wrong)
        try:
            spec.validate(**kw)
        except Exception as e:  # pragma: no cover - a suite bug
            return res.fail("harness", f"invalid conformance case (suite bug, please report): {_exc(e)}")
        # 2. supports predicate
        if impl.supports is not None:
            try:
                ok = impl.supports(**kw)
            except Exception as e:
                return res.fail("supports", f"supports() raised {_exc(e)}")
            if not isinstance(ok, bool):
                return res.fail("supports", f"supports() must return a plain bool, returned {type(ok).__name__}")
            if not ok:
                reason = ""
                if impl.why_not is not None:
                    try:
                        reason = impl.why_not(**kw)
                    except Exception as e:
                        reason = f"why_not() raised {_exc(e)}"
                    if not isinstance(reason, str):
                        return res.fail("supports", f"why_not() must return a str (the reason), returned "
                                                    f"{type(reason).__name__} {reason!r}")
                res.status, res.message = DECLINED, reason or "supports() returned False"
                return res
        # 3. the reference in the case dtype and the fp64 evaluation (an op that writes in place:
        #    each runs on copies of the written arguments, and what those hold after is the output)
        ref, exact = compare.expected_outputs(spec, kw)
        # 4. the backend (on its own copies of the written arguments; nothing else may change)
        call_kw = compare.with_copies(spec, kw)
        snap = _snapshot({k: v for k, v in call_kw.items() if k not in spec.writes})
        try:
            raw = impl.fn(**call_kw)
            if torch.device(compare.device_of(kw)).type == "cuda":
                torch.cuda.synchronize()          # asynchronous kernel errors belong to this case
        except Exception as e:
            return res.fail("raised", f"the op raised {_exc(e)}")
        changed = _modified(call_kw, snap)
        if changed:
            return res.fail("modified input", f"modified its input(s) {', '.join(changed)} in place")
        if spec.writes:
            if raw is not None:
                return res.fail("structure", f"returned {type(raw).__name__}; an op that writes "
                                             f"{', '.join(spec.writes)} in place returns None")
            raw = compare.written_values(spec, call_kw)
        # 5. structure and numbers
        res.checks += compare.judge(spec, call_kw, raw, ref, exact, dtype)
        bad = [c for c in res.checks if not c.ok]
        if bad:
            discrete = all(c.metric.startswith(("index_set", "route", "exact")) for c in bad)
            res.fail("discrete" if discrete else "numeric", "; ".join(compare.describe_check(c, tol.k, floor) for c in bad))
    except Mismatch as e:
        res.fail(e.kind, str(e))
    except Exception as e:  # a failure of the fp64/reference evaluation on a legal case: suite bug
        res.fail("harness", f"conformance harness error (please report): {_exc(e)}")
    finally:
        res.seconds = time.perf_counter() - t0
    return res


# ---------------------------------------------------------------------------------------------
# Whole runs
# ---------------------------------------------------------------------------------------------

def run(backend: str | Backend, *, ops: str | Sequence[str] | None = None, shapes: str | Sequence[str] = "small",
        dtypes: str | Sequence[Any] = ("float32", "bfloat16"), device: str = "cpu", seed: int = 0,
        progress: Callable[[str], None] | None = None, world_sizes: Sequence[int] = (),
        dist_backend: str = "gloo", dist_device: str = "cpu", dist_ref: str | None = None) -> Report:
    """Run the op conformance suite for ``backend`` (a discovered backend name or a
    :class:`~dsv4core.hal.Backend` object, e.g. one built in a test) and return the Report.

    ``world_sizes`` (the CLI's default: 2, 4): also check the backend's collectives over that many
    spawned ranks (``dist_backend`` on ``dist_device``; see :mod:`.distributed`). The spawned
    ranks find the backend by name, or through ``dist_ref`` (``"module:function"``) for an
    in-process Backend. Without it the collectives are checked in one process only, which the
    report lists as a gap (not complete).

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
    specs = catalogue()
    report = Report(be.name, be.version, device, shape_sets, tuple(dtype_name(d) for d in dts), seed,
                    all_ops=set(op_names) == set(specs), sources=source_digests(be),
                    date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    t_all = time.perf_counter()
    for name in op_names:
        spec = specs[name]
        impl = be.impls.get(name)
        rejected = None if impl is not None else getattr(be, "rejected", {}).get(name)
        opres = OpResult(name, impl is not None or rejected is not None, spec.tolerance)
        report.ops.append(opres)
        t0 = time.perf_counter()
        if rejected is not None:   # registered, but its contract check failed: the op was left out
            opres.cases.append(CaseResult(name, "-", "-", "<registration>", FAILED, message=rejected,
                                          failure="contract"))
        if impl is not None:
            for sh in shape_sets:
                for dt in dts:
                    try:
                        cases = iter_cases(spec, sh, dt, device, seed)
                        for case in cases:
                            opres.cases.append(run_case(spec, impl, case, dt, sh))
                    except Exception as e:  # the case generator itself failed
                        opres.cases.append(CaseResult(name, dtype_name(dt), sh, "<generate cases>", FAILED,
                                                      message=f"conformance harness error: {_exc(e)}",
                                                      failure="harness"))
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
    return report


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
