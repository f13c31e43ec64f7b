"""Launch parameters of the portable Triton kernels, per (vendor, arch), owned by the plugins.

The kernel sources are written once (this package). What differs between an H200, an MI300X
(gfx942), an MI355X (gfx950) or an Intel GPU is how they are launched: block sizes, warps, pipeline
stages, and target-only launch keywords (AMD's ``waves_per_eu``, ``matrix_instr_nonkdim``, ...).
Those live in a **launch table** that each plugin owns and hands to
:func:`dsv4core.kernels.triton.registry.register_ops`::

    {"attention": {"BH": 16, "BK": 32, "num_stages": 2,
                   "launch": {"waves_per_eu": 2}},       # extra keywords for every launch
     "norm": {...}, ...}

A module's entry may also be a callable taking the op's arguments and returning the dict for
that call (e.g. smaller tiles for fp32 inputs). Keys are the kernel module's tuning keys (the names its ``TUNE.get(key, default)`` calls use; a
key absent from the table keeps the kernel's own default, measured on an H200). While a bound op
runs, its backend's table is the *active* table (a context variable set by the registry wrapper);
each kernel module's ``TUNE`` reads it. Entries set on ``TUNE`` itself (tuning scripts,
``benchmarks/tune_triton.py``) take precedence over the table.

Cheap to import: no triton import here.
"""
from __future__ import annotations

import contextvars
import dataclasses
from typing import Mapping

#: the launch table of the backend whose op is running (None: kernel defaults)
_ACTIVE: contextvars.ContextVar[Mapping | None] = contextvars.ContextVar("dsv4core_launch_table", default=None)

#: launch keywords that only the AMD backend of Triton accepts (CUDA and XPU raise KeyError on them)
AMD_ONLY = ("waves_per_eu", "matrix_instr_nonkdim", "kpack", "schedule_hint", "llvm_fn_attrs", "wgp_cu_mode")


class Tune(dict):
    """A kernel module's launch parameters: its own entries (tuning overrides) over the active
    launch table's entry for the module, over the default the kernel passes to :meth:`get`.

    ``keys``: the tuning keys the module reads (``launch`` is always allowed). Setting any other key,
    here or in a launch table's entry for the module, raises: a misspelt or retired key would
    otherwise time or run the defaults under the variant's name."""

    def __init__(self, module: str, keys):
        super().__init__()
        self.module = module.rsplit(".", 1)[-1]
        self.keys = frozenset(keys) | {"launch"}

    def check(self, entry: Mapping, where: str = "TUNE") -> Mapping:
        """``entry`` unchanged, or ValueError naming the module, the unknown keys and the known ones."""
        unknown = set(entry) - self.keys
        if unknown:
            raise ValueError(f"launch parameters of {self.module} ({where}): unknown key(s) "
                             f"{', '.join(sorted(map(str, unknown)))}; expected some of {', '.join(sorted(self.keys))}")
        return entry

    def __setitem__(self, key, value):
        self.check({key: value})
        super().__setitem__(key, value)

    def update(self, *args, **kwargs):
        new = dict(*args, **kwargs)
        super().update(self.check(new))

    def __ior__(self, other):
        self.update(other)
        return self

    def setdefault(self, key, default=None):
        self.check({key: default})
        return super().setdefault(key, default)

    def _table(self) -> Mapping:
        entry = (_ACTIVE.get() or {}).get(self.module)
        return entry if isinstance(entry, Mapping) else {}   # callables are resolved by the registry

    def get(self, key, default=None):
        if dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        return self._table().get(key, default)

    def __bool__(self) -> bool:   # "any launch parameter set?" (own overrides or the table's)
        return dict.__len__(self) > 0 or any(k != "launch" for k in self._table())

    def options(self) -> dict:
        """Extra keywords for every launch of this module (e.g. ``waves_per_eu``); ``{}`` by default."""
        return dict(self.get("launch") or {})


class active:
    """``with active(table): ...`` runs kernels with ``table`` (tests, tools; the registry does this
    for bound ops)."""

    def __init__(self, table: Mapping | None):
        self.table = table

    def __enter__(self):
        self._tok = _ACTIVE.set(self.table)
        return self.table

    def __exit__(self, *exc):
        _ACTIVE.reset(self._tok)
        return False


def accepted_options(target) -> frozenset[str]:
    """Launch option names Triton's backend for ``target`` (a ``triton.backends.compiler.GPUTarget``)
    accepts: the fields of its options dataclass (what ``parse_options`` keeps). FP fusion is
    passed explicitly (its value does not change the field names): left unset, Triton 3.9 warns
    that its default changes in 3.10."""
    from triton.compiler.compiler import make_backend

    opts = make_backend(target).parse_options({"enable_fp_fusion": True})
    return frozenset(f.name for f in dataclasses.fields(opts))


def for_target(table: Mapping | None, accepted) -> dict:
    """A copy of ``table`` whose ``launch`` keywords are restricted to ``accepted`` option names
    (so an AMD table can run on CUDA for functional checks: AMD-only keys dropped). Callable
    entries are wrapped: their result is filtered per call."""
    return {mod: _filter_entry(entry, frozenset(accepted)) for mod, entry in (table or {}).items()}


def _filter_entry(entry, accepted):
    if callable(entry):
        def filtered(*args, **kwargs):
            return _filter_entry(entry(*args, **kwargs), accepted)
        return filtered
    entry = dict(entry)
    if "launch" in entry:
        entry["launch"] = {k: v for k, v in entry["launch"].items() if k in accepted}
    return entry


def activation(args, kwargs):
    """The first floating-point tensor among an op's arguments (its activation input), or None.

    For callable table entries that depend only on the activation's dtype or token count, so that
    they keep working when an op gains or renames arguments."""
    import torch

    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    return None


def is_f32(args, kwargs) -> bool:
    import torch

    x = activation(args, kwargs)
    return x is not None and x.dtype == torch.float32
