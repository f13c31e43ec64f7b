"""Launch parameters of the portable Triton kernels, per target, owned by the plugins.

The kernel sources are written once (this package). What differs between an H200, an MI300X
(gfx942), an MI355X (gfx950) or an Intel GPU is how they are launched: block sizes, warps, pipeline
stages, and target-only launch keywords (AMD's ``waves_per_eu``, ``matrix_instr_nonkdim``, ...).
Each plugin states them in one :class:`LaunchTable`, keyed by target (``"sm90"``, ``"gfx942"``,
an XPU shared-memory tier, ...)::

    TABLES = LaunchTable("rocm", {
        "gfx942": {"attention": {"BH": 16, "BK": 16, "num_stages": 2,
                                 "launch": {"matrix_instr_nonkdim": 16}},   # extra launch keywords
                   "moe": moe_entry, ...},                                  # a callable entry
        "other": {...}}, fallback="other")
    register_ops(backend, "cuda", launch=lambda: TABLES.resolve(arch()))

An entry (per kernel module) is a dict of the module's tuning keys, or a callable taking the op's
arguments and returning that dict for the call (or None: nothing for this call), e.g. smaller
tiles for fp32 inputs. Module names and keys are checked when the table is built (a dict entry)
or, by ``register_ops``, when a callable entry returns (its result), against the keys each kernel module declares in
:data:`TUNING_KEYS`: a misspelt key fails with the plugin, target, module, key and the known keys.

Precedence, per key, while a bound op runs (the registry wrapper makes its backend's resolved
table the *active* one, a context variable each kernel module's ``TUNE`` reads):

1. an entry set on the kernel module's ``TUNE`` itself (tuning scripts, ``benchmarks/tune_triton.py``);
2. the active table's entry for the module (a callable entry: its result for this call);
3. the kernel's portable default, the second argument of its ``TUNE.get(key, default)`` call.

Values tuned on one GPU belong in that plugin's table with the measurement they came from, and a
kernel's default is a portable choice with its design reason stated. Defaults still measured on
one GPU say so where they are set (the CUDA plugin's launch.py lists the modules).

Cheap to import: no triton import here.
"""
from __future__ import annotations

import contextvars
import dataclasses
import types
from collections.abc import Callable, Iterator, Mapping

#: the launch table of the backend whose op is running (None: kernel defaults)
_ACTIVE: contextvars.ContextVar[Mapping | None] = contextvars.ContextVar("dsv4core_launch_table", default=None)

#: launch keywords that only the AMD backend of Triton accepts (CUDA and XPU raise KeyError on them)
AMD_ONLY = ("waves_per_eu", "matrix_instr_nonkdim", "kpack", "schedule_hint", "llvm_fn_attrs", "wgp_cu_mode")


#: the keys of grouped_gemm's launches (linear's and wo_a's; linear._config reads them)
#: ("tiles": a function (rows, quantised, big) -> (mode, BM, BN, BK, num_warps, num_stages[, NBLK]),
#: the op's tile table in place of the kernel's portable one: linear.linear_tiles)
#: ("w8a8": linear's official W8A8 path with FP8 weights, linear.W8A8_PATHS; "w8a8_tiles": the
#: tile function of its FP8 x FP8 launches, default the "tiles" one)
GEMM_KEYS = ("mode", "BM", "BN", "BK", "num_warps", "num_stages", "KSUB", "NBLK", "fp8", "S", "target", "chain",
             "dequant_rows", "dequant_bytes", "tiles", "w8a8", "w8a8_tiles")

#: kernel module -> the tuning keys its launchers read (``launch``, the extra launch keywords, is
#: always allowed). Each module's ``TUNE = Tune(__name__)`` takes its keys from here, so a plugin's
#: table is checked without importing the kernels (and triton); tests/test_launch_tables.py keeps
#: this in step with the keys the sources read.
TUNING_KEYS: dict[str, tuple[str, ...]] = {
    "attention": ("BH", "BK", "S", "target", "cBLOCK", "c_num_warps", "num_warps", "num_stages", "pipe"),
    "cache": ("BD", "BR", "num_warps"),
    "compress": ("BD", "num_warps", "windows_BD", "windows_num_warps"),
    "indexer": ("BD", "BL", "num_warps", "num_stages", "BR", "BN", "rq_warps"),
    "linear": GEMM_KEYS,
    "mhc": ("BT", "BK", "target", "num_warps", "num_stages", "epi_chunks", "epi_num_warps", "post_BLOCK",
            "post_num_warps"),
    # "tiles": a function (P, E, H, I, programs, fp8, plain, scaled, big) -> (BM, BNu, BNd, BK,
    # num_warps, num_stages) for the tensor-core path, in place of moe._tiles (moe._config)
    # "gemm": a plugin's grouped FP4 expert GEMMs (moe.py's docstring: the contract)
    "moe": ("BM", "BNu", "BNd", "BK", "num_warps", "num_stages", "fp4", "fp8", "Su", "Sd", "split", "dequant_rows",
            "dequant_bytes", "tiles", "gemm"),
    "norm": ("ROWS", "num_warps"),
    "rope": ("HB", "num_warps", "rowpos_below"),
    "topk": ("BLOCK", "TB", "num_warps"),
    "wo_a": GEMM_KEYS,
}


