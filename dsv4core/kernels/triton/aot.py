"""Ahead-of-time compile of every portable kernel for a GPU target that is not present.

    python -m dsv4core.kernels.triton.aot --target hip:gfx942 [--table MODULE:ATTR] [--json out.json]
    python -m dsv4core.kernels.triton.aot --target cuda:90 --device-branch --json new.json --compare old.json

Triton's stock wheel compiles for ``GPUTarget("hip", "gfx942", 64)`` on a CPU-only machine (no ROCm
needed): it emits AMDGCN and an HSA code object and reports shared memory (LDS), VGPRs and spills.
It also compiles for ``GPUTarget("cuda", 90, 32)`` (an H100 / H200: PTX, then a cubin with the
ptxas it ships); registers and spills come from its ``cuobjdump``.

Every record carries ``code_sha``: a hash of the generated code (PTX / AMDGCN) with the source
locations and debug sections taken out. ``--compare OLD.json`` matches the records of two runs by
(op, kernel, constexprs, signature, options) and says which compiled to the same code: a source
change that leaves a kernel's code unchanged cannot change what it computes on that target (for
the Triton version that compiled it), so a GPU conformance run of the old code still stands
for it.
This module runs each op's conformance cases (shape set ``flash`` by default) through the op's
Python launcher with the launches turned into compiles, so every kernel specialisation the
launcher picks (with a plugin's launch table active) is compiled exactly as it would be on the
device. Nothing runs: outputs are never read.

``--device-branch``: the launchers choose some specialisations by their tensors' device (CPU here),
through helpers of ``_util`` that each kernel module imports by name; :func:`device_branch`
answers them as the target GPU would, so the branch a GPU runs is what compiles (without it, e.g.
bf16 dots compile as the interpreter's fp32 upcast, which no GPU runs).

Compile-only evidence: syntax, dtypes, resource use. Not a correctness or speed result.
Must run in a process without ``TRITON_INTERPRET=1`` (the interpreter replaces the jit functions).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import re
import sys
import time
from collections.abc import Mapping

import torch

from . import OPS

#: shared-memory (LDS) capacity per workgroup, bytes (CDNA3 / CDNA4 / RDNA3 ISA documents; the
#: same figures aiter prunes its configs with)
LDS_LIMIT = {"gfx942": 64 * 1024, "gfx950": 160 * 1024, "gfx1100": 64 * 1024}
WARP_SIZE = {"gfx942": 64, "gfx950": 64, "gfx1100": 32}
#: shared memory per block (bytes) of a CUDA compute capability (CUDA programming guide: 227 KiB
#: opt-in on sm90)
SMEM_LIMIT = {90: 227 * 1024}


#: an Intel GPU as Intel's Triton describes one (sub-groups of 16 or 32, DPAS, 2-D block IO); the
#: SLM gate is 64 KiB, assumed as the smallest current Intel GPU's per-work-group limit [unverified]
XPU_PROPERTIES = {"architecture": 0, "sub_group_sizes": [16, 32], "max_num_sub_groups": 64,
                  "has_subgroup_2d_block_io": True, "has_subgroup_matrix_multiply_accumulate": True,
                  "has_subgroup_matrix_multiply_accumulate_tensor_float32": False,
                  "local_mem_size": 64 * 1024}
XPU_SLM_LIMIT = 64 * 1024

#: compute units of the arch's largest part (AMD data sheets: MI300X 304, MI355X 256): what
#: ``_util.target_programs`` reads from a device's properties, which sets the split-K factors
COMPUTE_UNITS = {"gfx942": 304, "gfx950": 256, 90: 132}   # 90: H100 / H200 SXM, 132 SMs


def parse_target(text: str):
    """``hip:gfx942`` -> GPUTarget("hip", "gfx942", 64); ``cuda:90`` -> GPUTarget("cuda", 90, 32);
    ``xpu`` -> an Intel GPU target (needs Intel's Triton)."""
    from triton.backends.compiler import GPUTarget

    backend, _, arch = text.partition(":")
    if backend == "xpu":
        return GPUTarget("xpu", dict(XPU_PROPERTIES), 16)
    if backend == "cuda" and arch.isdigit() and int(arch) in SMEM_LIMIT:
        return GPUTarget("cuda", int(arch), 32)
    if backend != "hip" or arch not in WARP_SIZE:
        known = [f"hip:{a}" for a in WARP_SIZE] + [f"cuda:{c}" for c in SMEM_LIMIT] + ["xpu"]
        raise ValueError(f"aot: --target must be one of {', '.join(known)}, got {text!r}")
    return GPUTarget("hip", arch, WARP_SIZE[arch])


class _FakeDriver:
    """Just enough of a Triton driver for compiling: a target, device 0, stream 0."""

    def __init__(self, target):
        self.target = target

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def _compile_only(target, sink: list):
    """Every ``kernel[grid](...)`` compiles for ``target`` (appending (jit fn, compiled, grid)) and returns."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    if not hasattr(JITFunction, "create_binder"):
        raise RuntimeError("aot: this triton has no JITFunction.create_binder (needs triton >= 3.4 without TRITON_INTERPRET=1)")
    orig_run = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        kernel = orig_run(self, *args, grid=grid, warmup=True, **kwargs)
        sink.append((self, kernel, (grid, _args(args))))
        return kernel

    prev = getattr(driver, "_active", None)
    driver.set_active(_FakeDriver(target))
    JITFunction.run = run
    try:
        yield
    finally:
        JITFunction.run = orig_run
        driver._active = prev
        for jit, *_ in sink:   # their binders hold the fake target
            jit.device_caches.clear()


@contextlib.contextmanager
def device_branch(target):
    """Within: each kernel module's device helpers (names it imported from ``_util``) answer as on a
    ``target`` GPU: ``interp`` / ``interpreting`` / ``rne`` / ``rne_for`` False (bf16 / FP8 MFMA dots, hardware
    bf16 rounding), ``accurate`` True (libdevice sin / cos), ``target_programs`` 2 per compute
    unit. The kernel modules' own source is untouched; the names are restored on exit. Yields the
    patched ``module.name`` list."""
    from . import _util

    cus = COMPUTE_UNITS.get(getattr(target, "arch", None))
    if cus is None:
        raise ValueError(f"aot: --device-branch needs the compute-unit count of {target}; known: "
                         f"{', '.join(f'cuda:{a}' if isinstance(a, int) else f'hip:{a}' for a in COMPUTE_UNITS)}")
    answers = {"interp": lambda t: False, "interpreting": lambda t: False, "rne": lambda out: False,
               "rne_for": lambda device, dtype: False,
               "accurate": lambda t: True, "target_programs": lambda device, cpu=16: 2 * cus}
    saved = []
    for modname in sorted(set(OPS.values())):
        mod = importlib.import_module(f"{__package__}.{modname}")
        for name, fn in answers.items():
            if getattr(mod, name, None) is getattr(_util, name):
                saved.append((mod, name, getattr(mod, name)))
                setattr(mod, name, fn)
    try:
        yield [f"{m.__name__.rsplit('.', 1)[1]}.{n}" for m, n, _ in saved]
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


def _amdgcn_stats(asm: str) -> dict:
    def num(pattern):
        m = re.search(pattern, asm)
        return int(m.group(1)) if m else None

    return {"vgprs": num(r"; NumVgprs:\s*(\d+)"), "vgpr_spills": num(r"\.vgpr_spill_count:\s*(\d+)"),
            "sgpr_spills": num(r"\.sgpr_spill_count:\s*(\d+)"), "scratch_bytes": num(r"; ScratchSize:\s*(\d+)")}


def _cuda_stats(cubin: bytes) -> dict:
    """Registers and spill bytes of a cubin, from ``cuobjdump --dump-resource-usage`` (the one
    Triton's NVIDIA backend ships; None where it cannot be run)."""
    import os
    import subprocess
    import tempfile

    out = {"regs": None, "spill_stores": None, "spill_loads": None, "local_bytes": None}
    try:
        import shutil

        import triton.backends.nvidia as nv

        tool = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
        tool = tool if os.access(tool, os.X_OK) else shutil.which("cuobjdump")
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                                  timeout=60).stdout
    except Exception:  # noqa: BLE001 - no cuobjdump: the figures stay unknown
        return out
    for key, pat in (("regs", r"REG:(\d+)"), ("local_bytes", r"LOCAL:(\d+)")):
        m = re.search(pat, text)
        out[key] = int(m.group(1)) if m else None
    # ptxas reports spills only with -v; a kernel without local memory has none
    out["spill_stores"] = out["spill_loads"] = 0 if out["local_bytes"] == 0 else out["local_bytes"]
    return out


#: lines that are not instructions: source locations, comments, debug sections, and PTX's debug
#: labels ($L__tmpN:, referenced only by the debug sections; their count follows the inlining)
_NOISE = re.compile(r"^\s*(\.loc|\.file|//|;|\.section\s+\.debug|\.ident|\$L__tmp\d+:\s*$)")


def code_sha(kernel) -> str | None:
    """sha256 of the kernel's generated code (PTX or AMDGCN) without source locations, comments and
    debug sections: equal for two source versions that compile to the same instructions."""
    import hashlib

    asm = kernel.asm.get("ptx") or kernel.asm.get("amdgcn")
    if not asm:
        return None
    if isinstance(asm, bytes):
        asm = asm.decode(errors="replace")
    keep, debug = [], False
    for line in asm.splitlines():
        if line.lstrip().startswith(".section") and ".debug" in line:
            debug = True
            continue
        if debug:                       # a debug section runs to the next non-debug section or EOF
            if line.lstrip().startswith((".section", ".text", ".amdgpu_metadata")):
                debug = False
            else:
                continue
        if not _NOISE.match(line):
            keep.append(line.split("//")[0].rstrip())
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()[:16]


def _grid(grid) -> list | str:
    """A launch grid as recorded: its sizes (a callable grid: its repr, not resolved here)."""
    if callable(grid):
        return repr(grid)
    return [int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,))]


