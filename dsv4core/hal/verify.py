"""Runtime verify mode: re-run a fraction of op calls on the reference and compare.

``DSV4CORE_VERIFY=<fraction>`` (or ``bind(..., verify=)`` / ``load_model(..., verify=)``) makes
every op of the bound table check that fraction of its calls: after the call returns, the
reference math is run on its (read-only) inputs (in the call's dtype and in float64 - on the same
device, or on the CPU where the device has no float64) and the output is judged exactly as the
conformance suite judges a case (the op's Tolerance: ``k x`` the reference's own error + floor;
index sets and routes as sets). Sampling is per call site: a call site is where in the model an
op is called, the module making the call and the op (``layers.3.self_attn.q_a_proj:linear``; the
attention module's own calls ``layers.3.self_attn:rope``, ...), named once when the model is built
(:meth:`~dsv4core.hal.binding.OpTable.at`: each module gets its own callables, so the unchecked
path does no lookup and no stack inspection). Calls made on the table directly belong to the
op's own site (the op's name). Each site has its own stream, ``random.Random`` seeded from the
run's seed, the op and the site (:func:`sampler`), and is sampled stratified
(:class:`Sampler`): its calls are cut into consecutive blocks of ``1 / fraction`` calls and
exactly one call of each block, chosen uniformly at random, is checked. So every site - however
rarely it is called next to the others - is checked at the requested rate, and a site called
``n >= 1 / fraction`` times is checked at least ``floor(n * fraction)`` times, whatever the seed:
a bug confined to it is caught with certainty (at 5 %: within 20 calls of that site). The price
of that guarantee: a backend that could tell a checked call from an unchecked one would know
the rest of that block is unchecked; it cannot tell from the frame (below), and the verify mode
is a guard against bugs - conformance is the judge of a backend. Whether a call is checked is drawn
after the backend returns, and nothing is bound or copied before it: the frame a backend can
inspect is the same on checked and unchecked calls. An op that writes in place (``cache_store``)
is judged on the buffer it left: the written rows must hold the bits the reference writes from
the same inputs (a stray write elsewhere in the buffer is not seen: that would take a copy of it
before every call). The seed is ``DSV4CORE_VERIFY_SEED``
(an integer) when set, else drawn afresh from the OS for each bound table; it is reported in
``verify_summary()["seed"]`` so that a run's sampling can be reproduced exactly.

A divergence is counted per op; the first of each op is logged as a warning naming the op, the
argument shapes and the err/bound. With ``DSV4CORE_VERIFY_STRICT=1`` (``verify_strict=True``) the
first divergence raises :class:`VerifyError` instead (``dsv4core generate`` then exits non-zero).
The counts are in ``OpTable.report()`` / ``model.hal_report()`` (``"verify"`` per op) and
``OpTable.verify_summary()``.

Whole-step sampling (devices that replay graphs). A graph replays recorded kernels: no host
code runs per op, so per-call sampling cannot run inside one, and a table with the verify mode on
is not capturable. A model on a device with graph capture therefore samples whole steps instead
(:meth:`~dsv4core.hal.binding.OpTable.whole_steps`): its graphs are recorded with the plain
callables (:meth:`~dsv4core.hal.binding.OpTable.unverified`), each step is drawn at the same
fraction (:class:`WholeSteps`: stratified, one step of every block of ``1 / fraction`` steps, its
own stream of the seed), an unsampled step replays its graph unverified (a step no graph serves
runs eagerly under per-call sampling, as on a device without graphs), and a sampled step runs
eagerly with every call checked, counted per call site as above. So every call site is checked
in the same fraction of the steps, and a bug confined to one site is caught within
``1 / fraction`` steps whatever the seed. What a backend can tell: a sampled step is an eager
one, and the steps after it in its block are not sampled; as above, the verify mode guards
against bugs, conformance judges a backend. A kernel wrong only inside a recording is not seen
(the sampled step runs eagerly). ``verify_summary()["steps"]`` counts the steps drawn and sampled.

Off (the default, or fraction 0) costs nothing: the bound callables are the plain ones.
"""

from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .errors import HALError

log = logging.getLogger("dsv4core.hal")
ENV, ENV_STRICT, ENV_SEED = "DSV4CORE_VERIFY", "DSV4CORE_VERIFY_STRICT", "DSV4CORE_VERIFY_SEED"


class VerifyError(HALError):
    """A verified op call diverged from the reference beyond the op's tolerance (strict mode)."""


