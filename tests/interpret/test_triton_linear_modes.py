"""linear / wo_a (one grouped split-K GEMM, dsv4core/kernels/triton/linear.py): every inner-product
mode (dot, swap), scale blocks per K step (NBLK) and split-K factor the launch parameters can
select, judged like the
conformance suite (dsv4core.kernels.triton.selftest.check_case: per output, the kernel's error vs
an fp64 evaluation <= k * the reference's error + floor, k = 4 for both ops: SPEC tolerance of a
length-K fp32 dot product) on every "small" sample case of both ops, fp32 and bf16, under the
Triton interpreter. The suite's own run (tests/interpret/test_triton_kernels.py) covers the defaults.

Interpreter limits (stated, not hidden): it runs the fp32-product branch of each mode (the
interpreter's bf16 tl.dot is unreliable, see _util.interp), so the bf16 / FP8 MMA branches and the
unscaled ``KSUB`` unroll compile only on a GPU (and in the ROCm AOT gate, tests/test_rocm_aot.py).
The FP8 block-scale bookkeeping does run (the fp32 products take the interpreter's decode of the
e4m3 codes): one scale per 128-column block for every mode, NBLK and split. TUNE fp8 "via_f32"
also runs the fp32 path there, so its bf16 conversion chain is only compiled (for sm90, by the
last test, which checks what that chain is for).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from _interp import interpreted_report

pytest.importorskip("triton")

_MODES = """
import json, sys
import torch
from dsv4core.hal import Backend, catalogue
from dsv4core.kernels.triton import linear, wo_a
from dsv4core.kernels.triton.registry import register_ops
from dsv4core.kernels.triton.selftest import check_case
from dsv4core.conformance.cases import iter_cases

b = Backend(name="t", device_types=("cpu",))
register_ops(b, "cpu", ["linear", "wo_a"])
specs = catalogue()
# (variant, dtypes, FP8 cases only). Splits are fixed (K = 128..384 here is 1-3 blocks of 128;
# the default split rule under the interpreter fills 16 programs); NBLK 2 / 4 make a step cover
# 2 / 4 scale blocks (K = 300 and 384: a step runs past the end of K, the clamped-scale path)
F32, BF16 = torch.float32, torch.bfloat16
VARIANTS = [({"mode": "swap", "S": 1}, (F32, BF16), False),
            ({"NBLK": 2, "S": 2, "BN": 32}, (F32, BF16), False),
            ({"mode": "swap", "NBLK": 4, "S": 1}, (F32, BF16), True),
            ({"mode": "swap", "S": 3, "BN": 16}, (F32, BF16), True),
            ({"fp8": "via_f32", "S": 2}, (F32, BF16), True),
            # the official W8A8 on FP8 weights as an FP8 x FP8 product on the activation codes (taken
            # for bf16 in and out; the other W8A8 calls keep the activation values), split and not
            ({"w8a8": "fp8", "S": 2}, (F32, BF16), True),
            ({"w8a8": "fp8", "mode": "swap", "NBLK": 2, "S": 1, "BN": 16}, (BF16,), True)]
# calls of the GEMM on FP8 activation codes, per variant
codes = []
_gg = linear.grouped_gemm
def _spy(*a, **k):
    codes[-1] += k.get("a_scale") is not None
    return _gg(*a, **k)
linear.grouped_gemm = _spy
results = []
for v, dts, fp8_only in VARIANTS:
    rows = []
    codes.append(0)
    for op, mod in (("linear", linear), ("wo_a", wo_a)):
        mod.TUNE.clear()
        mod.TUNE.update(v)
        for dt in dts:
            for case in iter_cases(specs[op], "small", dt, "cpu", 0):
                if fp8_only and "fp8" not in case.tags:
                    continue
                r = check_case(specs[op], b.impls[op], case.kwargs, dt)
                rows.append({"op": op, "case": case.name, "dtype": str(dt), "status": r["status"],
                             "detail": str(r.get("detail", ""))})
        mod.TUNE.clear()
    results.append({"variant": repr(v), "rows": rows, "codes": codes[-1]})
