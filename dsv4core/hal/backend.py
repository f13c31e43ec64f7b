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
    """

    name: str
    version: str = "0"
    device_types: tuple[str, ...] = ("cpu",)
    api_version: tuple[int, int] = HAL_API_VERSION
    priority: int = 50
    available: Callable[[], tuple[bool, str]] = lambda: (True, "")
    description: str = ""
    impls: dict[str, Impl] = field(default_factory=dict)

    def serves(self, device_type: str) -> bool:
        """True if this backend runs on ``device_type`` (``"*"`` in device_types means any)."""
        return "*" in self.device_types or device_type in self.device_types

    def implements(self, op_name: str, *, supports: Callable[..., bool] | None = None,
                   why_not: Callable[..., str] | None = None) -> Callable[[Callable], Callable]:
        """Decorator registering ``fn`` as this backend's implementation of ``op_name``.

        ``fn``, ``supports`` and ``why_not`` must have exactly the op's parameters (names and order);
        a mismatch raises RegistrationError naming the op and the parameter.
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
        want = list(specs[op_name].signature.parameters)
        for what, f in (("implementation", fn), ("supports", supports), ("why_not", why_not)):
            if f is None:
                continue
            got = list(inspect.signature(f).parameters)
            if got != want:
                missing = [p for p in want if p not in got]
                extra = [p for p in got if p not in want]
                detail = (f"missing parameter {missing[0]!r}" if missing else
                          f"unexpected parameter {extra[0]!r}" if extra else f"parameter order {got}")
                raise RegistrationError(f"backend {self.name!r}, op {op_name!r}: {what} signature does not "
                                        f"match the op contract ({detail}; expected {want})")
        if op_name in self.impls:
            raise RegistrationError(f"backend {self.name!r}: op {op_name!r} registered twice")
        self.impls[op_name] = Impl(op_name, fn, supports, why_not, self.name)
