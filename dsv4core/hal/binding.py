"""Selection and binding: resolve each op once to a plain callable.

Per op, an ordered candidate list is built (per-op override, then the explicit backend or the
available backends for the device by priority, then ``reference``).

Selection under ``auto`` (see :func:`auto_order`): every available backend serving the device type
with priority >= 0, highest priority first; equal priorities in backend-name order (so the result
does not depend on installation or entry-point order). A backend with a NEGATIVE priority is never
chosen by ``auto``: it is used only when named (``backend=``, ``DSV4CORE_BACKEND``, a per-op
override) - the way to ship a backend that must be opted into. The first candidate that
implements the op serves it; the others that were skipped are recorded with their reason. If the
serving implementation has a ``supports`` predicate, the bound callable checks it and hands
unsupported calls down the chain (one warning per op under ``warn``; an error under ``strict``).
The result is an :class:`OpTable`: attribute access + call, no registry lookups on the hot path.
With the verify mode on (``verify=`` / ``DSV4CORE_VERIFY``, :mod:`dsv4core.hal.verify`) each
callable also re-checks a fraction of its calls against the reference; off, nothing is added.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .backend import Impl
from .discovery import PluginStatus, discover
from .errors import BackendNotFoundError, FallbackError, HALError
from .spec import catalogue
from .typed_ops import TypedOps
from .version import version_str
from .verify import VerifyStats, WholeSteps, parse_fraction, parse_seed, parse_strict
from .verify import wrap as verify_wrap

log = logging.getLogger("dsv4core.hal")
POLICIES = ("strict", "warn", "allow")
REFERENCE = "reference"


@dataclass
class OpBinding:
    """How one op is served: the serving backend, the candidate order and why others declined."""

    op: str
    backend: str
    candidates: tuple[str, ...]
    declined: dict[str, str]
    call: Callable = field(repr=False)
    runtime_fallbacks: int = 0      # calls handed down the chain because `supports` said no
    impl: Impl | None = field(default=None, repr=False)   # the serving implementation (None: hand-built)
    verify: VerifyStats | None = None   # verify-mode counts (None: verify mode off)
    #: Candidates in the chain that implement an older contract of the op (backend -> what that
    #: means: calls setting the parameters it lacks go to the next backend).
    limits: dict[str, str] = field(default_factory=dict)
    #: Contract violations seen at call time (backend -> the first one: a ``supports`` that raised
    #: or returned a non-bool); such calls were handed to the next backend.
    problems: dict[str, str] = field(default_factory=dict)

    @property
    def is_fallback(self) -> bool:
        return self.backend != self.candidates[0]

    def as_dict(self) -> dict[str, Any]:
        d = {"op": self.op, "backend": self.backend, "fallback": self.is_fallback,
             "candidates": list(self.candidates), "declined": dict(self.declined),
             "runtime_fallbacks": self.runtime_fallbacks, "limits": dict(self.limits),
             "problems": dict(self.problems)}
        if self.verify is not None:
            d["verify"] = self.verify.as_dict()
        return d


class OpTable(TypedOps):
    """A frozen op -> callable table for one device type. ``table.rms_norm(x, w, eps)``.

    Each op is an instance attribute holding its bound callable (``bindings[op].call``: the serving
    implementation itself, or the chain built by :func:`_dispatch_chain`). Its type, for editors and
    type checkers, comes from :class:`~dsv4core.hal.typed_ops.TypedOps` (generated from the catalogue:
    one method per op with the op's signature)."""

    def __init__(self, device_type: str, policy: str, bindings: dict[str, OpBinding]):
        object.__setattr__(self, "device_type", device_type)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "bindings", bindings)
        object.__setattr__(self, "_verified", any(b.verify is not None for b in bindings.values()))
        for name, b in bindings.items():
            object.__setattr__(self, name, b.call)

    def __setattr__(self, name, value):
        raise AttributeError("OpTable is frozen; bind again to change it")

    def __getattr__(self, name):  # only reached for unknown names
        raise AttributeError(f"no HAL op named {name!r} (known: {', '.join(self.bindings)})")

    def accepts(self, op_name: str, *args, **kwargs) -> bool:
        """True iff the implementation that SERVES ``op_name`` (not a fallback further down the
        chain) accepts these arguments: its ``supports`` predicate says yes, or it has none.

        For decisions taken once, ahead of the hot path (e.g. the model keeping FP8 weights when
        the serving ``linear`` takes them). Pass arguments shaped, typed and placed like the real
        call. A predicate that raises counts as a no. A binding built by hand without ``impl``
        (no predicate known) accepts only when it is served by the reference backend.
        Unknown op names raise :class:`HALError`.
        """
        b = self.bindings.get(op_name)
        if b is None:
            raise HALError(f"no HAL op named {op_name!r} (known: {', '.join(self.bindings)})")
        impl = b.impl
        if impl is None:
            return b.backend == REFERENCE
        if impl.supports is None:
            return True
        try:
            return impl.supports(*args, **kwargs) is True   # a non-bool answer is a contract violation: no
        except Exception:  # noqa: BLE001 - a probe declines, it never raises
            return False

    def native_quantized(self, op_name: str) -> bool:
        """Whether the implementation serving ``op_name`` declares that it reads quantised weights
        as they are (``Backend.add(..., native_quantized=True)``) rather than dequantising a copy
        per call. A hand-built binding (no implementation record) says no."""
        b = self.bindings.get(op_name)
        if b is None:
            raise HALError(f"no HAL op named {op_name!r} (known: {', '.join(self.bindings)})")
        return bool(b.impl is not None and b.impl.native_quantized)

    def capturable(self, op_names=None) -> dict[str, str]:
        """Ops (all, or ``op_names``) whose SERVING implementation is not declared capturable
        (``Backend.add(..., capturable=True)``), with the reason: ``{}`` means every one is. A
        call that the serving implementation's ``supports`` hands down the chain while a graph is
        being recorded runs the fallback inside the recording; if that one is not capturable the
        recording fails and the caller runs the step eagerly (the model reports why)."""
        out = {}
        for name in (self.bindings if op_names is None else op_names):
            b = self.bindings[name]
            if b.impl is None:
                out[name] = "bound by hand (no implementation record)"
            elif getattr(b, "verify", None) is not None:
                out[name] = ("verify mode on (sampling and judging run on the host; a model records its graphs "
                             "with unverified() and samples whole steps)")
            elif not b.impl.capturable:
                out[name] = f"implementation of {b.impl.backend!r} not declared capturable"
        return out

    def report(self) -> list[dict[str, Any]]:
        """The binding table: per op, the serving backend, the candidates and declined reasons
        (and the verify-mode counts when it is on)."""
        return [b.as_dict() for b in self.bindings.values()]

    def at(self, site: str) -> "OpTable":
        """The table a call site uses (``site``: where in the model the calls are made, e.g.
        ``layers.3.self_attn.q_a_proj``; named once, when the model is built). With the verify mode on, its
        ops are the site's own callables (sampled and counted per site, see
        :mod:`dsv4core.hal.verify`), made on first use; off, it is this table itself."""
        if not self._verified:
            return self
        views = self.__dict__.setdefault("_sites", {})
        if site not in views:
            views[site] = _SiteTable(self, site)
        return views[site]

    def unverified(self) -> "OpTable":
        """The table without the verify mode (the one the verify mode wraps); this table itself
        when the verify mode is off."""
        return self.__dict__.get("_plain", (self,))[0]

    def whole_steps(self) -> WholeSteps | None:
        """Whole-step sampling of this verified table (made once; None when the verify mode is
        off): the plain table, the table checking every call (a sampled step's; counted with this
        table's counts) and the draw of the sampled steps (:class:`~dsv4core.hal.verify.WholeSteps`)."""
        got = self.__dict__.get("_whole_steps")
        if got is None and "_plain" in self.__dict__:
            plain, strict = self._plain
            specs = catalogue()
            bindings = {n: dataclasses.replace(b, call=verify_wrap(specs[n], plain.bindings[n].call, b.verify, strict,
                                                                   b.backend, fraction=1.0))
                        for n, b in self.bindings.items()}
            first = next(iter(self.bindings.values())).verify
            got = WholeSteps(plain, OpTable(self.device_type, self.policy, bindings), first.fraction, first.seed)
            object.__setattr__(self, "_whole_steps", got)
        return got

    def verify_summary(self) -> dict[str, Any] | None:
        """Verify-mode totals, the ops that diverged, the counts per op and per call site
        (``"sites": {"<module path>:<op>": {"op", "calls", "checked", "divergences"}}``; a call
        made on the table directly counts under the op's own name) and the whole steps drawn and
        sampled (``"steps": {"sampled", "total"}``, :meth:`whole_steps`; zero where the model
        samples calls). None when the verify mode is off."""
        stats = {n: b.verify for n, b in self.bindings.items() if b.verify is not None}
        if not stats:
            return None
        first, steps = next(iter(stats.values())), self.__dict__.get("_whole_steps")
        return {"fraction": first.fraction, "seed": first.seed,
                "calls": sum(v.calls for v in stats.values()), "checked": sum(v.checked for v in stats.values()),
                "divergences": sum(v.divergences for v in stats.values()),
                "diverged": {n: v.as_dict() for n, v in stats.items() if v.divergences},
                # per op: how many calls there were and how many of them were checked
                "ops": {n: {"calls": v.calls, "checked": v.checked} for n, v in stats.items() if v.calls},
                "sites": {site: c.as_dict() for v in stats.values() for site, c in v.sites.items() if c.calls},
                "steps": steps.as_dict() if steps is not None else {"sampled": 0, "total": 0}}

    def __repr__(self) -> str:
        served = {}
        for b in self.bindings.values():
            served.setdefault(b.backend, []).append(b.op)
        return f"OpTable(device_type={self.device_type!r}, policy={self.policy!r}, served={served})"