def parse_fraction(value: float | str | None, where: str = ENV) -> float:
    """``None`` / ``""`` / ``0`` -> 0.0 (off); a number or ``"N%"`` in [0, 1]; anything else is a
    HALError naming ``where`` and the value."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return 0.0
    text = str(value).strip()
    try:
        f = float(text[:-1]) / 100.0 if text.endswith("%") else float(text)
    except ValueError:
        f = math.nan
    if isinstance(value, bool) or not (0.0 <= f <= 1.0):
        raise HALError(f"{where}: expected a fraction of op calls to verify in [0, 1] (e.g. 0.01 or 1%), "
                       f"got {value!r}")
    return f


def parse_strict(value: bool | str | None) -> bool:
    if value is None:
        value = os.environ.get(ENV_STRICT, "")
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("", "0", "false", "no"):
        return False
    if text in ("1", "true", "yes"):
        return True
    raise HALError(f"{ENV_STRICT}: expected 1 or 0, got {value!r}")


def parse_seed(value: int | str | None = None) -> int:
    """The sampling seed: ``value``, else ``DSV4CORE_VERIFY_SEED``, else a fresh one from the OS.
    A non-negative integer (decimal text is accepted); anything else is a HALError naming it."""
    where = "verify_seed"
    if value is None:
        value, where = os.environ.get(ENV_SEED, ""), ENV_SEED
        if not value.strip():
            return int.from_bytes(os.urandom(8), "little")
    try:
        seed = value if isinstance(value, int) and not isinstance(value, bool) else int(str(value).strip(), 10)
    except ValueError:
        seed = -1
    if isinstance(value, bool) or seed < 0:
        raise HALError(f"{where}: expected a non-negative integer seed for the verify sampling, got {value!r}")
    return seed


def sampler(seed: int, op: str, site: str | None = None) -> random.Random:
    """The random stream of one call site (``site`` None: the op's own, for calls made on the
    table directly); :class:`Sampler` draws one ``randrange`` per block of calls from it."""
    return random.Random(f"dsv4core-verify:{seed}:{op}" + ("" if site is None else f"@{site}"))


class Sampler:
    """Which calls of one site are checked: call ``n`` (from 0) lies in block ``b`` when
    ``ceil(b / f) <= n < ceil((b + 1) / f)`` (blocks of ``floor(1/f)`` or ``ceil(1/f)`` calls), and
    each block's checked call is drawn uniformly from it when the block starts. Called once per
    op call (after the call returned), it says whether that call is checked; the verify wrapper
    does the same inline with :meth:`advance`, ``end`` and ``pick``."""

    __slots__ = ("_rng", "_f", "_n", "_block", "end", "pick")

    def __init__(self, rng: random.Random, fraction: float) -> None:
        self._rng, self._f = rng, fraction
        self._n = self._block = self.end = 0
        #: the current block ends before call ``end``; its checked call is ``pick``
        self.pick = -1

    def advance(self) -> None:
        """Start the next block: [old end, new end), and draw its checked call."""
        start = self.end
        self._block += 1
        self.end = max(math.ceil(self._block / self._f - 1e-9), start + 1)
        self.pick = start + self._rng.randrange(self.end - start)

    def __call__(self) -> bool:
        n = self._n
        self._n = n + 1
        if n >= self.end:
            self.advance()
        return n == self.pick


class WholeSteps:
    """Whole-step sampling of a verified table, for a model that replays device graphs (see the
    module docstring): ``plain`` is the table without the verify mode (what the graphs record),
    ``checked`` the table whose callables check every call (what a sampled
    step runs eagerly; its counts are the verified table's own, per call site). :meth:`draw` says
    whether the next step is sampled: stratified like a call site's calls (:class:`Sampler`), on
    the stream :func:`sampler` of the run's seed and ``"whole-step"``."""

    __slots__ = ("plain", "checked", "sampled", "total", "_draw")

    def __init__(self, plain, checked, fraction: float, seed: int) -> None:
        self.plain, self.checked = plain, checked
        self.sampled = self.total = 0
        self._draw = Sampler(sampler(seed, "whole-step"), fraction)

    def draw(self) -> bool:
        self.total += 1
        hit = self._draw()
        self.sampled += hit
        return hit

    def as_dict(self) -> dict[str, int]:
        return {"sampled": self.sampled, "total": self.total}


class SiteStats:
    """One call site's counts (``verify_summary()["sites"][site]``)."""

    __slots__ = ("op", "calls", "checked", "divergences")

    def __init__(self, op: str) -> None:
        self.op, self.calls, self.checked, self.divergences = op, 0, 0, 0

    def as_dict(self) -> dict[str, Any]:
        return {"op": self.op, "calls": self.calls, "checked": self.checked, "divergences": self.divergences}


@dataclass
class VerifyStats:
    """Per-op verify counts (in the op's binding)."""

    fraction: float
    seed: int = 0                   # the run's sampling seed (see :func:`sampler`)
    calls: int = 0
    checked: int = 0
    divergences: int = 0
    worst_ratio: float = 0.0
    first: str = ""                 # the first divergence, as logged
    #: per call site (the op's own name for calls made on the table directly): SiteStats
    sites: dict = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "seed": self.seed, "calls": self.calls, "checked": self.checked,
                "divergences": self.divergences,
                "worst_ratio": self.worst_ratio if math.isfinite(self.worst_ratio) else None,
                "first_divergence": self.first or None}


