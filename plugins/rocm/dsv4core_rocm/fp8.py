"""OCP float8_e4m3fn checkpoint weights on gfx942 (MI300), whose native fp8 is float8_e4m3fnuz.

DSV4 checkpoints store FP8 weights as OCP e4m3fn codes with 128x128 block scales. gfx942 converts
e4m3fnuz codes in hardware and only emulates OCP e4m3fn (Triton's AMD backend, in software). On
gfx942 the rocm backend therefore feeds ``linear`` and ``wo_a`` the same bytes read as e4m3fnuz,
with the block scale doubled (a copy only for weights holding -0 codes, below), and the product is
exactly the same.

Why that is exact (from the two formats' definitions; code c = sign s, exponent e (4 bits),
mantissa m (3 bits)):

    e4m3fn   (OCP, bias 7):  e >= 1: (-1)^s 2^(e-7) (1 + m/8);  e = 0: (-1)^s 2^-6 (m/8)
                             c = 0x7F / 0xFF (e = 15, m = 7) is NaN; 0x80 is -0; no infinity
    e4m3fnuz (bias 8):       e >= 1: (-1)^s 2^(e-8) (1 + m/8);  e = 0: (-1)^s 2^-7 (m/8)
                             c = 0x80 is the only NaN (no -0); 0x7F / 0xFF are +-240; no infinity

For every code other than 0x80, 0x7F and 0xFF the two readings differ by exactly one power of
two, normal and subnormal alike: fnuz(c) = fn(c) / 2. So ``fn(c) * S == fnuz(c) * (2 S)`` for the
block scale S, with no rounding anywhere (doubling a float is exact unless it overflows).
The three special codes:

* 0x80 is -0 in e4m3fn but NaN in e4m3fnuz: the kernel must read 0x00 (+0) there, which changes
  no value (-0 == +0 in every product and sum). A weight with no 0x80 code is read as it is (a
  view). One with such codes is, by default, read from a converted copy (cached per weight, its
  size logged once): an op never writes its caller's inputs, and the caller's tensor may be
  read-only memory (a memory-mapped checkpoint) or shared with another backend. A deployment that
  owns its weights can set ``DSV4CORE_ROCM_FNUZ_IN_PLACE=1`` to rewrite the codes in place
  instead (no extra memory; accelerator tensors only, never a CPU tensor, whose storage may be a
  read-only mapping that torch cannot detect).
* 0x7F / 0xFF are NaN in e4m3fn but +-240 in e4m3fnuz: a weight holding them is declined (the
  reference serves it, and propagates the NaN as the HAL specifies).
* Range: the largest finite e4m3fn code, 0x7E = 448, reads as 224 in e4m3fnuz (max 240), so the
  reinterpretation never leaves the fnuz range (SGLang uses 224 as its e4m3 maximum on HIP).

Scales: fp32 S -> 2 S (declined if that overflows: |S| > 2^127 would become inf); e8m0 S = 2^(b -
127) -> byte b + 1 (declined for b = 254, whose double 2^128 is not an e8m0 value; b = 255 is NaN
and stays NaN). The doubled scale is a new tensor of 1/16384 of the weight's size.

The conversion runs at the first call that sees a weight (``supports`` triggers it, so it happens
at model load when the loader asks whether the backend takes the FP8 weight), and is cached per
(weight, scale) pair; a weight changed in place is converted again. It reads the weight (a device
sync), so a weight first seen inside a device-graph capture is an error, not a silent fallback.

``moe_experts`` is not converted: the portable MoE kernel recognises FP8 experts by the e4m3fn
dtype (dsv4core/kernels/triton/moe.py ``_format``), so it would misread e4m3fnuz experts; on
gfx942 FP8 experts are declined and the reference serves them. (DSV4's routed experts are FP4,
which gfx942 serves through the portable kernel.)
"""
from __future__ import annotations

import logging
import os
import weakref

import torch

log = logging.getLogger("dsv4core.rocm")

E4M3FN = getattr(torch, "float8_e4m3fn", None)
E4M3FNUZ = getattr(torch, "float8_e4m3fnuz", None)
E8M0 = getattr(torch, "float8_e8m0fnu", None)
#: the ops whose portable kernels read any fp8 dtype through ``.to(bf16)`` and take the fnuz view
CONVERTED_OPS = ("linear", "wo_a")
MOE_DECLINE = ("FP8 experts on gfx942: the portable MoE kernel reads e4m3fn codes only and gfx942's fp8 "
               "is e4m3fnuz (the e4m3fn -> e4m3fnuz reinterpretation is wired for linear / wo_a only); "
               "the reference serves them")