def unknown_keys(module: str, entry: Mapping, where: str, known=None) -> None:
    """None, or ValueError naming ``where`` (plugin / target), the module, the unknown keys and the
    known ones (default: the module's TUNING_KEYS and ``launch``)."""
    known = frozenset(TUNING_KEYS.get(module, ())) | {"launch"} if known is None else known
    unknown = set(entry) - known
    if unknown:
        raise ValueError(f"launch parameters of {module} ({where}): unknown key(s) "
                         f"{', '.join(sorted(map(str, unknown)))}; expected some of {', '.join(sorted(known))}")


_NONE: Mapping = types.MappingProxyType({})   # no entry for the module (read only)
_MISSING = object()
#: distinct (key, parameters) configurations a module's ``Tune.memo`` keeps (then forgotten at once)
_MEMO_MAX = 4096


def _frozen(entry: Mapping) -> tuple:
    """A launch-parameter mapping as a hashable value, each value with its type (1, 1.0 and True
    are equal keys otherwise) and the ``launch`` keywords, a dict, as their items; TypeError for a
    value that is not hashable. (Built by C-level ``map`` / ``tuple`` where no value is a dict: a
    launcher pays this per call.)"""
    kinds = tuple(map(type, entry.values()))
    if dict not in kinds:
        return tuple(entry.items()), kinds
    return tuple((k, type(v), tuple(v.items()) if type(v) is dict else v) for k, v in entry.items()), ()


class Tune(dict):
    """A kernel module's launch parameters: its own entries (tuning overrides) over the active
    launch table's entry for the module, over the default the kernel passes to :meth:`get`.

    ``keys``: the tuning keys the module reads (default: its :data:`TUNING_KEYS`; ``launch`` is
    always allowed). Setting any other key, here or in a launch table's entry for the module,
    raises: a misspelt or retired key would otherwise time or run the defaults under the variant's
    name. Not usable as a truth value (a dict's "non-empty" would read its own overrides only):
    :meth:`sets_any` says whether any parameter is set."""

    def __init__(self, module: str, keys=None):
        super().__init__()
        self.module = module.rsplit(".", 1)[-1]
        if keys is None:
            if self.module not in TUNING_KEYS:
                raise ValueError(f"Tune({module!r}): no TUNING_KEYS entry for {self.module!r} "
                                 f"(dsv4core/kernels/triton/launch.py); known: {', '.join(sorted(TUNING_KEYS))}")
            keys = TUNING_KEYS[self.module]
        self.keys = frozenset(keys) | {"launch"}
        self._memo: dict = {}

    def check(self, entry: Mapping, where: str = "TUNE") -> Mapping:
        """``entry`` unchanged, or ValueError naming the module, the unknown keys and the known ones."""
        unknown_keys(self.module, entry, where, self.keys)
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
        active = _ACTIVE.get()
        entry = active.get(self.module) if active is not None else None
        if entry is None:
            return _NONE
        if type(entry) is dict or isinstance(entry, Mapping):   # (the common case first: no ABC check)
            return entry
        return _NONE                                              # callables are resolved by the registry

    def get(self, key, default=None):
        if dict.__len__(self) and dict.__contains__(self, key):
            return dict.__getitem__(self, key)
        active = _ACTIVE.get()              # (``_table`` inlined: launchers read a few keys a launch)
        entry = active.get(self.module) if active is not None else None
        if entry is None:
            return default
        if type(entry) is dict:
            return entry.get(key, default)
        return self._table().get(key, default)

    def memo(self, key, build: Callable[[], object]):
        """``build()``'s value for ``key`` (hashable: the shapes, dtypes and flags it depends on) under
        the launch parameters in effect now (this module's own overrides and the active table's entry,
        compared by value), computed once and then reused: for a launcher's per-call configuration,
        which depends on nothing else. The value is shared between calls (read it, never change it).
        Parameters that cannot be compared by value (unhashable) are not memoised: ``build()`` then
        runs every time."""
        active = _ACTIVE.get()              # (``_table`` inlined, as in ``get``)
        entry = active.get(self.module) if active is not None else None
        if entry is not None and type(entry) is not dict:
            entry = self._table()
        try:
            k = (key, _frozen(self) if dict.__len__(self) else (), _frozen(entry) if entry else ())
            v = self._memo.get(k, _MISSING)
        except TypeError:
            return build()
        if v is _MISSING:
            if len(self._memo) >= _MEMO_MAX:
                self._memo.clear()
            v = self._memo[k] = build()
        return v

    def sets_any(self) -> bool:
        """Whether any launch parameter is set for this call: an own override (``launch``
        included) or a key of the active table's entry other than ``launch``."""
        return dict.__len__(self) > 0 or any(k != "launch" for k in self._table())

    def __bool__(self):
        raise TypeError(f"{self.module}.TUNE has no truth value: use TUNE.sets_any() (any parameter set) "
                        f"or len(TUNE) (own overrides)")

    def options(self) -> dict:
        """Extra keywords for every launch of this module (e.g. ``waves_per_eu``); ``{}`` by default."""
        extra = self.get("launch")
        return dict(extra) if extra else {}


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


