"""dsv4core: the reference way to run DeepSeek-V4 on any accelerator.

Layers: ``dsv4core.model`` (device-neutral model core) -> ``dsv4core.hal`` (op specs, backends,
binding) -> backends (the built-in ``reference`` and plugins in entry-point group
``dsv4core.backends``).
"""

__version__ = "0.1.0"


def load_model(path_or_name, *, backend=None, dtype=None, device=None, quantized="auto", verify=None, tp=1, ep=1,
               numerics="auto", allow_nonfinite=False):
    """Load a DSV4 model (a checkpoint directory or ``"tiny"``); ``backend``: a name or "auto"
    (default: env ``DSV4CORE_BACKEND``, else "auto"); ``tp`` / ``ep``: tensor- and
    expert-parallel sizes (run under torchrun); ``numerics``: "auto", "exact" or "official"
    (:mod:`dsv4core.model.numerics`). See :mod:`dsv4core.model.api`."""
    from .model.api import load_model as _load

    return _load(path_or_name, backend=backend, dtype=dtype, device=device, quantized=quantized, verify=verify,
                 tp=tp, ep=ep, numerics=numerics, allow_nonfinite=allow_nonfinite)


__all__ = ["__version__", "load_model"]
