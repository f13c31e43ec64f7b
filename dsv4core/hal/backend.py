"""The backend interface: a named set of op implementations for some device types."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import RegistrationError
from .spec import catalogue

#: The HAL API version (major, minor). Majors are incompatible; minors only add (new optional ops,
#: new arguments with defaults). See dsv4core/hal/CHANGELOG.md.
HAL_API_VERSION = (1, 1)


@dataclass(frozen=True)
class Impl:
    """One op implementation of a backend."""

    op: str
    fn: Callable
    supports: Callable[..., bool] | None = None
    why_not: Callable[..., str] | None = None
    backend: str = ""
    #: The implementation may be recorded in a device graph: it never synchronises with the host,
    #: allocates no shape that depends on tensor values, and does the same work on replay.
    capturable: bool = False
    #: The implementation reads quantised weights (FP8 block-scaled, ...) as they are; False means
    #: it dequantises a copy per call (correct but slow: the model then dequantises once at load).
    native_quantized: bool = False


@dataclass
class Backend:
    """A backend: ``name``, device types, HAL API version, availability probe, op implementations.

    ``available()`` returns ``(ok, reason)``; it is a static platform probe (no device init).
    ``priority``: higher wins under ``auto`` selection (equal priorities: by backend name); the
    reference backend has priority 0 and always comes last. A negative priority means "by name
    only": ``auto`` never picks the backend, ``backend=NAME`` / ``DSV4CORE_BACKEND`` / a per-op
    override do.
    ``validated``: whether the backend has been validated on hardware (a recorded conformance
    report, :mod:`dsv4core.hal.validation`), one line; ``""`` = not stated.
    """

    name: str
    version: str = "0"
    device_types: tuple[str, ...] = ("cpu",)
    api_version: tuple[int, int] = HAL_API_VERSION
    priority: int = 50
    available: Callable[[], tuple[bool, str]] = lambda: (True, "")
    description: str = ""
    validated: str = ""
    impls: dict[str, Impl] = field(default_factory=dict)
    #: Optional device-graph capture for the device types this backend serves
    #: (see dsv4core.hal.graphs.GraphCapture).
    graph_capture: Any = None

    def serves(self, device_type: str) -> bool:
        """True if this backend runs on ``device_type`` (``"*"`` in device_types means any)."""
        return "*" in self.device_types or device_type in self.device_types

    def implements(self, op_name: str, *, supports: Callable[..., bool] | None = None,
                   why_not: Callable[..., str] | None = None,
                   capturable: bool = False, native_quantized: bool = False) -> Callable[[Callable], Callable]:
        """Decorator registering ``fn`` as this backend's implementation of ``op_name``.

        ``fn``, ``supports`` and ``why_not`` must have exactly the op's parameters (names, order,
        kinds, and the op's defaults where it has them); a mismatch raises RegistrationError naming
        the op and the parameter. ``supports(...) -> bool`` (a plain bool) says whether this
        implementation takes the call (declined calls go to the next backend);
        ``why_not(...) -> str`` gives the reason for a decline (called only after ``supports``
        said no; shown in warnings and conformance reports).
        ``capturable=True`` declares that the implementation (and its
        ``supports`` predicate) can be recorded in a device graph: no host synchronisation, no
        shape that depends on tensor values. Undeclared implementations are run eagerly.
        ``native_quantized=True`` declares that quantised weights are read as they are (no
        dequantised copy per call).
        """

        def wrap(fn: Callable) -> Callable:
            self.add(op_name, fn, supports=supports, why_not=why_not, capturable=capturable,
                     native_quantized=native_quantized)
            return fn

        return wrap

    def add(self, op_name: str, fn: Callable, *, supports=None, why_not=None, capturable: bool = False,
            native_quantized: bool = False) -> None:
        specs = catalogue()
        if op_name not in specs:
            raise RegistrationError(f"backend {self.name!r}: unknown op {op_name!r} "
                                    f"(known: {', '.join(specs)})")
        params = specs[op_name].signature.parameters
        want = list(params)
        for what, f in (("implementation", fn), ("supports", supports), ("why_not", why_not)):
            if f is None:
                continue
            got_params = inspect.signature(f).parameters
            got = list(got_params)
            detail = ""
            if got != want:
                missing = [p for p in want if p not in got]
                extra = [p for p in got if p not in want]
                detail = (f"missing parameter {missing[0]!r}" if missing else
                          f"unexpected parameter {extra[0]!r}" if extra else f"parameter order {got}")
            else:  # callers pass arguments positionally or by name and omit defaulted ones
                for name, p in params.items():
                    g = got_params[name]
                    if g.kind != p.kind:
                        detail = f"parameter {name!r} is {g.kind.description}, expected {p.kind.description}"
                    elif p.default is not inspect.Parameter.empty and (
                            g.default is inspect.Parameter.empty or not _same_default(g.default, p.default)):
                        detail = (f"parameter {name!r} must default to {p.default!r}, "
                                  f"got {'no default' if g.default is inspect.Parameter.empty else repr(g.default)}")
                    if detail:
                        break
            if detail:
                raise RegistrationError(f"backend {self.name!r}, op {op_name!r}: {what} signature does not "
                                        f"match the op contract ({detail}; expected {want})")
        if op_name in self.impls:
            raise RegistrationError(f"backend {self.name!r}: op {op_name!r} registered twice")
        self.impls[op_name] = Impl(op_name, fn, supports, why_not, self.name, bool(capturable), bool(native_quantized))


def _same_default(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - an uncomparable default is a different default
        return False
