"""Running single conformance cases: loading a backend, normalising the run's arguments, the
reproducible case seeds and generation, and one case's check against the fp64 evaluation (the
rules are in :mod:`.runner`'s docstring)."""

from __future__ import annotations

import time
import traceback
import zlib
from typing import Iterator, Sequence

import torch

from dsv4core.hal import Backend, catalogue, discover
from dsv4core.hal.backend import Impl
from dsv4core.hal.spec import Case, OpSpec
from dsv4core.hal import compare
from dsv4core.hal.compare import Mismatch, dtype_name

from .results import DECLINED, PASSED, CaseResult, ConformanceError

SHAPE_SETS = ("small", "flash", "pro")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# Argument parsing helpers (shared by the CLI and the pytest plugin)
# ---------------------------------------------------------------------------------------------

def load_backend(name: str, device: str = "cpu") -> Backend:
    """The discovered backend ``name``; ConformanceError if unknown, broken, unavailable or not
    serving ``device``'s type."""
    statuses = discover()
    st = statuses.get(name)
    if st is None:
        raise ConformanceError(f"unknown backend {name!r}; installed: {', '.join(sorted(statuses))}")
    if st.backend is None or not st.available:
        cause = f" ({type(st.error).__name__}: {st.error})" if st.error is not None and str(st.error) not in st.reason else ""
        raise ConformanceError(f"backend {name!r} cannot be loaded: {st.reason or 'unavailable'}{cause}")
    dev_type = torch.device(device).type
    if not st.backend.serves(dev_type):
        raise ConformanceError(f"backend {name!r} does not serve device type {dev_type!r} "
                               f"(it serves {', '.join(st.backend.device_types)})")
    return st.backend


def parse_ops(text: str | Sequence[str] | None) -> list[str]:
    specs = catalogue()
    if text is None:
        return list(specs)
    names = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    families = {}
    for s in specs.values():
        families.setdefault(s.family, []).append(s.name)
    out: list[str] = []
    for n in names:
        if n in specs:
            out.append(n)
        elif n in families:
            out.extend(families[n])
        else:
            raise ConformanceError(f"unknown op {n!r}; ops: {', '.join(specs)}; families: {', '.join(families)}")
    if not out:
        raise ConformanceError("--ops selected no op")
    return list(dict.fromkeys(out))


def parse_shapes(text: str | Sequence[str]) -> tuple[str, ...]:
    items = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    out: list[str] = []
    for s in items:
        if s == "all":
            out.extend(SHAPE_SETS)
        elif s in SHAPE_SETS:
            out.append(s)
        else:
            raise ConformanceError(f"unknown shape set {s!r}; expected small, flash, pro or all")
    return tuple(dict.fromkeys(out))


def parse_dtypes(text: str | Sequence[str]) -> tuple[torch.dtype, ...]:
    items = [p.strip() for p in (text.split(",") if isinstance(text, str) else text) if p.strip()]
    out = []
    for s in items:
        key = s.replace("torch.", "")
        key = {"fp32": "float32", "f32": "float32", "bf16": "bfloat16"}.get(key, key)
        if key not in DTYPES:
            raise ConformanceError(f"unsupported dtype {s!r}; expected {' or '.join(DTYPES)}")
        out.append(DTYPES[key])
    if not out:
        raise ConformanceError("no dtype given")
    return tuple(dict.fromkeys(out))


def parse_world_sizes(text: str) -> tuple[int, ...]:
    """``"2,4"`` -> (2, 4); ``"none"`` / ``"0"`` -> () (collectives in one process only)."""
    if text.strip().lower() in ("none", "0", ""):
        return ()
    try:
        sizes = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise ConformanceError(f"--world-sizes: expected comma-separated ints >= 2 or 'none', got {text!r}") from None
    if any(n < 2 for n in sizes):
        raise ConformanceError(f"--world-sizes: every size must be >= 2 (got {text!r}); 'none' disables the spawned run")
    return sizes


def mix_seed(seed: int, *parts) -> int:
    """A generator seed derived from the suite's ``seed`` and the ``parts`` naming what it draws
    (joined with "/"): reproducible, and different for different parts."""
    return (seed * 1_000_003 + zlib.crc32("/".join(map(str, parts)).encode())) % (2 ** 63)


def case_seed(seed: int, op: str, shapes: str, dtype: torch.dtype) -> int:
    """The generator seed of one (op, shape set, dtype) case list: reproducible from ``seed``."""
    return mix_seed(seed, op, shapes, dtype_name(dtype))