#: a module's entry: its tuning keys, or a callable of the op's arguments returning them (or None)
Entry = Mapping | Callable[..., Mapping | None]


class LaunchTable(Mapping):
    """One plugin's launch parameters for the portable kernels, per target.

    ``plugin``: the plugin's name (for errors). ``targets``: target name -> {kernel module ->
    :data:`Entry`}. ``fallback``: the target whose entries a target without its own take (None:
    such a target is an error). ``select``: maps what the plugin reads from its device (a compute
    capability, a shared-memory size, ...) to a target name; without it the device's name is the
    target's (an arch string). Precedence of the values: the module docstring.

    Checked at construction: every module has launch parameters (:data:`TUNING_KEYS`), every
    dict entry (and its ``launch`` keywords, a dict) names only the module's keys. Callable
    entries' results are checked where they are called (``register_ops``), with the same message. A Mapping of target -> its
    entries (``TABLES["gfx942"]``), so tools name one as ``module:TABLES.gfx942``."""

    def __init__(self, plugin: str, targets: Mapping[str, Mapping[str, Entry]], *, fallback: str | None = None,
                 select: Callable[[object], str] | None = None):
        self.plugin, self.fallback, self.select = plugin, fallback, select
        if fallback is not None and fallback not in targets:
            raise ValueError(f"launch table of {plugin}: fallback target {fallback!r} has no entries; "
                             f"targets: {', '.join(targets)}")
        self._targets = {name: {mod: self._checked(name, mod, entry) for mod, entry in entries.items()}
                         for name, entries in targets.items()}

    def _checked(self, target: str, module: str, entry: Entry) -> Entry:
        where = f"plugin {self.plugin}, target {target}"
        if module not in TUNING_KEYS:
            raise ValueError(f"launch table ({where}): {module!r} is not a kernel module with launch "
                             f"parameters; known: {', '.join(sorted(TUNING_KEYS))}")
        if callable(entry):   # its result is checked on each call where it is used (registry.register_ops)
            return entry
        if not isinstance(entry, Mapping):
            raise TypeError(f"launch table ({where}): the entry for {module!r} is a {type(entry).__name__}; "
                            f"expected a dict of launch parameters or a callable of the op's arguments")
        unknown_keys(module, entry, where)
        if not isinstance(entry.get("launch", {}), Mapping):
            raise TypeError(f"launch table ({where}): {module}'s 'launch' must be a dict of launch keywords, "
                            f"got {type(entry['launch']).__name__}")
        return dict(entry)

    def __getitem__(self, target: str) -> dict:
        return dict(self._targets[target])

    def __iter__(self) -> Iterator[str]:
        return iter(self._targets)

    def __len__(self) -> int:
        return len(self._targets)

    def target(self, device) -> str:
        """The target name whose entries ``device`` (a target name, or what ``select`` maps) takes."""
        name = device if isinstance(device, str) and device in self._targets else \
            self.select(device) if self.select is not None else device
        if name in self._targets:
            return name
        if self.fallback is None:
            raise KeyError(f"launch table of {self.plugin}: no entries for {device!r}; targets: {', '.join(self)}")
        return self.fallback

    def resolve(self, device, accepted=None) -> dict:
        """{kernel module -> entry} for ``device`` (see :meth:`target`): what ``register_ops``
        takes. ``accepted``: the launch option names the Triton target accepts (see
        :func:`accepted_options`); other ``launch`` keywords are dropped (None: all kept)."""
        entries = self[self.target(device)]
        return entries if accepted is None else for_target(entries, accepted)


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
    if entry is None:                       # a callable entry's "no parameters for this call"
        return None
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
