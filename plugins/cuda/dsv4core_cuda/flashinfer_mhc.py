"""Backend ``cuda-flashinfer``: FlashInfer's mHC kernels (hc_mult 4) serving ``hc_pre`` / ``hc_post``.

Where the kernels come from, first that works (resolved once, at the first call that needs them):

1. ``flashinfer`` installed: ``flashinfer.mhc.get_mhc_module()`` (FlashInfer JIT-builds it).
2. ``DSV4CORE_FLASHINFER_SRC`` names a folder with FlashInfer's mHC sources (the wheel's
   ``flashinfer/data`` layout: ``csrc/mhc/{mhc_post,mhc_pre_big_fuse}.cu``, ``csrc/tvm_ffi_utils.h``,
   ``include/flashinfer/layout.cuh``; ``benchmarks/fetch_flashinfer_mhc.py`` brings them), and
   apache-tvm-ffi + nvcc are present: the two files are built once with nvcc (FlashInfer's own
   flags: ``-O3 -use_fast_math``, for this GPU's arch) into a cache folder
   (``DSV4CORE_FLASHINFER_CACHE``, default ``~/.cache/dsv4core/flashinfer-mhc``), keyed by the
   sources, flags, arch and nvcc version, and loaded with ``tvm_ffi.load_module``. The build says
   what it does on stderr; a failure is reported (why_not, one warning) and every call falls
   back to the next backend (``cuda``'s Triton kernel), never an exception.

Both give the same module: the raw functions of the two ``.cu`` files. Their conventions (read
from FlashInfer 0.7.2.post1's sources) and how the HAL ops map onto them:

``mhc_post(out, x, residual, post_layer_mix, comb_res_mix)`` writes ``out[t, new] =
x[t] * post[t, new] + sum_old residual[t, old] * comb[t, old, new]`` (fp32 FMAs, bf16 store):
exactly ``hc_post(o, residual, post, comb)`` with ``comb``'s FIRST index summed, as the HAL's.

``mhc_pre_big_fuse_with_prenorm(post_mix, comb_mix, layer_input, dot_mix, residual, scale, base,
rms_eps, pre_eps, sinkhorn_eps, post_mult, sinkhorn_repeat, block_size)`` takes the RAW mix
logits ``dot_mix = flatten(x) @ fn.T`` [T, 24] fp32 (the GEMM is not FlashInfer's: here it is
torch's fp32 matmul; the SPEC also allows TF32 for bf16 activations) and computes in the
kernel: ``rstd = rsqrt(sum(x^2) / (4H) + rms_eps)`` (the sum over all 4H raw bf16 values, fp32),
``pre = sigmoid(dot*rstd*scale[0] + base) + pre_eps``, ``post = sigmoid(..scale[1]..) * post_mult``,
``comb = softmax_rows(dot*rstd*scale[2] + base) + eps``, a column normalisation ``/ (colsum + eps)``,
then ``sinkhorn_repeat - 1`` (row, column) pairs ``/ (sum + eps)``, and ``layer_input = sum_j pre_j
x_j`` (fp32, bf16 store). That is SPEC.md hc_pre steps 1-5 to the letter with ``pre_eps =
sinkhorn_eps = hc_eps``, ``sinkhorn_repeat = iters`` and ``post_mult`` passed through (FlashInfer's
Python default 1.0 differs from the HAL's 2.0, so it is always passed). The comb logits are laid
out ``[j, k] = 8 + 4j + k`` like the HAL's.

Declined (``supports()`` says no, the call goes down the chain): hc_mult != 4, activations other
than bf16 (the kernels read and write bf16 only), H == 0 or, for hc_pre, H % 8 != 0 (the kernel
asserts it), eps <= 0 (FlashInfer's API requires eps > 0), iters or T beyond int32, tensors not
all on one CUDA device. Non-contiguous or not 16-byte aligned inputs are copied first (the
kernels use 16-byte vector loads).

Priority: below the ``cuda`` backend (:data:`PRIORITY`), so ``auto`` keeps the Triton kernels
until a measurement (``benchmarks/flashinfer_mhc.py``) says otherwise; ``DSV4CORE_OPS=
hc_pre=cuda-flashinfer,hc_post=cuda-flashinfer`` selects it per op, and ``dsv4core conformance
--backend cuda-flashinfer`` judges it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from dsv4core.hal import HAL_API_VERSION, Backend, catalogue

log = logging.getLogger("dsv4core.cuda")

NAME = "cuda-flashinfer"
#: below the cuda backend's 100: auto picks the Triton kernels until measured otherwise
PRIORITY = 90
SRC_ENV, CACHE_ENV = "DSV4CORE_FLASHINFER_SRC", "DSV4CORE_FLASHINFER_CACHE"
#: what the build needs under DSV4CORE_FLASHINFER_SRC (the wheel's flashinfer/data layout)
SOURCES = ("csrc/mhc/mhc_post.cu", "csrc/mhc/mhc_pre_big_fuse.cu")
HEADERS = ("csrc/tvm_ffi_utils.h", "include/flashinfer/layout.cuh")
#: FlashInfer's default JIT flags for these files (flashinfer/jit/core.py: -O3, -DNDEBUG, fast math)
NVCC_FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "-use_fast_math", "-Xcompiler", "-fPIC")
BUILD_TIMEOUT_S = 600
_I32 = 2 ** 31 - 1


# ---------------------------------------------------------------------------------------------- finding
def _nvcc() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    on_path = shutil.which("nvcc")
    if on_path:
        return on_path
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


def source_problem(src: str) -> str:
    """Why ``src`` is not a usable FlashInfer mHC source folder ("" if it is)."""
    root = Path(src)
    if not root.is_dir():
        return f"{SRC_ENV}={src} is not a directory"
    missing = [f for f in SOURCES + HEADERS if not (root / f).is_file()]
    if missing:
        return (f"{SRC_ENV}={src} lacks {', '.join(missing)} (expected the flashinfer/data layout; "
                f"benchmarks/fetch_flashinfer_mhc.py brings it)")
    return ""


def found(name: str) -> bool:
    """``name`` is importable (found without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def origin() -> tuple[str, str]:
    """Where the kernels would come from, without importing or building: ``("package", "")``,
    ``("source", folder)`` or ``("", why neither)``."""
    if found("flashinfer"):
        return "package", ""
    src = os.environ.get(SRC_ENV, "")
    if not src:
        return "", (f"flashinfer is not installed and {SRC_ENV} is not set (point it at FlashInfer's mHC "
                    f"sources: python benchmarks/fetch_flashinfer_mhc.py)")
    why = source_problem(src)
    if why:
        return "", why
    if not found("tvm_ffi"):
        return "", f"{SRC_ENV} is set but apache-tvm-ffi is not installed (pip install apache-tvm-ffi)"
    if _nvcc() is None:
        return "", f"{SRC_ENV} is set but nvcc was not found (CUDA_HOME, PATH, /usr/local/cuda)"
    return "source", src


def available() -> tuple[bool, str]:
    """Static probe: a CUDA build of torch that sees a device, and a kernel origin. No build."""
    if not getattr(torch.version, "cuda", None):
        build = f"a ROCm build (hip {torch.version.hip})" if getattr(torch.version, "hip", None) else "a CPU-only build"
        return False, f"torch {torch.__version__} is {build}; FlashInfer's mHC kernels need a CUDA build"
    if not torch.cuda.is_available():
        return False, f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device"
    kind, why = origin()
    return (True, "") if kind else (False, why)


# ---------------------------------------------------------------------------------------------- building
class BuildError(RuntimeError):
    pass


def _tvm_ffi_paths() -> tuple[list[str], str]:
    """(include folders, folder of libtvm_ffi.so) of the installed apache-tvm-ffi."""
    from tvm_ffi import libinfo

    lib = Path(libinfo.find_libtvm_ffi())
    return sorted({libinfo.find_include_path(), libinfo.find_dlpack_include_path()}), str(lib.parent)


def _arch(device_index: int = 0) -> str:
    major, minor = torch.cuda.get_device_capability(device_index)
    return f"{major}{minor}"


def _nvcc_version(nvcc: str) -> str:
    p = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
    return p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else f"unknown ({nvcc})"


def _run_parallel(cmds) -> list[tuple[list[str], str, int]]:
    """Run ``cmds`` at the same time; (command, combined output, exit status) of each."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    try:
        return [(c, p.communicate(timeout=BUILD_TIMEOUT_S)[0] or "", p.returncode) for c, p in zip(cmds, procs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def build(src: str, cache: str | None = None, arch: str | None = None, nvcc: str | None = None,
          progress=None) -> Path:
    """Compile FlashInfer's two mHC sources into one shared library (once: a cached build with
    the same sources, flags, arch and nvcc is reused) and return its path. BuildError says why
    not (the nvcc command and the end of its output)."""
    progress = progress or (lambda msg: print(f"dsv4core {NAME}: {msg}", file=sys.stderr, flush=True))
    why = source_problem(src)
    if why:
        raise BuildError(why)
    nvcc = nvcc or _nvcc()
    if nvcc is None:
        raise BuildError("nvcc was not found (CUDA_HOME, PATH, /usr/local/cuda)")
    try:
        includes, libdir = _tvm_ffi_paths()
    except Exception as e:  # noqa: BLE001 - not installed / broken install: reported
        raise BuildError(f"apache-tvm-ffi is not usable ({type(e).__name__}: {e})") from e
    arch = arch or _arch()
    root = Path(src)
    key = hashlib.sha256()
    for f in SOURCES + HEADERS:
        key.update(f.encode() + b"\0" + (root / f).read_bytes())
    key.update(repr((NVCC_FLAGS, arch, _nvcc_version(nvcc), includes)).encode())
    out_dir = Path(cache or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dsv4core" / "flashinfer-mhc")
    out_dir = out_dir / f"sm{arch}-{key.hexdigest()[:16]}"
    lib = out_dir / "flashinfer_mhc.so"
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f"flashinfer_mhc.{os.getpid()}.so.tmp"
    objs = [out_dir / f"{Path(f).stem}.{os.getpid()}.o" for f in SOURCES]
    flags = [*NVCC_FLAGS, f"-gencode=arch=compute_{arch},code=sm_{arch}",
             *(f"-I{p}" for p in [*includes, str(root / "csrc"), str(root / "include")])]
    # one nvcc per file, in parallel; then one link against libtvm_ffi
    compiles = [[nvcc, *flags, "-c", str(root / f), "-o", str(o)] for f, o in zip(SOURCES, objs)]
    link = [nvcc, "-shared", *map(str, objs), f"-L{libdir}", "-ltvm_ffi", "-Xlinker", f"-rpath={libdir}",
            "-o", str(tmp)]
    progress(f"building FlashInfer's mHC kernels for sm_{arch} with {nvcc} (once; ~20 s) into {out_dir}")
    t0 = time.perf_counter()
    try:
        results = _run_parallel(compiles)
        if all(rc == 0 for _, _, rc in results):
            results += _run_parallel([link])
    except (OSError, subprocess.TimeoutExpired) as e:
        raise BuildError(f"nvcc did not run to completion ({type(e).__name__}: {e}); command: {' '.join(compiles[0])}") from e
    finally:
        for o in objs:
            o.unlink(missing_ok=True)
    (out_dir / "build.log").write_text("\n".join(f"{' '.join(c)}\n{out}[exit {rc}]\n" for c, out, rc in results))
    failed = [(out, rc) for _, out, rc in results if rc != 0]
    if failed or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        out, rc = failed[0] if failed else ("the link step wrote no library", 0)
        tail = "\n".join(out.strip().splitlines()[-12:])
        raise BuildError(f"nvcc exited with status {rc} (full log: {out_dir / 'build.log'}):\n{tail}")
    os.replace(tmp, lib)   # atomic: a concurrent build of the same key leaves one valid file
    progress(f"built {lib} in {time.perf_counter() - t0:.1f} s")
    return lib


def _load_package():
    import flashinfer.mhc as fm

    get = getattr(fm, "get_mhc_module", None)
    if get is None:
        ver = getattr(sys.modules.get("flashinfer"), "__version__", "?")
        raise BuildError(f"flashinfer {ver} has no mhc.get_mhc_module (this provider follows 0.7.2.post1)")
    return get()


def _load_source(src: str):
    lib = build(src)
    if not (hasattr(torch.Tensor, "__dlpack_c_exchange_api__") or found("torch_c_dlpack_ext")):
        # this torch predates the DLPack exchange API: importing tvm_ffi would JIT-build its torch
        # addon (a torch C++ extension, minutes). Its per-call Python DLPack path is used instead
        # (same tensors and current stream; more host time per eager call). pip install
        # torch-c-dlpack-ext for the fast path.
        os.environ.setdefault("TVM_FFI_DISABLE_TORCH_C_DLPACK", "1")
    import tvm_ffi

    return tvm_ffi.load_module(str(lib))


class Kernels:
    """FlashInfer's two mHC functions, resolved once (thread-safe): ``get()`` -> (module, "") or
    (None, why). ``loader``: a zero-argument callable returning the module (tests); default: the
    installed package, else the source folder of DSV4CORE_FLASHINFER_SRC."""

    def __init__(self, loader=None):
        self._loader = loader
        self._lock = threading.Lock()
        self._done = False
        self._mod = None
        self._why = ""
        self.origin = ""

    def _resolve(self):
        if self._loader is not None:
            self.origin = "given"
            return self._loader()
        kind, where = origin()
        if kind == "package":
            self.origin = "flashinfer package"
            try:
                return _load_package()
            except Exception as e:  # noqa: BLE001 - a broken flashinfer: try the sources if given
                src = os.environ.get(SRC_ENV)
                if not src:
                    raise
                log.warning("%s: flashinfer.mhc failed (%s: %s); building from %s=%s",
                            NAME, type(e).__name__, e, SRC_ENV, src)
                kind, where = "source", src
        if kind == "source":
            self.origin = f"built from {where}"
            return _load_source(where)
        raise BuildError(where)

    def get(self):
        if not self._done:
            with self._lock:
                if not self._done:
                    try:
                        mod = self._resolve()
                        for fn in ("mhc_post", "mhc_pre_big_fuse_with_prenorm"):
                            if getattr(mod, fn, None) is None:
                                raise BuildError(f"the FlashInfer mHC module has no {fn}")
                        self._mod = mod
                    except Exception as e:  # noqa: BLE001 - reported, and the op falls back
                        self._why = f"FlashInfer mHC kernels unavailable ({self.origin or 'no origin'}): " \
                                    f"{type(e).__name__}: {e}"
                        log.warning("%s: %s; hc_pre / hc_post run on the next backend", NAME, self._why)
                    self._done = True
        return self._mod, self._why


KERNELS = Kernels()


# ---------------------------------------------------------------------------------------------- the ops
def _one_cuda_device(device_type, *tensors) -> str:
    devs = {t.device for t in tensors}
    if len(devs) != 1 or next(iter(devs)).type != device_type:
        return f"tensors must all be on one {device_type!r} device (got {', '.join(sorted(map(str, devs)))})"
    return ""


def _dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` if contiguous and 16-byte aligned (the kernels' vector loads), else a fresh copy."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def hc_pre_problem(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0, device_type="cuda") -> str:
    if x.dim() != 3 or x.dtype != torch.bfloat16:
        return f"x must be a bf16 [T, n, H] tensor (got {x.dtype} {tuple(x.shape)}): the kernel reads bf16 only"
    T, n, H = x.shape
    if n != 4:
        return f"FlashInfer's mHC kernels are built for hc_mult 4 (n = {n})"
    if H == 0 or H % 8:
        return f"mhc_pre_big_fuse needs H % 8 == 0 and H > 0 (H = {H})"
    if T > _I32:
        return f"T = {T} exceeds the kernel's int32 token count"
    if tuple(fn.shape) != (24, 4 * H) or fn.dtype != torch.float32:
        return f"fn must be float32 [24, {4 * H}] (got {fn.dtype} {tuple(fn.shape)})"
    if tuple(scale.shape) != (3,) or scale.dtype != torch.float32 or tuple(base.shape) != (24,) \
            or base.dtype != torch.float32:
        return "scale [3] and base [24] must be float32"
    if not (float(rms_eps) > 0 and float(hc_eps) > 0):
        return f"FlashInfer's API requires eps > 0 (rms_eps = {rms_eps}, hc_eps = {hc_eps})"
    if not 1 <= int(iters) <= _I32:
        return f"iters = {iters} is outside 1..2^31-1"
    return _one_cuda_device(device_type, x, fn, scale, base)


def hc_post_problem(o, residual, post, comb, device_type="cuda") -> str:
    if residual.dim() != 3 or residual.dtype != torch.bfloat16 or o.dtype != torch.bfloat16:
        return f"o and residual must be bf16 (got {o.dtype}, {residual.dtype}): the kernel reads bf16 only"
    T, n, H = residual.shape
    if n != 4:
        return f"FlashInfer's mHC kernels are built for hc_mult 4 (n = {n})"
    if H == 0:
        return "H = 0"
    if tuple(o.shape) != (T, H) or tuple(post.shape) != (T, 4) or tuple(comb.shape) != (T, 4, 4):
        return "o [T, H], post [T, 4] and comb [T, 4, 4] must match residual [T, 4, H]"
    if post.dtype != torch.float32 or comb.dtype != torch.float32:
        return "post and comb must be float32"
    return _one_cuda_device(device_type, o, residual, post, comb)


#: most bytes of the fp32 copy of x that the mix GEMM makes at once (T = 4096, H = 4096: 256 MiB whole)
MIX_CHUNK_BYTES = 32 << 20


def _mix_logits(x2: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """The raw mix logits ``x2 @ fn.T`` [T, 24] in fp32: torch's fp32 GEMM on an fp32 copy of the
    bf16 rows (the copy is exact), a bounded number of token rows at a time (shapes only:
    graph-capturable; the chunks may pick other GEMM kernels than one call would, so the logits
    can differ from an unchunked product in the last bits)."""
    T, K = x2.shape
    out = torch.empty((T, fn.shape[0]), dtype=torch.float32, device=x2.device)
    rows = max(1, MIX_CHUNK_BYTES // (4 * K))
    for t0 in range(0, T, rows):
        torch.mm(x2[t0:t0 + rows].float(), fn.t(), out=out[t0:t0 + rows])
    return out


def hc_pre(mod, x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
    T, n, H = x.shape
    post = torch.empty((T, 4), dtype=torch.float32, device=x.device)
    comb = torch.empty((T, 4, 4), dtype=torch.float32, device=x.device)
    y = torch.empty((T, H), dtype=torch.bfloat16, device=x.device)
    if T == 0:
        return y, post, comb
    xd = _dense(x)
    dot = _mix_logits(xd.view(T, 4 * H), fn)
    mod.mhc_pre_big_fuse_with_prenorm(post, comb, y, dot, xd, _dense(scale), _dense(base), float(rms_eps),
                                      float(hc_eps), float(hc_eps), float(post_mult), int(iters), 0)
    return y, post, comb


def hc_post(mod, o, residual, post, comb):
    r = _dense(residual)
    out = torch.empty_like(r)
    if r.shape[0]:
        mod.mhc_post(out, _dense(o), r, _dense(post), _dense(comb))
    return out


_OPS = {"hc_pre": (hc_pre_problem, hc_pre), "hc_post": (hc_post_problem, hc_post)}


def _impl(op: str, kernels: Kernels, device_type: str):
    problem, call = _OPS[op]
    sig = catalogue()[op].signature

    def why_not(*args, **kwargs) -> str:
        try:
            why = problem(*args, **kwargs, device_type=device_type)
        except Exception as e:  # noqa: BLE001 - a malformed call declines
            return f"inputs not understood ({type(e).__name__}: {e})"
        return why or kernels.get()[1]

    def supports(*args, **kwargs) -> bool:
        return not why_not(*args, **kwargs)

    def fn(*args, **kwargs):
        mod, why = kernels.get()
        if mod is None:
            raise RuntimeError(f"{NAME} {op}: {why}")   # only reached when supports() was bypassed
        return call(mod, *args, **kwargs)

    for f in (fn, supports, why_not):
        f.__signature__ = sig
        f.__name__ = f.__qualname__ = op
    return fn, supports, why_not


def make_backend(kernels: Kernels | None = None, device_type: str = "cuda", available_fn=None,
                 version: str = "0.1.0") -> Backend:
    """The ``cuda-flashinfer`` Backend. ``kernels`` / ``device_type`` / ``available_fn`` let tests
    run the glue on CPU tensors with an emulated FlashInfer module."""
    kernels = kernels or KERNELS
    b = Backend(name=NAME, version=version, device_types=(device_type,), api_version=HAL_API_VERSION,
                priority=PRIORITY, available=available_fn or available,
                description="FlashInfer mhc_post / mhc_pre_big_fuse_with_prenorm (hc_mult 4, bf16) for hc_post / "
                            "hc_pre; below 'cuda' by priority until measured (benchmarks/flashinfer_mhc.py)")
    for op in _OPS:
        fn, supports, why_not = _impl(op, kernels, device_type)
        # the kernels launch on torch's current stream (tvm-ffi reads it per call); the glue is
        # torch.empty / torch.mm: no host synchronisation, no value-dependent shape
        b.add(op, fn, supports=supports, why_not=why_not, capturable=True)
    return b


def describe() -> str:
    kind, where = origin()
    if kind == "package":
        return "flashinfer installed"
    if kind == "source":
        return f"sources at {where} (built on first use)"
    return "not usable: " + where


__all__ = ["NAME", "PRIORITY", "Kernels", "KERNELS", "BuildError", "available", "build", "make_backend",
           "origin", "describe", "source_problem", "hc_pre_problem", "hc_post_problem"]
