"""The reference backend: every op's spec function, unchanged. Pure PyTorch, any device.

It is the numerical oracle: clear rather than fast, fp32 internal math (fp64 for fp64 inputs).
"""

from .backend import HAL_API_VERSION, Backend
from .spec import catalogue


def make_reference_backend() -> Backend:
    import dsv4core

    b = Backend(name="reference", version=dsv4core.__version__, device_types=("*",),
                api_version=HAL_API_VERSION, priority=0,
                description="pure PyTorch oracle (dsv4core/hal/ops); runs on any torch device")
    for name, spec in catalogue().items():
        b.add(name, spec.reference, capturable=spec.capturable)
    return b
