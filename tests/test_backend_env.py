"""One precedence rule for the backend choice wherever it defaults: an explicit argument >
DSV4CORE_BACKEND / DSV4CORE_OPS > auto (load_model, build_model, dsv4core generate, bind)."""

from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stdout

import pytest

import dsv4core
from dsv4core.hal import BackendNotFoundError, HALError, backend_request, bind
from dsv4core.model.api import TINY_CONFIG, build_model


def test_backend_request_precedence(monkeypatch):
    assert backend_request(None) == "auto"
    monkeypatch.setenv("DSV4CORE_BACKEND", "reference")
    assert backend_request(None) == "reference"
    assert backend_request("auto") == "auto"          # explicit wins, even "auto"
    assert backend_request("other") == "other"


@pytest.mark.parametrize("entry", ["load_model", "build_model"])
def test_env_backend_is_honoured_by_the_model_api(monkeypatch, entry):
    make = {"load_model": lambda **kw: dsv4core.load_model("tiny", **kw),
            "build_model": lambda **kw: build_model(TINY_CONFIG, seed=0, **kw)}[entry]
    monkeypatch.setenv("DSV4CORE_BACKEND", "no-such-backend")
    with pytest.raises(BackendNotFoundError, match="no-such-backend"):
        make()
    m = make(backend="reference")                      # the explicit argument wins
    assert m.backend == "reference"
    monkeypatch.setenv("DSV4CORE_BACKEND", "reference")
    m = make()
    assert m.backend == "reference" and {r["backend"] for r in m.hal_report()} == {"reference"}


def test_env_ops_is_honoured_by_load_model(monkeypatch):
    monkeypatch.setenv("DSV4CORE_OPS", "rms_norm=no-such-backend")
    with pytest.raises(HALError, match="no-such-backend"):
        dsv4core.load_model("tiny")


def test_bind_explicit_ops_win_over_env(monkeypatch):
    monkeypatch.setenv("DSV4CORE_OPS", "rms_norm=no-such-backend")
    with pytest.raises(HALError, match="no-such-backend"):
        bind("cpu")
    assert bind("cpu", ops={}).rms_norm is not None


def _generate(argv):
    from dsv4core.commands import generate

    parser = argparse.ArgumentParser()
    generate.add_parser(parser.add_subparsers())
    args = parser.parse_args(["generate", "--model", "tiny", "--input-ids", "1,2,3", "--max-new-tokens", "2",
                              "--json", "--no-progress", *argv])
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = args.func(args)
    return rc, buf.getvalue()


def test_env_backend_is_honoured_by_generate(monkeypatch):
    monkeypatch.setenv("DSV4CORE_BACKEND", "no-such-backend")
    with pytest.raises(BackendNotFoundError, match="no-such-backend"):
        _generate([])
    rc, out = _generate(["--backend", "reference"])
    assert rc == 0 and json.loads(out)["backend"] == "reference"
    monkeypatch.setenv("DSV4CORE_BACKEND", "reference")
    rc, out = _generate([])
    assert rc == 0 and json.loads(out)["backend"] == "reference"
