"""The aiter-served ops of the rocm backend, each in front of the portable Triton kernel.

| op      | aiter entry point                                        | since aiter | served when                         |
|---------|----------------------------------------------------------|-------------|-------------------------------------|
| hc_pre  | ``aiter.ops.mhc.mhc_pre`` (HIP, JIT-built)               | 0.1.11      | bf16 x, n == 4, H % 256 == 0, gfx942/gfx950 |
| hc_post | ``aiter.ops.mhc.mhc_post``                               | 0.1.11      | bf16, n == 4, H % 256 == 0, gfx942/gfx950   |
| wo_a    | ``aiter.ops.triton.gemm.batched.batched_gemm_bf16``      | 0.1.10      | bf16 weights, T <= 64 (decode), gfx950      |

Layouts (VENDORS.md A.2): ``mhc_pre`` returns ``(post [T,n,1], comb [T,n,n], y [T,H])`` where the
HAL returns ``(y, post [T,n], comb)``; ``mhc_post(out, x, residual, post [T,n,1], comb)`` writes
``out`` in place, with comb's first index summed (the HAL's orientation); ``batched_gemm_bf16(X
[G,T,D], W [G,R,D])`` returns ``[G,T,R]`` where the HAL's ``wo_a`` takes ``o [T,G,D]`` and returns
``[T,G,R]``. The HAL's single ``hc_eps`` is both aiter's ``hc_pre_eps`` and ``hc_sinkhorn_eps``.

aiter is imported at the first call of one of these ops, never at plugin import. Missing module,
an aiter older than the op needs, or an import error: the op runs the portable kernel, and the
reason (with the installed version) is logged once and shown by :func:`status`.
"""
from __future__ import annotations

import importlib
import inspect
import logging
from importlib import metadata

import torch

from dsv4core.hal import catalogue

log = logging.getLogger("dsv4core.rocm")

#: distributions that install the ``aiter`` package (PyPI name, source-build name)
_DISTS = ("amd-aiter", "aiter")


def aiter_version() -> str | None:
    for d in _DISTS:
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            continue
    return None


def _vtuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if not part.isdigit():
            break
    return tuple(out)


class VendorFn:
    """One aiter function, resolved at first use: the callable, or why it cannot be used."""

    def __init__(self, modules: tuple[str, ...], attr: str, since: str):
        self.modules, self.attr, self.since = modules, attr, since
        self._fn = None
        self._why: str | None = None

    def resolve(self):
        """(fn, "") or (None, reason); cached."""
        if self._fn is None and self._why is None:
            self._fn, self._why = self._find()
            if self._why:
                log.info("rocm: %s unavailable: %s", self.attr, self._why)
        return self._fn, self._why or ""

    def _find(self):
        ver = aiter_version()
        if ver is not None and _vtuple(ver) < _vtuple(self.since):
            return None, f"aiter {ver} is older than {self.since}, the first with {self.modules[0]}.{self.attr}"
        errors = []
        for name in self.modules:
            try:
                mod = importlib.import_module(name)
            except ImportError as e:
                errors.append(f"import {name} failed: {e}")
                continue
            except Exception as e:  # noqa: BLE001 - aiter raises RuntimeError without ROCm
                errors.append(f"import {name} raised {type(e).__name__}: {e}")
                continue
            fn = getattr(mod, self.attr, None)
            if fn is not None:
                return fn, None
            errors.append(f"{name} has no {self.attr}")
        have = f"aiter {ver}" if ver else "aiter (version unknown)"
        return None, f"{have}: " + "; ".join(errors)


MHC_PRE = VendorFn(("aiter.ops.mhc",), "mhc_pre", "0.1.11")
MHC_POST = VendorFn(("aiter.ops.mhc",), "mhc_post", "0.1.11")
# the old flat path is kept by aiter's backward-compat map; 0.1.7 (PyPI) has only that one
BATCHED_GEMM_BF16 = VendorFn(("aiter.ops.triton.gemm.batched.batched_gemm_bf16",
                              "aiter.ops.triton.batched_gemm_bf16"), "batched_gemm_bf16", "0.1.10")

_MHC_ARCHS = ("gfx942", "gfx950")
_WO_A_ARCHS = ("gfx950",)
#: decode sizes (SGLang uses batched_gemm_bf16 on decode only); larger T runs the portable kernel
WO_A_MAX_TOKENS = 64


