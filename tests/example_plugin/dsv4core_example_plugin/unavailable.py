"""A plugin whose platform probe says no (its device is absent)."""

from dsv4core.hal import Backend, hookimpl


@hookimpl
def dsv4core_register_backends(register):
    register(Backend(name="unavailable", version="1.0", device_types=("cpu",), priority=98,
                     available=lambda: (False, "no FooAccelerator device found (probe)")))