def _shapes(kw: dict) -> str:
    return ", ".join(f"{k}{list(v.shape)}:{str(v.dtype).replace('torch.', '')}" if isinstance(v, torch.Tensor)
                     else f"{k}={v!r}" for k, v in kw.items())


def _copy(v):
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def _call_dtype(kw: dict) -> torch.dtype:
    for v in kw.values():
        if isinstance(v, torch.Tensor) and v.dtype in (torch.float32, torch.bfloat16, torch.float64):
            return v.dtype
    return torch.float32


def wrap(spec, call: Callable, stats: VerifyStats, strict: bool, backend: str,
         fraction: float | None = None) -> Callable:
    """``call`` with the verify mode: every call counted, the calls of each site sampled at
    ``fraction`` (default ``stats.fraction``; :class:`Sampler` over :func:`sampler` of
    ``stats.seed``, the op and the site). The returned callable serves the op's own site;
    ``.at(site)`` makes (once per site) the callable of a named call site. Two wrappers over the
    same ``stats`` (the table's callables and those of its sampled whole steps, :class:`WholeSteps`)
    count into the same per-site counts."""
    from . import compare

    sig = spec.signature
    fraction = stats.fraction if fraction is None else fraction

    def check(args, kwargs, out, site):
        """The shadow check of one call, after it returned, from its arguments and output."""
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        kw = dict(bound.arguments)
        stats.checked += 1
        site.checked += 1
        problem, ratio = "", 0.0
        try:
            # inputs are read-only by contract, so the reference runs on them as they are now; an
            # op that writes in place is judged on what it left: the reference rewrites a copy of
            # the written buffer from the same inputs, and every row must hold the same bits
            ref, exact = compare.expected_outputs(spec, kw)
            if spec.writes:
                out = compare.written_values(spec, kw)
            checks = compare.judge(spec, kw, out, ref, exact, _call_dtype(kw))
            bad = [c for c in checks if not c.ok]
            ratio = max((c.ratio for c in checks), default=0.0)
            if bad:
                tol = spec.tolerance
                problem = "; ".join(compare.describe_check(c, tol.k, tol.floor_for(_call_dtype(kw))) for c in bad)
        except compare.Mismatch as e:
            problem, ratio = str(e), math.inf
        stats.worst_ratio = max(stats.worst_ratio, ratio)
        if problem:
            stats.divergences += 1
            site.divergences += 1
            where = "" if site is own else f" at {site_name[id(site)]}"
            msg = (f"verify: {spec.name} (backend {backend!r}) diverged from the reference{where} on call "
                   f"{site.calls} ({_shapes(kw)}): {problem}")
            if strict:
                raise VerifyError(msg + f" — {ENV_STRICT}=1")
            if not stats.first:
                stats.first = msg
                log.warning(msg)

    made: dict[str | None, Callable] = {}
    site_name: dict[int, str] = {}

    def make(name: str | None) -> Callable:
        if name in made:
            return made[name]
        key = spec.name if name is None else f"{name}:{spec.name}"
        site = stats.sites.get(key)
        if site is None:
            site = stats.sites[key] = SiteStats(spec.name)
        site_name[id(site)] = key
        draw = Sampler(sampler(stats.seed, spec.name, name), fraction)
        writes = bool(spec.writes)

        def verified(*args, **kwargs):
            # The backend is called before anything about this call is decided or copied: the frame it
            # runs under (this one: args, kwargs and the closure) is the same on checked and unchecked
            # calls, so it cannot tell whether it is being judged. (The Sampler's draw, inlined:
            # call i of the site is checked when it is its block's pick.)
            stats.calls += 1
            out = call(*args, **kwargs)
            i = site.calls
            site.calls = i + 1
            if i >= draw.end:
                draw.advance()
            if i == draw.pick:
                check(args, kwargs, out, site)
            return None if writes else out

        verified.__name__ = spec.name
        verified.__wrapped__ = call
        verified.at = make
        verified.site = site_name[id(site)]
        made[name] = verified
        return verified

    own_callable = make(None)
    own = stats.sites[spec.name]             # noqa: F841 (read by check)
    return own_callable