json.dump(results, open(sys.argv[1], "w"))
"""


def test_every_mode_nblk_and_split_passes_the_conformance_rule_in_interpreter(tmp_path):
    rep = interpreted_report(_MODES, tmp_path, "modes", timeout=900)
    bad = [(v["variant"], r) for v in rep for r in v["rows"] if r["status"] != "pass"]
    assert not bad, bad
    # cases passed, none declined: all cases = linear 22 (9 of them W8A8, act_block=128) + wo_a 7 a
    # dtype; FP8 cases = linear 9 (four W8A8 on FP8 weights) + wo_a 2
    passed = [sum(r["status"] == "pass" for r in v["rows"]) for v in rep]
    assert passed == [2 * 29, 2 * 29, 2 * 11, 2 * 11, 2 * 11, 2 * 11, 11], \
        [(v["variant"], n) for v, n in zip(rep, passed)]
    # the FP8 x FP8 product ran for the four W8A8-on-FP8 cases in bf16, and only with TUNE w8a8 "fp8"
    assert [v["codes"] for v in rep] == [0, 0, 0, 0, 0, 4, 4], [(v["variant"], v["codes"]) for v in rep]


def test_launch_config_keys_and_errors():
    import torch

    from dsv4core.kernels.triton import linear, wo_a

    cfg = linear._config("linear", 1, False, True, {}, linear.linear_tiles)
    assert cfg["mode"] == "dot" and cfg["KSUB"] * cfg["BK"] == 128           # FP8 at T = 1: one scale block a step
    cfg = linear._config("linear", 64, False, False, {"KSUB": 2, "num_warps": 8}, linear.linear_tiles)
    assert (cfg["KSUB"], cfg["num_warps"]) == (2, 8)
    with pytest.raises(ValueError, match=r"linear: BK \* KSUB \* NBLK = 128 \* 3 \* 1 = 384 must be a power of two"):
        linear._config("linear", 64, False, False, {"BK": 128, "KSUB": 3}, linear.linear_tiles)
    with pytest.raises(ValueError, match=r"linear: TUNE mode='gemv'"):
        linear._config("linear", 1, False, False, {"mode": "gemv"}, linear.linear_tiles)
    with pytest.raises(ValueError, match=r"wo_a: BK=256 must divide 128"):
        linear._config("wo_a", 1, False, True, {"BK": 256}, linear.linear_tiles)
    cfg = linear._config("linear", 1, False, True, {"NBLK": 2}, linear.linear_tiles)
    assert (cfg["NBLK"], cfg["KSUB"] * cfg["BK"]) == (2, 128)   # a step = 2 scale blocks of 128
    with pytest.raises(ValueError, match=r"linear: BK \* KSUB \* NBLK = 128 \* 1 \* 3 = 384 must be a power of two"):
        linear._config("linear", 1, False, True, {"BK": 128, "NBLK": 3}, linear.linear_tiles)
    # TUNE "tiles" (a plugin table's tile function) replaces the op's portable tiles; keys still override
    cfg = linear._config("linear", 64, False, False, {"tiles": lambda M, q, big: ("swap", 32, 128, 64, 8, 3, 2),
                                                      "num_warps": 4}, linear.linear_tiles)
    assert (cfg["mode"], cfg["BM"], cfg["BN"], cfg["BK"], cfg["num_warps"], cfg["num_stages"], cfg["NBLK"]) == \
        ("swap", 32, 128, 64, 4, 3, 2)
    with pytest.raises(ValueError, match=r"linear: TUNE fp8='int'; expected one of cvt, via_f32"):
        linear._config("linear", 1, False, True, {"fp8": "int"}, linear.linear_tiles)
    with pytest.raises(ValueError, match=r"swap mode needs BM, BN, BK >= 16"):
        linear._config("linear", 1, False, False, {"mode": "swap", "BM": 8}, linear.linear_tiles)
    # wo_a's TUNE reaches the shared kernel through wo_a (not linear's TUNE): a bad key there raises
    wo_a.TUNE.update(mode="nope")
    try:
        with pytest.raises(ValueError, match="wo_a: TUNE mode='nope'"):
            wo_a.wo_a(torch.zeros(1, 2, 128), torch.zeros(2, 64, 128))
    finally:
        wo_a.TUNE.clear()
    # TUNE w8a8_tiles: the FP8 x FP8 launches' tile function, before "tiles" (which it falls back to)
    t1, t8 = (lambda M, q, big: ("dot", 16, 64, 64, 4, 2)), (lambda M, q, big: ("swap", 16, 128, 128, 4, 4))
    pick = {a8: linear._config("linear", 1, False, True, {"tiles": t1, "w8a8_tiles": t8}, linear.linear_tiles, a8=a8)
            for a8 in (False, True)}
    assert [(pick[a8]["mode"], pick[a8]["BN"]) for a8 in (False, True)] == [("dot", 64), ("swap", 128)]
    assert linear._config("linear", 1, False, True, {"tiles": t1}, linear.linear_tiles, a8=True)["BN"] == 64
    # TUNE w8a8: a path linear knows, checked before anything is computed; the FP8 x FP8 GEMM's
    # operands checked at its entry
    f8 = torch.float8_e4m3fn
    x, w, s = torch.zeros(1, 128, dtype=torch.bfloat16), torch.zeros(128, 128, dtype=f8), torch.ones(1, 1)
    linear.TUNE.update(w8a8="int8")
    try:
        with pytest.raises(ValueError, match="linear: TUNE w8a8='int8'; expected one of values, fp8"):
            linear.linear(x, w, s, act_block=128)
    finally:
        linear.TUNE.clear()
    with pytest.raises(ValueError, match=r"linear: FP8 activations need .* a_scale \[1, 1\]; got a torch.bfloat16"):
        linear.grouped_gemm(x.unsqueeze(1), w.unsqueeze(0), s.unsqueeze(0), torch.bfloat16, a_scale=torch.ones(1, 1))


_VIA32 = """
import os, shutil, subprocess, sys, tempfile
import torch
import triton.backends.nvidia as nv
from dsv4core.kernels.triton import aot, linear, moe
target = aot.parse_target("cuda:90")
tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
tool = tool if os.access(tool, os.X_OK) else shutil.which("cuobjdump")
if not tool:
    print("no cuobjdump"); sys.exit(0)