def is_e4m3fn(t) -> bool:
    return E4M3FN is not None and isinstance(t, torch.Tensor) and t.dtype == E4M3FN


def doubled_scale(scale: torch.Tensor):
    """2 * scale, exactly, in the scale's own dtype, or the reason it cannot be."""
    if E8M0 is not None and scale.dtype == E8M0:
        b = scale.view(torch.uint8)
        if bool((b == 254).any()):
            return "an e8m0 block scale is 2^127, whose double is not an e8m0 value"
        return torch.where(b == 255, b, b + 1).view(E8M0)
    if scale.dtype != torch.float32:
        return f"block scale dtype {scale.dtype} (float32 or float8_e8m0fnu expected)"
    s2 = scale * 2
    if bool((torch.isfinite(scale) & ~torch.isfinite(s2)).any()):
        return "a float32 block scale exceeds 2^127: doubling it overflows"
    return s2


IN_PLACE_ENV = "DSV4CORE_ROCM_FNUZ_IN_PLACE"


def _in_place_allowed(weight: torch.Tensor) -> bool:
    return os.environ.get(IN_PLACE_ENV, "0") == "1" and weight.device.type != "cpu"


def to_fnuz(weight: torch.Tensor, scale: torch.Tensor):
    """(the weight's bytes viewed as e4m3fnuz, 2 * scale), or the reason it cannot be done.

    The weight is never written unless ``DSV4CORE_ROCM_FNUZ_IN_PLACE=1`` (and it is not on the
    CPU): with -0 codes (0x80) present the result is a converted copy (see the module docstring)."""
    if E4M3FNUZ is None:
        return f"torch {torch.__version__} has no float8_e4m3fnuz"
    codes = weight.view(torch.uint8)
    if bool(((codes & 0x7F) == 0x7F).any()):
        return "the weight holds e4m3fn NaN codes (0x7F / 0xFF), which read as +-240 in e4m3fnuz"
    s2 = doubled_scale(scale)
    if isinstance(s2, str):
        return s2
    neg0 = codes == 0x80
    if not bool(neg0.any()):
        return weight.view(E4M3FNUZ), s2
    if _in_place_allowed(weight):
        try:
            with torch.no_grad():
                codes.masked_fill_(neg0, 0)
            return weight.view(E4M3FNUZ), s2
        except RuntimeError as e:   # e.g. an inference tensor outside inference mode: convert a copy
            log.warning("rocm: e4m3fn weight %s could not be rewritten in place (%s)", tuple(weight.shape), e)
    log.info("rocm: e4m3fn weight %s holds -0 codes (NaN in e4m3fnuz): using an e4m3fnuz copy (+%d bytes; "
             "%s=1 rewrites them in place instead)", tuple(weight.shape), weight.numel(), IN_PLACE_ENV)
    return codes.masked_fill(neg0, 0).view(E4M3FNUZ), s2


class FnuzCache:
    """Per (weight, scale) pair: the e4m3fnuz view and doubled scale, or why not; made at first
    sight and again only if either tensor changes in place."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}   # id(weight) -> (weight ref, scale ref, versions, result)

    def get(self, weight: torch.Tensor, scale: torch.Tensor):
        e = self._entries.get(id(weight))
        if e is not None and e[0]() is weight and e[1]() is scale and e[2] == (weight._version, scale._version):
            return e[3]
        if weight.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("rocm: an FP8 e4m3fn weight was first seen inside a device-graph capture; its "
                               "e4m3fnuz conversion reads the weight, so run one eager call (or load the model "
                               "on this backend) before capturing")
        result = to_fnuz(weight, scale)
        if e is None or e[0]() is not weight:
            weakref.finalize(weight, self._entries.pop, id(weight), None)
        self._entries[id(weight)] = (weakref.ref(weight), weakref.ref(scale), (weight._version, scale._version), result)
        return result


def _fnuz_device(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device read e4m3fnuz: a ROCm GPU, or the CPU (the Triton
    interpreter, the emulated tests). Not an NVIDIA GPU running the gfx942 launch table
    (benchmarks/vendor_tables_on_cuda.py), whose Triton has no e4m3fnuz: e4m3fn passes through."""
    return t.device.type == "cpu" or bool(getattr(torch.version, "hip", None))


