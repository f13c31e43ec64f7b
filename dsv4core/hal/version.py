"""The HAL API version (major, minor). See dsv4core/hal/CHANGELOG.md for what each version holds.

Within a major version a plugin built for any earlier minor loads and serves what it implements:
every signature change is recorded per parameter (``op(..., params_since=...)``) and checked
against the frozen contracts in ``dsv4core/hal/contracts/``. A breaking change needs a new major.
"""

HAL_API_VERSION = (1, 4)


def version_str(v) -> str:
    """``(1, 2)`` -> ``"1.2"``."""
    return ".".join(str(int(p)) for p in v)
