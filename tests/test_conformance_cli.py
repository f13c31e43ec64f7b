"""The conformance CLI, its reports, the pytest entry and the model-level check."""

from __future__ import annotations

import json
from pathlib import Path
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from dsv4core.commands.conformance import main
from dsv4core.conformance import FAILED, PASSED
from dsv4core.conformance.model_check import check_model

from conformance_backends import make_alt_backend, make_broken_backend


def test_cli_reference_subset_writes_all_reports(tmp_path, capsys):
    j, x, m = tmp_path / "r.json", tmp_path / "r.xml", tmp_path / "r.md"
    rc = main(["--backend", "reference", "--ops", "rms_norm,indexer_topk,moe_route", "--no-model",
               "--json", str(j), "--junit", str(x), "--markdown", str(m), "--seed", "3"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "worst err/bound" in out and "result: PASSED" in out        # final table on stdout
    # one copy of each result: stderr (not a terminal here) has the header, no per-op result lines
    assert "dsv4core conformance: backend 'reference'" in err
    assert "PASSED" not in err and "rms_norm" not in err and "\r" not in err
    data = json.loads(j.read_text())
    assert data["backend"] == "reference" and data["seed"] == 3 and not data["failed"] and data["complete"]
    assert [o["op"] for o in data["ops"]] == ["rms_norm", "indexer_topk", "moe_route"]
    assert data["ops"][0]["tolerance"]["why"]
    case = data["ops"][0]["cases"][0]
    assert {"id", "status", "checks"} <= set(case) and {"err", "err_ref", "bound"} <= set(case["checks"][0])
    root = ET.parse(x).getroot()
    assert int(root.get("tests")) == sum(len(o["cases"]) for o in data["ops"]) and root.get("failures") == "0"
    assert "| rms_norm | passed |" in m.read_text()
    # which code ran: the digest of the dsv4core sources (the reference backend: nothing else)
    import dsv4core
    from dsv4core.conformance.provenance import tree_digest
    assert data["sources"] == {"dsv4core": tree_digest(Path(dsv4core.__file__).parent)}
    assert f"sources: dsv4core {data['sources']['dsv4core']}" in out


def test_tree_digest_follows_paths_and_bytes(tmp_path):
    """tree_digest changes with a file's bytes, with its path, and with a new .py file; not with
    other files."""
    from dsv4core.conformance.provenance import tree_digest

    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "sub" / "b.py").write_text("y = 2\n")
    d0 = tree_digest(tmp_path / "pkg")
    assert len(d0) == 16 and d0 == tree_digest(tmp_path / "pkg")
    (tmp_path / "pkg" / "notes.txt").write_text("ignored")
    assert tree_digest(tmp_path / "pkg") == d0
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    d1 = tree_digest(tmp_path / "pkg")
    assert d1 != d0
    (tmp_path / "pkg" / "sub" / "b.py").rename(tmp_path / "pkg" / "b.py")
    assert tree_digest(tmp_path / "pkg") != d1


@pytest.mark.parametrize("argv, what", [
    (["--backend", "no-such-backend"], "unknown backend"),
    (["--backend", "reference", "--ops", "rms_norm,bogus"], "unknown op 'bogus'"),
    (["--backend", "reference", "--shapes", "giant"], "unknown shape set"),
    (["--backend", "reference", "--dtype", "int8"], "unsupported dtype"),
    (["--backend", "reference", "--device", "nodevice"], "device"),
])
def test_cli_bad_arguments_exit_2(argv, what, capsys):
    assert main(argv + ["--no-model"]) == 2
    assert what in capsys.readouterr().err


def test_cli_unloadable_backend_exit_2(capsys):
    from dsv4core.hal import discover

    broken = [n for n, st in discover().items() if not st.available]
    if not broken:
        pytest.skip("no unavailable backend installed")
    assert main(["--backend", broken[0], "--no-model"]) == 2
    assert "cannot be loaded" in capsys.readouterr().err


def test_cli_failing_backend_exit_1_and_junit_failures(tmp_path, monkeypatch, capsys):
    from dsv4core.conformance import cases

    broken = make_broken_backend("hc-post-comb-transposed")
    # The package resolves load_backend lazily from cases: patch cases only (patching both made
    # older pytest restore the package attribute to the patched value, leaking it).
    monkeypatch.setattr(cases, "load_backend", lambda name, device="cpu": broken)
    x = tmp_path / "r.xml"
    rc = main(["--backend", "whatever", "--ops", "mhc", "--dtype", "float32", "--no-model", "--junit", str(x)])
    out = capsys.readouterr().out
    assert rc == 1
    assert "hc_post" in out and "failed" in out and "bound" in out
    root = ET.parse(x).getroot()
    assert int(root.get("failures")) > 0
    fails = [tc.get("name") for tc in root.iter("testcase") if tc.find("failure") is not None]
    assert fails and all(n.startswith("hc_post[") for n in fails)


def test_model_check_alt_passes_and_broken_fails():
    good = check_model(make_alt_backend(), "tiny", ("float32",), steps=8, fp8=False)
    if good["status"] == "unavailable":
        pytest.skip(good["reason"])
    assert good["status"] == PASSED, good
    run = good["runs"][0]
    assert run["logits_error"] <= run["logits_bound"] and run["greedy_agreement"] == 1.0
    bad = check_model(make_broken_backend("rope-neox-pairs"), "tiny", ("float32",), steps=8, fp8=False)
    assert bad["status"] == FAILED and bad["runs"][0]["logits_error"] > bad["runs"][0]["logits_bound"]


def test_pytest_entry_one_item_per_case(tmp_path):
    x = tmp_path / "j.xml"
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "pytest", "--pyargs",
           "dsv4core.conformance", "--dsv4core-backend", "reference", "--dsv4core-ops", "rms_norm,hc_post",
           "--dsv4core-dtype", "float32", "--dsv4core-no-model", "-q", "-p", "no:cacheprovider",
           f"--junitxml={x}"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    names = [tc.get("name") for tc in ET.parse(x).getroot().iter("testcase")]
    assert any(n.startswith("test_op[rms_norm-small-float32-T0") for n in names)
    assert sum(n.startswith("test_op[") for n in names) > 10


def test_pytest_entry_unknown_backend_is_a_usage_error(tmp_path):
    cmd = [sys.executable, "-m", "pytest", "--pyargs",
           "dsv4core.conformance", "--dsv4core-backend", "no-such-backend", "-q", "-p", "no:cacheprovider"]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode != 0 and "unknown backend" in p.stdout + p.stderr


# ---------------------------------------------------------------------------------------------
# Exit status and the result line agree (a run that verified nothing must not say "PASSED")
# ---------------------------------------------------------------------------------------------

def _cli(monkeypatch, capsys, backend, argv):
    from dsv4core.conformance import cases

    monkeypatch.setattr(cases, "load_backend", lambda name, device="cpu": backend)
    rc = main(["--backend", "x", "--no-model", "-q", *argv])
    out = capsys.readouterr().out
    return rc, out.split("result: ", 1)[1].strip()


def test_cli_nothing_verified_has_its_own_exit_code(monkeypatch, capsys):
    """A backend whose only op declines every call verified nothing: exit 3, never 'PASSED'."""
    from conformance_backends import ALT_IMPLS, make_backend

    be = make_backend("declines", {"rms_norm": ALT_IMPLS["rms_norm"]},
                      supports={"rms_norm": lambda x, weight, eps: False})
    for extra in ([], ["--require-all"], ["--ops", "rms_norm"]):
        rc, result = _cli(monkeypatch, capsys, be, ["--dtype", "float32", *extra])
        assert rc == 3 and result.startswith("NOTHING VERIFIED") and "PASSED" not in result, (extra, result)


def test_cli_require_all_partial_is_incomplete_not_passed(monkeypatch, capsys):
    from conformance_backends import ALT_IMPLS, make_backend

    be = make_backend("partial", {"rms_norm": ALT_IMPLS["rms_norm"]})
    rc, result = _cli(monkeypatch, capsys, be, ["--ops", "rms_norm,hc_post", "--dtype", "float32"])
    assert rc == 0 and result.startswith("PASSED for the implemented ops") and "hc_post" in result
    rc, result = _cli(monkeypatch, capsys, be, ["--ops", "rms_norm,hc_post", "--dtype", "float32", "--require-all"])
    assert rc == 1 and result.startswith("INCOMPLETE") and "PASSED" not in result and "hc_post" in result
    # --ops X --require-all: complete for the selected op only, and it says so
    rc, result = _cli(monkeypatch, capsys, be, ["--ops", "rms_norm", "--dtype", "float32", "--require-all"])
    assert rc == 0 and "complete for the 1 selected op(s)" in result and "every op" not in result


@pytest.mark.parametrize("kind,fn", [
    ("modified input", lambda x, weight, eps: x.mul_(1.0 + 2 ** -10)),
    ("dtype", lambda x, weight, eps: x.double()),
])
def test_cli_structural_failure_shows_its_reason_not_a_ratio(monkeypatch, capsys, kind, fn, tmp_path):
    from conformance_backends import make_backend

    j = tmp_path / "r.json"
    rc, result = _cli(monkeypatch, capsys, make_backend("s", {"rms_norm": fn}),
                      ["--ops", "rms_norm", "--dtype", "float32", "--json", str(j)])
    assert rc == 1 and result.startswith("FAILED")
    data = json.loads(j.read_text())
    op = data["ops"][0]
    assert op["status"] == FAILED and op["failure_kinds"] == [kind]
    failed = [c for c in op["cases"] if c["status"] == FAILED]
    assert failed and all(c["failure"] == kind and c["worst_ratio"] is None for c in failed)
    main(["--backend", "x", "--no-model", "-q", "--ops", "rms_norm", "--dtype", "float32"])
    row = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("rms_norm")][0]
    assert row.rstrip().endswith(f"failed: {kind}"), row