# ---- shape / dtype limits (what the aiter kernels accept; VENDORS.md A.2)

def _hc_dims(kernel: str, t) -> str:
    """The [T, n, H] limits aiter's mhc kernels share: hc_mult 4, H % 256 == 0, T > 0."""
    T, n, H = t.shape
    if n != 4:
        return f"aiter {kernel} is built for hc_mult 4 only (n = {n})"
    if H % 256:
        return f"aiter {kernel} needs H % 256 == 0 (H = {H})"
    if T == 0:
        return "T = 0"
    return ""


def _hc_pre_shape(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0) -> str:
    if x.dim() != 3 or x.dtype != torch.bfloat16:
        return f"x must be a bf16 [T, n, H] tensor (got {x.dtype}, {tuple(x.shape)})"
    why = _hc_dims("mhc_pre", x)
    if why:
        return why
    if fn.dtype != torch.float32 or scale.dtype != torch.float32 or base.dtype != torch.float32:
        return "fn / scale / base must be float32"
    if int(iters) < 1:
        return f"iters must be >= 1 (got {iters})"
    return ""


def _hc_post_shape(o, residual, post, comb) -> str:
    if residual.dim() != 3 or residual.dtype != torch.bfloat16 or o.dtype != torch.bfloat16:
        return f"residual and o must be bf16 (got {residual.dtype}, {o.dtype})"
    why = _hc_dims("mhc_post", residual)
    if why:
        return why
    if post.dtype != torch.float32 or comb.dtype != torch.float32:
        return "post / comb must be float32"
    return ""


def _wo_a_shape(o, weight, weight_scale=None) -> str:
    if weight_scale is not None:
        return "fp8 weights (batched_gemm_bf16 is bf16 only)"
    if o.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or o.dim() != 3:
        return f"o and weight must be bf16 (got {o.dtype}, {weight.dtype})"
    if o.shape[0] == 0 or o.shape[0] > WO_A_MAX_TOKENS:
        return f"T = {o.shape[0]} is outside the decode range 1..{WO_A_MAX_TOKENS}"
    return ""


# ---- the calls (argument order and layouts as documented; see the module docstring)

def _hc_pre(mhc_pre, x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
    post, comb, y = mhc_pre(x.contiguous(), fn.contiguous(), scale.contiguous(), base.contiguous(),
                            rms_eps=float(rms_eps), hc_pre_eps=float(hc_eps), hc_sinkhorn_eps=float(hc_eps),
                            hc_post_mult_value=float(post_mult), sinkhorn_repeat=int(iters))
    return y, post.reshape(post.shape[0], post.shape[1]), comb


def _hc_post(mhc_post, o, residual, post, comb):
    residual = residual.contiguous()
    out = torch.empty_like(residual)
    mhc_post(out, o.contiguous(), residual, post.contiguous().unsqueeze(-1), comb.contiguous())
    return out


def _wo_a(bgemm, o, weight, weight_scale=None):
    y = bgemm(o.transpose(0, 1).contiguous(), weight.contiguous(), dtype=torch.bfloat16)   # [G, T, R]
    return y.transpose(0, 1).contiguous()                                                   # [T, G, R]


_OPS = {
    # op: (vendor fns, shape check, call, archs)
    "hc_pre": ((MHC_PRE,), _hc_pre_shape, _hc_pre, _MHC_ARCHS),
    "hc_post": ((MHC_POST,), _hc_post_shape, _hc_post, _MHC_ARCHS),
    "wo_a": ((BATCHED_GEMM_BF16,), _wo_a_shape, _wo_a, _WO_A_ARCHS),
}


def _device_ok(device_type, args, kwargs) -> bool:
    return all(v.device.type == device_type for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))