class _SiteTable(OpTable):
    """One call site's view of a verified table (:meth:`OpTable.at`): the same bindings, and per
    op the site's own callable, made on first access and then a plain attribute."""

    def __init__(self, table: OpTable, site: str):
        object.__setattr__(self, "device_type", table.device_type)
        object.__setattr__(self, "policy", table.policy)
        object.__setattr__(self, "bindings", table.bindings)
        object.__setattr__(self, "site", site)

    def __getattr__(self, name):  # first use of an op at this site
        b = self.__dict__.get("bindings", {}).get(name)
        if b is None:
            return OpTable.__getattr__(self, name)
        at = getattr(b.call, "at", None)
        call = at(self.site) if at is not None else b.call
        object.__setattr__(self, name, call)
        return call

    def at(self, site: str) -> "OpTable":
        raise HALError(f"the op table of call site {self.site!r} has no call sites of its own ({site!r})")


def parse_ops_override(text: str | dict[str, str] | None) -> dict[str, str]:
    """Parse ``"rms_norm=reference,attention=mybackend"`` (or the same as a dict); keys are op
    names or op family names (a family expands to its ops; an op named itself wins)."""
    if not text:
        return {}
    where = "DSV4CORE_OPS" if isinstance(text, str) else "ops override"
    if isinstance(text, str):
        pairs = []
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or not value.strip():
                raise HALError(f"DSV4CORE_OPS: expected 'op=backend' items, got {item!r}")
            pairs.append((key.strip(), value.strip()))
    else:
        pairs = [(str(k).strip(), str(v).strip()) for k, v in dict(text).items()]
    specs = catalogue()
    families: dict[str, list[str]] = {}
    for s in specs.values():
        families.setdefault(s.family, []).append(s.name)
    out: dict[str, str] = {}
    for key, value in pairs:
        if not value:
            raise HALError(f"{where}: no backend given for {key!r}")
        if key in specs:
            out[key] = value
        elif key in families:
            for name in families[key]:
                out.setdefault(name, value)
        else:
            raise HALError(f"{where}: unknown op or family {key!r} (ops: {', '.join(specs)}; "
                           f"families: {', '.join(families)})")
    return out


