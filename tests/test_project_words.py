"""The repository speaks of the project only: no words about work sessions, issue numbers of a
tracker the repository does not have, the machines a measurement was made on as "lent", or paths
outside the repository, in code, comments, docs, tests, file names or result names. (Result
files' contents are data and are not scanned; their names are.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: a work-log word, an issue number, a lent machine, a path outside the repository
WORDS = re.compile(r"\b(issue|session) ?#?\d+\b|\bthis session\b|\bwork ?sessions?\b|\blent (gpu|machine|h200)\b"
                   r"|\.\./shared\b|\bwork[- ]log\b", re.I)
#: result names made after work runs (s18, s23-final, run2, issue10)
RESULT_NAME = re.compile(r"(^|[-_/.])(s\d{2}|run\d+|issue\d+|session\d*)([-_/.]|$)", re.I)
THIS = Path(__file__).relative_to(ROOT).as_posix()


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.fail("git ls-files failed: this check needs the repository's git checkout")
    return [p for p in out.splitlines() if p]


def test_no_process_words_in_the_tree():
    bad = []
    for rel in _tracked():
        if rel == THIS or rel.startswith("benchmarks/results/"):
            continue
        path = ROOT / rel
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if WORDS.search(line):
                bad.append(f"{rel}:{n}: {line.strip()[:120]}")
    assert not bad, "process words in the tree:\n" + "\n".join(bad)


def test_no_work_run_names_in_file_or_result_names():
    bad = [rel for rel in _tracked() if RESULT_NAME.search(rel.lower()) or WORDS.search(rel)]
    assert not bad, bad


def test_the_patterns_find_what_they_are_for():
    for text in ("see issue 13", "measured in session 18", "on a lent GPU machine", "../shared/docs/X.md",
                 "the work log"):
        assert WORDS.search(text), text
    for name in ("bench-cuda-h200-s18-read.json", "conformance-issue10.json", "e2e-run2.json"):
        assert RESULT_NAME.search(name), name
    for ok in ("issue rate 251 warp-instructions", "pytest's session fixture", "tests/test_sampling.py",
               "sm90-aot", "h200/2026-12-02_bdb1848/conformance/cuda-all-ops.json"):
        assert not WORDS.search(ok) and not RESULT_NAME.search(ok), ok