f8 = torch.float8_e4m3fn
for path in ("cvt", "via_f32"):
    got = []
    for mod in (linear, moe):
        mod.TUNE.clear()
        mod.TUNE.update(fp8=path)
    with aot.device_branch(target), aot._compile_only(target, got):
        linear.linear(torch.empty(1, 256, dtype=torch.bfloat16), torch.empty(256, 256, dtype=f8),
                      torch.empty(2, 2), torch.bfloat16)
        # experts: FP8 w2 (the down GEMM), bf16 w13
        E, H, I = 2, 256, 256
        moe.moe_experts(torch.empty(1, H, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, 1),
                        torch.empty(E, 2 * I, H, dtype=torch.bfloat16), torch.empty(E, H, I, dtype=f8), 10.0,
                        None, torch.empty(E, 2, 2))
    for name in ("_gemm_kernel", "_moe_down_kernel"):
        (_, kern, _), = [g for g in got if g[0].__name__ == name]
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kern.asm["cubin"]); f.flush()
            sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        ops = [ln.split()[1] for ln in sass.splitlines() if "/*" in ln and len(ln.split()) > 1 and ln.split()[1][:1].isupper()]
        print(name, path, sum(o.startswith("F2F.BF16.F16") for o in ops), sum(o.startswith("F2FP") for o in ops))
"""


def test_fp8_via_f32_compiles_without_the_f16_to_bf16_conversions():
    """TUNE fp8="via_f32" (linear / wo_a, and moe_experts' FP8 weights) gives the MMA the same bf16
    values by another conversion chain; its point
    (benchmarks/results/sm90-aot/2026-12-01_7374812/aot/sass-fp8-decode-loops.md) is that sm90 code then has no per-code
    f16 -> bf16 conversion (F2F.BF16.F16), which the default chain has. Compile-only (no GPU: not
    timed)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _VIA32], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "no cuobjdump" in proc.stdout:
        pytest.skip("cuobjdump not found (Triton's NVIDIA backend ships it)")
    got = {tuple(line.split()[:2]): (int(line.split()[2]), int(line.split()[3])) for line in proc.stdout.splitlines()}
    for kernel in ("_gemm_kernel", "_moe_down_kernel"):
        cvt, via = got[(kernel, "cvt")], got[(kernel, "via_f32")]
        assert cvt[0] > 0 and via[0] == 0 and via[1] > 0, proc.stdout


def test_fp32_out_chain_config():
    """TUNE ``chain`` (fp32 outputs of tensor-core products): a K step keeps its bytes, in
    sub-blocks of ``chain`` columns; 0 is one chain over all of K; anything else is refused."""
    from dsv4core.kernels.triton import linear

    base = linear._config("linear", 1, False, False, {}, linear.linear_tiles)
    cfg = linear._config("linear", 1, False, False, {}, linear.linear_tiles, chained=True)
    assert cfg["chain"] == linear.CHAIN_K == cfg["BK"] and cfg["BK"] * cfg["KSUB"] == base["BK"] * base["KSUB"]
    cfg = linear._config("linear", 1, False, False, {"chain": 0}, linear.linear_tiles, chained=True)
    assert (cfg["chain"], cfg["BK"], cfg["KSUB"]) == (0, base["BK"], base["KSUB"])
    cfg = linear._config("linear", 1, False, False, {"chain": 256}, linear.linear_tiles, chained=True)
    assert (cfg["chain"], cfg["BK"]) == (base["BK"], base["BK"])   # a chain of at most one sub-block
    cfg = linear._config("linear", 1, False, False, {"chain": 16}, linear.linear_tiles, chained=True)
    assert (cfg["chain"], cfg["BK"], cfg["KSUB"]) == (16, 16, 4)          # 64 columns a step, 4 chains
    cfg = linear._config("linear", 64, False, False, {"BK": 128, "KSUB": 2, "chain": 32}, linear.linear_tiles,
                         chained=True)
    assert (cfg["chain"], cfg["BK"], cfg["KSUB"]) == (32, 32, 8)          # 256 columns a step, 8 chains
    assert linear._config("linear", 1, False, False, {"chain": 16}, linear.linear_tiles)["chain"] == 0  # not chained
    for bad in (8, 48, 32.0):
        with pytest.raises(ValueError, match=rf"linear: TUNE chain={bad!r}; expected 0 or a power of two >= 16"):
            linear._config("linear", 1, False, False, {"chain": bad}, linear.linear_tiles, chained=True)


