"""``dsv4core backends``: every backend found, its version, devices, availability and priority."""

from __future__ import annotations

from ._util import print_json, print_table


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("backends", help="list backends (built-in and plugins) and whether they are available",
                              description="List every backend: the built-in reference and each plugin found in "
                                          "the 'dsv4core.backends' entry-point group, with why it is unavailable.")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run)


def run(args) -> int:
    from dsv4core.hal import discover

    statuses = sorted(discover().values(), key=lambda s: (-s.priority, s.name))
    if args.json:
        print_json([s.as_dict() for s in statuses])
        return 0
    rows = [(s.name, s.version or "-", ".".join(map(str, s.api_version)) if s.api_version else "-",
             ",".join(s.device_types) or "-",
             f"{s.priority} (by name only)" if s.priority < 0 else s.priority,
             "yes" if s.available else f"no: {s.reason}",
             (f"{len(s.backend.impls)}" + (f" ({len(s.rejected)} rejected)" if s.rejected else "")) if s.backend else 0,
             s.validated or "-", s.source)
            for s in statuses]
    print_table(("backend", "version", "HAL", "devices", "priority", "available", "ops", "hardware validation",
                 "source"), rows)
    rejected = [(s.name, op, why) for s in statuses for op, why in sorted(s.rejected.items())]
    if rejected:
        print("\nRejected implementations (each op left out; the next backend serves it):")
        for name, op, why in rejected:
            print(f"  {name} / {op}: {why}")
    print("\n'auto' picks, per op, the available backend serving the device with the highest priority "
          "(ties: by name); a negative priority is used only when named.")
    return 0
