"""Conformance reports: the human table, JSON, JUnit XML and Markdown."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from typing import TextIO

from dsv4core._table import print_table

from .provenance import format_sources
from .results import DECLINED, FAILED, NOT_IMPLEMENTED, PASSED, Report


def table_rows(report: Report) -> list[tuple]:
    rows = []
    for o in report.ops:
        if not o.implemented:
            rows.append((o.op, NOT_IMPLEMENTED, "-", "-", "-", "-"))
            continue
        rows.append((o.op, o.status, o.count(PASSED), o.count(FAILED), o.count(DECLINED), o.worst))
    return rows


HEADERS = ("op", "status", "passed", "failed", "declined", "worst err/bound")


def write_table(report: Report, file: TextIO) -> None:
    """The final human table plus every failure (op, case, metric, measured value, bound)."""
    print(f"\nconformance of backend {report.backend!r} {report.backend_version} on {report.device} "
          f"(shapes {','.join(report.shapes)}; dtypes {','.join(report.dtypes)}; seed {report.seed}; "
          f"{report.seconds:.1f}s)", file=file)
    if report.sources:
        print("sources: " + format_sources(report.sources), file=file)
    if report.oracle:
        print(f"oracle: {report.oracle['digest']}" + (" (isolated)" if report.oracle.get("isolated") else ""),
              file=file)
    print_table(HEADERS, table_rows(report), file=file)
    fails = report.failures()
    if fails:
        print(f"\n{len(fails)} failing case(s):", file=file)
        for c in fails:
            print(f"  {c.id}: {c.message}", file=file)
    declined = [c for o in report.ops for c in o.cases if c.status == DECLINED]
    if declined:
        reasons: dict[str, int] = {}
        for c in declined:
            reasons[f"{c.op}: {c.message}"] = reasons.get(f"{c.op}: {c.message}", 0) + 1
        print(f"\n{len(declined)} declined case(s) (served by the next backend at run time; not a pass):", file=file)
        for r, n in reasons.items():
            print(f"  {n} x {r}", file=file)
    if report.model is not None:
        print(f"\nmodel check: {format_model(report.model)}", file=file)
    print(f"\nresult: {report.verdict()}", file=file)


def format_model(m: dict) -> str:
    if m.get("status") in ("unavailable", "skipped"):
        return f"{m['status']}: {m.get('reason', '')}"
    parts = [m.get("status", "?")]
    for run in m.get("runs", []):
        err, bound = run.get("logits_error"), run.get("logits_bound")
        s = f"{run['model']} {run['dtype']}"
        if "weights" in run:
            s += f" ({run['weights']} weights, {run.get('kv_dtype', '?')} KV)"
        s += ": logits error " + ("-" if err is None else f"{err:.3g}")
        if bound is not None:
            s += f" (bound {bound:.3g}" + (f" = {run['bound_k']:g} x the reference's own bf16 error"
                                           if "bound_k" in run else "") + ")"
        s += f", greedy agreement {run.get('greedy_agreement', 0):.0%}"
        if "reference_greedy_agreement" in run:
            s += f" (reference bf16 {run['reference_greedy_agreement']:.0%}; {run['prompts']} prompts)"
        else:
            s += f" over {run['steps']} steps"
        if run.get("fallbacks"):
            s += " [calls served by the reference: " + ", ".join(f"{k} {v}" for k, v in run["fallbacks"].items()) + "]"
        if run.get("message"):
            s += f" — {run['message']}"
        parts.append(s)
    if m.get("reason"):
        parts.append(m["reason"])
    return "; ".join(parts)


def write_json(report: Report, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report.as_dict(), f, indent=2, default=str)
        f.write("\n")


def write_junit(report: Report, path: str) -> None:
    """One <testsuite> per op, one <testcase> per case; failures carry the message, declines and
    unimplemented ops are <skipped> with their reason."""
    root = ET.Element("testsuites", name=f"dsv4core conformance: {report.backend}")
    tot = dict(tests=0, failures=0, skipped=0)
    for o in report.ops:
        suite = ET.SubElement(root, "testsuite", name=f"dsv4core.conformance.{o.op}")
        cases = o.cases if o.implemented else []
        n_fail = o.count(FAILED)
        n_skip = o.count(DECLINED) + (0 if o.implemented else 1)
        if not o.implemented:
            tc = ET.SubElement(suite, "testcase", classname=f"dsv4core.conformance.{o.op}", name=f"{o.op}[all]")
            ET.SubElement(tc, "skipped", message=f"not implemented by backend {report.backend!r}")
        for c in cases:
            tc = ET.SubElement(suite, "testcase", classname=f"dsv4core.conformance.{o.op}", name=c.id,
                               time=f"{c.seconds:.4f}")
            if c.status == FAILED:
                el = ET.SubElement(tc, "failure", message=c.message[:2000])
                el.text = json.dumps(c.as_dict(), indent=1, default=str)
            elif c.status == DECLINED:
                ET.SubElement(tc, "skipped", message=f"declined: {c.message}")
            else:
                w = c.worst
                if w is not None:
                    out = ET.SubElement(tc, "system-out")
                    out.text = f"worst {w.what}: {w.metric} {w.err:.3g} <= bound {w.bound:.3g}"
        n = max(1, len(cases)) if not o.implemented else len(cases)
        suite.set("tests", str(n))
        suite.set("failures", str(n_fail))
        suite.set("skipped", str(n_skip))
        suite.set("errors", "0")
        tot["tests"] += n
        tot["failures"] += n_fail
        tot["skipped"] += n_skip
    if report.model is not None:
        suite = ET.SubElement(root, "testsuite", name="dsv4core.conformance.model", tests="1",
                              failures=str(int(report.model.get("status") == FAILED)),
                              skipped=str(int(report.model.get("status") in ("unavailable", "skipped"))), errors="0")
        tc = ET.SubElement(suite, "testcase", classname="dsv4core.conformance.model", name="model[tiny]")
        if report.model.get("status") == FAILED:
            ET.SubElement(tc, "failure", message=format_model(report.model))
        elif report.model.get("status") in ("unavailable", "skipped"):
            ET.SubElement(tc, "skipped", message=format_model(report.model))
        tot["tests"] += 1
    for k, v in tot.items():
        root.set(k, str(v))
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def write_markdown(report: Report, path: str) -> None:
    lines = [f"# dsv4core conformance: `{report.backend}` {report.backend_version}", "",
             f"device `{report.device}`, shapes {', '.join(report.shapes)}, dtypes {', '.join(report.dtypes)}, "
             f"seed {report.seed}, {report.seconds:.1f}s. Result: **{report.verdict()}**."
             + (f" Sources: {format_sources(report.sources)}." if report.sources else ""), "",
             "| op | status | passed | failed | declined | worst err/bound | tolerance (k, floor, metric) |",
             "|---|---|---|---|---|---|---|"]
    for o, row in zip(report.ops, table_rows(report)):
        t = o.tolerance
        floors = t.floors
        fl = f"{t.floor:g}" + (" / " + ", ".join(f"{k} {v:g}" for k, v in floors.items()) if floors else "")
        lines.append("| " + " | ".join(str(c) for c in row) + f" | {t.k:g}, {fl}, {t.metric} |")
    fails = report.failures()
    if fails:
        lines += ["", "## Failures", ""]
        lines += [f"- `{c.id}`: {c.message}" for c in fails]
    if report.model is not None:
        lines += ["", "## Model check", "", format_model(report.model)]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
