"""Op specifications: the single source of truth for every HAL op.

An op is declared once, in ``dsv4core/hal/ops/<family>.py``, as a plain function whose body is the
reference math (fp32 internal math, cast once), decorated with :func:`op`.  Beside it, in the same
module, live its input check (``@<op>.check``), its sample-case generator (``@<op>.cases``) and its
tolerance policy with the reason for it.  The reference backend, the conformance suite, the docs and
the capability table are all derived from these specs.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from .errors import HALError, OpInputError
from .version import HAL_API_VERSION, version_str

#: Activation dtypes every op accepts for its "act" tensors.
ACT_DTYPES = (torch.float32, torch.bfloat16)
#: Float dtypes accepted where the spec says "fp32 parameter" (fp64 is allowed for fp64 evaluation).
F32 = (torch.float32, torch.float64)
INT_DTYPES = (torch.int32, torch.int64)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype reference math runs in: float64 for float64 inputs (fp64 evaluation), else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Tolerance:
    """How far a backend may be from an fp64 evaluation of the spec.

    A backend passes a case when ``err_backend <= k * err_reference + floor`` where both errors are
    measured against the fp64 evaluation on the same inputs in the same dtype (``metric`` says how:
    ``"max_rel"`` = max |diff| / max |fp64|, ``"max_abs"`` = max |diff|).  ``why`` is the reason for
    the numbers and is printed in conformance reports; ``floors`` may set the floor per dtype.
    """

    k: float
    floor: float
    why: str
    metric: str = "max_rel"
    #: Per-dtype floors (``{"bfloat16": 2**-10}``) overriding ``floor`` for cases of that dtype;
    #: stored read-only (a ``MappingProxyType`` over a private copy of the dict given).
    floors: Mapping[str, float] = field(default_factory=dict, hash=False, compare=False)
    #: Quantised calls (a case whose quantisation argument is set: ``act_block`` /
    #: ``nope_quant_block``, or an op that always quantises) may exceed the bound in 1 of every
    #: ``quantized_rows`` output rows (0: none), each such row in at most two values by at most
    #: ``quantized_step`` x its max |value|: a value rounded and then quantised to a coarse grid
    #: lands on the other side of a decision boundary when two legal computations differ by one
    #: fp32 rounding, which moves its code to the neighbouring one. ``why`` says the derivation.
    quantized_rows: int = 0
    quantized_step: float = 0.0

    def __post_init__(self):
        object.__setattr__(self, "floors", MappingProxyType(dict(self.floors)))

    def floor_for(self, dtype: torch.dtype) -> float:
        return float(self.floors.get(str(dtype).replace("torch.", ""), self.floor))


@dataclass
class Case:
    """One conformance / test input: keyword arguments for the op, plus a readable name and tags."""

    name: str
    kwargs: dict[str, Any]
    tags: tuple[str, ...] = ()


CaseGenerator = Callable[[str, torch.dtype, torch.device, torch.Generator], Iterable[Case]]


class FrozenSpecError(HALError, AttributeError):
    """An attribute of a declared op spec was assigned or deleted after the catalogue loaded."""


class OpSpec:
    """A HAL op: name, signature, reference implementation, input check, cases, tolerance.

    Once the built-in catalogue has loaded (:func:`catalogue`), every spec is frozen: assigning or
    deleting any attribute raises :class:`FrozenSpecError` naming the op and the attribute, and
    ``params_since`` becomes a read-only mapping (``Tolerance`` is a frozen dataclass whose
    ``floors`` are read-only too). The reference, the tolerances, the input check and the cases a
    backend is judged by cannot be changed by code that runs later, a plugin included.
    """

    _frozen = False

    def __init__(self, fn: Callable, family: str, tolerance: Tolerance, since: tuple[int, int],
                 writes: tuple[str, ...] = (), capturable: bool = True,
                 params_since: dict[str, tuple[int, int]] | None = None, converts_per_use: tuple[str, ...] = ()):
        self.name: str = fn.__name__
        self.family = family
        self.reference = fn
        self.signature = inspect.signature(fn)
        self.doc = inspect.getdoc(fn) or ""
        self.tolerance = tolerance
        self.since = _version(since, f"op {self.name!r}: since")
        #: The HAL version each parameter dates from (every parameter; those not named in the
        #: decorator's ``params_since`` date from the op's ``since``).
        self.params_since: dict[str, tuple[int, int]] = _check_params_since(self, params_since or {})
        #: Arguments the op writes in place (pool ops); the op returns None. Conformance compares
        #: what each backend leaves in them, and that no other argument changed.
        self.writes = tuple(writes)
        for w in self.writes:
            if w not in self.signature.parameters:
                raise ValueError(f"op {self.name!r}: writes names unknown parameter {w!r}")
        #: Whether the reference implementation can be recorded in a device graph (no host sync, no
        #: data-dependent shape). Backends declare their own implementations (Backend.add).
        self.capturable = capturable
        #: Arguments the reference converts itself, part by part where it uses them, to the dtype
        #: it computes in (that of its activations): the fp64 evaluation passes them as given
        #: instead of converting them whole first (the same values; the expert stacks, of which a
        #: call uses a few experts).
        self.converts_per_use = tuple(converts_per_use)
        for w in self.converts_per_use:
            if w not in self.signature.parameters:
                raise ValueError(f"op {self.name!r}: converts_per_use names unknown parameter {w!r}")
        #: Why the op is deprecated (what the model calls instead), or None for a current op.
        self.deprecated: str | None = None
        self._check: Callable | None = None
        self._cases: CaseGenerator | None = None

    def __setattr__(self, name: str, value) -> None:
        if self._frozen:
            raise FrozenSpecError(f"op {self.name!r}: cannot set {name!r}: the op specs are frozen once the "
                                  f"catalogue has loaded (the reference, tolerances, checks and cases a backend is "
                                  f"judged by are not changeable at run time)")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._frozen:
            raise FrozenSpecError(f"op {self.name!r}: cannot delete {name!r}: the op specs are frozen once the "
                                  f"catalogue has loaded")
        object.__delattr__(self, name)

    def _freeze(self) -> None:
        """Make the spec immutable (called by :func:`catalogue` once every op module has loaded)."""
        if not self._frozen:
            self.params_since = MappingProxyType(dict(self.params_since))
            object.__setattr__(self, "_frozen", True)

    # -- versioned contract ------------------------------------------------------------------
    def signature_for(self, api_version: tuple[int, int]) -> inspect.Signature:
        """The signature a backend declaring ``api_version`` implements: the parameters whose
        ``since`` is at most that version, in order (same major version only)."""
        v = _version(api_version, f"op {self.name!r}: signature_for")
        if v[0] != self.since[0]:
            raise ValueError(f"op {self.name!r}: HAL {version_str(v)} is another major version than the op's "
                             f"{version_str(self.since)}")
        if v < self.since:
            raise ValueError(f"op {self.name!r} does not exist in HAL {version_str(v)} "
                             f"(new in {version_str(self.since)})")
        return self.signature.replace(parameters=[p for n, p in self.signature.parameters.items()
                                                  if self.params_since[n] <= v])

    def versions(self) -> list[tuple[int, int]]:
        """Every HAL version of this major from the op's ``since`` to the current one."""
        return [(self.since[0], m) for m in range(self.since[1], HAL_API_VERSION[1] + 1)] \
            if self.since[0] == HAL_API_VERSION[0] else [self.since]

    # -- declaration helpers (used as decorators in the op modules) --------------------------
    def check(self, fn: Callable) -> Callable:
        """Register the input check; it takes the op's exact parameters and raises OpInputError."""
        _require_same_signature(self, fn, "check")
        self._check = fn   # FrozenSpecError once the catalogue has loaded
        return fn

    def cases(self, fn: CaseGenerator) -> CaseGenerator:
        """Register the sample-case generator ``fn(shapes, dtype, device, generator)``."""
        self._cases = fn
        return fn

    # -- use ---------------------------------------------------------------------------------
    def validate(self, *args, **kwargs) -> None:
        """Run the input check (binding arguments to the signature first)."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise OpInputError(self.name, "<call>", f"signature {self.name}{self.signature}", str(e)) from None
        if self._check is not None:
            self._check(*bound.args, **bound.kwargs)

    def sample_cases(self, shapes: str, dtype: torch.dtype, device: torch.device | str = "cpu",
                     seed: int = 0) -> Iterator[Case]:
        if self._cases is None:
            return iter(())
        gen = torch.Generator(device="cpu").manual_seed(seed)
        return iter(self._cases(shapes, dtype, torch.device(device), gen))

    def __call__(self, *args, **kwargs):
        """Public validating entry point: check the inputs, then run the reference math."""
        self.validate(*args, **kwargs)
        return self.reference(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<op {self.name}{self.signature}>"


_CATALOGUE: dict[str, OpSpec] = {}


def op(*, family: str, tolerance: Tolerance, since: tuple[int, int] = (1, 0), writes: tuple[str, ...] = (),
       capturable: bool = True, params_since: dict[str, tuple[int, int]] | None = None,
       deprecated: str | None = None, converts_per_use: tuple[str, ...] = ()) -> Callable[[Callable], OpSpec]:
    """Declare a HAL op. The decorated function is its reference implementation.

    ``since``: the HAL version that added the op. ``params_since``: the HAL version that added a
    parameter, for parameters added later than the op (``{"w13_scale": (1, 2)}``); every such
    parameter must have a default that means "the behaviour before it existed", must come after
    the older positional parameters (or be keyword-only), and cannot be newer than
    ``HAL_API_VERSION``. Backends built for an older version implement the op without it
    (:meth:`OpSpec.signature_for`). ``writes``: parameters written in place (the op returns
    None). ``capturable``: whether the reference implementation can be recorded in a device graph
    (see ``Backend.add``). ``deprecated``: why the op is deprecated (what replaces it); it stays
    in the catalogue and in conformance. ``converts_per_use``: arguments the reference converts
    itself where it uses them (the fp64 evaluation passes them as given)."""

    def wrap(fn: Callable) -> OpSpec:
        spec = OpSpec(fn, family, tolerance, since, writes, capturable, params_since, converts_per_use)
        spec.deprecated = deprecated
        if spec.name in _CATALOGUE:
            raise ValueError(f"op {spec.name!r} declared twice")
        _CATALOGUE[spec.name] = spec
        return spec

    return wrap


def catalogue() -> dict[str, OpSpec]:
    """All declared ops by name, in declaration order: a new dict on every call (changing it changes
    nothing), of specs frozen once the op modules have loaded (see :class:`OpSpec`).

    The op modules (``dsv4core.hal.ops``) fill it as they import; the package ``dsv4core.hal``
    imports them before anything else, and importing this module imports that package first, so
    the catalogue is complete whenever this can be called (and this module imports no op module:
    the op modules import it)."""
    for spec in _CATALOGUE.values():
        spec._freeze()
    return dict(_CATALOGUE)


def _version(v, what: str) -> tuple[int, int]:
    if (not isinstance(v, tuple) or len(v) != 2
            or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in v)):
        raise ValueError(f"{what}: expected a (major, minor) pair of ints, got {v!r}")
    return v


def _check_params_since(spec: OpSpec, given: dict) -> dict[str, tuple[int, int]]:
    """Validate the decorator's ``params_since`` and return the version of every parameter."""
    params = spec.signature.parameters
    where = f"op {spec.name!r}: params_since"
    out = {n: spec.since for n in params}
    for name, v in dict(given).items():
        if name not in params:
            raise ValueError(f"{where} names unknown parameter {name!r} (parameters: {', '.join(params)})")
        v = _version(v, f"{where}[{name!r}]")
        if v[0] != spec.since[0] or v <= spec.since:
            raise ValueError(f"{where}[{name!r}] = {version_str(v)} must be later than the op's since "
                             f"{version_str(spec.since)}, in the same major version")
        if v > HAL_API_VERSION:
            raise ValueError(f"{where}[{name!r}] = {version_str(v)} is newer than HAL_API_VERSION "
                             f"{version_str(HAL_API_VERSION)}")
        if params[name].default is inspect.Parameter.empty:
            raise ValueError(f"{where}[{name!r}]: a parameter added after the op needs a default meaning "
                             f"\"the behaviour before it existed\"")
        out[name] = v
    # positional parameters must be ordered by version, so that an older backend's positional
    # parameters are a prefix of the current ones (keyword-only parameters may come from any version)
    last = None
    for name, p in params.items():
        if p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD):
            continue
        if last is not None and out[name] < out[last]:
            raise ValueError(f"{where}: positional parameter {name!r} (HAL {version_str(out[name])}) comes after "
                             f"{last!r} (HAL {version_str(out[last])}); a newer parameter goes after the older "
                             f"ones or is keyword-only")
        last = name
    return out


