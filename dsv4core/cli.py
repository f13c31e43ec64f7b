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


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit 2 (argparse's default repeats the usage first).
    Subcommand parsers are of this class too (add_subparsers uses the parent's class)."""

    def error(self, message: str):
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="dsv4core", description="DeepSeek-V4 on any accelerator: a device-neutral "
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
        rc = int(args.func(args) or 0)
        sys.stdout.flush()    # here, where a closed pipe is caught, not at interpreter exit
        return rc
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:   # stdout closed early (`dsv4core backends --json | head -1`): stop quietly
        _silence_stdout()
        return 141            # what a shell reports for a writer stopped by SIGPIPE
    except Exception as e:  # a clean one-line error for users; -v shows the traceback
        if args.verbose:
            raise
        # one write, newline included: ranks under a launcher share stderr, and print()'s separate
        # write of the newline let two ranks' lines run together
        sys.stderr.write(f"dsv4core {args.command}: error{_rank_tag()}: {e}\n")
        sys.stderr.flush()
        from dsv4core.hal import HALError

        return 2 if isinstance(e, (HALError, ValueError)) else 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush of the closed pipe is silent."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
