"""``dsv4core conformance``: prove (or refute) a backend's numerical parity with the HAL spec.

Exit codes: 0 every implemented op (and the model check) passes; 1 any case fails (or, with
``--require-all``, a selected op is not implemented, a case was declined, or the model check
handed a call to the reference); 2 the backend cannot be loaded, the arguments are wrong, or the
oracle differs from the installed files (a plugin changed it: the run refuses to judge); 3
nothing was verified (every selected op not implemented or every case declined: not a pass).
See docs/conformance.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "conformance", help="run the op conformance suite (and a model check) against a backend",
        description="Run every HAL op's conformance cases on a backend (strict: no fallback to the reference) "
                    "and compare against an fp64 evaluation of the spec; then compare the tiny model's logits "
                    "and greedy tokens with the reference backend. Exit 0 all implemented ops pass, 1 a case "
                    "fails (or --require-all and the run is incomplete), 2 the backend cannot be loaded or the "
                    "arguments are wrong, 3 nothing was verified (no case passed).")
    p.add_argument("action", nargs="?", choices=["merge"],
                   help="merge: combine JSON reports into a compatibility matrix (dsv4core conformance merge "
                        "A.json B.json --markdown matrix.md --html matrix.html --svg heatmap.svg)")
    p.add_argument("reports", nargs="*", metavar="REPORT.json", help="(merge) conformance JSON reports")
    p.add_argument("--backend", help="backend name (see `dsv4core backends`); required unless merging")
    p.add_argument("--html", metavar="FILE", help="(merge) write the matrix as a self-contained HTML page")
    p.add_argument("--svg", metavar="FILE", help="(merge) write the err/bound heat map as an SVG image")
    p.add_argument("--ops", default=None, help="comma-separated op or family names (default: all ops)")
    p.add_argument("--shapes", default="small",
                   help="shape set(s): small (CPU-sized), flash, pro (DSV4-Flash / DSV4-Pro dims), all; comma-separated")
    p.add_argument("--dtype", default="float32,bfloat16", help="activation dtypes, comma-separated "
                                                              "(default: float32,bfloat16)")
    p.add_argument("--device", default="cpu", help="torch device for the inputs (default: cpu)")
    p.add_argument("--seed", type=int, default=0, help="case seed; the same seed gives the same inputs (default 0)")
    p.add_argument("--json", metavar="FILE", help="write the full JSON report")
    p.add_argument("--junit", metavar="FILE", help="write JUnit XML (one testcase per op x case)")
    p.add_argument("--markdown", metavar="FILE", help="write a Markdown summary (merge: the matrix)")
    p.add_argument("--model", default="tiny", metavar="PATH|tiny",
                   help="model for the model-level check: 'tiny' (built in, default) or a checkpoint directory")
    p.add_argument("--no-model", action="store_true", help="skip the model-level check")
    p.add_argument("--require-all", action="store_true",
                   help="a full-conformance claim: also exit 1 when a selected op is not implemented, a case is "
                        "declined, or the model check hands a call to the reference")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="take the cases and their reference / fp64 outputs from a separate process that loads no "
                        "plugin (defeats a plugin's patches to torch or the oracle; costs one more process start "
                        "and a temporary file of every case: see docs/conformance.md). Default: on with "
                        "--require-all, off otherwise")
    p.add_argument("--world-sizes", default="2,4", metavar="N,N",
                   help="check the collectives over this many spawned ranks each (default 2,4; 'none' = one "
                        "process only, listed as a gap)")
    p.add_argument("--dist-backend", default="gloo",
                   help="torch.distributed backend of the spawned ranks (default gloo; e.g. nccl with "
                        "--dist-device cuda to check the backend's own transport on its device)")
    p.add_argument("--dist-device", default="cpu", help="device of the collectives' inputs in the spawned ranks "
                                                        "(default cpu)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="run the ops' cases in N worker processes sharing the device (default 1; not with --isolate, "
                        "which --require-all turns on unless --no-isolate is given)")
    p.add_argument("-q", "--quiet", action="store_true", help="no per-op progress lines")
    p.set_defaults(func=run)


def run(args) -> int:
    from dsv4core.conformance import (ConformanceError, load_backend, parse_dtypes, parse_ops, parse_shapes,
                                      parse_world_sizes)
    from dsv4core.conformance import runner
    from dsv4core.conformance.report import write_json, write_junit, write_markdown, write_table

    def err(msg: str) -> int:
        print(f"dsv4core conformance: error: {msg}", file=sys.stderr)
        return 2

    if args.action == "merge":
        try:
            return _merge(args)
        except ConformanceError as e:
            return err(str(e))
    if args.reports:
        return err(f"unexpected arguments {' '.join(args.reports)} (only `merge` takes report files)")
    if not args.backend:
        return err("--backend NAME is required (or `dsv4core conformance merge REPORT.json...`)")
    if args.html or args.svg:
        return err("--html / --svg apply to `merge` only")
    try:
        parse_ops(args.ops)
        parse_shapes(args.shapes)
        dtypes = parse_dtypes(args.dtype)
        import torch

        try:
            torch.empty(0, device=args.device)
        except Exception as e:
            return err(f"device {args.device!r} is not usable: {e}")
        backend = load_backend(args.backend, args.device)
        world_sizes = parse_world_sizes(args.world_sizes)
    except ConformanceError as e:
        return err(str(e))

    progress = None if args.quiet else _Progress(sys.stderr)
    if progress:
        progress.note(f"dsv4core conformance: backend {backend.name!r} {backend.version}, device {args.device}, "
                      f"shapes {args.shapes}, dtypes {args.dtype}, seed {args.seed}")
    isolate = args.require_all if args.isolate is None else args.isolate
    try:
        report = runner.run(backend, ops=args.ops, shapes=args.shapes, dtypes=dtypes, device=args.device,
                            seed=args.seed, progress=progress, world_sizes=world_sizes,
                            dist_backend=args.dist_backend, dist_device=args.dist_device, dist_ref=args.backend,
                            isolate=isolate, jobs=args.jobs)
    except ConformanceError as e:
        return err(str(e))
    report.require_all = args.require_all
    if not args.no_model:
        from dsv4core.conformance.model_check import check_model

        if progress:
            progress(f"model check ({args.model}) ...")
        report.model = check_model(backend, args.model, tuple(str(d).replace("torch.", "") for d in dtypes),
                                   args.device, args.seed)
        from dsv4core.hal import oracle

        refusal = oracle.refusal(f"it changed during the model check of backend {backend.name!r}")
        if refusal:
            return err(refusal)
    if progress:
        progress.end()
    write_table(report, sys.stdout)    # the one copy of every result line
    for path, writer in ((args.json, write_json), (args.junit, write_junit), (args.markdown, write_markdown)):
        if path:
            writer(report, path)
    return report.exit_code(require_all=args.require_all)


class _Progress:
    """Where the run is, on stderr, without repeating the report (the table on stdout holds every
    result): on a terminal the current op's line, rewritten in place and erased at the end;
    otherwise (a log) a plain line at most every `every` seconds."""

    def __init__(self, stream, every: float = 10.0) -> None:
        self.stream, self.every = stream, every
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.t0 = self.last = time.perf_counter()
        self.done = 0
        self.live = False

    def note(self, line: str) -> None:
        """A line that stays (the run's header)."""
        self.stream.write(line + "\n")
        self.stream.flush()

    def __call__(self, line: str) -> None:
        """A finished op's line from the runner (or a step such as the model check)."""
        head = line.splitlines()[0] if line else ""
        if not head.startswith("model check"):
            self.done += 1
        now = time.perf_counter()
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.stream.write("\r\x1b[K" + f"[{now - self.t0:5.0f}s] {self.done} ops done; {head}"[:width])
            self.live = True
        elif now - self.last >= self.every or head.startswith("model check"):
            self.stream.write(f"conformance: {self.done} ops done after {now - self.t0:.0f}s; last: {head.split()[0]}\n"
                              if not head.startswith("model check") else f"conformance: {head}\n")
            self.last = now
        self.stream.flush()

    def end(self) -> None:
        if self.live:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.live = False


def _merge(args) -> int:
    from dsv4core.conformance import matrix

    cols = matrix.load_reports(args.reports)
    md = matrix.markdown(cols)
    outputs = ((args.markdown, md), (args.html, args.html and matrix.html_page(cols)),
               (args.svg, args.svg and matrix.svg_heatmap(cols)))
    for path, text in outputs:
        if path:
            with open(path, "w") as f:
                f.write(text)
    if not any(path for path, _ in outputs):
        sys.stdout.write(md)
    return 0


def main(argv=None) -> int:
    """Standalone entry (``python -m dsv4core.commands.conformance --backend NAME``), same as
    ``dsv4core conformance``."""
    import argparse
    import logging

    parser = argparse.ArgumentParser(prog="dsv4core")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["conformance", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
