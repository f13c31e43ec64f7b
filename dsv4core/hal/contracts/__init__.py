"""The frozen op contracts: every op's signature at every HAL version, as committed JSON.

``dsv4core/hal/contracts/<major>.<minor>.json`` records, for each op that exists at that version,
its parameters (name, kind, default) as a backend declaring that version implements them
(:meth:`dsv4core.hal.spec.OpSpec.signature_for`). The files of released versions never change:
``tests/test_hal_contracts.py`` fails when the catalogue no longer reproduces one of them, which
is what happens when a parameter is added without a ``params_since`` entry, or when a parameter
is removed, renamed, reordered or given another default within a major version.

The file of the current version (``HAL_API_VERSION``) is written by
``python -m dsv4core.hal.contracts --write`` after a versioned change (a new op with
``since=HAL_API_VERSION``, a new parameter with ``params_since``); that command refuses to run
while an older file disagrees with the catalogue.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

from ..spec import catalogue
from ..version import HAL_API_VERSION, version_str

DIR = Path(__file__).resolve().parent


def record(version: tuple[int, int]) -> dict:
    """The contract of every op that exists at ``version``: ``{op: [{name, kind, default?}, ...]}``."""
    out = {}
    for name, spec in catalogue().items():
        if spec.since[0] != version[0] or spec.since > version:
            continue
        params = []
        for p in spec.signature_for(version).parameters.values():
            d = {"name": p.name, "kind": p.kind.name.lower()}
            if p.default is not inspect.Parameter.empty:
                d["default"] = repr(p.default)
            params.append(d)
        out[name] = params
    return {"hal_api_version": version_str(version), "ops": out}


def path(version: tuple[int, int]) -> Path:
    return DIR / f"{version_str(version)}.json"


def frozen_versions() -> list[tuple[int, int]]:
    """The versions with a committed contract file, oldest first."""
    vs = []
    for f in DIR.glob("*.json"):
        major, _, minor = f.stem.partition(".")
        vs.append((int(major), int(minor)))
    return sorted(vs)


def load(version: tuple[int, int]) -> dict:
    return json.loads(path(version).read_text())


def render(version: tuple[int, int]) -> str:
    return json.dumps(record(version), indent=1) + "\n"


def differences(version: tuple[int, int]) -> list[str]:
    """How the catalogue's contract at ``version`` differs from the committed file ([] = same)."""
    if not path(version).exists():
        return [f"no committed contract for HAL {version_str(version)} ({path(version).name})"]
    want, got = load(version)["ops"], record(version)["ops"]
    out = []
    for op in want:
        if op not in got:
            out.append(f"{op}: in the HAL {version_str(version)} contract but no longer in the catalogue "
                       f"(an op is removed only in a new major version)")
    for op, params in got.items():
        if op not in want:
            out.append(f"{op}: not in the HAL {version_str(version)} contract (a new op needs since= the "
                       f"current version, {version_str(HAL_API_VERSION)})")
            continue
        start = len(out)
        w = {p["name"]: p for p in want[op]}
        g = {p["name"]: p for p in params}
        for n in g.keys() - w.keys():
            out.append(f"{op}: parameter {n!r} is not in the HAL {version_str(version)} contract "
                       f"(a new parameter needs params_since={{{n!r}: {HAL_API_VERSION}}} and a default)")
        for n in w.keys() - g.keys():
            out.append(f"{op}: parameter {n!r} of the HAL {version_str(version)} contract is gone "
                       f"(removing or renaming a parameter needs a new major version)")
        for n in w.keys() & g.keys():
            if w[n] != g[n]:
                out.append(f"{op}: parameter {n!r} changed from {w[n]} to {g[n]} (HAL {version_str(version)})")
        if len(out) == start and [p["name"] for p in want[op]] != [p["name"] for p in params]:
            out.append(f"{op}: parameter order changed from {[p['name'] for p in want[op]]} to "
                       f"{[p['name'] for p in params]} (HAL {version_str(version)})")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--write"]):
        print("usage: python -m dsv4core.hal.contracts [--write]", file=sys.stderr)
        return 2
    older = [v for v in frozen_versions() if v < HAL_API_VERSION]
    bad = {v: differences(v) for v in older}
    bad = {v: d for v, d in bad.items() if d}
    for v, d in bad.items():
        print(f"HAL {version_str(v)} (frozen) differs:\n  " + "\n  ".join(d), file=sys.stderr)
    if argv == ["--write"]:
        if bad:
            print("not written: a released contract changed (see above)", file=sys.stderr)
            return 1
        path(HAL_API_VERSION).write_text(render(HAL_API_VERSION))
        print(f"wrote {path(HAL_API_VERSION)}")
        return 0
    cur = differences(HAL_API_VERSION)
    if cur:
        print(f"HAL {version_str(HAL_API_VERSION)} (current) differs:\n  " + "\n  ".join(cur), file=sys.stderr)
    return 1 if bad or cur else 0
