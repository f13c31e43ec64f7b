"""Instruction counts of the CUDA plugin's native FP4 expert GEMM main loop (compile only, no GPU).

    DSV4CORE_NVRTC=.../libnvrtc.so.13 python benchmarks/native_sass.py --cuobjdump .../cuobjdump \
        [--ng 1,2,8] [--out FILE; default benchmarks/results/sm90-aot/<date>_<commit>/aot/sass-fp4-expert-gemm-loop.json]

``plugins/cuda/dsv4core_cuda/fp4_experts.cu`` is compiled with NVRTC for ``sm_90a`` (as the plugin
does on an H200) for each NG, disassembled with ``cuobjdump -sass`` (it runs ``nvdisasm``, which
must be on PATH or beside it), and its K loop (the last backward branch before the block's barrier)
is counted: every instruction, by opcode, and along the path a step takes when both rows' scale
bytes are <= 128 (one multiply a decoded pair: each if / else pair of the loop counted at its
shorter side). A step moves 1 KiB of weights a warp (two rows' 16-byte vectors a lane), so
``path / 1024`` is the instructions a weight byte. Why it matters: an H200 issues at most 4 warp
instructions a clock a SM, so at ``path`` instructions a KiB the loop cannot stream faster than
4 x SMs x clock x 1024 / path bytes a second, before any stall (``issue_bound_TBps`` at 132 SMs
and 1.98 GHz, the H200's boost clock: an upper bound, not a measurement).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _results import result_path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "cuda"))

SMS, CLOCK_HZ, ISSUE = 132, 1.98e9, 4   # H200: SMs, boost clock, warp instructions a clock a SM
STEP_BYTES = 1024                       # weight bytes a warp's K step reads


def parse_sass(text: str) -> list[tuple[int, str]]:
    out = []
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def _target(ins: str) -> int | None:
    m = re.search(r"\bBRA\s+(?:`\()?(0x[0-9a-f]+)", ins)
    return int(m.group(1), 16) if m else None


def loop_counts(code: list[tuple[int, str]]) -> dict:
    """The K loop's instruction counts (see the module docstring)."""
    bar = min((a for a, i in code if i.split()[0].startswith("BAR")), default=None)
    backs = [(a, _target(i)) for a, i in code if _target(i) is not None and _target(i) < a and (bar is None or a < bar)]
    if not backs:
        raise SystemExit("no loop found in the SASS")
    end, top = backs[-1]
    body = [(a, i) for a, i in code if top <= a <= end]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", i).split()[0].split(".")[0] for _, i in body)
    # if / else pairs: a conditional forward branch to t whose instruction before t is an
    # unconditional forward branch to j: [x + 1, t) and [t, j) are the two sides; the shorter is taken
    step = body[1][0] - body[0][0]
    at = dict(body)
    longer = 0
    for a, i in body:
        t = _target(i)
        if t is None or t <= a or not i.startswith("@"):
            continue
        before = at.get(t - step, "")
        j = _target(before)
        if j is not None and not before.startswith("@") and j > t:
            longer += max((t - a) // step - 1, (j - t) // step)
    path = len(body) - longer
    return {"loop": [hex(top), hex(end)], "instructions": len(body), "path": path,
            "hmma": ops.get("HMMA", 0), "hmul2": ops.get("HMUL2", 0),
            "per_weight_byte": round(path / STEP_BYTES, 4),
            "issue_bound_TBps": round(ISSUE * SMS * CLOCK_HZ * STEP_BYTES / path / 1e12, 2),
            "opcodes": dict(ops.most_common())}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ng", default="1,2,8", help="comma list of NG values (pair groups a tile)")
    ap.add_argument("--cuobjdump", default=shutil.which("cuobjdump") or "cuobjdump")
    ap.add_argument("--source", default=str(ROOT / "plugins/cuda/dsv4core_cuda/fp4_experts.cu"))
    ap.add_argument("--out", default=str(result_path("sm90-aot", "aot", "sass-fp4-expert-gemm-loop.json")))
    a = ap.parse_args()
    from dsv4core_cuda import nvrtc

    src = Path(a.source).read_text()
    env = dict(os.environ)
    env["PATH"] = str(Path(a.cuobjdump).resolve().parent) + os.pathsep + env.get("PATH", "")
    rows = []
    for ng in (int(v) for v in a.ng.split(",")):
        cubin = nvrtc.compile_cubin(src, f"fp4_experts_ng{ng}", "sm_90a", (f"-DNG={ng}",))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            sass = subprocess.run([a.cuobjdump, "-sass", f.name], capture_output=True, text=True, env=env, check=True).stdout
            res = subprocess.run([a.cuobjdump, "-res-usage", f.name], capture_output=True, text=True, env=env,
                                 check=True).stdout
        row = {"NG": ng, "resources": " ".join(re.findall(r"REG:\d+|SHARED:\d+|LOCAL:\d+|STACK:\d+", res)),
               **loop_counts(parse_sass(sass))}
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "opcodes"}), flush=True)
    meta = {"source": os.path.relpath(a.source, ROOT), "arch": "sm_90a", "step_bytes": STEP_BYTES,
            "issue_model": {"sms": SMS, "clock_hz": CLOCK_HZ, "warp_instructions_a_clock_a_sm": ISSUE}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    json.dump({"meta": meta, "rows": rows}, open(a.out, "w"), indent=1)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
