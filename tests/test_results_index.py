"""benchmarks/results/ is data: every file sits at <system>/<date>_<commit>/<kind>/<name> with a
system.json per system, INDEX.md is what benchmarks/index_results.py generates from the files, and
every result path the docs, plugins, benchmarks and code cite exists."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from _scripts import load_script

ROOT = Path(__file__).resolve().parents[1]


def _index_module():
    return load_script("index_results")


def test_committed_index_is_the_generated_one():
    mod = _index_module()
    committed = (mod.RESULTS / "INDEX.md").read_text()
    assert committed == mod.render(), "INDEX.md is stale: run python benchmarks/index_results.py"


def test_layout_errors_name_the_path(tmp_path):
    mod = _index_module()
    (tmp_path / "h200").mkdir()
    with pytest.raises(ValueError, match="h200: no system.json"):
        mod.scan(tmp_path)
    (tmp_path / "h200" / "system.json").write_text("{}")
    (tmp_path / "h200" / "latest").mkdir()
    with pytest.raises(ValueError, match=r"h200/latest: expected a folder named <YYYY-MM-DD>_<commit>"):
        mod.scan(tmp_path)
    (tmp_path / "h200" / "latest").rmdir()
    (tmp_path / "h200" / "2026-01-02_abc1234" / "misc").mkdir(parents=True)
    with pytest.raises(ValueError, match="misc: expected a folder named one of conformance"):
        mod.scan(tmp_path)
    (tmp_path / "h200" / "2026-01-02_abc1234" / "misc").rmdir()
    (tmp_path / "loose.json").write_text("{}")
    with pytest.raises(ValueError, match="loose.json: a result file outside"):
        mod.scan(tmp_path)


def test_the_newest_run_of_a_name_is_current(tmp_path):
    mod = _index_module()
    (tmp_path / "h200").mkdir()
    (tmp_path / "h200" / "system.json").write_text('{"system": "h200"}')
    for run in ("2026-01-02_aaaaaaa", "2026-01-05_bbbbbbb"):
        (tmp_path / "h200" / run / "bench").mkdir(parents=True)
        (tmp_path / "h200" / run / "bench" / "x.json").write_text("[]")
    text = mod.render(tmp_path)
    assert text.index("| x.json | 2026-01-05 | bbbbbbb") < text.index("| x.json (older) | 2026-01-02 | aaaaaaa")
    (tmp_path / "h200" / "2026-01-05_ccccccc" / "bench").mkdir(parents=True)
    (tmp_path / "h200" / "2026-01-05_ccccccc" / "bench" / "x.json").write_text("[]")
    with pytest.raises(ValueError, match="two runs on one date"):
        mod.render(tmp_path)


def test_cited_result_paths_exist():
    files = subprocess.run(["git", "ls-files", "*.py", "*.md", "*.sh", "*.toml", "*.json"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    cited = re.compile(r"benchmarks/results/[A-Za-z0-9_./{},*<>-]*[A-Za-z0-9_}*>]")
    missing = []
    for f in files:
        if f.startswith("benchmarks/results/") and f.endswith(".json"):
            continue
        for m in cited.findall((ROOT / f).read_text(errors="replace")):
            if any(c in m for c in "{}*<>"):           # a pattern: its fixed folder must exist
                m = re.split(r"[{}*<>]", m)[0].rsplit("/", 1)[0]
            if not (ROOT / m).exists() and not m.startswith("benchmarks/results/h200/$"):
                missing.append(f"{f}: {m}")
    assert not missing, missing
