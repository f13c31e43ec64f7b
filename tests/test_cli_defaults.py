"""CLI defaults a user meets without asking: the CPU thread count of `generate` (1 for the
built-in tiny models unless the user set one), load and bench progress on stderr (a terminal:
one line rewritten; a log: plain lines, never a carriage return), the `ops` table's header."""

from __future__ import annotations

import argparse

import pytest


def _gen_args(**kw):
    base = dict(threads=None, device="cpu", model="tiny")
    base.update(kw)
    return argparse.Namespace(**base)


def test_generate_threads_default_to_one_for_the_tiny_models_on_the_cpu(monkeypatch):
    from dsv4core.commands import generate
    from dsv4core.commands.generate import _threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _threads(_gen_args()) == 1 and _threads(_gen_args(model="tiny-official")) == 1
    assert _threads(_gen_args(model="/ckpt/dir")) is None          # a checkpoint: decided once its config is read
    assert _threads(_gen_args(model="/ckpt/dir"), 256) == 1         # the largest hidden size measured on one thread
    monkeypatch.setattr(generate, "physical_cores", lambda: 6)
    assert _threads(_gen_args(model="/ckpt/dir"), 4096) == 6       # else a thread a physical core
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _threads(_gen_args(model="/ckpt/dir"), 4096) == 1       # shared among a host's ranks (6 // 4)
    assert _threads(_gen_args(device="cuda")) is None
    assert _threads(_gen_args(threads=3)) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")                     # the user's choice stands
    assert _threads(_gen_args()) is None
    with pytest.raises(ValueError, match="--threads must be >= 1, got 0"):
        _threads(_gen_args(threads=0))


def test_physical_cores_count_the_affinity_mask_once_per_core(monkeypatch):
    import os

    from dsv4core.commands.generate import physical_cores

    mask = sorted(os.sched_getaffinity(0))
    assert 1 <= physical_cores() <= len(mask)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {mask[0]})
    assert physical_cores() == 1


