"""Recorded hardware validation: what lets ``dsv4core backends`` say "validated on hardware".

A backend is *validated on hardware* for a device when a conformance report produced ON that
device (``dsv4core conformance --backend NAME --device DEV --json report.json``) has been recorded
in the plugin's ``validation/`` folder, as ``<hardware-id>.json`` (the plugin chooses the id,
e.g. its arch name): the report's JSON plus a top-level ``"hardware"`` string naming the device
and the vendor software stack with versions. A report counts only if it
has no failed op. docs/conformance.md ("Vendor CI") describes how vendors record one.

Reading is cheap (a directory listing and small JSON files) and happens at plugin registration.
"""
from __future__ import annotations

import json
from pathlib import Path

NOT_VALIDATED = "not validated on hardware"


def _reports(directory: str | Path, backend: str) -> tuple[list[tuple[Path, dict]], list[str]]:
    """The recorded passing reports of ``backend`` in ``directory`` (path, report) and, for each
    file not counted, the reason."""
    d = Path(directory)
    good, bad = [], []
    for p in sorted(d.glob("*.json")) if d.is_dir() else ():
        try:
            rep = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            bad.append(f"{p.name}: unreadable ({type(e).__name__})")
            continue
        if not isinstance(rep, dict) or rep.get("backend") != backend or "summary" not in rep:
            bad.append(f"{p.name}: not a conformance report of backend {backend!r}")
            continue
        if rep.get("failed"):
            bad.append(f"{p.name}: the recorded report has failures")
            continue
        good.append((p, rep))
    return good, bad


def passed_ops(directory: str | Path, backend: str) -> frozenset[str]:
    """The ops with status "passed" in a recorded passing report of ``backend`` in ``directory``
    (the ops a plugin may serve as validated on hardware); empty without a record."""
    good, _ = _reports(directory, backend)
    return frozenset(op for _, rep in good for op, s in rep["summary"].items()
                     if isinstance(s, dict) and s.get("status") == "passed")


def recorded(directory: str | Path, backend: str) -> str:
    """One line: ``"validated on hardware: <hardware> (dsv4core X, N ops passed)[; ...]"`` for each
    recorded passing report of ``backend`` in ``directory``, else ``"not validated on hardware"``
    (followed by the reason a recorded file was not counted, if one was found)."""
    reports, bad = _reports(directory, backend)
    good = []
    for p, rep in reports:
        summary = rep["summary"]
        passed = sum(1 for s in summary.values() if s.get("status") == "passed")
        hw = rep.get("hardware") or p.stem
        good.append(f"{hw} (dsv4core {rep.get('dsv4core_version', '?')}, {passed}/{len(summary)} ops passed)")
    if good:
        return "validated on hardware: " + "; ".join(good)
    return NOT_VALIDATED + (f" (ignored: {'; '.join(bad)})" if bad else "")
