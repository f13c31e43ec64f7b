"""Imports run downward (DESIGN: commands -> conformance / model / checkpoint -> hal; engines ->
model; kernels -> hal; plugins -> the public HAL API and the kernels), with no import cycle: every import statement
of the package and of the plugins, at module level or inside a function, read from the source
(ast), so a lazy upward import is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dsv4core

ROOT = Path(dsv4core.__file__).parent
#: package -> the dsv4core subpackages / modules it must not import
FORBIDDEN = {
    "hal": ("checkpoint", "model", "conformance", "commands", "cli", "bench", "kernels", "engines"),
    "checkpoint": ("model", "conformance", "commands", "cli", "kernels", "engines"),
    "model": ("conformance", "commands", "cli", "kernels", "engines"),    # the model names no backend, no engine
    "conformance": ("commands", "cli", "engines"),
    # an engine adapter sits above the model (and names no backend)
    "engines": ("conformance", "commands", "cli", "kernels", "bench"),
    # a backend's kernels: the HAL and themselves only (never the model, the checkpoint, the suite)
    "kernels": ("checkpoint", "model", "conformance", "commands", "cli", "bench", "engines"),
}
#: what a vendor plugin (plugins/<vendor>/dsv4core_<vendor>/) may import of dsv4core: the public
#: HAL API and the shared kernels (a backend never imports the model)
PLUGIN_ALLOWED = ("hal", "kernels")
PLUGINS = ROOT.parent / "plugins"
#: import cycles accepted among dsv4core modules, each with why (none)
KNOWN_CYCLES: list[set[str]] = []


def _imports(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in the file (``root``: the folder of the top
    package the file belongs to)."""
    pkg = ".".join((root.name,) + path.relative_to(root).parent.parts)
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


def _plugin_packages() -> list[Path]:
    return sorted(p for p in PLUGINS.glob("*/dsv4core_*") if (p / "__init__.py").is_file())


def test_there_are_plugins_to_check():
    assert {p.name for p in _plugin_packages()} >= {"dsv4core_cuda", "dsv4core_rocm", "dsv4core_ascend", "dsv4core_xpu"}


@pytest.mark.parametrize("package", _plugin_packages(), ids=lambda p: p.name)
def test_plugins_use_the_public_hal_api(package):
    """A plugin imports dsv4core's HAL and shared kernels only, by public names, and no other plugin."""
    bad = []
    for path in sorted(package.rglob("*.py")):
        for line, name in _imports(path, package):
            parts = name.split(".")
            where = f"{path.relative_to(PLUGINS)}:{line} imports {name}"
            if parts[0] == "dsv4core" and len(parts) > 1:
                if parts[1] not in PLUGIN_ALLOWED:
                    bad.append(f"{where} (only dsv4core.{{{', '.join(PLUGIN_ALLOWED)}}})")
                elif any(p.startswith("_") for p in parts[1:]):
                    bad.append(f"{where} (a private name)")
            elif parts[0].startswith("dsv4core_") and parts[0] != package.name:
                bad.append(f"{where} (another plugin)")
    assert not bad, "plugin imports outside the public HAL API:\n" + "\n".join(sorted(set(bad)))


def _module_graph() -> dict[str, set[str]]:
    """dsv4core module -> the dsv4core modules it imports (lazy imports included; a module's own
    ancestor packages left out: they are loaded before it anyway)."""
    mods = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path

    def module_of(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in mods:
            parts.pop()
        return ".".join(parts) or None

    graph = {}
    for mod, path in mods.items():
        deps = {module_of(n) for _, n in _imports(path) if n.split(".")[0] == "dsv4core"}
        graph[mod] = {d for d in deps if d and d != mod and not mod.startswith(d + ".")}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]; counter[0] += 1; stack.append(start); on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]; counter[0] += 1; stack.append(w); on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop(); on.discard(w); comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_the_cycle_finder_finds_a_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(g) == [{"a", "b", "c"}] and _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = _cycles(_module_graph())
    new = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not new, "import cycles among dsv4core modules:\n" + "\n".join(" <-> ".join(c) for c in new)
    assert _module_graph()["dsv4core.conformance.distributed"].isdisjoint({"dsv4core.conformance.runner"})
