"""The oracle's fingerprint: what a backend is judged by, and whether it is still what is on disk.

**The oracle** is the code and the values conformance (and the verify mode) judge a backend with:
the modules ``dsv4core/hal/{spec,errors,version,quant,rowformats,compare}.py`` and
``dsv4core/hal/ops/*.py`` (every op's reference implementation, input check, case generator and
tolerance, the helpers they call, the comparison rules), plus the torch attributes that code
names.

**Its fingerprint** (:func:`fingerprint`) is a mapping ``{field: text}``:

* ``op <name>.<field>`` per op of the catalogue: its class; name, family, signature, versions,
  ``writes``, ``capturable``, ``deprecated``, ``converts_per_use``; its tolerance (class and every value: k, floor,
  floors, metric, quantised-row allowance, reason); and its ``reference``, ``check`` and
  ``cases`` functions, each as its module, qualified name, defaults and a digest of its code
  object (recursively: bytecode, constants, names; not the file name or line numbers);
* ``module <m>.<name>`` for every global name of every oracle module: functions as above,
  classes as the digests of every member of their ``__dict__`` (methods, properties, constants),
  constants by value, modules by name (caches by name only: their contents change at run time);
* ``torch <ns>.<name>`` for every name the oracle's code objects load that is an attribute of
  ``torch``, ``torch.nn.functional``, ``torch.linalg``, ``torch.special`` or ``torch.Tensor``:
  ``ok`` while it is the object it was when this module was imported (the HAL imports it before
  any plugin loads) or torch's own wrapper of it (code in torch's package, ``__wrapped__`` leading
  to it), else what replaced it and from which module.

**The expected fingerprint** (:func:`expected`) is the same function applied to a private copy
of the oracle modules executed afresh from the installed files on disk (cached per process: one
execution of the op modules, tens of ms). :func:`digest` of it (sha256, 16 hex digits) is what a
conformance report records as ``oracle.digest``. :func:`problems` compares it with the live
fingerprint: any field that differs means something rebound, patched or replaced part of the
oracle after it loaded (``object.__setattr__`` on a spec, a patched class, a rebound helper or
torch function). Discovery fingerprints the live oracle before the plugins load and after each
one (:func:`note_plugin`), so a change made while a plugin loaded names that plugin.

What this cannot see: a change below Python attribute level (an aten kernel registered over
torch's own, a patched C extension) or code that also patches this module. The conformance
runner's ``isolate`` mode (the reference and fp64 outputs from a process that loads no plugin)
covers those.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.machinery
import sys
import types
from pathlib import Path

import torch

from . import compare, errors, ops, quant, rowformats, spec, version

_HAL = __name__.rpartition(".")[0]                      # "dsv4core.hal"
_ROOT_MODULES = ("spec", "errors", "version", "quant", "rowformats", "compare")
_SHADOW = "_dsv4core_hal_oracle_from_disk"
_TORCH_NS = {"torch": torch, "torch.nn.functional": torch.nn.functional, "torch.linalg": torch.linalg,
             "torch.special": torch.special, "torch.Tensor": torch.Tensor}
_SIMPLE = (type(None), bool, int, float, complex, str, bytes)


def _ops_names(hal_dir: Path) -> list[str]:
    return ["ops"] + [f"ops.{p.stem}" for p in sorted((hal_dir / "ops").glob("*.py")) if p.stem != "__init__"]


def _live_modules() -> dict[str, types.ModuleType]:
    roots = {"spec": spec, "errors": errors, "version": version, "quant": quant, "rowformats": rowformats,
             "compare": compare, "ops": ops}
    out = {}
    for rel in (*_ROOT_MODULES, *_ops_names(Path(spec.__file__).parent)):
        out[rel] = roots.get(rel) or getattr(ops, rel.split(".", 1)[1])
    return out


_LIVE = _live_modules()


# ---------------------------------------------------------------------------------------------
# Fingerprints of values
# ---------------------------------------------------------------------------------------------

def _rel(module: str | None) -> str:
    """A module name with the oracle package's prefix (live or private copy) replaced by "hal"."""
    m = module or "?"
    for prefix in (_HAL, _SHADOW):
        if m == prefix or m.startswith(prefix + "."):
            return "hal" + m[len(prefix):]
    return m


