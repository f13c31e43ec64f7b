"""The error metrics and judging now live in :mod:`dsv4core.hal.compare` (the runtime verify mode
of the HAL uses them, and imports run downward); this module re-exports them for the suite."""

from dsv4core.hal.compare import *  # noqa: F401,F403
from dsv4core.hal.compare import _num  # noqa: F401
