"""A plugin whose import fails (a missing vendor library)."""

import dsv4core_nonexistent_vendor_library  # noqa: F401
