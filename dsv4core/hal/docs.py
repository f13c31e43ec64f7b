"""Generate from the op specs: the op reference (docs/ops.md, ``python -m dsv4core.hal.docs``)
and the typed attributes of the op table (``dsv4core/hal/typed_ops.py``,
``python -m dsv4core.hal.docs typed``).

The specs are the single source of truth; tests check that the committed files are up to date.
"""

from __future__ import annotations

import inspect
import sys

from .backend import HAL_API_VERSION
from .spec import catalogue
from .version import version_str


def render() -> str:
    specs = catalogue()
    lines = [
        "# HAL op reference",
        "",
        f"Generated from the op specs in `dsv4core/hal/ops/` by `python -m dsv4core.hal.docs` "
        f"(HAL API {HAL_API_VERSION[0]}.{HAL_API_VERSION[1]}). Do not edit by hand.",
        "",
        "Tolerance policy: a backend passes a conformance case when its error against an fp64 "
        "evaluation of the reference is at most `k` times the reference backend's own error in the "
        "same dtype on the same inputs, plus the absolute `floor`.",
        "",
        "| op | family | k | floor | metric |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| [`{s.name}`](#{s.name}){' (deprecated)' if s.deprecated else ''} | {s.family} | "
              f"{s.tolerance.k:g} | {s.tolerance.floor:g} | {s.tolerance.metric} |" for s in specs.values()]
    for s in specs.values():
        later: dict = {}
        for n, v in s.params_since.items():
            if v != s.since:
                later.setdefault(v, []).append(f"`{n}`")
        since = f"*Since* HAL {version_str(s.since)}" + "".join(
            f"; {', '.join(ns)} since HAL {version_str(v)}" for v, ns in sorted(later.items())) + "."
        lines += ["", f"## {s.name}", "", "```python", f"{s.name}{s.signature}", "```", "", since, ""]
        if s.deprecated:
            lines += [f"*Deprecated*: {s.deprecated}. It stays in the catalogue and in conformance.", ""]
        lines += [s.doc, "",
                  f"*Tolerance* (k = {s.tolerance.k:g}, floor = {s.tolerance.floor:g}, {s.tolerance.metric}): "
                  f"{s.tolerance.why}."]
    return "\n".join(lines) + "\n"


def _param(p: inspect.Parameter) -> str:
    text = p.name if p.annotation is inspect.Parameter.empty else f"{p.name}: {p.annotation}"
    if p.default is not inspect.Parameter.empty:
        text += f" = {p.default!r}" if p.annotation is not inspect.Parameter.empty else f"={p.default!r}"
    return text


def render_typed() -> str:
    """The source of ``dsv4core/hal/typed_ops.py``: a class with one method per op, of the op's
    signature, seen by type checkers and editors only (its body is under ``TYPE_CHECKING``)."""
    specs = catalogue()
    lines = [
        '"""The op table\'s attributes, typed: one method per HAL op with the op\'s signature, so that',
        "editors and type checkers follow ``ops.rms_norm(...)`` to the op and its spec.",
        "",
        "Generated from the op specs in ``dsv4core/hal/ops/`` by ``python -m dsv4core.hal.docs typed``.",
        "Do not edit by hand (a test checks it is current). At run time the class is empty: a bound",
        ":class:`~dsv4core.hal.OpTable` holds each op's bound callable as an instance attribute.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "from typing import TYPE_CHECKING",
        "",
        "if TYPE_CHECKING:",
        "    import torch",
        "",
        "",
        "class TypedOps:",
        '    """One attribute per HAL op (see the module docstring)."""',
        "",
        "    __slots__ = ()",
        "",
        "    if TYPE_CHECKING:",
    ]
    for i, s in enumerate(specs.values()):
        sig = s.signature
        params = ["self"] + [_param(p) for p in sig.parameters.values()]
        ret = "" if sig.return_annotation is inspect.Signature.empty else f" -> {sig.return_annotation}"
        if i:
            lines.append("")
        head = f"        def {s.name}({', '.join(params)}){ret}:"
        if len(head) <= 110:
            lines.append(head)
        else:
            lines += [f"        def {s.name}("] + [f"            {p}," for p in params] + [f"        ){ret}:"]
        doc = f"Spec and reference math: :func:`{s.reference.__module__}.{s.name}`."
        if s.deprecated:
            lines += [f'            """{doc}', f"            Deprecated: {s.deprecated}.", '            """']
        else:
            lines += [f'            """{doc}"""']
        lines += ["            ..."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["typed"]:
        sys.stdout.write(render_typed())
    elif sys.argv[1:]:
        sys.exit(f"usage: python -m dsv4core.hal.docs [typed]  (got {' '.join(sys.argv[1:])!r})")
    else:
        sys.stdout.write(render())
