"""A plugin built for another major HAL API version."""

from dsv4core.hal import Backend, hookimpl


@hookimpl
def dsv4core_register_backends(register):
    register(Backend(name="old-api", version="9.9", device_types=("cpu",), api_version=(0, 7), priority=99))