def code_digest(code: types.CodeType) -> str:
    """sha256 (16 hex digits) of a code object's behaviour: bytecode, argument counts, flags,
    names, variable names and constants (nested code objects by their own digest); not its file
    name, first line or line table."""
    d = _CODE_DIGESTS.get(code)        # code objects compare by content: equal code, equal digest
    if d is None:
        d = _CODE_DIGESTS[code] = _code_digest(code)
    return d


_CODE_DIGESTS: dict[types.CodeType, str] = {}


def _code_digest(code: types.CodeType) -> str:
    h = hashlib.sha256()
    for part in (code.co_name, code.co_qualname, code.co_argcount, code.co_posonlyargcount,
                 code.co_kwonlyargcount, code.co_flags, code.co_code, code.co_names, code.co_varnames,
                 code.co_freevars, code.co_cellvars):
        h.update(repr(part).encode() + b"\0")
    for c in code.co_consts:
        h.update((code_digest(c) if isinstance(c, types.CodeType) else _const(c)).encode() + b"\0")
    return h.hexdigest()[:16]


def _const(c) -> str:
    if isinstance(c, frozenset):
        return "frozenset(" + ",".join(sorted(_const(x) for x in c)) + ")"
    if isinstance(c, tuple):
        return "(" + ",".join(_const(x) for x in c) + ")"
    return f"{type(c).__name__}:{c!r}"


def _fn(f) -> str:
    if isinstance(f, functools._lru_cache_wrapper):
        return "lru_cache " + _fn(f.__wrapped__)
    if not isinstance(f, types.FunctionType):
        return _value(f, 0)
    return (f"fn {_rel(f.__module__)}.{f.__qualname__} {code_digest(f.__code__)} "
            f"defaults {_value(f.__defaults__, 1)} kwdefaults {_value(f.__kwdefaults__, 1)}")


def tolerance_fp(t) -> str:
    return (f"{type(t).__module__ and _rel(type(t).__module__)}.{type(t).__qualname__}"
            f"(k={t.k!r}, floor={t.floor!r}, floors={sorted(dict(t.floors).items())!r}, metric={t.metric!r}, "
            f"quantized_rows={t.quantized_rows!r}, quantized_step={t.quantized_step!r}, why={t.why!r})")


def _class(c: type) -> str:
    parts = [f"class {_rel(c.__module__)}.{c.__qualname__} bases "
             + ",".join(f"{_rel(b.__module__)}.{b.__qualname__}" for b in c.__bases__)]
    for k, v in sorted(vars(c).items()):
        if k in ("__dict__", "__weakref__", "__doc__", "__module__", "__annotations__", "__dataclass_fields__",
                 "__dataclass_params__", "__match_args__", "__slotnames__"):   # __slotnames__: pickle's cache
            continue
        parts.append(f"{k}={_member(v)}")
    return "; ".join(parts)


def _member(v) -> str:
    if isinstance(v, (staticmethod, classmethod)):
        return f"{type(v).__name__} {_fn(v.__func__)}"
    if isinstance(v, property):
        return f"property {_fn(v.fget)} {_fn(v.fset)} {_fn(v.fdel)}"
    if isinstance(v, types.FunctionType):
        return _fn(v)
    return _value(v, 1)


