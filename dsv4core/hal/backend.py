"""The backend interface: a named set of op implementations for some device types."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

from .errors import RegistrationError
from .spec import catalogue

#: The HAL API version (major, minor). Majors are incompatible; minors only add (new optional ops,
#: new arguments with defaults). See dsv4core/hal/CHANGELOG.md.
HAL_API_VERSION = (1, 0)


@dataclass(frozen=True)
class Impl:
    """One op implementation of a backend."""

    op: str
    fn: Callable
    supports: Callable[..., bool] | None = None
    why_not: Callable[..., str] | None = None
    backend: str = ""


@dataclass
class Backend:
    """A backend: ``name``, device types, HAL API version, availability probe, op implementations.

    ``available()`` returns ``(ok, reason)``; it is a static platform probe (no device init).
    ``priority``: higher wins under ``auto`` selection; the reference backend has priority 0.
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

    def serves(self, device_type: str) -> bool:
        """True if this backend runs on ``device_type`` (``"*"`` in device_types means any)."""
        return "*" in self.device_types or device_type in self.device_types

    def implements(self, op_name: str, *, supports: Callable[..., bool] | None = None,
                   why_not: Callable[..., str] | None = None) -> Callable[[Callable], Callable]:
        """Decorator registering ``fn`` as this backend's implementation of ``op_name``.

        ``fn``, ``supports`` and ``why_not`` must have exactly the op's parameters (names, order,
        kinds, and the op's defaults where it has them); a mismatch raises RegistrationError naming
        the op and the parameter.
        """

        def wrap(fn: Callable) -> Callable:
            self.add(op_name, fn, supports=supports, why_not=why_not)
            return fn

        return wrap

    def add(self, op_name: str, fn: Callable, *, supports=None, why_not=None) -> None:
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
        self.impls[op_name] = Impl(op_name, fn, supports, why_not, self.name)


def _same_default(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - an uncomparable default is a different default
        return False
