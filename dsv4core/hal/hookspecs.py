"""The whole plugin contract: one registration hook.

A backend distribution lists a module under the entry-point group ``dsv4core.backends``. That
module must be cheap to import (no device initialisation, no heavy vendor imports) and define::

    from dsv4core.hal import hookimpl, Backend

    @hookimpl
    def dsv4core_register_backends(register):
        register(Backend(name=..., ...))

pluggy is used for registration only; bound ops are plain Python calls.
"""

import pluggy

PROJECT = "dsv4core"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def dsv4core_register_backends(register):
    """Register zero or more backends by calling ``register(backend)`` for each.

    ``backend`` is a :class:`dsv4core.hal.Backend`. Do not import vendor libraries here; probe them
    in ``Backend.available`` and import them lazily inside the op implementations.
    """