def _require_same_signature(spec: OpSpec, fn: Callable, what: str) -> None:
    got = [p.name for p in inspect.signature(fn).parameters.values()]
    want = [p.name for p in spec.signature.parameters.values()]
    if got != want:
        raise TypeError(f"{spec.name}: {what} function parameters {got} differ from the op's {want}")


# ---------------------------------------------------------------------------------------------
# Input checking helpers
# ---------------------------------------------------------------------------------------------

def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


@dataclass
class Dims:
    """Collects named dimensions across an op's arguments and reports the first inconsistency.

    ``Dims("hc_pre").tensor("x", x, ("T", "n", "H"))`` binds T, n, H from ``x``; a later tensor
    whose shape names ``"n"`` must agree, else OpInputError names the op, argument and dimension.
    Integers in a shape pattern are literal sizes; ``None`` matches anything.
    """

    op: str
    sizes: dict[str, int] = field(default_factory=dict)

    def tensor(self, arg: str, t: Any, shape: tuple | None = None, dtypes: Iterable[torch.dtype] | None = None,
               *, min_rank: int | None = None, optional: bool = False) -> "Dims":
        if t is None:
            if optional:
                return self
            raise OpInputError(self.op, arg, "a tensor", "None")
        if not isinstance(t, torch.Tensor):
            raise OpInputError(self.op, arg, "a torch.Tensor", type(t).__name__)
        if dtypes is not None:
            dtypes = tuple(dtypes)
            if t.dtype not in dtypes:
                raise OpInputError(self.op, arg, f"dtype {_dtype_names(dtypes)}", str(t.dtype).replace("torch.", ""))
        if min_rank is not None and t.dim() < min_rank:
            raise OpInputError(self.op, arg, f"rank >= {min_rank}", f"rank {t.dim()} (shape {tuple(t.shape)})")
        if shape is not None:
            if t.dim() != len(shape):
                raise OpInputError(self.op, arg, f"rank {len(shape)} {self._pattern(shape)}",
                                   f"rank {t.dim()} (shape {tuple(t.shape)})")
            for i, (want, got) in enumerate(zip(shape, t.shape)):
                self._match(arg, i, want, int(got), shape, tuple(t.shape))
        return self

    def _match(self, arg, i, want, got, shape, actual):
        if want is None:
            return
        if isinstance(want, int):
            if want != got:
                raise OpInputError(self.op, arg, f"dim {i} = {want} in shape {self._pattern(shape)}", f"shape {actual}")
            return
        if want in self.sizes and self.sizes[want] != got:
            raise OpInputError(self.op, arg, f"dim {i} ({want}) = {self.sizes[want]} to match the other arguments",
                               f"shape {actual}")
        self.sizes[want] = got

    def _pattern(self, shape) -> str:
        return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def expect(op_name: str, arg: str, ok: bool, expected: str, actual: Any) -> None:
    """Raise OpInputError unless ``ok``."""
    if not ok:
        raise OpInputError(op_name, arg, expected, str(actual))

