"""Imports run downward (HELPERS / DESIGN: commands -> conformance / model / checkpoint -> hal):
every import statement of the package, at module level or inside a function, read from the
source (ast), so a lazy upward import is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dsv4core

ROOT = Path(dsv4core.__file__).parent
#: package -> the dsv4core subpackages / modules it must not import
FORBIDDEN = {
    "hal": ("checkpoint", "model", "conformance", "commands", "cli", "bench"),
    "checkpoint": ("model", "conformance", "commands", "cli"),
    "model": ("conformance", "commands", "cli"),
    "conformance": ("commands", "cli"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in the file."""
    pkg = ".".join(("dsv4core",) + path.relative_to(ROOT).parent.parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return out


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_imports_run_downward(layer):
    bad = []
    for path in sorted((ROOT / layer).rglob("*.py")):
        for line, name in _imports(path):
            parts = name.split(".")
            if parts[0] == "dsv4core" and len(parts) > 1 and parts[1] in FORBIDDEN[layer]:
                bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {name}")
    assert not bad, f"dsv4core.{layer} imports a layer above it:\n" + "\n".join(sorted(set(bad)))


def test_the_checker_sees_relative_and_lazy_imports(tmp_path, monkeypatch):
    mod = ROOT / "hal" / "ops" / "projections.py"
    names = {n for _, n in _imports(mod)}
    assert "dsv4core.hal.quant.quantize_fp8_block" in names and "dsv4core.hal.spec" in names
    src = ROOT / "conformance" / "distributed.py"
    assert "dsv4core.conformance.cases.mix_seed" in {n for _, n in _imports(src)}   # inside a function
