"""CLI subcommands. Each module defines ``add_parser(subparsers)`` which adds one subcommand and
sets ``func(args) -> int`` as its handler; :mod:`dsv4core.cli` lists them in ``COMMANDS``."""