def iter_cases(spec: OpSpec, shapes: str, dtype: torch.dtype, device: str, seed: int) -> Iterator[Case]:
    """The op's cases for one shape set and dtype. Cases with no tensor of ``dtype`` (ops whose
    inputs are float32 by contract, e.g. moe_route) are only run under float32."""
    for case in spec.sample_cases(shapes, dtype, device, case_seed(seed, spec.name, shapes, dtype)):
        if dtype != torch.float32:
            has = any(isinstance(v, torch.Tensor) and v.dtype == dtype for v in case.kwargs.values())
            if not has:
                continue
        yield case


# ---------------------------------------------------------------------------------------------
# One case
# ---------------------------------------------------------------------------------------------

def _floor(tol, dtype: torch.dtype) -> float:
    return tol.floor_for(dtype)


def _snapshot(kwargs: dict) -> dict:
    return {k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (bitwise comparison: NaN == NaN, works for fp8 / e8m0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _modified(kwargs: dict, snap: dict) -> list[str]:
    bad = []
    for k, before in snap.items():
        now = kwargs[k]
        if now.shape != before.shape or now.dtype != before.dtype or not torch.equal(_bits(now), _bits(before)):
            bad.append(k)
    return bad


def _exc(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" (at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno})" if tb else ""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:500]}{where}"


def run_case(spec: OpSpec, impl: Impl, case: Case, dtype: torch.dtype, shapes: str = "",
             expected: tuple | None = None) -> CaseResult:
    """Run one case of one op implementation and judge it. ``expected``: the (reference, fp64)
    outputs of the case and its moved-code allowance (a tensor or None), computed elsewhere
    (:mod:`.isolate`); None: all computed here."""
    res = CaseResult(spec.name, dtype_name(dtype), shapes, case.name, PASSED, tuple(case.tags))
    kw = case.kwargs
    tol = spec.tolerance
    floor = _floor(tol, dtype)
    t0 = time.perf_counter()
    try:
        # 1. the case must be valid input (else the suite itself is wrong)
        try:
            spec.validate(**kw)
        except Exception as e:  # pragma: no cover - a suite bug
            return res.fail("harness", f"invalid conformance case (suite bug, please report): {_exc(e)}")
        # 2. supports predicate
        if impl.supports is not None:
            try:
                ok = impl.supports(**kw)
            except Exception as e:
                return res.fail("supports", f"supports() raised {_exc(e)}")
            if not isinstance(ok, bool):
                return res.fail("supports", f"supports() must return a plain bool, returned {type(ok).__name__}")
            if not ok:
                reason = ""
                if impl.why_not is not None:
                    try:
                        reason = impl.why_not(**kw)
                    except Exception as e:
                        reason = f"why_not() raised {_exc(e)}"
                    if not isinstance(reason, str):
                        return res.fail("supports", f"why_not() must return a str (the reason), returned "
                                                    f"{type(reason).__name__} {reason!r}")
                res.status, res.message = DECLINED, reason or "supports() returned False"
                return res
        # 3. the reference in the case dtype and the fp64 evaluation (an op that writes in place:
        #    each runs on copies of the written arguments, and what those hold after is the output)
        if expected is None:
            (ref, exact), allow = compare.expected_outputs(spec, kw), compare.COMPUTE
        else:
            ref, exact, allow = expected
        # 4. the backend (on its own copies of the written arguments; nothing else may change)
        call_kw = compare.with_copies(spec, kw)
        snap = _snapshot({k: v for k, v in call_kw.items() if k not in spec.writes})
        try:
            raw = impl.fn(**call_kw)
            if torch.device(compare.device_of(kw)).type == "cuda":
                torch.cuda.synchronize()          # asynchronous kernel errors belong to this case
        except Exception as e:
            return res.fail("raised", f"the op raised {_exc(e)}")
        changed = _modified(call_kw, snap)
        if changed:
            return res.fail("modified input", f"modified its input(s) {', '.join(changed)} in place")
        if spec.writes:
            if raw is not None:
                return res.fail("structure", f"returned {type(raw).__name__}; an op that writes "
                                             f"{', '.join(spec.writes)} in place returns None")
            raw = compare.written_values(spec, call_kw)
        # 5. structure and numbers
        res.checks += compare.judge(spec, call_kw, raw, ref, exact, dtype, allowance=allow)
        bad = [c for c in res.checks if not c.ok]
        if bad:
            discrete = all(c.metric.startswith(("index_set", "route", "exact")) for c in bad)
            res.fail("discrete" if discrete else "numeric", "; ".join(compare.describe_check(c, tol.k, floor) for c in bad))
    except Mismatch as e:
        res.fail(e.kind, str(e))
    except Exception as e:  # a failure of the fp64/reference evaluation on a legal case: suite bug
        res.fail("harness", f"conformance harness error (please report): {_exc(e)}")
    finally:
        res.seconds = time.perf_counter() - t0
    return res
