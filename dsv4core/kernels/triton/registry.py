"""Register the Triton kernels on a HAL Backend for one device type (no triton import here)."""
from __future__ import annotations

import importlib
import inspect

import torch

from . import OPS, predicates

_mods: dict = {}

#: Kernels whose launch wrapper synchronises with the host (a grid sized from device data): not
#: recordable in a device graph. None since the MoE kernel sorts on the device; every kernel here
#: launches a grid fixed by the shapes.
HOST_SYNC: frozenset[str] = frozenset()


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


def _lazy(op: str, modname: str, sig: inspect.Signature, device_type: str):
    """A wrapper with the op's exact signature that imports the kernel module on first use and then
    rebinds itself to the kernel function (one extra Python call on the hot path).

    Device guard: Triton launches on the CURRENT device, so a call whose tensors live on another
    device of the same type (``cuda:1`` while ``cuda:0`` is current) runs with that device made
    current for the call (``supports`` already declined calls mixing devices)."""
    target = []
    accel = getattr(torch, device_type, None) if device_type != "cpu" else None

    def impl(*args, **kwargs):
        if not target:
            target.append(getattr(_module(modname), op))
        if accel is not None:
            dev = _first_device(args, kwargs)
            if dev is not None and dev.index is not None and dev.index != accel.current_device():
                with accel.device(dev):
                    return target[0](*args, **kwargs)
        return target[0](*args, **kwargs)

    impl.__signature__ = sig
    impl.__name__ = impl.__qualname__ = op
    impl.__doc__ = f"Triton kernel for {op} ({__package__}.{modname})."
    return impl


def _on_device(pred, device_type: str):
    """pred plus: every tensor argument lives on ONE device of ``device_type``; any exception declines."""
    sig = inspect.signature(pred)

    def supports(*args, **kwargs):
        try:
            dev = None
            for v in (*args, *kwargs.values()):
                if isinstance(v, torch.Tensor):
                    if v.device.type != device_type or (dev is not None and v.device != dev):
                        return False
                    dev = v.device
            return bool(pred(*args, **kwargs))
        except Exception:  # noqa: BLE001 - a predicate declines, it never raises
            return False

    supports.__signature__ = sig
    supports.__name__ = supports.__qualname__ = pred.__name__
    return supports


def register_ops(backend, device_type: str, ops=None) -> None:
    """Add every Triton op (or the subset ``ops``) to ``backend`` for tensors on ``device_type``."""
    for op, modname in OPS.items():
        if ops is not None and op not in ops:
            continue
        pred = getattr(predicates, f"{op}_supports")
        backend.add(op, _lazy(op, modname, inspect.signature(pred), device_type),
                    supports=_on_device(pred, device_type), capturable=op not in HOST_SYNC,
                    native_quantized=True)  # no kernel here dequantises a weight copy
