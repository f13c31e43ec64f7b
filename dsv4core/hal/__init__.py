"""dsv4core's hardware abstraction layer: op specs, backends, discovery, selection, binding.

Typical use::

    from dsv4core.hal import bind
    ops = bind(device="cpu")            # OpTable: one plain callable per op
    y = ops.rms_norm(x, weight, 1e-6)

Plugins: see :mod:`dsv4core.hal.hookspecs` and :class:`Backend`.
"""

# The op modules first: declaring the ops fills the catalogue (hal.spec) before any other module of
# the HAL, or of a caller, can ask for it.
from . import ops  # noqa: F401  (isort: skip)
from .backend import HAL_API_VERSION, Backend, Impl
from .binding import POLICIES, OpBinding, OpTable, backend_request, bind, parse_ops_override
from .discovery import ENTRY_POINT_GROUP, PluginStatus, discover
from .graphs import GraphCapture, graph_capture
from .errors import BackendNotFoundError, FallbackError, HALError, OpInputError, RegistrationError
from .hookspecs import hookimpl
from .spec import Case, OpSpec, Tolerance, catalogue
from .verify import VerifyError


def call(op_name: str, *args, **kwargs):
    """Public validating entry point: check the inputs of ``op_name``, then run its reference math."""
    specs = catalogue()
    if op_name not in specs:
        raise HALError(f"unknown op {op_name!r} (known: {', '.join(specs)})")
    return specs[op_name](*args, **kwargs)


def reset() -> None:
    """Forget discovered backends and bound tables (after installing a plugin in-process; tests)."""
    from .binding import _bind_cached

    discover.cache_clear()
    _bind_cached.cache_clear()


__all__ = [
    "HAL_API_VERSION", "Backend", "Impl", "POLICIES", "OpBinding", "OpTable", "backend_request", "bind", "parse_ops_override",
    "ENTRY_POINT_GROUP", "PluginStatus", "discover", "BackendNotFoundError", "FallbackError", "HALError",
    "OpInputError", "RegistrationError", "GraphCapture", "graph_capture", "hookimpl", "Case", "OpSpec", "Tolerance",
    "catalogue", "call", "reset", "VerifyError",
]
