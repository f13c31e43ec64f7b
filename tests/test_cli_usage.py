"""What a user meets at the command line: strict `--input-ids`, one-line usage errors (exit 2),
a quiet exit on a closed pipe, progress that never writes a carriage return into a log, and
`bench` on the reference backend on the CPU with a header true to the device."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsv4core.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _run(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("ids, said", [
    ("1 2 3", "separate ids with commas, not spaces"),     # never the single token 123
    ("1,,2", "an empty item"),
    ("1,", "an empty item"),
    ("1,abc", "'abc' is not an integer"),
    ("1,2-3", "'2-3' is not an integer"),
    ("-3,4", "token ids must be >= 0, got -3"),             # read as a value, refused as a negative id
])
def test_input_ids_are_parsed_strictly_with_one_line_errors(ids, said, capsys):
    code, err = _run(["generate", "--model", "tiny", "--input-ids", ids], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "dsv4core generate: error: argument --input-ids" in err and said in err


def test_input_ids_accept_spaces_after_commas():
    from dsv4core.commands.generate import _ids

    assert _ids("0, 17,42 ,7") == [0, 17, 42, 7] and _ids("5") == [5]


def test_a_missing_device_is_a_one_line_usage_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert main(["generate", "--model", "tiny", "--input-ids", "1,2", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device cuda: no cuda device is available" in err
    assert main(["generate", "--model", "tiny", "--input-ids", "1,2", "--device", "gpu0"]) == 2
    assert "'gpu0' is not a torch device" in capsys.readouterr().err


def test_json_to_a_closed_pipe_exits_quietly():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    p = subprocess.run(f"{sys.executable} -m dsv4core backends --json | head -c 1", shell=True, cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120,
                       executable="/bin/bash")
    assert p.stdout == "["
    assert "Broken pipe" not in p.stderr and "Traceback" not in p.stderr, p.stderr


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_generate_progress_rewrites_a_terminal_line_and_writes_plain_lines_to_a_log(monkeypatch):
    from dsv4core.commands import generate

    clock = iter([0.0, 2.0, 3.0, 15.0, 16.0] * 2)
    monkeypatch.setattr(generate.time, "perf_counter", lambda: next(clock))
    tty, log = _Tty(), io.StringIO()
    for stream in (tty, log):
        p = generate._Progress(True, stream=stream, every=10.0)    # t0 = 0
        for step in (1, 2, 3, 4):                                  # at 2 s, 3 s, 15 s, 16 s
            p(step, 4)
    assert tty.getvalue().count("\r") == 4 and tty.getvalue().endswith("4/4 tokens, 0.2 tokens/s\n")
    assert "\r" not in log.getvalue()
    # a log: the first line (after 1 s), the next one 10 s later, and the last
    assert [ln.split(",")[0] for ln in log.getvalue().splitlines()] == [
        "generate: 1/4 tokens", "generate: 3/4 tokens", "generate: 4/4 tokens"]


def test_bench_on_the_reference_runs_on_the_cpu_and_says_how_it_timed(monkeypatch):
    from dsv4core import bench

    monkeypatch.setattr(bench, "measure_ceilings", lambda device, timer: {"copy_GBps": 10.0, "bf16_mm_TFLOPs": 0.1})
    res = bench.run_bench("reference", ["rms_norm"], "small", [1], compile_ref=False, reps=1, log=lambda s: None,
                          compare="none")
    assert res["device"] == "cpu" and res["rows"][0]["status"] == "ok"
    md = bench.markdown(res)
    assert "host wall-clock" in md and "CUDA" not in md


def test_bench_options_have_help():
    from dsv4core.cli import build_parser

    text = build_parser()._subparsers._group_actions[0].choices["bench"].format_help()
    assert "DSV4-Flash" in text and "timed calls per op" in text


def test_tables_fit_the_given_width_by_wrapping_the_widest_column():
    from dsv4core._table import print_table

    rows = [("cuda", "no: " + "torch was built without CUDA support " * 4, "x"), ("reference", "yes", "y")]
    wide, narrow = io.StringIO(), io.StringIO()
    print_table(("backend", "available", "ops"), rows, file=wide)
    print_table(("backend", "available", "ops"), rows, file=narrow, width=60)
    assert max(map(len, wide.getvalue().splitlines())) > 60 and len(wide.getvalue().splitlines()) == 4
    lines = narrow.getvalue().splitlines()
    assert max(map(len, lines)) <= 60 and len(lines) > 4
    # nothing lost: the wrapped words are all there, in order
    assert " ".join(ln[11:11 + 45].strip() for ln in lines[2:-1] if ln[11:11 + 45].strip()).split() == rows[0][1].split()