def test_generate_sets_and_reports_the_thread_count(monkeypatch, capsys):
    import json

    import torch

    from dsv4core.cli import main

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        assert main(["generate", "--model", "tiny", "--backend", "reference", "--input-ids", "1,2",
                     "--max-new-tokens", "2", "--json", "--no-progress", "--threads", "2"]) == 0
        assert json.loads(capsys.readouterr().out)["threads"] == torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_checkpoint_gets_the_default_of_its_hidden_size(monkeypatch, capsys, tmp_path):
    """The thread count of a checkpoint is decided once its config is read: hidden 64 -> 1."""
    import json

    import torch

    import dsv4core
    from dsv4core.checkpoint.writer import write_transformers
    from dsv4core.cli import main
    from dsv4core.model.api import TINY_CONFIG

    write_transformers(dsv4core.load_model("tiny", backend="reference").state_dict(),
                       dict(TINY_CONFIG, dtype="float32"), tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert main(["generate", "--model", str(tmp_path), "--backend", "reference", "--input-ids", "1,2",
                     "--max-new-tokens", "1", "--json", "--no-progress"]) == 0
        assert json.loads(capsys.readouterr().out)["threads"] == torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


class _Stream:
    def __init__(self, tty: bool):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def _clock(times):
    it = iter(times)
    return lambda: next(it)


def test_status_line_rewrites_a_terminal_and_writes_plain_lines_only_when_asked():
    from dsv4core._progress import StatusLine

    tty = _Stream(True)
    s = StatusLine(stream=tty, clock=_clock([0, 1, 2]))
    s.update("load: 10 MiB")
    s.update("load: 5 MiB")                 # shorter: the rest of the longer line is blanked
    s.log("a result")                       # the status line cleared, the result on its own line
    s.close()
    assert tty.text == "\rload: 10 MiB" + "\rload: 5 MiB " + "\r" + " " * 11 + "\r" + "a result\n"

    log = _Stream(False)
    s = StatusLine(stream=log, clock=_clock([0, 1, 2]))     # a log, no flag: nothing but results
    s.update("x")
    s.log("row")
    s.close()
    assert log.text == "row\n"

    log = _Stream(False)
    s = StatusLine(stream=log, lines=True, every=10.0, clock=_clock([0, 1, 5, 12, 13, 14]))
    for i in range(1, 5):
        s.update(f"step {i}")               # t = 1, 5, 12, 13: lines at 1 and 12 (10 s apart)
    s.update("step 5", final=True)          # the last one always
    s.close()
    assert log.text == "step 1\nstep 3\nstep 5\n" and "\r" not in log.text


def test_a_short_run_shows_no_progress():
    from dsv4core._progress import StatusLine

    tty = _Stream(True)
    s = StatusLine(stream=tty, delay=1.0, clock=_clock([0, 0.2, 0.5]))
    s.update("a")
    s.update("b", final=True)
    s.close()
    assert tty.text == ""


def test_checkpoint_load_reports_bytes_per_tensor(tmp_path):
    from dsv4core import load_model
    from dsv4core.checkpoint import load_progress, open_checkpoint
    from dsv4core.checkpoint.writer import write_transformers
    from dsv4core.model.api import TINY_CONFIG

    tiny = load_model("tiny", backend="reference")
    write_transformers(tiny.state_dict(), dict(TINY_CONFIG, dtype="float32"), tmp_path)
    seen = []
    with load_progress(lambda done, total, shard: seen.append((done, total, shard))):
        load_model(tmp_path, backend="reference")
    stored = sum(i.nbytes for i in open_checkpoint(tmp_path).infos().values())
    assert seen and all(t == stored for _, t, _ in seen) and seen[-1][0] == stored
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
    assert {s for _, _, s in seen} == {f.name for f in open_checkpoint(tmp_path).files}
    seen.clear()
    load_model(tmp_path, backend="reference")          # outside the block: no callback
    assert seen == []


def test_bench_rows_go_to_stderr_the_table_once_to_stdout(monkeypatch, capsys):
    from dsv4core import bench
    from dsv4core.cli import main

    monkeypatch.setattr(bench, "measure_ceilings", lambda device, timer: {"copy_GBps": 10.0, "bf16_mm_TFLOPs": 0.1})
    argv = ["bench", "--backend", "reference", "--ops", "rms_norm", "--shapes", "small", "--tokens", "1,2",
            "--reps", "1", "--no-compile", "--compare", "none"]
    assert main(argv + ["--progress"]) == 0
    out, err = capsys.readouterr()
    assert out.count("| rms_norm | 1 |") == 1 and "T=1" not in out
    assert "bench: case 1/2: rms_norm T=1" in err and "bench: case 2/2: rms_norm T=2" in err and "\r" not in err
    assert err.count("rms_norm               T=1") == 1
    assert main(argv) == 0                              # not a terminal, no flag: no progress lines
    assert "bench: case" not in capsys.readouterr().err


def test_the_ops_table_names_every_column_and_its_header_lines_up(capsys):
    from dsv4core.cli import main

    assert main(["ops"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rule = lines[0], lines[1]
    starts = [i for i in range(len(rule)) if rule[i] == "-" and (i == 0 or rule[i - 1] == " ")]
    names = [header[a:b].strip() for a, b in zip(starts, starts[1:] + [len(header) + 1])]
    assert names == ["op", "family", "served by", "notes", "declined / limits / deprecation"]
    assert all(header[i] != " " and (i == 0 or header[i - 1] == " ") for i in starts)
    flagged = [ln for ln in lines[2:] if "deprecated: " in ln]
    assert flagged, "the catalogue has deprecated ops: their reason is shown"
    notes = slice(starts[3], starts[4])
    assert all(ln[notes].strip() in ("", "fallback", "deprecated", "fallback, deprecated") for ln in lines[2:])
