"""Register the Triton kernels on a HAL Backend for one device type (no triton import here).

A kernel function declares the op it implements where it is defined::

    @implements("rms_norm", supports=rms_norm_supports)
    def rms_norm(x, weight, eps): ...

:func:`register_ops` adds, for each op of the index :data:`~dsv4core.kernels.triton.OPS`, a wrapper
with the op's signature, guarded by the op's predicate (:data:`.predicates.SUPPORTS`); the first
call imports the kernel module (running its ``@implements``) and then calls the declared function.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Callable

import torch

from . import OPS, predicates
from .launch import _ACTIVE, LaunchTable

_mods: dict = {}

#: op -> the kernel function declared for it by :func:`implements` (filled as kernel modules import)
KERNELS: dict[str, Callable] = {}


def implements(op: str, *, supports: Callable) -> Callable[[Callable], Callable]:
    """Mark the decorated function as the Triton implementation of HAL op ``op``, guarded by
    ``supports`` (the op's predicate in :mod:`.predicates`). Returns the function unchanged.

    Raises ValueError when the declaration disagrees with what the lazy registration reads: ``op``
    not in the index :data:`OPS`, declared in another module than the index names, declared twice,
    or ``supports`` not the predicate :data:`.predicates.SUPPORTS` holds for ``op``."""

    def mark(fn: Callable) -> Callable:
        where = f"@implements({op!r}) on {fn.__module__}.{fn.__qualname__}"
        if op not in OPS:
            raise ValueError(f"{where}: {op!r} is not in the kernel index OPS "
                             f"(dsv4core/kernels/triton/__init__.py); known: {', '.join(OPS)}")
        module = f"{__package__}.{OPS[op]}"
        if fn.__module__ != module:
            raise ValueError(f"{where}: the index OPS places {op!r} in {module}, not {fn.__module__}")
        want = predicates.SUPPORTS.get(op)
        if supports is not want:
            raise ValueError(f"{where}: supports={getattr(supports, '__name__', supports)!r}, but the "
                             f"registration guards {op!r} with predicates.SUPPORTS[{op!r}] = "
                             f"{getattr(want, '__name__', want)!r}")
        if op in KERNELS and KERNELS[op] is not fn:
            raise ValueError(f"{where}: {op!r} is already implemented by {KERNELS[op].__qualname__}")
        KERNELS[op] = fn
        return fn

    return mark


def kernel(op: str) -> Callable:
    """The kernel function declared for ``op`` (imports its module: triton with it)."""
    if op not in OPS:
        raise KeyError(f"no Triton kernel for op {op!r} (known: {', '.join(OPS)})")
    _module(OPS[op])
    fn = KERNELS.get(op)
    if fn is None:
        raise LookupError(f"kernel module {__package__}.{OPS[op]} declares no @implements({op!r}, ...)")
    return fn

def _module(name: str):
    mod = _mods.get(name)
    if mod is None:
        mod = _mods[name] = importlib.import_module(f"{__package__}.{name}")
    return mod


def _first_device(args, kwargs):
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v.device
    return None


def _lazy(op: str, modname: str, sig: inspect.Signature, device_type: str, launch=None):
    """A wrapper with the op's exact signature that imports the kernel module on first use and then
    rebinds itself to the kernel function (one extra Python call on the hot path).

    ``launch``: the backend's launch table (launch.py), or a zero-argument callable returning it
    (resolved at the first call: a plugin reads its device's arch only then). Its entry for the
    kernel module is active while the kernel runs; an entry that is a callable is called with the
    op's arguments and returns the entry for this call (e.g. other tiles for fp32 inputs).

    Device guard: Triton launches on the CURRENT device, so a call whose tensors live on another
    device of the same type (``cuda:1`` while ``cuda:0`` is current) runs with that device made
    current for the call (``supports`` already declined calls mixing devices). With one device of
    the type (its ``device_count()``, read at the first call) every tensor is on the current one:
    no guard, nothing read per call."""
    target = []
    accel = getattr(torch, device_type, None) if device_type != "cpu" else None

    def guarded(fn, args, kwargs):
        dev = _first_device(args, kwargs)
        if dev is not None and dev.index is not None and dev.index != accel.current_device():
            with accel.device(dev):
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    def impl(*args, **kwargs):
        if not target:
            mod = _module(modname)
            fn, table = kernel(op), _entries(launch() if callable(launch) else launch)
            entry = (table or {}).get(modname)
            tune = getattr(mod, "TUNE", None)
            if entry is not None and tune is None:
                raise ValueError(f"launch table: an entry for {modname!r} (op {op}), a kernel module without "
                                 f"launch parameters")
            if entry is not None and not callable(entry):
                tune.check(entry, f"the launch table's entry, op {op}")
            target[:] = [fn, entry, None if entry is None or callable(entry) else {modname: entry}, tune,
                         _several(accel)]
        fn, entry, static, tune, several = target
        if entry is None:
            return guarded(fn, args, kwargs) if several else fn(*args, **kwargs)
        if static is None:   # a callable entry: its result checked per call (a subset test, ~0.1 µs)
            got = entry(*args, **kwargs)
            if got is not None:
                if not isinstance(got, dict):
                    raise TypeError(f"launch table: the entry for {modname!r} returned {type(got).__name__} for "
                                    f"op {op}; expected a dict of launch parameters or None")
                if not got.keys() <= tune.keys:
                    tune.check(got, f"the launch table's entry, op {op}")
            static = {modname: got}
        tok = _ACTIVE.set(static)
        try:
            return guarded(fn, args, kwargs) if several else fn(*args, **kwargs)
        finally:
            _ACTIVE.reset(tok)

    impl.__signature__ = sig
    impl.__name__ = impl.__qualname__ = op
    impl.__doc__ = f"Triton kernel for {op} ({__package__}.{modname})."
    return impl


def _several(accel) -> bool:
    """Whether the device module ``accel`` (``torch.cuda``, ...; None for the CPU) may hold tensors
    on a device other than the current one: it has more than one device, or does not say."""
    if accel is None:
        return False
    count = getattr(accel, "device_count", None)
    try:
        return count is None or int(count()) > 1
    except Exception:  # noqa: BLE001 - a count it cannot give: keep the guard
        return True


def _entries(table):
    """A table's {module -> entry}, refusing a whole LaunchTable (whose keys are targets)."""
    if isinstance(table, LaunchTable):
        raise TypeError(f"launch table of {table.plugin}: register_ops takes one target's entries, "
                        f"e.g. TABLES.resolve(arch) (targets: {', '.join(table)}), not the LaunchTable")
    return table


def _on_device(pred, device_type: str):
    """pred plus: every tensor argument lives on ONE device of ``device_type``; any exception declines.

    Per call, host cost: a tensor's device type is read from its ``is_<type>`` flag and its device
    index from ``get_device()`` (no ``torch.device`` object is built: ``t.device.type`` alone costs
    more than the rest of a typical predicate); the index only on a device type with several
    devices (``_several``, decided at the first call)."""
    sig = inspect.signature(pred)
    flag = f"is_{device_type}" if hasattr(torch.Tensor, f"is_{device_type}") else None   # else t.device.type

    Tensor = torch.Tensor
    several = []     # whether the type has several devices (read at the first call: `_several`)

    def supports(*args, **kwargs):
        try:
            if not several:      # the CPU and meta: one device; a type without a torch module: unknown
                accel = getattr(torch, device_type, None)
                several.append(device_type not in ("cpu", "meta") and (accel is None or _several(accel)))
            index, check = None, several[0]      # one device of the type: no index to compare
            for v in (args if not kwargs else (*args, *kwargs.values())):
                if isinstance(v, Tensor):
                    if not (getattr(v, flag) if flag is not None else v.device.type == device_type):
                        return False
                    if check:
                        i = v.get_device()
                        if index is None:
                            index = i
                        elif i != index:
                            return False
            return bool(pred(*args, **kwargs))
        except Exception:  # noqa: BLE001 - a predicate declines, it never raises
            return False

    supports.__signature__ = sig
    supports.__name__ = supports.__qualname__ = pred.__name__
    return supports


def triton_backend_problem(backend: str, distribution: str, index: str) -> str:
    """Why the installed Triton cannot compile for a vendor ("" if it can): not importable, or
    without the vendor's compiler backend (``amd``, ``intel``) because upstream ``triton``
    replaced the vendor's build. For a plugin's ``available()``; imports triton."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        return (f"triton is not importable; the vendor's torch wheel brings it as {distribution!r} "
                f"(reinstall that from the {index}, do not pip install upstream 'triton')")
    import triton
    import triton.backends

    found = getattr(triton.backends, "backends", {})
    if backend in found:
        return ""
    return (f"the installed triton {getattr(triton, '__version__', '?')} has no {backend!r} backend "
            f"(backends: {', '.join(sorted(found)) or 'none'}): upstream triton replaced the vendor's; "
            f"reinstall {distribution!r} from the {index}")


def register_ops(backend, device_type: str, ops=None, launch=None, supports=None) -> None:
    """Add every Triton op (or the subset ``ops``) to ``backend`` for tensors on ``device_type``.

    ``launch``: one target's entries of the plugin's :class:`.launch.LaunchTable`
    (``TABLES.resolve(arch)``), or a zero-argument callable returning them (resolved at the
    first call); None runs the kernels' own defaults. ``supports``: optional extra predicates
    per op (same parameters as the op) that must also accept a call, e.g. a plugin declining a dtype
    its target cannot run."""
    if not callable(launch):
        _entries(launch)   # a whole LaunchTable fails here, not at the first call
    for op, modname in OPS.items():
        if ops is not None and op not in ops:
            continue
        pred = predicates.SUPPORTS[op]
        extra = (supports or {}).get(op)
        backend.add(op, _lazy(op, modname, inspect.signature(pred), device_type, launch),
                    supports=_on_device(_both(pred, extra) if extra else pred, device_type),
                    capturable=True,  # every kernel here launches a grid fixed by the shapes
                    native_quantized=True)  # no kernel here dequantises a weight copy


def _both(pred, extra):
    def both(*args, **kwargs):
        return pred(*args, **kwargs) and extra(*args, **kwargs)

    both.__signature__ = inspect.signature(pred)
    both.__name__ = pred.__name__
    return both