def _args(args) -> list:
    """A launch's positional arguments as recorded: scalars by value, tensors by shape, strides and
    dtype (their values are the case's inputs, the same in both runs)."""
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append([list(a.shape), list(a.stride()), str(a.dtype)])
        elif a is None or isinstance(a, (bool, int, float, str)):
            out.append(a)
        else:
            out.append(type(a).__name__)
    return out


def _constexprs(jit, kernel) -> dict:
    """The kernel's constexpr arguments by name (what distinguishes its specialisations)."""
    consts = getattr(getattr(kernel, "src", None), "constants", {}) or {}
    out = {}
    for k, v in consts.items():
        idx = k[0] if isinstance(k, tuple) and len(k) == 1 else None
        if not isinstance(idx, int) or idx >= len(jit.arg_names):
            continue
        out[jit.arg_names[idx]] = v if isinstance(v, (int, float, bool, str)) or v is None else str(v)
    return out


def _signature(kernel) -> dict:
    sig = getattr(getattr(kernel, "src", None), "signature", {}) or {}
    return {k: str(v) for k, v in sig.items() if str(v) != "constexpr"}


def compile_all(target, table=None, *, backend=None, shapes: str = "flash",
                dtypes=(torch.bfloat16, torch.float32), ops=None, progress=None,
                launches: dict | None = None) -> list[dict]:
    """Compile every kernel specialisation reached by the ops' ``shapes`` cases for ``target``.

    Either ``table`` (a launch table: the kernels run through the registry's wrapper with it), or
    ``backend``: a plugin's Backend built for CPU tensors, whose implementations are called only
    for the cases its ``supports`` accepts (what the plugin would really launch). One record per
    distinct compiled kernel: op, kernel, constexprs, options, LDS bytes, VGPRs, spills, LDS
    limit, ok (LDS within the limit and zero VGPR / SGPR spills), code_sha. ``launches`` (a dict,
    filled if given): "op/case/dtype" -> the [kernel, code_sha, grid, arguments] of each launch of
    that case, in order (arguments: scalars by value, tensors by shape / strides / dtype)."""
    from dsv4core.hal import catalogue

    specs = catalogue()
    records: dict[str, dict] = {}
    got: list = []
    with _compile_only(target, got):
        for op, modname in OPS.items():
            if ops is not None and op not in ops:
                continue
            if backend is not None:
                impl = backend.impls.get(op)
                if impl is None:
                    continue
                fn, accept = impl.fn, impl.supports
            else:
                from .registry import _lazy   # the same wrapper a plugin's bound op runs through

                fn, accept = _lazy(op, modname, specs[op].signature, "cpu", table), None
            _compile_op(specs[op], op, fn, accept, target, shapes, dtypes, records, got, progress,
                        {} if launches is None else launches)
    return list(records.values())


