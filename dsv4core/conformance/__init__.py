"""dsv4core's conformance suite: proves (or refutes) a backend's numerical parity with the HAL spec.

Command line: ``dsv4core conformance --backend NAME`` (see ``docs/conformance.md``).
pytest (JUnit natively): ``pytest --pyargs dsv4core.conformance --dsv4core-backend NAME``.
Python::

    from dsv4core.conformance import run
    report = run("mybackend", shapes="small")        # or run(Backend(...)) for an in-process backend
    report.exit_code(), report.as_dict()
"""

__all__ = ["run", "run_case", "iter_cases", "load_backend", "parse_ops", "parse_shapes", "parse_dtypes", "Report",
           "OpResult", "CaseResult", "ConformanceError", "OracleChanged", "SHAPE_SETS", "PASSED", "FAILED", "DECLINED",
           "NOT_IMPLEMENTED", "EXIT_PASSED", "EXIT_FAILED", "EXIT_USAGE", "EXIT_NOTHING_VERIFIED",
           "parse_world_sizes"]

#: the module each public name lives in (imported on first use)
_HOME = {"run": "runner", **{n: "cases" for n in ("run_case", "iter_cases", "load_backend", "parse_ops", "parse_shapes",
                                                  "parse_dtypes", "parse_world_sizes", "SHAPE_SETS")},
         **{n: "results" for n in ("Report", "OpResult", "CaseResult", "ConformanceError", "OracleChanged", "PASSED", "FAILED",
                                   "DECLINED", "NOT_IMPLEMENTED", "EXIT_PASSED", "EXIT_FAILED", "EXIT_USAGE",
                                   "EXIT_NOTHING_VERIFIED")}}


def __getattr__(name):
    # Lazy: the pytest11 entry point imports this package in every pytest run of an environment
    # with dsv4core installed, so it must not import torch until the suite is actually used.
    if name in __all__:
        from importlib import import_module

        return getattr(import_module(f".{_HOME[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