def why_not_vendor(op: str, get_arch, device_type: str, *args, **kwargs) -> str:
    """Why aiter does not serve this call ("" if it does)."""
    fns, shape, _, archs = _OPS[op]
    if not _device_ok(device_type, args, kwargs):
        return f"tensors are not all on {device_type!r}"
    arch = get_arch()
    if arch not in archs:
        return f"arch {arch} (aiter's {op} path is used on {', '.join(archs)})"
    try:
        why = shape(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a malformed call declines
        return f"inputs not understood ({type(e).__name__}: {e})"
    if why:
        return why
    for vf in fns:
        _, why = vf.resolve()
        if why:
            return why
    return ""


def register(backend, portable, device_type: str, get_arch) -> None:
    """Add ``portable``'s ops to ``backend``; for the ops in the table above, an implementation
    that calls aiter when it can serve the call and the portable kernel otherwise."""
    specs = catalogue()
    for op, impl in portable.impls.items():
        if op not in _OPS:
            backend.add(op, impl.fn, supports=impl.supports, why_not=impl.why_not, capturable=impl.capturable,
                        native_quantized=impl.native_quantized)
            continue
        fn, supports, why_not = _front(op, specs[op].signature, impl, device_type, get_arch)
        # aiter's side has not been recorded in a device graph here: not declared capturable
        backend.add(op, fn, supports=supports, why_not=why_not, native_quantized=impl.native_quantized)
    for op in _OPS:   # an aiter op the portable kernels lack (none today) would still be served
        if op not in portable.impls:
            fn, supports, why_not = _front(op, specs[op].signature, None, device_type, get_arch)
            backend.add(op, fn, supports=supports, why_not=why_not)


def _front(op, sig: inspect.Signature, portable_impl, device_type, get_arch):
    """(fn, supports, why_not) for an aiter-fronted op, with the vendor gate evaluated once per call.

    The HAL calls ``supports`` and then ``fn`` on every call. Every call aiter serves is one the
    portable kernel also accepts (the aiter limits above are narrower than the portable
    predicates), so ``supports`` is the portable predicate alone and ``fn`` evaluates the gate,
    once, to pick aiter or the portable kernel. Without a portable kernel (none today) the gate is
    ``supports`` and ``fn`` calls aiter directly."""
    fns, _, call, _ = _OPS[op]
    told = [False]

    def vendor_why(*args, **kwargs) -> str:
        why = why_not_vendor(op, get_arch, device_type, *args, **kwargs)
        if why and not told[0]:
            lib_why = fns[0].resolve()[1]
            if lib_why:   # the vendor library itself is missing or too old: say so once
                told[0] = True
                log.warning("rocm %s: using the portable Triton kernel: %s", op, lib_why)
        return why

    def vendor_call(*args, **kwargs):
        return call(*(vf.resolve()[0] for vf in fns), *args, **kwargs)

    if portable_impl is None:
        def fn(*args, **kwargs):
            return vendor_call(*args, **kwargs)

        def supports(*args, **kwargs) -> bool:
            return not vendor_why(*args, **kwargs)

        def why_not(*args, **kwargs) -> str:
            return f"aiter: {why_not_vendor(op, get_arch, device_type, *args, **kwargs)}; no portable kernel"
    else:
        portable_fn, portable_ok = portable_impl.fn, portable_impl.supports

        def fn(*args, **kwargs):
            if vendor_why(*args, **kwargs):
                return portable_fn(*args, **kwargs)
            return vendor_call(*args, **kwargs)

        def supports(*args, **kwargs) -> bool:
            return portable_ok is None or bool(portable_ok(*args, **kwargs))

        def why_not(*args, **kwargs) -> str:
            why = (portable_impl.why_not(*args, **kwargs) if portable_impl.why_not
                   else "its supports() predicate declined these inputs")
            return f"portable Triton kernel: {why} (aiter serves a subset of those calls)"

    for f in (fn, supports, why_not):
        f.__signature__ = sig
        f.__name__ = f.__qualname__ = op
    return fn, supports, why_not


def status(get_arch=None) -> dict[str, str]:
    """Per aiter-served op: "aiter <fn>" or the reason it is not used (resolves aiter: call on a
    ROCm machine, e.g. from vendor CI logs)."""
    out = {}
    for op, (fns, _, _, archs) in _OPS.items():
        arch = get_arch() if get_arch else None
        whys = [vf.resolve()[1] for vf in fns]
        if arch is not None and arch not in archs:
            out[op] = f"portable (arch {arch}; aiter path on {', '.join(archs)})"
        elif any(whys):
            out[op] = "portable (" + "; ".join(w for w in whys if w) + ")"
        else:
            out[op] = "aiter " + ", ".join(f"{vf.modules[0]}.{vf.attr}" for vf in fns)
    return out