def _value(v, depth: int) -> str:
    if isinstance(v, _SIMPLE) or isinstance(v, torch.dtype):
        return repr(v)
    if isinstance(v, (tuple, list)) and depth < 4:
        return type(v).__name__ + "[" + ",".join(_value(x, depth + 1) for x in v) + "]"
    if isinstance(v, (dict, types.MappingProxyType)) and depth < 4:
        return "dict{" + ",".join(f"{_value(k, depth + 1)}:{_value(x, depth + 1)}"
                                  for k, x in sorted(v.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(v, (types.FunctionType, functools._lru_cache_wrapper)):
        return _fn(v) if depth == 0 else f"fn {_rel(v.__module__)}.{v.__qualname__}"
    if isinstance(v, type):
        return _class(v) if depth == 0 else f"class {_rel(v.__module__)}.{v.__qualname__}"
    if isinstance(v, types.ModuleType):
        return f"module {_rel(v.__name__)}"
    if isinstance(v, spec.Tolerance) or type(v).__name__ == "Tolerance":
        return tolerance_fp(v)
    if isinstance(v, torch.Tensor):
        return f"tensor {v.dtype} {tuple(v.shape)} " + hashlib.sha256(
            v.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    if type(v).__name__ == "OpSpec":
        return f"op spec {v.name}"
    return f"{_rel(type(v).__module__)}.{type(v).__qualname__}"


def _is_cache(name: str) -> bool:
    return name.upper().endswith("_CACHE") or name == "_CATALOGUE"


# ---------------------------------------------------------------------------------------------
# The fingerprint
# ---------------------------------------------------------------------------------------------

def _spec_fields(s) -> dict[str, str]:
    return {"class": f"{_rel(type(s).__module__)}.{type(s).__qualname__}",
            "declaration": repr((s.name, s.family, str(s.signature), s.since, sorted(dict(s.params_since).items()),
                                 tuple(s.writes), s.capturable, s.deprecated, tuple(s.converts_per_use))),
            "tolerance": tolerance_fp(s.tolerance), "reference": _fn(s.reference),
            "check": _fn(s._check), "cases": _fn(s._cases)}


def _loaded_names(modules: dict[str, types.ModuleType]) -> set[str]:
    names: set[str] = set()

    def walk(code):
        names.update(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                walk(c)

    for m in modules.values():
        for v in vars(m).values():
            fns = [v] if isinstance(v, types.FunctionType) else (
                [x for x in vars(v).values() if isinstance(x, types.FunctionType)]
                if isinstance(v, type) and v.__module__ == m.__name__ else [])
            if type(v).__name__ == "OpSpec":
                fns = [f for f in (v.reference, v._check, v._cases) if isinstance(f, types.FunctionType)]
            for f in fns:
                walk(f.__code__)
    return names


def _torch_attr(ns, name):
    try:
        return (object.__getattribute__(ns, "__dict__").get(name, None) if isinstance(ns, types.ModuleType)
                else next((vars(c)[name] for c in ns.__mro__ if name in vars(c)), None))
    except Exception:  # noqa: BLE001
        return None


def _torch_snapshot(names) -> dict[str, object]:
    return {f"{ns_name}.{n}": obj for ns_name, ns in _TORCH_NS.items() for n in sorted(names)
            if (obj := _torch_attr(ns, n)) is not None}


_TORCH_AT_IMPORT = _torch_snapshot(_loaded_names(_LIVE))


_TORCH_DIR = str(Path(torch.__file__).parent)


def _torch_wrapper_of(now, orig) -> bool:
    """``now`` is ``orig``, or torch's own wrapper of it (``__wrapped__`` chain of functions whose
    code lies in torch's package: ``torch._dynamo`` wraps ``torch.manual_seed`` when imported)."""
    for _ in range(8):
        if now is orig:
            return True
        code = getattr(now, "__code__", None)
        if not isinstance(code, types.CodeType) or not code.co_filename.startswith(_TORCH_DIR):
            return False
        now = getattr(now, "__wrapped__", None)
    return False


def _origin(obj) -> str:
    mod = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", "?")
    return f"{mod}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def fingerprint(modules: dict[str, types.ModuleType] | None = None, catalogue_: dict | None = None,
                torch_check: bool = True) -> dict[str, str]:
    """The fingerprint of the oracle made of ``modules`` (default: the live ones) and the
    catalogue ``catalogue_`` (default: the live one), as ``{field: text}`` (module docstring)."""
    modules = _LIVE if modules is None else modules
    cat = spec._CATALOGUE if catalogue_ is None else catalogue_
    out = {"ops": ",".join(cat)}
    for name, s in cat.items():
        for k, v in _spec_fields(s).items():
            out[f"op {name}.{k}"] = v
    for rel, m in modules.items():
        for k, v in vars(m).items():
            if k.startswith("__") and k.endswith("__") or k == "annotations" or not k.isidentifier():
                continue      # not an identifier: no source can bind it (pytest's assertion rewriting
                              # adds "@py_builtins" / "@pytest_ar" to the modules it rewrites)
            out[f"module {rel}.{k}"] = "cache" if _is_cache(k) else _value(v, 0)
    if torch_check:
        for key, obj in _TORCH_AT_IMPORT.items():
            ns_name, _, n = key.rpartition(".")
            now = _torch_attr(_TORCH_NS[ns_name], n)
            out[f"torch {key}"] = "ok" if _torch_wrapper_of(now, obj) else f"replaced by {_origin(now)}"
    return out


def digest(fp: dict[str, str]) -> str:
    """sha256 (16 hex digits) of a fingerprint's fields and texts, in field order."""
    h = hashlib.sha256()
    for k in sorted(fp):
        h.update(k.encode() + b"\0" + fp[k].encode() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def _expected() -> tuple[tuple[str, str], ...]:
    hal_dir = Path(spec.__file__).parent
    pkg = types.ModuleType(_SHADOW)
    pkg.__path__ = [str(hal_dir)]
    pkg.__spec__ = importlib.machinery.ModuleSpec(_SHADOW, None, is_package=True)
    pkg.__spec__.submodule_search_locations = [str(hal_dir)]
    saved = {k: v for k, v in sys.modules.items() if k == _SHADOW or k.startswith(_SHADOW + ".")}
    sys.modules[_SHADOW] = pkg
    try:
        mods = {rel: importlib.import_module(f"{_SHADOW}.{rel}") for rel in (*_ROOT_MODULES, *_ops_names(hal_dir))}
        fp = fingerprint(mods, mods["spec"]._CATALOGUE, torch_check=False)
    finally:
        for k in [k for k in sys.modules if k == _SHADOW or k.startswith(_SHADOW + ".")]:
            del sys.modules[k]
        sys.modules.update(saved)
    fp.update({f"torch {k}": "ok" for k in _TORCH_AT_IMPORT})
    return tuple(fp.items())


def expected() -> dict[str, str]:
    """The fingerprint of the oracle as the installed files define it (module docstring)."""
    return dict(_expected())


def problems(live: dict[str, str] | None = None) -> list[str]:
    """The fields where the live oracle differs from the files on disk, one line each
    (``field: expected ..., found ...``); [] when it is intact."""
    want, got = expected(), fingerprint() if live is None else live
    out = []
    for k in sorted(set(want) | set(got)):
        if want.get(k) != got.get(k):
            out.append(f"{k}: expected {_short(want.get(k))}, found {_short(got.get(k))}")
    return out


def _short(text: str | None) -> str:
    if text is None:
        return "nothing"
    return text if len(text) <= 160 else text[:157] + "..."


#: Fields of the live oracle each plugin changed while it loaded: [(plugin source, [field, ...])].
CHANGED_BY: list[tuple[str, list[str]]] = []


def note_plugin(source: str, before: dict[str, str]) -> dict[str, str]:
    """Record the fields that differ between ``before`` and the live fingerprint now, as changed
    by ``source`` (a plugin that has just loaded); return the live fingerprint."""
    now = fingerprint()
    changed = sorted(k for k in set(now) | set(before) if now.get(k) != before.get(k))
    if changed:
        CHANGED_BY.append((source, changed))
    return now


def who_changed(fields) -> list[str]:
    """The plugins recorded (:func:`note_plugin`) as having changed any of ``fields``."""
    fields = set(fields)
    return list(dict.fromkeys(src for src, changed in CHANGED_BY if fields & set(changed)))


def refusal(context: str = "") -> str | None:
    """The message with which a judge refuses to judge (None when the live oracle is intact):
    which plugin changed it, when that is known, and every field that differs."""
    lines = problems()
    if not lines:
        return None
    fields = [ln.split(": expected ")[0] for ln in lines]
    who = who_changed(fields)
    by = (f"changed by plugin {', '.join(who)}" if who else
          "changed after the plugins loaded (no plugin changed it while loading)" + (f"; {context}" if context else ""))
    return (f"the oracle differs from the installed dsv4core files (refusing to judge): {by}; "
            f"{len(lines)} field(s) differ:\n  " + "\n  ".join(lines[:20])
            + (f"\n  ... and {len(lines) - 20} more" if len(lines) > 20 else ""))
