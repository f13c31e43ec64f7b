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
    from dsv4core.commands.generate import _threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _threads(_gen_args()) == 1 and _threads(_gen_args(model="tiny-official")) == 1
    assert _threads(_gen_args(model="/ckpt/dir")) is None          # a checkpoint: torch's choice
    assert _threads(_gen_args(device="cuda")) is None
    assert _threads(_gen_args(threads=3)) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")                     # the user's choice stands
    assert _threads(_gen_args()) is None
    with pytest.raises(ValueError, match="--threads must be >= 1, got 0"):
        _threads(_gen_args(threads=0))


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
