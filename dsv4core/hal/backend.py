"""The backend interface: a named set of op implementations for some device types."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import HALError, RegistrationError
from .spec import OpSpec, catalogue
from .version import HAL_API_VERSION, version_str

log = logging.getLogger("dsv4core.hal")

#: HAL_API_VERSION (re-exported from .version): (major, minor). Majors are incompatible; within a
#: major, a plugin built for any earlier minor loads and serves what it implements (new ops are
#: optional, new parameters are versioned and defaulted). See dsv4core/hal/CHANGELOG.md.
__all__ = ["HAL_API_VERSION", "Backend", "Impl"]


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
    #: The HAL version whose signature of the op the implementation takes (None: built by hand).
    contract: tuple[int, int] | None = None
    #: The op's parameters newer than ``contract`` (the implementation does not take them). When
    #: non-empty, ``fn`` / ``supports`` / ``why_not`` are adapters: they drop those parameters when
    #: they hold their defaults, and ``supports`` declines a call that sets one (the next backend
    #: serves it); ``raw_fn`` is the plugin's own function.
    lacks: tuple[str, ...] = ()
    raw_fn: Callable | None = field(default=None, repr=False, compare=False)


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
    #: Ops whose implementation failed its contract check at ``add`` (op -> reason): each is left
    #: out (the next backend serves it), the rest of the backend is unaffected.
    rejected: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        problem = check_fields(self)
        if problem:
            raise RegistrationError(problem)

    def serves(self, device_type: str) -> bool:
        """True if this backend runs on ``device_type`` (``"*"`` in device_types means any)."""
        return "*" in self.device_types or device_type in self.device_types

    def implements(self, op_name: str, *, supports: Callable[..., bool] | None = None,
                   why_not: Callable[..., str] | None = None,
                   capturable: bool = False, native_quantized: bool = False) -> Callable[[Callable], Callable]:
        """Decorator registering ``fn`` as this backend's implementation of ``op_name``.

        ``fn``, ``supports`` and ``why_not`` must have exactly the op's parameters at the HAL
        version the backend declares (``api_version``; ``OpSpec.signature_for``) or at a later one
        this HAL knows: names, order, kinds, and the op's defaults where it has them. A mismatch
        leaves the op out: it is recorded in ``rejected`` with the reason naming the op and the
        parameter (shown by ``dsv4core backends`` / ``ops`` and conformance), and logged; the
        backend's other ops are unaffected. ``supports(...) -> bool`` (a plain bool) says whether this
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
        """Register ``fn`` as the implementation of ``op_name`` (see :meth:`implements`). A contract
        failure is recorded in ``rejected`` (and logged), never raised."""
        problem = None
        try:
            problem = self._add(op_name, fn, supports, why_not, capturable, native_quantized)
        except Exception as e:  # noqa: BLE001 - e.g. a callable whose signature cannot be read
            problem = f"backend {self.name!r}, op {op_name!r}: could not be checked: {type(e).__name__}: {e}"
        if problem:
            self.rejected[op_name] = problem
            log.warning("%s%s", problem, "" if op_name in self.impls else "; the op is left out")
        else:
            self.rejected.pop(op_name, None)

    def _add(self, op_name, fn, supports, why_not, capturable, native_quantized) -> str:
        specs = catalogue()
        if op_name not in specs:
            return f"backend {self.name!r}: unknown op {op_name!r} (known: {', '.join(specs)})"
        if op_name in self.impls:
            return f"backend {self.name!r}: op {op_name!r} registered twice (the first registration is kept)"
        spec = specs[op_name]
        if not callable(fn):
            return f"backend {self.name!r}, op {op_name!r}: implementation is {type(fn).__name__}, not callable"
        for what, f in (("supports", supports), ("why_not", why_not)):
            if f is not None and not callable(f):
                return f"backend {self.name!r}, op {op_name!r}: {what} is {type(f).__name__}, not callable"
        versions = _contract_versions(spec, tuple(self.api_version))
        first_detail = None
        for v in versions:
            sig = spec.signature_for(v)
            detail = next(((what, d) for what, f in (("implementation", fn), ("supports", supports),
                                                      ("why_not", why_not))
                           if f is not None and (d := _mismatch(sig, f))), None)
            if detail is None:
                break
            first_detail = first_detail or (v, sig, detail)
        else:
            v, sig, (what, d) = first_detail
            later = f" or of a later HAL version up to {version_str(versions[-1])}" if len(versions) > 1 else ""
            return (f"backend {self.name!r}, op {op_name!r}: {what} signature does not match the op contract "
                    f"of HAL {version_str(v)}{later} ({d}; expected {list(sig.parameters)})")
        fn_a, sup_a, why_a, lacks = _adapt(spec, v, self.name, fn, supports, why_not)
        self.impls[op_name] = Impl(op_name, fn_a, sup_a, why_a, self.name, bool(capturable), bool(native_quantized),
                                   contract=v, lacks=lacks, raw_fn=fn)
        return ""


