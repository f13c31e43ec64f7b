"""``dsv4core bench``: per-op timings of a backend vs the reference and torch.compile (dsv4core.bench)."""

from __future__ import annotations


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="time ops of a backend against the reference and torch.compile",
                              description="Per op and token count: median device time, bytes / FLOPs, GB/s, "
                                          "TFLOP/s, % of the copy bandwidth and bf16 matmul rate measured in the "
                                          "same run, speedup over the reference and over torch.compile of it.")
    from dsv4core.bench import add_arguments

    add_arguments(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from dsv4core.bench import run_args

    return run_args(args)
