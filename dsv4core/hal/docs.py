"""Generate the op reference (docs/ops.md) from the op specs: ``python -m dsv4core.hal.docs``.

The specs are the single source of truth; tests check that the committed page is up to date.
"""

from __future__ import annotations

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


if __name__ == "__main__":
    sys.stdout.write(render())