# ---------------------------------------------------------------------------------------------
# dsv4core conformance merge: the compatibility matrix
# ---------------------------------------------------------------------------------------------

def test_merge_renders_the_matrix_from_two_real_reports(tmp_path, capsys):
    a, b = tmp_path / "ref.json", tmp_path / "example.json"
    assert main(["--backend", "reference", "--ops", "rms_norm,hc_post", "--dtype", "float32", "--no-model", "-q",
                 "--json", str(a)]) == 0
    assert main(["--backend", "example", "--ops", "rms_norm,hc_post,hc_pre", "--dtype", "float32", "--no-model",
                 "-q", "--json", str(b)]) in (0, 1)
    md, page, svg = tmp_path / "m.md", tmp_path / "m.html", tmp_path / "m.svg"
    capsys.readouterr()
    assert main(["merge", str(a), str(b), "--markdown", str(md), "--html", str(page), "--svg", str(svg)]) == 0
    text = md.read_text()
    rows = {ln.split("|")[1].strip(): [c.strip() for c in ln.split("|")[2:-1]] for ln in text.splitlines()
            if ln.startswith("| ") and ln.count("|") == 4}
    ex = json.loads(b.read_text())["summary"]
    assert rows["rms_norm"][0].startswith("passed") and rows["hc_pre"][0] == "not run"
    assert rows["hc_pre"][1] == ex["hc_pre"]["status"] and rows["*device*"] == ["cpu", "cpu"]
    # the code each report verified: its source digests (the example plugin's package in its column)
    src = [json.loads(p.read_text())["sources"] for p in (a, b)]
    assert rows["*sources*"] == [", ".join(f"{k} {v}" for k, v in d.items()) for d in src]
    assert "dsv4core_example_plugin" in rows["*sources*"][1] and "dsv4core " in rows["*sources*"][0]
    assert "`reference`" in text and "`example`" in text
    assert "<table>" in page.read_text() and "<svg" in page.read_text()
    assert svg.read_text().startswith("<svg") and "rms_norm" in svg.read_text()


