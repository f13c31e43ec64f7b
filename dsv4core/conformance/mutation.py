"""Do the conformance cases exercise every argument? A mutation check of the suite itself.

For each parameter of an op (enumerated from the op's signature, so a parameter added to a spec is
covered without touching this module), a few *mutants* are built: implementations that run the
reference math with that one argument ignored or mishandled the way real kernels get it wrong.

* any parameter: **fixed** - the argument is replaced by each value the op's cases give it (or
  its default): a kernel that hard-codes the "usual" value (``scale = d ** -0.5``, ``eps = 1e-6``,
  ``iters = 20``, ``weight_scale = None``, ``act_block = None``), or the other one (``act_block =
  128`` always: quantising where the call asks for none; ``row_format = "fp8"`` for FP4 keys too).
  Killed only if some case passes another value that changes the result.
* an optional tensor (default ``None``): **dropped** - the kernel ignores it.
* a tensor: **axis i collapsed**, for every axis of size > 1 - the kernel reads index 0 along
  axis ``i`` for all of it (one scale for every block of a row, one sink for every head, the first
  query's positions for all queries); a tensor with one element: **fixed** to the first case's.
* an optional switch (a non-tensor parameter defaulting to ``None`` that selects a quantised path:
  ``act_block``, ``nope_quant_block``, ``row_format``, ``kv_format``, ``k_format``): for each value
  the cases give it, every mutant of the op's other parameters again, **judged on the cases with
  that value only** - a quantised path is its own kernel in practice (an FP8-row attention that
  reads the first row's scales for every row, a W8A8 GEMM that hard-codes ``out_dtype``), and a
  kill by an unquantised case says nothing about it.

A mutant is *killed* when some case of the op fails under it. A mutant that survives names a
parameter (or an axis of one) that no case can tell apart from a broken kernel: a hole in the
suite. ``tests/test_conformance_mutation.py`` requires every mutant of every op to be killed.

The collectives run here as single-process identities; their parameters (``group``, split sizes)
are checked by the multi-process run (:mod:`dsv4core.conformance.distributed`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dsv4core.hal.backend import Impl
from dsv4core.hal.spec import Case, OpSpec

from .cases import iter_cases, run_case
from .results import FAILED


@dataclass
class Mutant:
    """One planted mishandling of one parameter."""

    op: str
    param: str
    how: str                                # "fixed to 1e-06", "dropped", "axis 1 collapsed"
    transform: Callable[[Any], Any]         # argument value -> the value the mutant computes with
    only: tuple[str, Any] | None = None     # (switch, value): judged on the cases passing that value

    @property
    def name(self) -> str:
        where = "" if self.only is None else f"; on the cases with {self.only[0]}={_short(self.only[1])}"
        return f"{self.op}({self.param}: {self.how}{where})"

    def judged_on(self, spec: OpSpec, cases: list[Case]) -> list[Case]:
        """The cases that can kill this mutant."""
        if self.only is None:
            return cases
        name, value = self.only
        return [c for c in cases if _value(spec, c, name) == value]

    def impl(self, spec: OpSpec) -> Impl:
        sig, param, transform = spec.signature, self.param, self.transform

        def fn(*args, **kwargs):
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            bound.arguments[param] = transform(bound.arguments[param])
            return spec.reference(*bound.args, **bound.kwargs)

        return Impl(spec.name, fn, backend=f"mutant {self.name}")


@dataclass
class MutantResult:
    mutant: Mutant
    killed_by: str = ""         # the first failing case id ('' = survived)
    message: str = ""           # its failure message

    @property
    def killed(self) -> bool:
        return bool(self.killed_by)


def _collapse(axis: int) -> Callable[[Any], Any]:
    def transform(v):
        if not isinstance(v, torch.Tensor) or v.dim() <= axis or v.shape[axis] <= 1:
            return v
        return v.narrow(axis, 0, 1).expand_as(v).clone()
    return transform


def _short(v: Any) -> str:
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def _default(spec: OpSpec, name: str) -> Any:
    p = spec.signature.parameters[name]
    return None if p.default is inspect.Parameter.empty else p.default


def _value(spec: OpSpec, case: Case, name: str) -> Any:
    return case.kwargs.get(name, _default(spec, name))


def _distinct(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if not any(v is u or (type(v) is type(u) and v == u) for u in out):
            out.append(v)
    return out


def switches(spec: OpSpec, cases: list[Case]) -> list[tuple[str, Any]]:
    """(parameter, value) for each optional switch of ``spec`` (a parameter whose default is None
    and whose values are format names or block sizes: str / int; ``out_dtype``, a cast, is not one)
    and each non-None value the cases give it."""
    out = []
    for name, p in spec.signature.parameters.items():
        values = [v for v in (_value(spec, c, name) for c in cases) if v is not None]
        if p.default is None and values and all(isinstance(v, (str, int)) and not isinstance(v, bool) for v in values):
            out += [(name, v) for v in _distinct(values)]
    return out


def _param_mutants(spec: OpSpec, cases: list[Case], skip: tuple[str, ...] = ()) -> list[Mutant]:
    out: list[Mutant] = []
    for name, p in spec.signature.parameters.items():
        if name in skip:
            continue
        values = [_value(spec, c, name) for c in cases]
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        if tensors:
            if p.default is None:
                out.append(Mutant(spec.name, name, "dropped (treated as None)", lambda v: None))
            axes = [a for a in range(max(t.dim() for t in tensors))
                    if any(t.dim() > a and t.shape[a] > 1 for t in tensors)]
            for axis in axes:
                out.append(Mutant(spec.name, name, f"axis {axis} collapsed to its first entry", _collapse(axis)))
            if not axes:    # single-element tensors (hc_head's scale [1]): a hard-coded value
                usual = tensors[0]
                out.append(Mutant(spec.name, name, f"fixed to {usual.flatten().tolist()}",
                                  lambda v, u=usual: v if v is None else u.to(v.dtype).expand_as(v).clone()))
        else:
            for usual in _distinct(values) if values else [_default(spec, name)]:
                out.append(Mutant(spec.name, name, f"fixed to {_short(usual)}", lambda v, u=usual: u))
    return out


def mutants(spec: OpSpec, cases: list[Case]) -> list[Mutant]:
    """The mutants of every parameter of ``spec`` (given the cases, to pick the values to fix and
    the tensor ranks), then those of the other parameters per switch value (judged on its cases)."""
    out = _param_mutants(spec, cases)
    for name, value in switches(spec, cases):
        sub = [c for c in cases if _value(spec, c, name) == value]
        for m in _param_mutants(spec, sub, skip=(name,)):
            m.only = (name, value)
            out.append(m)
    return out


def check_op(spec: OpSpec, shapes: str = "small", dtype: torch.dtype = torch.float32, seed: int = 0,
             device: str = "cpu") -> list[MutantResult]:
    """Run every mutant of ``spec`` over the op's cases (stopping at the first failing case)."""
    cases = list(iter_cases(spec, shapes, dtype, device, seed))
    results = []
    for m in mutants(spec, cases):
        impl = m.impl(spec)
        res = MutantResult(m)
        for case in m.judged_on(spec, cases):
            r = run_case(spec, impl, case, dtype, shapes)
            if r.status == FAILED:
                res.killed_by, res.message = r.id, r.message
                break
        results.append(res)
    return results
