"""The ``dsv4core`` command line. Subcommands live in :mod:`dsv4core.commands`."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

import dsv4core

#: Subcommand modules, in the order ``--help`` lists them.
COMMANDS = ["backends", "ops", "generate", "inspect", "conformance", "bench"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsv4core", description="DeepSeek-V4 on any accelerator: a device-neutral "
                                     "model core, a hardware abstraction layer and vendor backends.")
    parser.add_argument("--version", action="version", version=f"dsv4core {dsv4core.__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages (plugin import errors...)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"dsv4core.commands.{name}")
        module.add_parser(sub)
    return parser


def _rank_tag() -> str:
    """" (rank R of W)" under a launcher that started several processes (torchrun), else ""."""
    world = os.environ.get("WORLD_SIZE", "1")
    return f" (rank {os.environ.get('RANK', '?')} of {world})" if world not in ("", "0", "1") else ""


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):   # no subcommand: a usage error (stderr, exit 2)
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a clean one-line error for users; -v shows the traceback
        if args.verbose:
            raise
        # one write, newline included: ranks under a launcher share stderr, and print()'s separate
        # write of the newline let two ranks' lines run together
        sys.stderr.write(f"dsv4core {args.command}: error{_rank_tag()}: {e}\n")
        sys.stderr.flush()
        from dsv4core.hal import HALError

        return 2 if isinstance(e, (HALError, ValueError)) else 1


if __name__ == "__main__":
    sys.exit(main())
