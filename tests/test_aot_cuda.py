"""The ahead-of-time compile for an NVIDIA target on this CPU machine (dsv4core/kernels/triton/aot.py,
``--target cuda:90``): PTX and a cubin from the ptxas Triton ships, registers and spills from its
cuobjdump, and the code fingerprint ``--compare`` uses to say which conformance cases still launch
the code a GPU run verified. Compile-only; a subprocess without TRITON_INTERPRET (the interpreter
replaces the jit functions)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")


def _aot(tmp_path, name, *extra, env_extra=None):
    out = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-m", "dsv4core.kernels.triton.aot", "--target", "cuda:90", "--device-branch",
                        "--ops", "rms_norm", "--dtypes", "bfloat16", "--shapes", "small", "--json", str(out), *extra],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and out.exists(), p.stdout[-2000:] + p.stderr[-3000:]
    return json.loads(out.read_text()), p.stdout


def test_cuda_target_compiles_and_the_fingerprint_tells_same_from_changed(tmp_path):
    a, _ = _aot(tmp_path, "a")
    recs = a["kernels"]
    assert recs and all(r["ok"] and r["code_sha"] and r["regs"] and r["spill_stores"] == 0 for r in recs), recs
    assert sum(bool(v) for v in a["launches"].values()) >= len(a["launches"]) // 2   # T = 0 cases launch nothing
    # the same source again: every case compiles to the same code
    _, out = _aot(tmp_path, "b", "--compare", str(tmp_path / "a.json"))
    assert f"same code as in {tmp_path / 'a.json'}: {len(a['launches'])}; changed: 0" in out, out
    # a launch table that changes the warps: the cases it reaches compile to other code
    (tmp_path / "warps_table.py").write_text('TABLE = {"norm": {"num_warps": 2}}\n')
    _, out = _aot(tmp_path, "c", "--table", "warps_table:TABLE", "--compare", str(tmp_path / "a.json"),
                  env_extra={"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    changed = int(out.split("changed: ")[1].split(";")[0])
    assert changed > 0, out


def test_compare_matches_cases_in_order_code_and_grid():
    from dsv4core.kernels.triton.aot import compare

    old = {"op/c1/bf16": [["k", "aa", [1]], ["r", "bb", [2, 1]]], "op/c2/bf16": [["k", "aa", [1]]],
           "op/c3/bf16": [["k", "cc", [1]]], "op/c5/bf16": [["k", "aa", [4]]]}
    new = {"op/c1/bf16": [["k", "aa", [1]], ["r", "bb", [2, 1]]], "op/c2/bf16": [["k", "ab", [1]]],
           "op/c4/bf16": [["k", "cc", [1]]], "op/c5/bf16": [["k", "aa", [8]]]}
    got = compare(old, new)
    # c2: other code; c5: the same code on another grid (a host-side split change)
    assert got == {"same": ["op/c1/bf16"], "changed": ["op/c2/bf16", "op/c5/bf16"], "new": ["op/c4/bf16"],
                   "gone": ["op/c3/bf16"]}
    # the same kernels in another order is another launch sequence
    assert compare({"x": [["a", "1", [1]], ["b", "2", [1]]]}, {"x": [["b", "2", [1]], ["a", "1", [1]]]})["changed"] == ["x"]
    # a None argument is a compile-time constant, not a launch argument: an added pointer argument
    # left None is the same launch; a tensor or a value in its place is not
    args = [[[4, 8], [8, 1], "torch.bfloat16"], 4, 0.0]
    old = {"x": [["k", "aa", [1], args]]}
    assert compare(old, {"x": [["k", "aa", [1], args[:1] + [None] + args[1:]]]})["same"] == ["x"]
    assert compare(old, {"x": [["k", "aa", [1], args[:1] + [[[4], [1], "torch.float32"]] + args[1:]]]})["changed"] == ["x"]
    assert compare(old, {"x": [["k", "aa", [1], args[:1] + [7] + args[1:]]]})["changed"] == ["x"]


def test_code_sha_ignores_locations_comments_debug_but_not_instructions():
    from types import SimpleNamespace

    from dsv4core.kernels.triton.aot import code_sha

    def sha(text):
        return code_sha(SimpleNamespace(asm={"ptx": text}))

    body = ".visible .entry k(\n.param .u64 p)\n{\n\tld.global.b32 %r1, [%rd1];\n\tadd.s32 %r2, %r1, 1;\n}\n"
    located = body.replace("\tadd.s32 %r2, %r1, 1;", "\t.loc 1 42 7\n$L__tmp3:\n\tadd.s32 %r2, %r1, 1; // x + 1")
    debug = body + '\t.file 1 "/some/path/k.py"\n\t.section\t.debug_info\n\t{\n.b8 1\n.b8 0\n\t}\n'
    assert sha(body) == sha(located) == sha(debug)
    assert sha(body) != sha(body.replace("add.s32 %r2, %r1, 1", "add.s32 %r2, %r1, 2"))   # an instruction
    assert sha(body) != sha(body.replace("ld.global.b32", "ld.global.nc.b32"))
    # AMDGCN: the kernel descriptor's execution modes are part of the code
    amd = "\t.amdhsa_float_denorm_mode_32 3\n\ts_endpgm\n"
    assert code_sha(SimpleNamespace(asm={"amdgcn": amd})) != \
        code_sha(SimpleNamespace(asm={"amdgcn": amd.replace("mode_32 3", "mode_32 0")}))
