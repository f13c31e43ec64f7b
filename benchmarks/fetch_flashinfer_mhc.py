"""Bring the parts of FlashInfer's mHC kernels a GPU run needs, into git-ignored folders.

    python benchmarks/fetch_flashinfer_mhc.py            # run from the repository root

Downloads (``pip download --no-deps``) flashinfer-python 0.7.2.post1 and the apache-tvm-ffi
cp312 manylinux wheel (the JIT loader FlashInfer's kernels are written against), then keeps
only:

* ``.vendor/flashinfer-mhc/``: the two mHC CUDA sources, the two headers they include, and
  ``flashinfer/mhc.py`` (to read the call conventions), in the wheel's ``flashinfer/data`` layout
  (``csrc/``, ``include/``), plus ``MANIFEST.json`` (versions, sha256 of every file). About 100 KB.
* ``.whl/``: the apache-tvm-ffi wheel (3.3 MB), which benchmarks/h200_run.sh installs with the
  other wheels there.

Both folders are git-ignored: third-party files are fetched for a run, never committed. Point
the cuda plugin at the sources with ``DSV4CORE_FLASHINFER_SRC=.vendor/flashinfer-mhc``; it
JIT-builds the two kernels with nvcc on first use (plugins/cuda/README.md).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FLASHINFER = "flashinfer-python==0.7.2.post1"
TVM_FFI = "apache-tvm-ffi==0.1.15.post2"
#: wheel member -> path under the vendor folder
MEMBERS = {
    "flashinfer/data/csrc/mhc/mhc_post.cu": "csrc/mhc/mhc_post.cu",
    "flashinfer/data/csrc/mhc/mhc_pre_big_fuse.cu": "csrc/mhc/mhc_pre_big_fuse.cu",
    "flashinfer/data/csrc/tvm_ffi_utils.h": "csrc/tvm_ffi_utils.h",
    "flashinfer/data/include/flashinfer/layout.cuh": "include/flashinfer/layout.cuh",
    "flashinfer/mhc.py": "python/flashinfer/mhc.py",
}


def _download(spec: str, dest: Path, *platform_args: str) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q",
           "-d", str(dest), *platform_args, spec]
    print("$", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True)
    name = spec.split("==")[0].replace("-", "_")
    found = sorted(dest.glob(f"{name}-*.whl"))
    if not found:
        raise SystemExit(f"pip download {spec}: no wheel named {name}-*.whl in {dest}")
    return found[-1]


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".", help="repository root (default: the current directory)")
    ap.add_argument("--vendor", default=".vendor/flashinfer-mhc", help="where the sources go (under --root)")
    ap.add_argument("--wheels", default=".whl", help="where the tvm-ffi wheel goes (under --root)")
    args = ap.parse_args(argv)
    root = Path(args.root).resolve()
    vendor, wheels = root / args.vendor, root / args.wheels
    with tempfile.TemporaryDirectory(prefix="dsv4core-fi-") as tmp:
        tmp = Path(tmp)
        fi_whl = _download(FLASHINFER, tmp)
        tvm_whl = _download(TVM_FFI, tmp, "--only-binary=:all:", "--python-version", "3.12",
                            "--implementation", "cp", "--platform", "manylinux_2_28_x86_64")
        if vendor.exists():
            shutil.rmtree(vendor)
        with zipfile.ZipFile(fi_whl) as z:
            names = set(z.namelist())
            missing = [m for m in MEMBERS if m not in names]
            if missing:
                raise SystemExit(f"{fi_whl.name} lacks {missing}: the wheel layout changed")
            for member, rel in MEMBERS.items():
                out = vendor / rel
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(z.read(member))
        wheels.mkdir(parents=True, exist_ok=True)
        for old in wheels.glob("apache_tvm_ffi-*.whl"):
            old.unlink()
        shutil.copy2(tvm_whl, wheels / tvm_whl.name)
        manifest = {"flashinfer": FLASHINFER, "flashinfer_wheel": fi_whl.name, "flashinfer_wheel_sha256": _sha256(fi_whl),
                    "tvm_ffi_wheel": tvm_whl.name, "tvm_ffi_wheel_sha256": _sha256(tvm_whl),
                    "files": {rel: _sha256(vendor / rel) for rel in MEMBERS.values()}}
    (vendor / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    size = sum(p.stat().st_size for p in vendor.rglob("*") if p.is_file())
    print(f"sources: {vendor} ({size / 1024:.0f} KiB, {len(MEMBERS)} files + MANIFEST.json)")
    print(f"wheel:   {wheels / tvm_whl.name} ({(wheels / tvm_whl.name).stat().st_size / 1e6:.1f} MB)")
    print(f"use:     DSV4CORE_FLASHINFER_SRC={vendor}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
