"""pytest entry for the conformance suite (JUnit natively, one test item per op x case).

    pytest --pyargs dsv4core.conformance --dsv4core-backend NAME [--junitxml report.xml]

This module adds the ``--dsv4core-*`` options. It is registered as a ``pytest11`` entry point of
the dsv4core distribution; without that entry point load it explicitly with
``-p dsv4core.conformance.pytest_plugin`` (or set ``DSV4CORE_CONFORMANCE_BACKEND=NAME`` and skip
the options altogether).
"""

from __future__ import annotations

import os

ENV = "DSV4CORE_CONFORMANCE_BACKEND"


def pytest_addoption(parser):
    g = parser.getgroup("dsv4core", "dsv4core conformance suite (pytest --pyargs dsv4core.conformance)")
    g.addoption("--dsv4core-backend", default=None,
                help=f"backend to check (default: ${ENV}; required to run the suite)")
    g.addoption("--dsv4core-ops", default=None, help="comma-separated op or family names (default: all)")
    g.addoption("--dsv4core-shapes", default="small", help="small, flash, pro or all (default: small)")
    g.addoption("--dsv4core-dtype", default="float32,bfloat16", help="activation dtypes (default: float32,bfloat16)")
    g.addoption("--dsv4core-device", default="cpu", help="torch device (default: cpu)")
    g.addoption("--dsv4core-seed", default=0, type=int, help="case seed (default: 0)")
    g.addoption("--dsv4core-model", default="tiny", help="model for the model-level check: tiny or a checkpoint dir")
    g.addoption("--dsv4core-no-model", action="store_true", help="skip the model-level check")
    g.addoption("--dsv4core-world-sizes", default="2,4",
                help="spawned ranks for the collectives (default 2,4; 'none' = one process only)")
    g.addoption("--dsv4core-dist-backend", default="gloo", help="torch.distributed backend of those ranks")
    g.addoption("--dsv4core-dist-device", default="cpu", help="device of the collectives' inputs there")


def settings(config) -> dict:
    """The suite settings from the options (or their defaults / the env var when the plugin is not loaded)."""
    def opt(name, default):
        try:
            v = config.getoption(name)
        except ValueError:
            return default
        return default if v is None else v

    return dict(backend=opt("dsv4core_backend", None) or os.environ.get(ENV),
                ops=opt("dsv4core_ops", None), shapes=opt("dsv4core_shapes", "small"),
                dtypes=opt("dsv4core_dtype", "float32,bfloat16"), device=opt("dsv4core_device", "cpu"),
                seed=int(opt("dsv4core_seed", 0)), model=opt("dsv4core_model", "tiny"),
                no_model=bool(opt("dsv4core_no_model", False)), world_sizes=opt("dsv4core_world_sizes", "2,4"),
                dist_backend=opt("dsv4core_dist_backend", "gloo"), dist_device=opt("dsv4core_dist_device", "cpu"))