def test_merge_rejects_what_is_not_a_report_naming_the_file(tmp_path, capsys):
    good = tmp_path / "good.json"
    assert main(["--backend", "reference", "--ops", "rms_norm", "--dtype", "float32", "--no-model", "-q",
                 "--json", str(good)]) == 0
    old = json.loads(good.read_text())
    old["schema_version"] = 1
    cases = {"junk.json": "not json", "other.json": json.dumps({"a": 1}), "old.json": json.dumps(old)}
    for name, content in cases.items():
        (tmp_path / name).write_text(content)
        capsys.readouterr()
        assert main(["merge", str(good), str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert name in err and ("schema version 1" in err if name == "old.json" else "report" in err), err
    assert main(["merge"]) == 2 and "at least one" in capsys.readouterr().err


def test_patching_cases_load_backend_does_not_leak_into_the_package(monkeypatch):
    """The CLI finds backends through the package's lazy attribute; a test patch of the defining
    module's function is seen there and leaves nothing behind (a leak once made later tests run a
    broken backend under the name 'reference')."""
    import dsv4core.conformance as pkg
    from dsv4core.conformance import cases

    assert "load_backend" not in vars(pkg)
    with monkeypatch.context() as m:
        m.setattr(cases, "load_backend", lambda name, device="cpu": None)
        assert pkg.load_backend("reference") is None
    assert pkg.load_backend is cases.load_backend and "load_backend" not in vars(pkg)


def test_source_digests_name_the_plugin_and_hash_only_its_code(tmp_path, monkeypatch):
    """The package of the backend's entry point (``module:attr`` form too) is hashed; a one-file
    plugin hashes its own file, not the folder it sits in; a missing source is named, not skipped."""
    import importlib
    import sys
    import types

    from dsv4core.conformance import provenance
    from dsv4core.hal import Backend

    (tmp_path / "one_file_plugin.py").write_text("X = 1\n")
    (tmp_path / "unrelated.py").write_text("Y = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("one_file_plugin")
    monkeypatch.setitem(sys.modules, "no_file_pkg", types.ModuleType("no_file_pkg"))
    try:
        be = Backend(name="fake-one-file")
        status = types.SimpleNamespace(source="some-dist (one_file_plugin:make_backend)")
        monkeypatch.setattr(provenance, "discover", lambda: {"fake-one-file": status})
        d = provenance.source_digests(be)
        assert set(d) == {"dsv4core", "one_file_plugin"}
        assert d["one_file_plugin"] == provenance.tree_digest(tmp_path / "one_file_plugin.py")
        (tmp_path / "unrelated.py").write_text("Y = 3\n")           # not part of the plugin
        assert provenance.source_digests(be)["one_file_plugin"] == d["one_file_plugin"]
        (tmp_path / "one_file_plugin.py").write_text("X = 2\n")
        assert provenance.source_digests(be)["one_file_plugin"] != d["one_file_plugin"]
        status.source = "some-dist (no_file_pkg)"
        assert provenance.source_digests(be)["no_file_pkg"] == "unknown (no source file)"
    finally:
        sys.modules.pop("one_file_plugin", None)


def test_progress_on_a_terminal_is_one_line_rewritten_and_erased():
    import io

    from dsv4core.commands.conformance import _Progress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, log = Tty(), io.StringIO()
    for stream in (tty, log):
        p = _Progress(stream, every=3600.0)
        p.note("header")
        p("rms_norm               PASSED   4 passed, 0 failed, 0 declined  (0.1s)")
        p("rope                   PASSED   4 passed, 0 failed, 0 declined  (0.1s)")
        p.end()
    assert tty.getvalue().startswith("header\n") and tty.getvalue().endswith("\r\x1b[K")
    assert tty.getvalue().count("\n") == 1 and "2 ops done; rope" in tty.getvalue()
    assert log.getvalue() == "header\n"           # a log: nothing until `every` seconds have passed


def test_jobs_give_the_single_process_report(tmp_path, capsys):
    """--jobs N: the same cases, statuses and err/bound ratios, in the same order, as one process."""
    from dsv4core.conformance import ConformanceError, runner
    from conformance_backends import make_alt_backend

    ops = "rms_norm,indexer_topk,moe_route"
    one = runner.run("reference", ops=ops, shapes="small,flash", dtypes="float32")
    two = runner.run("reference", ops=ops, shapes="small,flash", dtypes="float32", jobs=2)

    def rows(r):
        return [(c.id, c.status, None if c.worst is None else c.worst.ratio) for o in r.ops for c in o.cases]

    assert [o.op for o in two.ops] == ops.split(",") and rows(two) == rows(one) and len(rows(one)) > 40
    assert two.verdict() == one.verdict()
    with pytest.raises(ConformanceError, match="jobs=2 needs a backend found by name"):
        runner.run(make_alt_backend(), ops="rms_norm", jobs=2)


def test_jobs_count_a_rejected_op_once():
    """A parallel run's pieces of a rejected op: only the first shape set's piece reports the
    failed registration, as one process does."""
    from types import SimpleNamespace

    from dsv4core.conformance import runner
    from dsv4core.hal import catalogue

    be = SimpleNamespace(impls={}, rejected={"rms_norm": "contract check failed"})
    spec = catalogue()["rms_norm"]
    first = runner._run_op(be, spec, ("small",), ("float32",), "cpu", 0)
    later = runner._run_op(be, spec, ("flash",), ("float32",), "cpu", 0, registration=False)
    assert [c.case for c in first.cases] == ["<registration>"] and first.status == FAILED
    assert later.cases == [] and later.implemented