_CHAIN = """
import re, torch
from dsv4core.kernels.triton import aot, linear
target = aot.parse_target("cuda:90")
w = torch.empty(256, 512, dtype=torch.bfloat16)
for rows in (1, 64):        # an MMA v2 tile (16 rows) and a Hopper wgmma tile (64 rows)
    for chain in (0, 32):
        got = []
        linear.TUNE.clear()
        linear.TUNE.update(chain=chain)
        with aot.device_branch(target), aot._compile_only(target, got):
            linear.linear(torch.empty(rows, 512, dtype=torch.bfloat16), w, out_dtype=torch.float32)
        (_, kern, _), = [g for g in got if g[0].__name__ == "_gemm_kernel"]
        ir = kern.asm["ttgir"]
        # the dots' accumulator operands, and the fp32 adds of MMA results into the running sum
        dots = re.findall(r"= (?:tt\\.dot|ttng\\.warp_group_dot) %\\S+, %\\S+, %([^ ,]+)", ir)
        adds = re.findall(r"arith\\.addf %\\S+, %\\S+ : tensor<\\d+x\\d+xf32, #mma", ir)
        print(rows, chain, len(dots), len(set(dots)), len(adds))
"""


def test_fp32_out_chains_are_not_folded_back_into_one():
    """The point of ``chain``: each MMA chain starts from a runtime zero and is added to the fp32
    sum by its own add. From a constant zero the compiler folds ``acc + dot(a, w, 0)`` into
    ``dot(a, w, acc)``; here the sm90 TTGIR (compile-only, no GPU) of an fp32-out launch has, with
    chain 32, dots that all start from one value and one fp32 add per dot, and with chain 0 none."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _CHAIN], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {(int(r[0]), int(r[1])): tuple(map(int, r[2:])) for r in (line.split() for line in proc.stdout.splitlines())
           if len(r) == 5}
    for rows in (1, 64):
        dots0, _, adds0 = got[rows, 0]
        dots, inits, adds = got[rows, 32]
        assert dots0 >= 1 and adds0 == 0, proc.stdout            # one chain: the dot accumulates acc itself
        assert dots >= 2 and inits == 1 and adds == dots, proc.stdout


_CHAINED = """
import json, sys
import torch
from dsv4core.kernels.triton import linear
linear.interp = lambda t: False      # the tensor-core branch (fp16 operands: exact products here)
rows = []
for K in (300, 1000):
    g = torch.Generator().manual_seed(K)
    x = torch.randn(5, K, generator=g).half()
    w = torch.randn(70, K, generator=g).half()
    y64 = x.double() @ w.double().T
    bound = K * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    for tune in ({"chain": 0}, {"chain": 16}, {"chain": 32}, {"chain": 64}, {"chain": 16, "S": 3}):
        linear.TUNE.clear()
        linear.TUNE.update(tune)
        y = linear.linear(x, w, out_dtype=torch.float32)
        linear.TUNE.clear()
        rows.append({"K": K, "tune": repr(tune), "dtype": str(y.dtype),
                     "excess": ((y.double() - y64).abs() - bound).max().item()})
json.dump(rows, open(sys.argv[1], "w"))
"""


def test_fp32_out_chains_compute_the_product(tmp_path):
    """The chained MMA path run under the interpreter: fp16 operands take the tensor-core branch
    there once ``interp`` answers False (the interpreter's fp16 tl.dot is exact in fp32; its bf16
    one is not, see _util.interp). Every chain length, one chain (0) and a split K give the
    product within the fp32 dot-product bound |y - y64| <= K 2^-24 (|x| @ |w|^T) (a sum of K
    rounded terms, each rounding at most 2^-24 relative: gamma_K), per output."""
    rows = interpreted_report(_CHAINED, tmp_path, "chained", timeout=600)
    assert len(rows) == 10, rows
    bad = [r for r in rows if r["dtype"] != "torch.float32" or r["excess"] > 0]
    assert not bad, bad
