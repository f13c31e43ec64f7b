"""The built wheel holds what an install needs: every module of dsv4core and of the in-tree
plugins, the package data, the entry points, the license; nothing from tests/ or benchmarks/.

The wheel is built from a copy of the package sources (no build isolation, no dependencies: about
two seconds), so the test neither downloads anything nor writes into the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _sources() -> list[Path]:
    """The files the wheel must carry, relative to their import root."""
    out = [p.relative_to(ROOT) for p in (ROOT / "dsv4core").rglob("*.py")]
    for vendor in ("cuda", "rocm", "ascend", "xpu"):
        base = ROOT / "plugins" / vendor
        out += [p.relative_to(base) for p in base.glob("dsv4core_*/**/*.py")]
    return [p for p in out if "__pycache__" not in p.parts]


def _data() -> list[Path]:
    """The data files the code reads at run time, relative to their import root: the HAL changelog,
    every versioned contract (`dsv4core.hal.contracts` globs them) and every plugin's recorded
    validation reports (read by `dsv4core backends`)."""
    out = [Path("dsv4core/hal/CHANGELOG.md")]
    out += [p.relative_to(ROOT) for p in (ROOT / "dsv4core" / "hal" / "contracts").glob("*.json")]
    for vendor in ("cuda", "rocm", "ascend", "xpu"):
        base = ROOT / "plugins" / vendor
        for pattern in ("dsv4core_*/validation/*.json", "dsv4core_*/validation/README.md"):
            out += [p.relative_to(base) for p in base.glob(pattern)]
    return out


def test_the_wheel_holds_the_packages_data_entry_points_and_license(tmp_path):
    pytest.importorskip("setuptools")
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in ("dsv4core", "plugins"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (whl,) = (tmp_path / "dist").glob("dsv4core-*-py3-none-any.whl")
    names = set(zipfile.ZipFile(whl).namelist())

    missing = sorted(str(p) for p in _sources() if p.as_posix() not in names)
    assert not missing, f"modules missing from the wheel: {missing[:10]}"
    data = {p.as_posix() for p in _data()}
    for required in ("dsv4core/hal/contracts/1.0.json", "dsv4core_cuda/validation/README.md",
                     "dsv4core_rocm/validation/README.md", "dsv4core_ascend/validation/README.md",
                     "dsv4core_xpu/validation/README.md"):
        assert required in data, required      # the globs above found the files they are for
    missing = sorted(data - names)
    assert not missing, f"package data missing from the wheel: {missing}"
    assert not any(n.startswith(("tests/", "benchmarks/")) or "/tests/" in n for n in names)
    tops = {n.split("/")[0] for n in names}
    dist_info = next(t for t in tops if t.endswith(".dist-info"))
    assert tops == {"dsv4core", "dsv4core_cuda", "dsv4core_rocm", "dsv4core_ascend", "dsv4core_xpu", dist_info}
    z = zipfile.ZipFile(whl)
    license_text = z.read(f"{dist_info}/licenses/LICENSE").decode()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    meta = z.read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in meta
    assert "Requires-Dist: torch<2.15,>=2.11" in meta
    entry = z.read(f"{dist_info}/entry_points.txt").decode()
    for line in ("dsv4core = dsv4core.cli:main", "cuda = dsv4core_cuda", "rocm = dsv4core_rocm",
                 "ascend = dsv4core_ascend", "xpu = dsv4core_xpu",
                 "triton-interpret = dsv4core.kernels.triton.interpret_plugin",
                 "dsv4core_conformance = dsv4core.conformance.pytest_plugin",
                 "dsv4core = dsv4core.engines.vllm.plugin:register"):
        assert line in entry, line


def test_ci_runs_the_fresh_environment_install_check():
    """`.ci/run` ends with `.ci/install_check`, which builds the wheel, installs that wheel file (not
    the source tree) into a new venv and runs from outside the tree what reads its modules and
    package data (about 10 s, so it runs in CI, not here)."""
    run = (ROOT / ".ci" / "run").read_text()
    check = (ROOT / ".ci" / "install_check").read_text()
    assert "bash .ci/install_check" in run.splitlines()[-1]
    for part in ("-m pip wheel -q --no-deps --no-build-isolation", 'rm -rf "$tmp/src"', "--system-site-packages",
                 'pip install -q --no-deps --no-build-isolation --disable-pip-version-check "${wheels[0]}"',
                 "unset PYTHONPATH", "dsv4core\" --help", "backends --json", "-m dsv4core.hal.contracts",
                 "generate --model tiny"):
        assert part in check, part
