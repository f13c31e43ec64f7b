"""``dsv4core conformance merge``: several JSON reports -> one backends x ops compatibility matrix.

What a vendor-results page shows: one column per report (backend, version, device, dsv4core and
torch versions, date, verdict, the source digests of the code that ran), one row per op (status
and worst err/bound), as Markdown, as a self-contained HTML page, and as an SVG heat map of
err/bound per op and backend (no plotting library needed: the SVG is written directly).
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

from .provenance import format_sources
from .results import REPORT_SCHEMA, REPORT_SCHEMA_VERSION, ConformanceError


@dataclass
class Column:
    """One report: its header fields and ``cells[op] = (status, worst_ratio or None, failure kinds)``."""

    path: str
    backend: str
    version: str
    device: str
    dsv4core: str
    torch: str
    date: str
    verdict: str
    cells: dict
    #: the report's ``sources`` as one line ("package digest, ..."); "" for reports written before it
    sources: str = ""

    @property
    def label(self) -> str:
        return f"{self.backend} {self.version} ({self.device})"


def load_report(path: str | Path) -> Column:
    """Read one conformance JSON report; ConformanceError naming the file when it is not one."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConformanceError(f"{p}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConformanceError(f"{p}: not a JSON conformance report ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("schema") != REPORT_SCHEMA:
        raise ConformanceError(f"{p}: not a dsv4core conformance report (expected \"schema\": \"{REPORT_SCHEMA}\"; "
                               f"write one with `dsv4core conformance --backend NAME --json FILE`)")
    if data.get("schema_version") != REPORT_SCHEMA_VERSION:
        raise ConformanceError(f"{p}: conformance report schema version {data.get('schema_version')!r}; this "
                               f"dsv4core reads version {REPORT_SCHEMA_VERSION} (re-run the suite with this version)")
    try:
        cells = {o["op"]: (o["status"], o["worst_ratio"], list(o.get("failure_kinds") or [])) for o in data["ops"]}
        return Column(str(p), data["backend"], str(data["backend_version"]), data["device"],
                      str(data["dsv4core_version"]), str(data["torch_version"]), data.get("date", ""),
                      data.get("verdict", ""), cells, format_sources(data.get("sources")))
    except (KeyError, TypeError) as e:
        raise ConformanceError(f"{p}: malformed conformance report (missing or wrong field {e})") from None


def load_reports(paths) -> list[Column]:
    if not paths:
        raise ConformanceError("merge: give at least one REPORT.json")
    return [load_report(p) for p in paths]


def _ops(cols: list[Column]) -> list[str]:
    from dsv4core.hal import catalogue

    known = list(catalogue())
    seen = {op for c in cols for op in c.cells}
    return [op for op in known if op in seen] + sorted(seen - set(known))


def cell_text(cell) -> str:
    if cell is None:
        return "not run"
    status, ratio, kinds = cell
    if status == "failed" and kinds:
        return f"failed ({', '.join(kinds)})"
    if ratio is None or status in ("not implemented", "no cases"):
        return status
    return f"{status} {ratio:.2g}"


HEADER_FIELDS = (("device", "device"), ("backend version", "version"), ("dsv4core", "dsv4core"),
                 ("torch", "torch"), ("date", "date"), ("result", "verdict"), ("sources", "sources"))


def markdown(cols: list[Column]) -> str:
    ops = _ops(cols)
    lines = ["# dsv4core compatibility matrix", "",
             "Each cell: the op's status and its worst err/bound over all cases (<= 1 passes; a failure "
             "without a ratio names its kind). One column per conformance report.", "",
             "| | " + " | ".join(f"`{c.backend}`" for c in cols) + " |",
             "|---|" + "---|" * len(cols)]
    for title, attr in HEADER_FIELDS:
        lines.append(f"| *{title}* | " + " | ".join(str(getattr(c, attr)).replace("|", "/") for c in cols) + " |")
    for op in ops:
        lines.append(f"| {op} | " + " | ".join(cell_text(c.cells.get(op)) for c in cols) + " |")
    return "\n".join(lines) + "\n"


def _colour(cell) -> str:
    if cell is None or cell[0] in ("not implemented", "no cases"):
        return "#e0e0e0"
    status, ratio, _ = cell
    if status == "failed":
        return "#d9534f"
    if status == "declined":
        return "#f0ad4e"
    r = 0.0 if ratio is None else min(1.0, max(0.0, ratio))
    # green (ratio 0) -> yellow (ratio 1): how much of its bound a passing op uses
    return f"#{int(92 + 148 * r):02x}{int(184 - 20 * r):02x}{int(92 - 40 * r):02x}"


def svg_heatmap(cols: list[Column]) -> str:
    """err/bound per op (rows) and report (columns) as an SVG image."""
    ops = _ops(cols)
    cw, ch, left, top = 150, 22, 170, 60
    w, h = left + cw * len(cols) + 10, top + ch * len(ops) + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="11">',
           f'<text x="4" y="16" font-size="13">dsv4core conformance: worst err/bound per op and backend</text>']
    for j, c in enumerate(cols):
        out.append(f'<text x="{left + j * cw + 4}" y="{top - 8}">{html.escape(c.label)[:28]}</text>')
    for i, op in enumerate(ops):
        y = top + i * ch
        out.append(f'<text x="4" y="{y + 15}">{html.escape(op)}</text>')
        for j, c in enumerate(cols):
            cell = c.cells.get(op)
            out.append(f'<rect x="{left + j * cw}" y="{y}" width="{cw - 2}" height="{ch - 2}" fill="{_colour(cell)}"/>')
            out.append(f'<text x="{left + j * cw + 4}" y="{y + 15}">{html.escape(cell_text(cell))[:26]}</text>')
    y = top + len(ops) * ch + 20
    out.append(f'<text x="4" y="{y}">green: err/bound 0, yellow: 1 (the bound); red: failed; orange: declined; '
               f'grey: not implemented</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def html_page(cols: list[Column]) -> str:
    ops = _ops(cols)
    rows = ["<tr><th></th>" + "".join(f"<th>{html.escape(c.backend)}</th>" for c in cols) + "</tr>"]
    for title, attr in HEADER_FIELDS:
        rows.append(f"<tr><td><i>{title}</i></td>" +
                    "".join(f"<td>{html.escape(str(getattr(c, attr)))}</td>" for c in cols) + "</tr>")
    for op in ops:
        rows.append(f"<tr><td><code>{op}</code></td>" + "".join(
            f'<td style="background:{_colour(c.cells.get(op))}">{html.escape(cell_text(c.cells.get(op)))}</td>'
            for c in cols) + "</tr>")
    return ("<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>dsv4core compatibility matrix</title>\n"
            "<style>body{font-family:sans-serif} table{border-collapse:collapse} "
            "td,th{border:1px solid #999;padding:3px 8px;font-size:13px}</style></head><body>\n"
            "<h1>dsv4core compatibility matrix</h1>\n<p>Each cell: the op's status and its worst err/bound over "
            "all cases (&le; 1 passes).</p>\n<table>\n" + "\n".join(rows) + "\n</table>\n" + svg_heatmap(cols) +
            "</body></html>\n")