def _compile_op(spec, op, fn, accept, target, shapes, dtypes, records, got, progress, launches):
    xpu, cuda = target.backend == "xpu", target.backend == "cuda"
    limit = XPU_SLM_LIMIT if xpu else SMEM_LIMIT.get(target.arch) if cuda else LDS_LIMIT.get(target.arch)
    t0 = time.perf_counter()
    for dt in dtypes:
        for case in spec.sample_cases(shapes, dt, "cpu", seed=0):
            if accept is not None and not accept(**case.kwargs):
                continue
            n0 = len(got)
            try:
                fn(**case.kwargs)
            except Exception as e:  # noqa: BLE001 - a compile error is the result
                records[f"{op}/{case.name}/{dt}"] = {
                    "op": op, "kernel": "?", "case": case.name, "dtype": str(dt),
                    "error": f"{type(e).__name__}: {str(e)[:400]}", "ok": False}
                continue
            launches[f"{op}/{case.name}/{dt}"] = [[jit.__name__, code_sha(kernel), _grid(g), a]
                                                  for jit, kernel, (g, a) in got[n0:]]
            for jit, kernel, _ in got[n0:]:
                meta = kernel.metadata
                opts = {k: getattr(meta, k) for k in ("num_warps", "num_stages", "waves_per_eu",
                                                      "matrix_instr_nonkdim") if hasattr(meta, k)}
                cx = _constexprs(jit, kernel)
                sig = _signature(kernel)
                key = "|".join((jit.__name__, json.dumps(cx, sort_keys=True), json.dumps(sig, sort_keys=True),
                                json.dumps(opts, sort_keys=True)))
                if key in records:
                    continue
                if xpu:   # SPIR-V: no native code, so no register / spill figures
                    stats = {"spirv": "spv" in kernel.asm, "vgprs": None, "vgpr_spills": None, "sgpr_spills": None}
                elif cuda:
                    stats = _cuda_stats(kernel.asm.get("cubin", b""))
                else:
                    stats = _amdgcn_stats(kernel.asm.get("amdgcn", ""))
                lds = int(meta.shared)
                spills = (stats.get("spill_stores"),) if cuda else (stats["vgpr_spills"], stats["sgpr_spills"])
                known = not cuda or stats.get("regs") is not None     # no cuobjdump: unknown is not ok
                ok = (limit is None or lds <= limit) and known and not any(spills) and stats.get("spirv", True)
                stats["code_sha"] = code_sha(kernel)
                records[key] = {"op": op, "kernel": jit.__name__, "case": case.name, "dtype": str(dt),
                                "constexprs": cx, "signature": sig, "options": opts, "lds_bytes": lds, "lds_limit": limit,
                                **stats, "ok": ok}
    if progress:
        progress(f"{op}: {sum(r['op'] == op for r in records.values())} kernels compiled "
                 f"in {time.perf_counter() - t0:.1f}s")