def _weight_args(args, kwargs):
    """(weight, weight_scale) of a linear / wo_a call (both take ``(x, weight, weight_scale=None, ...)``)."""
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    s = args[2] if len(args) > 2 else kwargs.get("weight_scale")
    return w, s


def _with_weight(args, kwargs, w, s):
    args = list(args)
    for i, name, v in ((1, "weight", w), (2, "weight_scale", s)):
        if len(args) > i:
            args[i] = v
        else:
            kwargs = dict(kwargs, **{name: v})
    return tuple(args), kwargs


def _front(op: str, impl, get_arch, cache: FnuzCache):
    """(fn, supports, why_not) for ``op`` (linear / wo_a) around the portable implementation: on
    gfx942, e4m3fn weights go to the kernel as their e4m3fnuz view with doubled scales; everything
    else passes through unchanged."""
    fn0, ok0 = impl.fn, impl.supports

    def converted(args, kwargs):
        """None (pass through), the converted (args, kwargs), or the reason (str)."""
        w, s = _weight_args(args, kwargs)
        if s is None or not is_e4m3fn(w) or get_arch() != "gfx942" or not _fnuz_device(w):
            return None
        res = cache.get(w, s)
        return res if isinstance(res, str) else _with_weight(args, kwargs, *res)

    def fn(*args, **kwargs):
        c = converted(args, kwargs)
        if c is None:
            return fn0(*args, **kwargs)
        if isinstance(c, str):
            raise ValueError(f"{op}: the rocm backend cannot run this e4m3fn weight on gfx942: {c}")
        return fn0(*c[0], **c[1])

    def supports(*args, **kwargs) -> bool:
        if ok0 is not None and not ok0(*args, **kwargs):
            return False
        return not isinstance(converted(args, kwargs), str)

    def why_not(*args, **kwargs) -> str:
        if ok0 is not None and not ok0(*args, **kwargs):
            return "the portable Triton kernel's supports() predicate declined these inputs"
        c = converted(args, kwargs)
        return f"gfx942 (e4m3fnuz hardware): {c}" if isinstance(c, str) else ""

    return fn, supports, why_not


def _moe_front(impl, get_arch):
    """supports / why_not for moe_experts: FP8 (e4m3fn) experts declined on gfx942."""
    ok0 = impl.supports

    def fp8_on_gfx942(args, kwargs) -> bool:
        w13 = args[3] if len(args) > 3 else kwargs.get("w13")
        w2 = args[4] if len(args) > 4 else kwargs.get("w2")
        return (is_e4m3fn(w13) or is_e4m3fn(w2)) and get_arch() == "gfx942"

    def supports(*args, **kwargs) -> bool:
        return (ok0 is None or bool(ok0(*args, **kwargs))) and not fp8_on_gfx942(args, kwargs)

    def why_not(*args, **kwargs) -> str:
        if fp8_on_gfx942(args, kwargs):
            return MOE_DECLINE
        return "the portable Triton kernel's supports() predicate declined these inputs"

    return impl.fn, supports, why_not


def add_ops(backend, portable, get_arch) -> None:
    """Add ``portable``'s ops to ``backend``, with the gfx942 FP8 handling above for linear / wo_a
    (e4m3fnuz view) and moe_experts (declined); declarations (capturable, native_quantized) kept."""
    from dsv4core.hal import catalogue

    specs = catalogue()
    cache = FnuzCache()
    for op, impl in portable.impls.items():
        fn, supports, why_not = impl.fn, impl.supports, impl.why_not
        if op in CONVERTED_OPS or op == "moe_experts":
            fn, supports, why_not = _front(op, impl, get_arch, cache) if op != "moe_experts" else _moe_front(impl, get_arch)
            for f in {fn, supports, why_not} - {impl.fn}:
                f.__signature__ = specs[op].signature
                f.__name__ = f.__qualname__ = op
        backend.add(op, fn, supports=supports, why_not=why_not, capturable=impl.capturable,
                    native_quantized=impl.native_quantized)