def _usable(name: str, statuses: dict[str, PluginStatus], device_type: str, why: str) -> PluginStatus:
    """An explicitly requested backend must exist, be available and serve the device type."""
    st = statuses.get(name)
    if st is None:
        raise BackendNotFoundError(f"backend {name!r} ({why}) is not installed; known backends: "
                                   f"{', '.join(sorted(statuses))}")
    if not st.available or st.backend is None:
        raise BackendNotFoundError(f"backend {name!r} ({why}) is not available: {st.reason}") from st.error
    if not st.backend.serves(device_type):
        raise BackendNotFoundError(f"backend {name!r} ({why}) does not serve device type {device_type!r} "
                                   f"(it serves {', '.join(st.backend.device_types)})")
    return st


def backend_request(backend: str | None = None) -> str:
    """The backend a call asks for, by the one precedence rule: an explicit argument (a name or
    ``"auto"``) > env ``DSV4CORE_BACKEND`` > ``"auto"``. ``None`` (or ``""``) means "not given"."""
    return backend or os.environ.get("DSV4CORE_BACKEND") or "auto"


def bind(device: str | torch.device = "cpu", backend: str | None = None, policy: str | None = None,
         ops: dict[str, str] | str | None = None, check: bool | None = None,
         verify: float | str | None = None, verify_strict: bool | None = None,
         verify_seed: int | str | None = None) -> OpTable:
    """Resolve every op for ``device`` and return the frozen :class:`OpTable`.

    backend: a backend name or ``"auto"``; default (None): env ``DSV4CORE_BACKEND``, else ``"auto"``
             (:func:`backend_request`: an explicit argument, even ``"auto"``, wins over the env).
    policy:  ``strict`` (raise on any fallback), ``warn`` (default; one warning per op and process)
             or ``allow``; default: env ``DSV4CORE_FALLBACK``, else ``"warn"``.
    ops:     per-op (or per-family) backend overrides; default (None): env ``DSV4CORE_OPS``; an
             explicit value (``{}`` for none) wins over the env.
    check:   validate inputs on every call (default: on under ``strict`` or env ``DSV4CORE_CHECK=1``).
    verify:  fraction of op calls re-run on the reference and compared (0 = off, the default; env
             ``DSV4CORE_VERIFY``); ``verify_strict`` (env ``DSV4CORE_VERIFY_STRICT=1``) raises
             VerifyError at the first divergence; ``verify_seed`` (env ``DSV4CORE_VERIFY_SEED``,
             else a fresh one) seeds the random choice of the calls checked. See
             :mod:`dsv4core.hal.verify`. A table with the verify mode on is built afresh (its
             counts are its own), never cached.
    """
    device_type = torch.device(device).type
    backend = backend_request(backend)
    policy = policy or os.environ.get("DSV4CORE_FALLBACK") or "warn"
    if policy not in POLICIES:
        raise HALError(f"fallback policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    if ops is None:
        ops = os.environ.get("DSV4CORE_OPS")
    overrides = parse_ops_override(ops)
    if check is None:
        check = policy == "strict" or os.environ.get("DSV4CORE_CHECK", "") not in ("", "0")
    fraction = parse_fraction(os.environ.get("DSV4CORE_VERIFY") if verify is None else verify,
                              "DSV4CORE_VERIFY" if verify is None else "verify")
    strict = parse_strict(verify_strict)
    seed = parse_seed(verify_seed)
    table = _bind_cached(device_type, backend, policy, tuple(sorted(overrides.items())), bool(check))
    if fraction == 0:
        return table
    return _with_verify(table, fraction, strict, seed)


def _with_verify(table: OpTable, fraction: float, strict: bool, seed: int) -> OpTable:
    specs = catalogue()
    bindings = {}
    for name, b in table.bindings.items():
        stats = VerifyStats(fraction, seed)
        nb = dataclasses.replace(b, verify=stats)
        nb.call = verify_wrap(specs[name], b.call, stats, strict, b.backend)
        bindings[name] = nb
    verified = OpTable(table.device_type, table.policy, bindings)
    object.__setattr__(verified, "_plain", (table, strict))
    return verified


def auto_order(statuses: dict[str, PluginStatus], device_type: str) -> list[str]:
    """The backends ``auto`` tries for ``device_type``, best first: available, serving the device
    type, priority >= 0 (negative = by name only), by descending priority, then by name."""
    usable = [st for n, st in statuses.items()
              if n != REFERENCE and st.available and st.backend and st.backend.serves(device_type)
              and st.priority >= 0]
    return [st.name for st in sorted(usable, key=lambda st: (-st.priority, st.name))]


@functools.lru_cache(maxsize=64)
def _bind_cached(device_type: str, backend: str, policy: str, overrides: tuple, check: bool) -> OpTable:
    statuses = discover()
    specs = catalogue()
    if backend == "auto":
        main = auto_order(statuses, device_type)
    else:
        main = [_usable(backend, statuses, device_type, "requested explicitly").name]
    override_map = dict(overrides)
    for op_name, b in override_map.items():
        if op_name not in specs:
            raise HALError(f"per-op override names unknown op {op_name!r}")
        _usable(b, statuses, device_type, f"per-op override for {op_name}")

    bindings: dict[str, OpBinding] = {}
    for op_name, spec in specs.items():
        order = list(dict.fromkeys(([override_map[op_name]] if op_name in override_map else []) + main + [REFERENCE]))
        declined: dict[str, str] = {}
        chain: list[Impl] = []
        for name in order:
            st = statuses[name]
            impl = st.backend.impls.get(op_name) if st.backend else None
            if not st.available:
                declined[name] = f"backend unavailable: {st.reason}"
            elif not st.backend.serves(device_type):
                declined[name] = f"does not serve device type {device_type!r}"
            elif impl is None:
                rejected = st.backend.rejected.get(op_name)
                declined[name] = f"implementation rejected: {rejected}" if rejected else "does not implement this op"
            else:
                chain.append(impl)
        serving = chain[0].backend
        if serving != order[0]:
            msg = f"{op_name}: {order[0]!r} declined ({declined[order[0]]}); served by {serving!r}"
            if policy == "strict":
                raise FallbackError(msg + " — strict policy forbids fallbacks")
            # Under `auto`, a partial backend plus the reference for the rest is the normal case:
            # recorded in the table (`dsv4core ops`), logged at info. A backend the user named
            # explicitly (or per op) that cannot serve an op is worth a warning.
            explicit = backend != "auto" or op_name in override_map
            log.log(logging.WARNING if policy == "warn" and explicit else logging.INFO, msg)
        limits = {i.backend: (f"implements HAL {version_str(i.contract)}, which has no {', '.join(i.lacks)}: "
                              f"calls setting {'it' if len(i.lacks) == 1 else 'them'} go to the next backend")
                  for i in chain if i.lacks and i.contract is not None}
        binding = OpBinding(op_name, serving, tuple(order), declined, call=None, impl=chain[0], limits=limits)
        binding.call = _make_call(spec, chain, policy, binding, check)
        bindings[op_name] = binding
    return OpTable(device_type, policy, bindings)


def _make_call(spec, chain: list[Impl], policy: str, binding: OpBinding, check: bool) -> Callable:
    call = _dispatch_chain(spec.name, chain, policy, binding)
    if not check:
        return call
    validate = spec.validate
    #: argument key -> True: the check passed on these keys and reads no tensor data (skipped from
    #: now on); False: it passed, but reads tensor values (run on every call, the probe not again)
    seen: dict = {}

    def checked(*args, **kwargs):
        key = _arg_key(args, kwargs)
        known = seen.get(key) if key is not None else False
        if known is not True:
            validate(*args, **kwargs)           # raises OpInputError: nothing is remembered
            if known is None:
                if len(seen) >= _MAX_KEYS:
                    seen.clear()
                seen[key] = _metadata_only(validate, args, kwargs)
        return call(*args, **kwargs)

    checked.__name__ = spec.name
    return checked


#: distinct argument keys remembered per op (then forgotten all at once)
_MAX_KEYS = 4096


def _arg_key(args, kwargs):
    """What an op's input check can see of its arguments without reading tensor data: per tensor
    its type, shape, strides, dtype and device; other values as they are (None: an argument that
    cannot be a dict key, e.g. a list of tensors, so the call is checked every time)."""
    try:
        key = tuple(_value_key(v) for v in args)
        if kwargs:
            key += tuple((k, _value_key(v)) for k, v in kwargs.items())
        hash(key)
        return key
    except TypeError:
        return None


def _value_key(v):
    if isinstance(v, torch.Tensor):
        return (type(v), v.shape, v.stride(), v.dtype, v.device)
    if isinstance(v, (list, tuple)):
        return (type(v),) + tuple(_value_key(x) for x in v)
    if isinstance(v, float) and v != v:
        raise TypeError("nan")                  # nan != nan: never found again
    return (type(v), v)


def _metadata_only(validate, args, kwargs) -> bool:
    """Whether the check's verdict on these arguments follows from their keys alone: it passes
    again on ``meta`` tensors of the same shapes, strides and dtypes, which hold no data (a check
    that reads values, e.g. an index range, fails there and is run on every call)."""
    def meta(v):
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        if isinstance(v, (list, tuple)):
            return type(v)(meta(x) for x in v)
        return v

    try:
        validate(*(meta(v) for v in args), **{k: meta(v) for k, v in kwargs.items()})
    except Exception:  # noqa: BLE001 - any failure: not decidable from the key
        return False
    return True


def _dispatch_chain(op_name: str, chain: list[Impl], policy: str, binding: OpBinding) -> Callable:
    head = chain[0]
    if head.supports is None or len(chain) == 1:
        return head.fn   # the common case: the bound callable IS the implementation
    fn, supports, why_not = head.fn, head.supports, head.why_not
    rest = _dispatch_chain(op_name, chain[1:], policy, binding)
    warned = [False]

    version_reason = f"{head.backend} implements HAL "

    def dispatch(*args, **kwargs):
        try:
            ok = supports(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - a broken predicate: isolated, reported below
            ok = e
        if ok is True:
            return fn(*args, **kwargs)
        binding.runtime_fallbacks += 1
        if ok is not False:   # a contract violation of the plugin: always reported (once)
            if head.backend not in binding.problems:
                what = (f"raised {type(ok).__name__}: {ok}" if isinstance(ok, Exception) else
                        f"returned {type(ok).__name__}, not a bool")
                msg = (f"{op_name}: backend {head.backend!r}'s supports() {what}; the call is served by "
                       f"{chain[1].backend!r} (fix the plugin: supports() must return a plain bool)")
                binding.problems[head.backend] = msg
                if policy == "strict":
                    raise FallbackError(msg + " — strict policy forbids fallbacks")
                log.error(msg)
            return rest(*args, **kwargs)
        if policy != "allow" and not warned[0]:
            reason = why_not(*args, **kwargs) if why_not else "its supports() predicate declined these inputs"
            if head.lacks and isinstance(reason, str) and reason.startswith(version_reason):
                msg = f"{op_name}: {reason}: served by {chain[1].backend}"
            else:
                msg = f"{op_name}: backend {head.backend!r} declined a call ({reason}); next: {chain[1].backend!r}"
            if policy == "strict":
                raise FallbackError(msg + " — strict policy forbids fallbacks")
            warned[0] = True
            log.warning(msg)
        return rest(*args, **kwargs)

    dispatch.__name__ = op_name
    return dispatch
