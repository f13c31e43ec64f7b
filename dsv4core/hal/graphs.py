"""Device graphs (record a step once, replay it): the vendor-neutral contract.

A backend plugin may provide graph capture for the device types it serves
(``Backend(graph_capture=...)``): an object with

    new_pool(device) -> pool                      # memory the graphs of one owner share
    capture(fn, device, pool=None) -> (replay, outputs)

``capture`` warms ``fn`` up (on the device's side stream, so lazy initialisation and kernel compilation
happen outside the recording), records one call of ``fn`` and returns a callable replaying it plus
the outputs of the recorded call (their storage is reused by every replay). The model core
asks :func:`graph_capture` for the device it runs on; whether the *ops* bound for that device
can be recorded is a separate question, answered by ``OpTable.capturable()``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


class GraphCapture(Protocol):
    def new_pool(self, device) -> Any: ...

    def capture(self, fn: Callable[[], Any], device, pool: Any = None) -> tuple[Callable[[], None], Any]: ...


def graph_capture(device_type: str) -> tuple[GraphCapture | None, str]:
    """The graph capture of the highest-priority available backend serving ``device_type`` that
    provides one: ``(capture, "")``, or ``(None, reason)``."""
    from .discovery import discover

    cands = sorted((st for st in discover().values() if st.available and st.backend is not None
                    and st.backend.serves(device_type) and st.backend.graph_capture is not None),
                   key=lambda st: -st.priority)
    if not cands:
        return None, f"no available backend provides graph capture for device type {device_type!r}"
    return cands[0].backend.graph_capture, ""
