"""The model's handle on the bound op table, and the call sites it is called from.

A call site is where in the model an op is called: the module path of the module making the call
(``layers.3.self_attn.q_a_proj``, ``layers.3.self_attn``, ``norm``; ``lm_head`` / ``embed`` /
``ring_store`` for the calls the causal-LM wrapper makes itself) and the op; the verify summary
names it ``layers.3.self_attn.q_a_proj:linear``. :func:`name_sites` gives every module of a built
model its own :class:`OpsRef` for its site, once; each holds the table of its site
(``OpTable.at``: under the verify mode, callables sampled and counted per site; otherwise the
table itself), so a call costs the same attribute lookups as before and inspects no stack.

With graphs on and the verify mode on, steps are sampled whole (`dsv4core.hal.verify`): the graphs
record the plain ops (:class:`UnverifiedCapture`), and a sampled step runs eagerly with every site
calling the table that checks every call (:func:`sampled_step`, :meth:`OpsRef.using`).
"""

from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from dsv4core.hal.binding import OpTable


class OpsRef:
    """Shared, rebindable holder of the bound op table (`dsv4core.hal.OpTable`) and of the
    numerics the model calls it with (`"exact"` or `"official"`: `dsv4core.model.numerics`).

    The model's root ref is shared; :meth:`site` makes the ref of one call site, which follows
    the root: assigning the root's ``t`` or ``numerics`` updates every site's."""

    __slots__ = ("t", "numerics", "site_name", "_sites")
    t: OpTable     # ``self._ops.t.rms_norm(...)``: the op's typed attribute (dsv4core.hal.typed_ops)
    numerics: str

    def __init__(self, table: OpTable | None = None, numerics: str = "exact", site_name: str = "") -> None:
        object.__setattr__(self, "site_name", site_name)
        object.__setattr__(self, "_sites", {})
        self.t = table
        self.numerics = numerics

    def __setattr__(self, name: str, value) -> None:
        object.__setattr__(self, name, value)
        for s in getattr(self, "_sites", {}).values():   # a site ref follows its root (rebinding, numerics)
            s._follow(name, value)

    def _follow(self, name: str, value) -> None:
        if name == "t" and isinstance(value, OpTable):     # any other table object is used as it is
            value = value.at(self.site_name)
        object.__setattr__(self, name, value)

    def site(self, name: str) -> "OpsRef":
        """The ref of call site ``name`` (made once; it follows this ref)."""
        if name not in self._sites:
            ref = OpsRef.__new__(OpsRef)
            object.__setattr__(ref, "site_name", name)
            object.__setattr__(ref, "_sites", {})
            ref._follow("t", self.t)
            ref._follow("numerics", self.numerics)
            self._sites[name] = ref
        return self._sites[name]

    @property
    def official(self) -> bool:
        return self.numerics == "official"

    @contextmanager
    def using(self, table: OpTable | None):
        """Every site calls ``table`` (None: the bound one, unchanged) for the block's duration."""
        if table is None:
            yield
            return
        bound = self.t
        self.t = table
        try:
            yield
        finally:
            self.t = bound


class UnverifiedCapture:
    """The graph capture of a model whose table has the verify mode on (whole-step sampling:
    :meth:`~dsv4core.hal.binding.OpTable.whole_steps`): what it records runs on the table's plain
    callables (``plain``: ``OpTable.unverified()``), so a replay checks nothing and costs what an
    unverified one does."""

    def __init__(self, capture, ops: OpsRef, plain: OpTable) -> None:
        self.inner, self.ops, self.plain = capture, ops, plain

    def new_pool(self, device):
        return self.inner.new_pool(device)

    def capture(self, fn, device, pool=None):
        def plain():
            with self.ops.using(self.plain):
                return fn()
        return self.inner.capture(plain, device, pool)


def name_sites(root: nn.Module, ops: OpsRef) -> None:
    """Give every module under ``root`` that holds ``ops`` the ref of its own call site: its
    module path (``layers.3.attn.wq_a``)."""
    for path, m in root.named_modules():
        if getattr(m, "_ops", None) is ops:
            m._ops = ops.site(path or "root")


#: why a sampled step ran eagerly (`graph_status(last_step=True)`)
SAMPLED = "verify: the step was sampled (run eagerly, every op call checked against the reference)"


def sampled_step(table):
    """Whole-step verify (graphs on, the verify mode on: `OpTable.whole_steps`): the table that
    checks every call when this step is drawn (it then runs eagerly), else None (the step replays
    unverified, or runs eagerly on the bound table, sampled per call, when no graph serves it)."""
    steps = table.whole_steps()
    return steps.checked if steps is not None and steps.draw() else None
