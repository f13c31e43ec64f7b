"""Device graphs (record a step once, replay it): the vendor-neutral contract.

A backend plugin may provide graph capture for the device types it serves
(``Backend(graph_capture=...)``): an object with

    new_pool(device) -> pool                      # memory the graphs of one owner share
    capture(fn, device, pool=None) -> (replay, outputs)

``capture`` warms ``fn`` up (on the device's side stream, so lazy initialisation and kernel compilation
happen outside the recording), records one call of ``fn`` and returns a callable replaying it plus
the outputs of the recorded call (their storage is reused by every replay). The replay callable
keeps ``fn`` alive: a tensor ``fn`` closes over (a static input made before the recording) is
read by the graph at its recorded address, so it must live as long as the graph does. The model core
asks :func:`graph_capture` for the device it runs on; whether the *ops* bound for that device
can be recorded is a separate question, answered by ``OpTable.capturable()``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


class GraphCapture(Protocol):
    def new_pool(self, device) -> Any: ...

    def capture(self, fn: Callable[[], Any], device, pool: Any = None) -> tuple[Callable[[], None], Any]: ...


def graph_capture(device_type: str) -> tuple[GraphCapture | None, str]:
    """The graph capture of the first backend in ``auto``'s order for ``device_type`` (available,
    priority >= 0, by priority then name) that provides one: ``(capture, "")``, or
    ``(None, reason)``."""
    from .binding import REFERENCE, auto_order
    from .discovery import discover

    statuses = discover()
    for name in auto_order(statuses, device_type) + [REFERENCE]:   # the order `auto` uses
        st = statuses.get(name)
        if st is not None and st.backend is not None and st.backend.graph_capture is not None:
            return st.backend.graph_capture, ""
    return None, f"no available backend provides graph capture for device type {device_type!r}"
