"""What a conformance run produces: case / op results, the run's report, its statuses and exit
codes (the data; :mod:`.runner` fills it)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv4core.hal import compare
from dsv4core.hal.compare import Check

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


class OracleChanged(ConformanceError):
    """The live oracle (references, tolerances, checks, cases, comparison code, the torch
    functions they call) differs from the installed files: the run refuses to judge (exit code 2)."""


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
    #: the oracle judged with: {"digest": dsv4core.hal.oracle digest of the installed files (the
    #: live oracle matched it before and after the run), "isolated": whether the expected outputs
    #: came from a process that loaded no plugin}
    oracle: dict = field(default_factory=dict)

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
                "date": self.date, "sources": self.sources, "oracle": self.oracle,
                "failed": self.failed, "complete": self.complete, "verified": self.verified,
                "all_ops": self.all_ops, "require_all": self.require_all, "world_sizes": list(self.world_sizes), "verdict": self.verdict(),
                "exit_code": self.exit_code(), "seconds": round(self.seconds, 2),
                "summary": {o.op: {"status": o.status, "passed": o.count(PASSED), "failed": o.count(FAILED),
                                   "declined": o.count(DECLINED)} for o in self.ops},
                "model": self.model, "ops": [o.as_dict() for o in self.ops]}