def _triton_version() -> str:
    import triton

    return triton.__version__


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsv4core.kernels.triton.aot", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="hip:gfx942, hip:gfx950, hip:gfx1100, cuda:90 or xpu")
    ap.add_argument("--table", default=None,
                    help="launch table as MODULE:ATTR (a dict, e.g. one target of a plugin's LaunchTable, or a "
                         "callable taking no argument), e.g. dsv4core_rocm.launch:TABLES.gfx942; default: "
                         "the kernels' own defaults")
    ap.add_argument("--backend", default=None,
                    help="a plugin's backend as MODULE:FACTORY, FACTORY(arch) returning a Backend for CPU "
                         "tensors, e.g. dsv4core_rocm:aot_backend (only the cases it accepts are compiled)")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--shapes", default="flash")
    ap.add_argument("--ops", default=None, help="comma-separated op names (default: all)")
    ap.add_argument("--device-branch", action="store_true",
                    help="compile the branch a GPU runs (device_branch), not the one CPU tensors select")
    ap.add_argument("--json", default=None, help="write the records here")
    ap.add_argument("--compare", default=None, metavar="OLD.json",
                    help="an earlier --json of the same target: say which kernels compiled to the same code")
    a = ap.parse_args(argv)
    target = parse_target(a.target)
    table = None
    if a.table:
        modname, _, attr = a.table.partition(":")
        obj = importlib.import_module(modname)
        for part in filter(None, attr.split(".")):
            obj = obj[part] if isinstance(obj, Mapping) else getattr(obj, part)
        table = obj() if callable(obj) else obj
    backend = None
    if a.backend:
        modname, _, attr = a.backend.partition(":")
        backend = getattr(importlib.import_module(modname), attr)(target.arch)
    ops = a.ops.split(",") if a.ops else None
    dtypes = tuple(getattr(torch, d) for d in a.dtypes.split(","))
    launches: dict = {}
    with device_branch(target) if a.device_branch else contextlib.nullcontext() as patched:
        recs = compile_all(target, table, backend=backend, shapes=a.shapes, dtypes=dtypes, ops=ops,
                           progress=lambda s: print(s, file=sys.stderr), launches=launches)
    for r in recs:
        regs, spills = (r.get("regs"), r.get("spill_stores")) if target.backend == "cuda" else \
            (r.get("vgprs"), r.get("vgpr_spills"))
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['op']:22s} {r['kernel']:24s} LDS {r.get('lds_bytes', '-')}"
              f"/{r.get('lds_limit', '-')} regs {regs if regs is not None else '-'} spills "
              f"{spills if spills is not None else '-'}{'  ' + r['error'] if 'error' in r else ''}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"target": a.target, "table": a.table, "backend": a.backend, "device_branch": patched,
                       "shapes": a.shapes,
                       "dtypes": a.dtypes, "triton": _triton_version(), "kernels": recs, "launches": launches},
                      f, indent=1)
    if a.compare:
        with open(a.compare) as f:
            old = json.load(f)
        cmp = compare(old.get("launches", {}), launches)
        print(f"cases whose launches compiled to the same code as in {a.compare}: {len(cmp['same'])}; "
              f"changed: {len(cmp['changed'])}; only here: {len(cmp['new'])}; only there: {len(cmp['gone'])}")
        for k in ("changed", "new", "gone"):
            for key in cmp[k]:
                print(f"  {k}: {key}")
    return 0 if all(r["ok"] for r in recs) else 1


def compare(old: dict, new: dict) -> dict[str, list[str]]:
    """Two runs' ``launches`` matched by case ("op/case/dtype"): "same" (the same kernels compiled
    to the same code and launched on the same grids with the same scalar arguments and tensor
    shapes / strides / dtypes, in the same order), "changed", "new" (only in ``new``), "gone" (only
    in ``old``). A "same" case runs the same instructions over the same programs and the same
    memory layout as before on this target (for the Triton version that compiled both). Both runs
    must come from the same aot.py (the fingerprint's rules are part of it). A None argument is
    not passed to the kernel (Triton compiles it as a constant): launches are compared without
    them, so a pointer argument added to a kernel and given None by the launches that do not use
    it leaves those launches "same" where their code is."""
    def runtime(launches):
        return [[*launch[:3], *([a for a in arg if a is not None] for arg in launch[3:4])] for launch in launches]

    both = sorted(set(old) & set(new))
    same = [k for k in both if runtime(old[k]) == runtime(new[k]) and all(launch[1] for launch in new[k])]
    return {"same": same, "changed": sorted(set(both) - set(same)),
            "new": sorted(set(new) - set(old)), "gone": sorted(set(old) - set(new))}


if __name__ == "__main__":
    sys.exit(main())
