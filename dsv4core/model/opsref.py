"""The model's handle on the bound op table, and the call sites it is called from.

A call site is where in the model an op is called: the module path of the module making the call
(``layers.3.self_attn.q_a_proj``, ``layers.3.self_attn``, ``norm``; ``lm_head`` / ``embed`` /
``ring_store`` for the calls the causal-LM wrapper makes itself) and the op; the verify summary
names it ``layers.3.self_attn.q_a_proj:linear``. :func:`name_sites` gives every module of a built
model its own :class:`OpsRef` for its site, once; each holds the table of its site
(``OpTable.at``: under the verify mode, callables sampled and counted per site; otherwise the
table itself), so a call costs the same attribute lookups as before and inspects no stack.
"""

from __future__ import annotations

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


def name_sites(root: nn.Module, ops: OpsRef) -> None:
    """Give every module under ``root`` that holds ``ops`` the ref of its own call site: its
    module path (``layers.3.attn.wq_a``)."""
    for path, m in root.named_modules():
        if getattr(m, "_ops", None) is ops:
            m._ops = ops.site(path or "root")
