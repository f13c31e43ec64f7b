"""CUDA C++ kernels of the CUDA plugin, compiled at run time with NVRTC and launched through the
driver API (both through ctypes: no nvcc, no host compiler, no torch extension build).

NVRTC is the library CUDA builds of torch already depend on (the ``nvidia-cuda-nvrtc`` wheel, or a
CUDA toolkit's ``libnvrtc``); ``DSV4CORE_NVRTC`` names the library file where neither is found.
A module is compiled once per (source, options, device) in a process, for the device's own
architecture (``sm_90a`` on an H200), and loaded into the device's primary context, which torch has
made current. Launches go to torch's current stream, so they are captured by CUDA graphs like any
other kernel of the step.

Nothing here runs at import.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading

import torch

#: environment variable naming the NVRTC library file to load
NVRTC_ENV = "DSV4CORE_NVRTC"

_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}
_MODULES: dict[tuple, "Module"] = {}


class NativeKernelError(RuntimeError):
    """NVRTC or the driver refused a native kernel: the message names the kernel and the call."""


def _nvrtc_candidates() -> list[str]:
    env = os.environ.get(NVRTC_ENV)
    if env:
        return [env]
    out = []
    for base in sys.path:
        for pat in ("nvidia/cu13/lib/libnvrtc.so.*", "nvidia/cuda_nvrtc/lib/libnvrtc.so.*",
                    "nvidia/cu12/lib/libnvrtc.so.*"):
            out += sorted(p for p in glob.glob(os.path.join(base, pat)) if "builtins" not in p and ".alt." not in p)
    found = ctypes.util.find_library("nvrtc")
    if found:
        out.append(found)
    return out


def _lib(name: str) -> ctypes.CDLL:
    with _LOCK:
        if name in _LIBS:
            return _LIBS[name]
        if name == "cuda":
            lib = ctypes.CDLL("libcuda.so.1")
        else:
            tried = _nvrtc_candidates()
            lib, errors = None, []
            for path in tried:
                try:
                    # NVRTC opens its builtins library by name: load the one beside it first
                    for b in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so.*"))):
                        if ".alt." not in b:
                            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                    lib = ctypes.CDLL(path)
                    break
                except OSError as e:
                    errors.append(f"{path}: {e}")
            if lib is None:
                raise NativeKernelError(
                    f"NVRTC not found (tried {tried or 'no candidates'}; {'; '.join(errors)}): install the "
                    f"nvidia-cuda-nvrtc wheel matching torch's CUDA, or set {NVRTC_ENV} to libnvrtc.so")
        _LIBS[name] = lib
        return lib


def _check_cu(rc: int, what: str) -> None:
    if rc != 0:
        cu = _lib("cuda")
        msg = ctypes.c_char_p()
        cu.cuGetErrorString(rc, ctypes.byref(msg))
        raise NativeKernelError(f"{what}: CUDA driver error {rc} ({(msg.value or b'?').decode()})")


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    # the architecture-specific target (sm_90a) from sm90 on: the cubin is built for this device only
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def compile_cubin(source: str, name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """The cubin of ``source`` for ``arch`` (e.g. "sm_90a"); NativeKernelError with NVRTC's log."""
    nv = _lib("nvrtc")
    prog = ctypes.c_void_p()
    rc = nv.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None)
    if rc:
        raise NativeKernelError(f"{name}: nvrtcCreateProgram failed ({rc})")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17"] + [o.encode() for o in options]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        rc = nv.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nv.nvrtcGetProgramLog(prog, log)
        if rc:
            raise NativeKernelError(f"{name}: NVRTC compile for {arch} failed ({rc}):\n{log.value.decode(errors='replace')}")
        nv.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        rc = nv.nvrtcGetCUBIN(prog, cubin)
        if rc:
            raise NativeKernelError(f"{name}: nvrtcGetCUBIN failed ({rc})")
        return cubin.raw
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(prog))


class Module:
    """A loaded module: ``kernel(name)`` gives a launchable function."""

    def __init__(self, cubin: bytes):
        cu = _lib("cuda")
        self._cubin = ctypes.create_string_buffer(cubin, len(cubin))   # kept alive with the module
        self.handle = ctypes.c_void_p()
        _check_cu(cu.cuModuleLoadData(ctypes.byref(self.handle), self._cubin), "cuModuleLoadData")
        self._funcs: dict[str, ctypes.c_void_p] = {}

    def kernel(self, name: str) -> ctypes.c_void_p:
        f = self._funcs.get(name)
        if f is None:
            f = ctypes.c_void_p()
            _check_cu(_lib("cuda").cuModuleGetFunction(ctypes.byref(f), self.handle, name.encode()),
                      f"cuModuleGetFunction({name})")
            self._funcs[name] = f
        return f


def module(source: str, name: str, device: torch.device, options: tuple[str, ...] = ()) -> Module:
    """``source`` compiled for ``device`` and loaded (once per process and device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (source, options, index)
    m = _MODULES.get(key)
    if m is None:
        with torch.cuda.device(index):
            torch.cuda.init()
            torch.empty(0, device=f"cuda:{index}")   # the primary context current on this thread
            cubin = compile_cubin(source, name, _arch(torch.device("cuda", index)), options)
            m = Module(cubin)
        _MODULES[key] = m
    return m


def launch(func: ctypes.c_void_p, grid: tuple[int, int, int], block: tuple[int, int, int], args: list,
           name: str, shared: int = 0) -> None:
    """``func<<<grid, block, shared, current stream>>>(*args)``; ``args``: ctypes values in the
    kernel's parameter order (c_void_p for pointers, c_int for ints, c_float for floats)."""
    ptrs = (ctypes.c_void_p * len(args))(*(ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args))
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    _check_cu(_lib("cuda").cuLaunchKernel(func, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                                          shared, stream, ptrs, None), f"launch of {name} (grid {grid}, block {block})")
