"""Finding backends: the built-in reference backend plus every ``dsv4core.backends`` entry point.

Each plugin is loaded and registered in isolation: an import error, a registration error, an
incompatible HAL API version or an unavailable platform is recorded in a :class:`PluginStatus`
with its reason and never affects the other plugins.
"""

from __future__ import annotations

import functools
import logging
import traceback
from dataclasses import dataclass, field
from importlib import metadata

import pluggy

from . import hookspecs
from .backend import HAL_API_VERSION, Backend

log = logging.getLogger("dsv4core.hal")
ENTRY_POINT_GROUP = "dsv4core.backends"


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

    def as_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "source": self.source,
                "api_version": ".".join(map(str, self.api_version)) if self.api_version else None,
                "device_types": list(self.device_types), "priority": self.priority,
                "available": self.available, "reason": self.reason, "validated": self.validated,
                "ops": sorted(self.backend.impls) if self.backend else []}


def _check_api(backend: Backend) -> str:
    major, minor = backend.api_version
    if major != HAL_API_VERSION[0]:
        return (f"built for HAL API {major}.{minor}, this dsv4core provides {HAL_API_VERSION[0]}.{HAL_API_VERSION[1]} "
                f"(major versions differ)")
    if minor > HAL_API_VERSION[1]:
        return (f"built for HAL API {major}.{minor}, newer than this dsv4core's "
                f"{HAL_API_VERSION[0]}.{HAL_API_VERSION[1]}; upgrade dsv4core")
    return ""


def _status_for(backend: Backend, source: str) -> PluginStatus:
    st = PluginStatus(name=backend.name, source=source, version=backend.version,
                      api_version=tuple(backend.api_version), device_types=tuple(backend.device_types),
                      priority=backend.priority, backend=backend, validated=str(backend.validated or ""))
    st.reason = _check_api(backend)
    if not st.reason:
        try:
            ok, why = backend.available()
        except Exception as e:  # a probe must never take the others down
            ok, why = False, f"availability probe raised {type(e).__name__}: {e}"
            st.error = e
        st.available, st.reason = bool(ok), ("" if ok else (why or "reported unavailable"))
    return st


@functools.lru_cache(maxsize=1)
def discover() -> dict[str, PluginStatus]:
    """All known backends by name (cached for the process; call ``discover.cache_clear()`` to rescan)."""
    from .reference import make_reference_backend

    found: dict[str, PluginStatus] = {}
    ref = make_reference_backend()
    found[ref.name] = _status_for(ref, "builtin")

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist else "?"
        source = f"{dist} ({ep.value})"
        try:
            module = ep.load()
            pm.register(module, name=f"{dist}:{ep.name}")
        except (Exception, SystemExit) as e:  # a vendor library calling exit() at import included
            log.debug("backend plugin %s failed to import:\n%s", source, traceback.format_exc())
            found.setdefault(ep.name, PluginStatus(name=ep.name, source=source, error=e,
                                                   reason=f"import failed: {type(e).__name__}: {e}"))
            continue
        registered: list[Backend] = []
        impls = [h for h in pm.hook.dsv4core_register_backends.get_hookimpls() if h.plugin is module]
        try:
            if not impls:
                raise TypeError("module defines no dsv4core_register_backends hook")
            for h in impls:  # pluggy for registration only; each plugin isolated
                h.function(register=registered.append)
            for b in registered:
                if not isinstance(b, Backend):
                    raise TypeError(f"register() got {type(b).__name__}, expected dsv4core.hal.Backend")
        except (Exception, SystemExit) as e:
            found.setdefault(ep.name, PluginStatus(name=ep.name, source=source, error=e,
                                                   reason=f"registration failed: {type(e).__name__}: {e}"))
            continue
        for b in registered:
            if b.name in found:
                log.warning("backend %r from %s ignored: the name is already taken by %s",
                            b.name, source, found[b.name].source)
                continue
            try:  # a malformed Backend (e.g. api_version not a (major, minor) pair) stays isolated
                found[b.name] = _status_for(b, source)
            except Exception as e:
                found[b.name] = PluginStatus(name=b.name, source=source, error=e,
                                             reason=f"registration failed: {type(e).__name__}: {e}")
    return found
