"""Which code a conformance report was produced by: digests of the Python sources involved."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from dsv4core.hal import Backend, discover


def tree_digest(root) -> str:
    """sha256 (first 16 hex digits) over the ``*.py`` files under ``root`` (a folder; or one file):
    their paths relative to it and their bytes, in path order. Identifies the code a report
    verified where no git checkout is at hand (an installed package on another machine)."""
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