def check_fields(b: "Backend") -> str:
    """Why ``b``'s fields are malformed ("" when they are fine): checked at construction and again
    at discovery (a field may be reassigned after construction)."""
    name = getattr(b, "name", None)
    if not isinstance(name, str) or not name.strip():
        return f"Backend name must be a non-empty str, got {type(name).__name__} {name!r}"
    p = b.priority
    if not isinstance(p, int) or isinstance(p, bool):
        return (f"Backend {name!r}: priority must be an int (higher wins under auto; negative = used only "
                f"when named), got {type(p).__name__} {p!r}")
    v = b.api_version
    if (not isinstance(v, tuple) or len(v) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)):
        return f"Backend {name!r}: api_version must be a (major, minor) tuple of ints, got {type(v).__name__} {v!r}"
    d = b.device_types
    if not isinstance(d, (tuple, list)) or not d or not all(isinstance(x, str) and x for x in d):
        return f"Backend {name!r}: device_types must be a non-empty tuple of device type names, got {d!r}"
    if not callable(b.available):
        return f"Backend {name!r}: available must be a callable returning (ok, reason), got {type(b.available).__name__}"
    return ""


def _contract_versions(spec: OpSpec, declared: tuple[int, int]) -> list[tuple[int, int]]:
    """The HAL versions whose signature of ``spec`` a backend declaring ``declared`` may take: its
    own (or the op's first, for an op newer than it) and every later one this HAL knows."""
    allv = spec.versions()
    if declared[0] != spec.since[0] or declared > HAL_API_VERSION:
        return [allv[-1]]    # another major or a newer HAL: the backend is reported unavailable anyway
    return [v for v in allv if v >= declared] or [allv[-1]]


def _mismatch(sig: inspect.Signature, f: Callable) -> str:
    """Why ``f``'s parameters differ from ``sig`` ("" when they match: names, order, kinds, defaults)."""
    params = sig.parameters
    want = list(params)
    got_params = inspect.signature(f).parameters
    got = list(got_params)
    if got != want:
        missing = [p for p in want if p not in got]
        extra = [p for p in got if p not in want]
        return (f"missing parameter {missing[0]!r}" if missing else
                f"unexpected parameter {extra[0]!r}" if extra else f"parameter order {got}")
    for name, p in params.items():  # callers pass arguments positionally or by name and omit defaulted ones
        g = got_params[name]
        if g.kind != p.kind:
            return f"parameter {name!r} is {g.kind.description}, expected {p.kind.description}"
        if p.default is not inspect.Parameter.empty and (
                g.default is inspect.Parameter.empty or not _same_default(g.default, p.default)):
            return (f"parameter {name!r} must default to {p.default!r}, "
                    f"got {'no default' if g.default is inspect.Parameter.empty else repr(g.default)}")
    return ""


def _is_default(value, default) -> bool:
    if value is default:
        return True
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:  # noqa: BLE001
        return False


def _adapt(spec: OpSpec, contract: tuple[int, int], backend: str, fn, supports, why_not):
    """Adapters for an implementation of an older contract: the parameters it lacks are dropped
    when they hold their defaults; a call that sets one is declined by ``supports`` (and refused by
    ``fn``). Returns the callables unchanged when nothing is lacked (no extra work per call)."""
    params = spec.signature.parameters
    lacks = tuple(n for n in params if spec.params_since[n] > contract)
    if not lacks:
        return fn, supports, why_not, ()
    defaults = {n: params[n].default for n in lacks}
    old = spec.signature_for(contract).parameters
    n_pos = sum(1 for p in old.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))
    lacks_pos = tuple(n for n in lacks if params[n].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                             inspect.Parameter.POSITIONAL_OR_KEYWORD))
    lack_set = frozenset(lacks)
    version = version_str(contract)

    def split(args, kwargs):
        newer = None
        if len(args) > n_pos:
            for name, value in zip(lacks_pos, args[n_pos:]):
                if newer is None and not _is_default(value, defaults[name]):
                    newer = name
            args = args[:n_pos]
        if kwargs and not lack_set.isdisjoint(kwargs):
            for name in lacks:
                if name in kwargs and newer is None and not _is_default(kwargs[name], defaults[name]):
                    newer = name
            kwargs = {k: v for k, v in kwargs.items() if k not in lack_set}
        return args, kwargs, newer

    def reason(newer: str) -> str:
        return f"{backend} implements HAL {version}, which has no {newer}"

    def adapted_fn(*args, **kwargs):
        args, kwargs, newer = split(args, kwargs)
        if newer is not None:
            raise HALError(f"{spec.name}: {reason(newer)} (its supports() declines such calls; the binding "
                           f"hands them to the next backend)")
        return fn(*args, **kwargs)

    def adapted_supports(*args, **kwargs):
        args, kwargs, newer = split(args, kwargs)
        if newer is not None:
            return False
        return True if supports is None else supports(*args, **kwargs)

    def adapted_why_not(*args, **kwargs):
        args, kwargs, newer = split(args, kwargs)
        if newer is not None:
            return reason(newer)
        return why_not(*args, **kwargs) if why_not is not None else "its supports() predicate declined these inputs"

    for f, orig in ((adapted_fn, fn), (adapted_supports, supports), (adapted_why_not, why_not)):
        f.__name__ = getattr(orig, "__name__", spec.name) if orig is not None else f.__name__
        f.__signature__ = spec.signature   # the adapters take the current signature
    return adapted_fn, adapted_supports, adapted_why_not, lacks


def _same_default(a, b) -> bool:
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - an uncomparable default is a different default
        return False
