"""dsv4core's conformance suite: proves (or refutes) a backend's numerical parity with the HAL spec.

Command line: ``dsv4core conformance --backend NAME`` (see ``docs/conformance.md``).
pytest (JUnit natively): ``pytest --pyargs dsv4core.conformance --dsv4core-backend NAME``.
Python::

    from dsv4core.conformance import run
    report = run("mybackend", shapes="small")        # or run(Backend(...)) for an in-process backend
    report.exit_code(), report.as_dict()
"""

from .runner import (DECLINED, FAILED, NOT_IMPLEMENTED, PASSED, SHAPE_SETS, CaseResult, ConformanceError, OpResult,
                     Report, iter_cases, load_backend, parse_dtypes, parse_ops, parse_shapes, run, run_case)

__all__ = ["run", "run_case", "iter_cases", "load_backend", "parse_ops", "parse_shapes", "parse_dtypes", "Report",
           "OpResult", "CaseResult", "ConformanceError", "SHAPE_SETS", "PASSED", "FAILED", "DECLINED",
           "NOT_IMPLEMENTED"]
