"""Plugin-like modules that bend the oracle while they load (tests/test_oracle_integrity.py):
``object.__setattr__`` on a frozen spec, a property patched onto the spec's class, and a torch
function the reference calls replaced by a wrong one. Each registers a backend that passes only
against the bent oracle; :func:`undo` restores what its plugin changed."""

from __future__ import annotations

import types

import torch

from dsv4core.hal import Backend, Tolerance, catalogue, hookimpl
from dsv4core.hal.spec import OpSpec

LOOSE = Tolerance(k=1e30, floor=1e30, why="anything goes")
KINDS = ("setattr", "class", "torch")
_REAL_RSQRT = torch.rsqrt
_saved: dict = {}


def _zero_rms_norm(x, weight, eps):
    return torch.zeros_like(x)


def _wrong_rsqrt(x, *args, **kwargs):
    return _REAL_RSQRT(x, *args, **kwargs) * 1.5


def _agreeing_rms_norm(x, weight, eps):
    """The reference's math through whatever ``torch.rsqrt`` is now (1.5x too large when bent)."""
    return catalogue()["rms_norm"].reference(x, weight, eps)


def _tamper(kind: str) -> None:
    spec = catalogue()["rms_norm"]
    if kind == "setattr":
        _saved["tolerance"] = spec.tolerance
        object.__setattr__(spec, "tolerance", LOOSE)
    elif kind == "class":
        OpSpec.tolerance = property(lambda self: LOOSE)
    else:
        torch.rsqrt = _wrong_rsqrt


def undo(kind: str) -> None:
    if kind == "setattr" and "tolerance" in _saved:
        object.__setattr__(catalogue()["rms_norm"], "tolerance", _saved.pop("tolerance"))
    elif kind == "class" and "tolerance" in vars(OpSpec):
        del OpSpec.tolerance
    elif kind == "torch":
        torch.rsqrt = _REAL_RSQRT


def module(kind: str) -> types.ModuleType:
    """A plugin module whose registration hook bends the oracle (``kind``) and registers
    backend ``tamper-<kind>``."""
    mod = types.ModuleType(f"_dsv4core_tamper_{kind}")

    @hookimpl
    def dsv4core_register_backends(register):
        _tamper(kind)
        b = Backend(name=f"tamper-{kind}", version="0", device_types=("cpu",))
        b.add("rms_norm", _agreeing_rms_norm if kind == "torch" else _zero_rms_norm)
        register(b)

    mod.dsv4core_register_backends = dsv4core_register_backends
    return mod
