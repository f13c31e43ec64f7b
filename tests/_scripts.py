"""The scripts under benchmarks/ as modules, for tests that call their functions."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str, module_name: str | None = None):
    """benchmarks/<name>.py, executed as a fresh module (``module_name``, default ``name``)."""
    spec = importlib.util.spec_from_file_location(module_name or name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
