"""``dsv4core ops``: which implementation serves each HAL op, and why others were declined."""

from __future__ import annotations

from ._util import print_json, print_table


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("ops", help="show which backend serves each op",
                              description="Resolve every HAL op for a device and backend choice and show the "
                                          "serving implementation; for a fallback, why the preferred one declined.")
    p.add_argument("--backend", default=None, help="backend name or 'auto' (default: $DSV4CORE_BACKEND or auto)")
    p.add_argument("--device", default="cpu", help="torch device type to resolve for (default: cpu)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    import sys

    import torch

    from dsv4core.hal import bind, catalogue

    try:
        device = torch.device(args.device)
    except (RuntimeError, ValueError) as e:   # a bad argument: exit 2 like the other usage errors
        print(f"dsv4core ops: error: bad --device {args.device!r}: {e}", file=sys.stderr)
        return 2
    table = bind(device, backend=args.backend, policy="allow")
    specs = catalogue()
    report = table.report()
    for r in report:
        r["family"] = specs[r["op"]].family
        r["deprecated"] = specs[r["op"]].deprecated
    if args.json:
        print_json({"device": table.device_type, "ops": report})
        return 0
    rows = []
    for r in report:
        why = "; ".join([f"{b}: {reason}" for b, reason in r["declined"].items()]
                        + [f"{b}: {note}" for b, note in r.get("limits", {}).items()]
                        + [f"{b}: {msg}" for b, msg in r.get("problems", {}).items()]
                        + ([f"deprecated: {r['deprecated']}"] if r["deprecated"] else []))
        # short flags in their own named column; the deprecation's sentence with the other details
        notes = ", ".join(n for n in ("fallback" if r["fallback"] else "",
                                      "deprecated" if r["deprecated"] else "") if n)
        rows.append((r["op"], r["family"], r["backend"], notes, why))
    print_table(("op", "family", "served by", "notes", "declined / limits / deprecation"), rows)
    return 0
