"""Finding backends: the built-in reference backend plus every ``dsv4core.backends`` entry point.

Each plugin is loaded and registered in isolation: an import error, a registration error, an
incompatible HAL API version, a malformed ``Backend``, a name already taken, an availability probe
that raises or does not answer, or an unavailable platform is recorded in a :class:`PluginStatus`
with its reason and never affects the other plugins (nor the other backends the same entry point
registers). Every exception a plugin raises is isolated — ``SystemExit`` and other
``BaseException`` subclasses (pytest's ``Skipped``, a vendor library's own) included — except
``KeyboardInterrupt``, which stops the process as the user asked. An implementation that fails
its contract check drops only that op (``Backend.rejected``).

Environment:

* ``DSV4CORE_PLUGINS=name1,name2``: load only the entry points with these names (the others are
  listed as "not loaded" without being imported); ``DSV4CORE_PLUGINS=none`` loads none (only the
  reference). Unset: every installed plugin.
* ``DSV4CORE_PROBE_TIMEOUT`` (seconds, default 10): how long a backend's ``available()`` may take;
  one that has not answered by then is listed as unavailable with that reason.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import traceback
from dataclasses import dataclass, field
from importlib import metadata

import pluggy

from . import hookspecs, oracle
from .backend import HAL_API_VERSION, Backend, check_fields

log = logging.getLogger("dsv4core.hal")
ENTRY_POINT_GROUP = "dsv4core.backends"
#: Default seconds an ``available()`` probe may take (env ``DSV4CORE_PROBE_TIMEOUT``).
PROBE_TIMEOUT = 10.0


@dataclass
class PluginStatus:
    """What happened to one backend (or to a plugin module that produced none)."""

    name: str
    source: str                    # "builtin" or "<distribution> (<module>)"
    version: str = ""
    api_version: tuple[int, int] | None = None
    device_types: tuple[str, ...] = ()
    priority: int = 0
    available: bool = False
    reason: str = ""               # why not available ("" when available)
    validated: str = ""            # Backend.validated: recorded hardware validation ("" = not stated)
    backend: Backend | None = field(default=None, repr=False)
    error: BaseException | None = field(default=None, repr=False)

    @property
    def rejected(self) -> dict[str, str]:
        """Ops whose implementation failed its contract check (op -> reason)."""
        return dict(self.backend.rejected) if self.backend is not None else {}

    def as_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "source": self.source,
                "api_version": ".".join(map(str, self.api_version)) if self.api_version else None,
                "device_types": list(self.device_types), "priority": self.priority,
                "available": self.available, "reason": self.reason, "validated": self.validated,
                "ops": sorted(self.backend.impls) if self.backend else [], "rejected": self.rejected}


def _check_api(backend: Backend) -> str:
    major, minor = backend.api_version
    if major != HAL_API_VERSION[0]:
        return (f"built for HAL API {major}.{minor}, this dsv4core provides {HAL_API_VERSION[0]}.{HAL_API_VERSION[1]} "
                f"(major versions differ)")
    if minor > HAL_API_VERSION[1]:
        return (f"built for HAL API {major}.{minor}, newer than this dsv4core's "
                f"{HAL_API_VERSION[0]}.{HAL_API_VERSION[1]}; upgrade dsv4core")
    return ""


def probe_timeout() -> float:
    text = os.environ.get("DSV4CORE_PROBE_TIMEOUT", "")
    if not text.strip():
        return PROBE_TIMEOUT
    try:
        t = float(text)
    except ValueError:
        t = -1.0
    if not t > 0:
        log.warning("DSV4CORE_PROBE_TIMEOUT=%r is not a positive number of seconds; using %g", text, PROBE_TIMEOUT)
        return PROBE_TIMEOUT
    return t


def _probe(backend: Backend) -> tuple[bool, str, BaseException | None]:
    """Run ``backend.available()`` in a daemon thread, bounded by the probe timeout."""
    box: dict = {}

    def target():
        try:
            box["out"] = backend.available()
        except BaseException as e:  # noqa: BLE001 - isolated; the thread is not the main one
            box["err"] = e

    t = threading.Thread(target=target, name=f"dsv4core-probe-{backend.name}", daemon=True)
    timeout = probe_timeout()
    t.start()
    t.join(timeout)
    if t.is_alive():
        return False, f"availability probe did not answer within {timeout:g} s (DSV4CORE_PROBE_TIMEOUT)", None
    if "err" in box:
        e = box["err"]
        if isinstance(e, KeyboardInterrupt):
            raise e
        return False, f"availability probe raised {type(e).__name__}: {e}", e
    out = box.get("out")
    if not (isinstance(out, tuple) and len(out) == 2):
        return False, f"availability probe must return (ok, reason), returned {type(out).__name__} {out!r:.80}", None
    ok, why = out
    if not isinstance(ok, bool):
        return False, f"availability probe must return a bool ok, returned {type(ok).__name__} {ok!r:.80}", None
    return ok, ("" if ok else (str(why) if why else "reported unavailable")), None


def _status_for(backend: Backend, source: str) -> PluginStatus:
    problem = check_fields(backend)
    if problem:
        raise TypeError(problem)
    st = PluginStatus(name=backend.name, source=source, version=str(backend.version),
                      api_version=tuple(backend.api_version), device_types=tuple(backend.device_types),
                      priority=backend.priority, backend=backend, validated=str(backend.validated or ""))
    st.reason = _check_api(backend)
    if not st.reason:
        st.available, st.reason, st.error = _probe(backend)
    return st


def selected_plugins() -> set[str] | None:
    """The entry-point names ``DSV4CORE_PLUGINS`` allows (None: all)."""
    text = os.environ.get("DSV4CORE_PLUGINS")
    if text is None:
        return None
    names = {p.strip() for p in text.split(",") if p.strip()}
    return set() if names <= {"none"} else names


def _free_key(found: dict, name: str, source: str) -> str:
    """A key for a status whose name is taken: "name (from <source>)"."""
    key = f"{name} (from {source})"
    n = 2
    while key in found:
        key, n = f"{name} (from {source}, #{n})", n + 1
    return key


@functools.lru_cache(maxsize=1)
def discover() -> dict[str, PluginStatus]:
    """All known backends by name (cached for the process; call ``discover.cache_clear()`` to rescan)."""
    from .reference import make_reference_backend

    found: dict[str, PluginStatus] = {}
    ref = make_reference_backend()
    found[ref.name] = _status_for(ref, "builtin")

    def failed(name: str, source: str, e: BaseException | None, reason: str) -> None:
        key = name
        if key in found:  # the entry-point name is taken: report it under another key, never drop it
            if found[name].source != source:
                reason += f" (and the name {name!r} is already taken by {found[name].source})"
            key = _free_key(found, name, source)
        found[key] = PluginStatus(name=key, source=source, error=e, reason=reason)

    only = selected_plugins()
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    seen = set()
    # the oracle's fingerprint before the plugins load and after each one: a plugin that changes
    # it (a spec, a helper, a torch function) is named when conformance refuses to judge
    oracle_before, previous = oracle.fingerprint(), None
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist else "?"
        source = f"{dist} ({ep.value})"
        if previous is not None:
            oracle_before = oracle.note_plugin(previous, oracle_before)
        previous = source
        seen.add(ep.name)
        if only is not None and ep.name not in only:
            failed(ep.name, source, None, "not loaded: DSV4CORE_PLUGINS does not name it")
            continue
        try:
            module = ep.load()
            pm.register(module, name=f"{dist}:{ep.name}")
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - exit() at import, pytest.skip(), ... included
            log.debug("backend plugin %s failed to import:\n%s", source, traceback.format_exc())
            failed(ep.name, source, e, f"import failed: {type(e).__name__}: {e}")
            continue
        registered: list = []
        hook_error = None
        impls = [h for h in pm.hook.dsv4core_register_backends.get_hookimpls() if h.plugin is module]
        try:
            if not impls:
                raise TypeError("module defines no dsv4core_register_backends hook")
            for h in impls:  # pluggy for registration only; each plugin isolated
                h.function(register=registered.append)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001
            log.debug("backend plugin %s failed to register:\n%s", source, traceback.format_exc())
            hook_error = e
        for b in registered:
            if not isinstance(b, Backend):
                failed(ep.name, source, None, f"registration failed: register() got {type(b).__name__}, "
                                              f"expected dsv4core.hal.Backend")
                continue
            name = b.name if isinstance(b.name, str) and b.name else ep.name
            if name in found:
                log.warning("backend %r from %s not used: the name is already taken by %s",
                            name, source, found[name].source)
                key = _free_key(found, name, source)
                found[key] = PluginStatus(name=key, source=source, backend=b,
                                          reason=f"not used: the backend name {name!r} is already taken by "
                                                 f"{found[name].source}")
                continue
            try:  # a malformed Backend (e.g. api_version not a (major, minor) pair) stays isolated
                found[name] = _status_for(b, source)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001
                found[name] = PluginStatus(name=name, source=source, error=e,
                                           reason=f"registration failed: {type(e).__name__}: {e}")
        if hook_error is not None:  # the backends registered before the error are kept (above)
            kept = [b.name for b in registered if isinstance(b, Backend)]
            failed(ep.name, source, hook_error, f"registration failed: {type(hook_error).__name__}: {hook_error}"
                   + (f" (after registering {', '.join(map(repr, kept))}, which are kept)" if kept else ""))
    if previous is not None:
        oracle.note_plugin(previous, oracle_before)
    for missing in sorted((only or set()) - seen):
        log.warning("DSV4CORE_PLUGINS names %r, but no installed plugin has that entry-point name", missing)
    return found
