"""The oracle cannot be bent at run time: once the catalogue has loaded, every op spec (its
reference, tolerance, signature, input check, cases, versions) is frozen, and a plugin-like
function that tries to loosen it gets a clear error; a backend returning zeros still fails."""

from __future__ import annotations

import pytest
import torch

from dsv4core.conformance import FAILED, run
from dsv4core.hal import Backend, HALError, Tolerance, catalogue
from dsv4core.hal.spec import FrozenSpecError

LOOSE = Tolerance(k=1e30, floor=1e30, why="anything goes")


def _zero_rms_norm(x, weight, eps):
    return torch.zeros_like(x)


def _zero_backend() -> Backend:
    b = Backend(name="zero", version="test", device_types=("cpu",), priority=10)
    b.add("rms_norm", _zero_rms_norm)
    return b


def _tamper(spec) -> list[tuple[str, BaseException | None]]:
    """What a malicious plugin would do at import: every way of loosening the spec it can name."""
    attempts = {
        "tolerance": lambda: setattr(spec, "tolerance", LOOSE),
        "reference": lambda: setattr(spec, "reference", _zero_rms_norm),
        "signature": lambda: setattr(spec, "signature", spec.signature.replace(parameters=[])),
        "_check": lambda: setattr(spec, "_check", None),
        "_cases": lambda: setattr(spec, "_cases", lambda *a: iter(())),
        "params_since": lambda: setattr(spec, "params_since", {}),
        "writes": lambda: setattr(spec, "writes", ("x",)),
        "capturable": lambda: setattr(spec, "capturable", False),
        "deprecated": lambda: setattr(spec, "deprecated", "gone"),
        "since": lambda: setattr(spec, "since", (1, 9)),
        "name": lambda: setattr(spec, "name", "other"),
        "new_attribute": lambda: setattr(spec, "new_attribute", 1),
        "del tolerance": lambda: delattr(spec, "tolerance"),
        "del _cases": lambda: delattr(spec, "_cases"),
        "check decorator": lambda: spec.check(lambda x, weight, eps: None),
        "cases decorator": lambda: spec.cases(lambda *a: iter(())),
        "params_since[x]": lambda: spec.params_since.__setitem__("x", (1, 2)),
        "tolerance.k": lambda: setattr(spec.tolerance, "k", 1e30),
        "tolerance.floors[float32]": lambda: spec.tolerance.floors.__setitem__("float32", 1e30),
        "tolerance.floors.update": lambda: spec.tolerance.floors.update(float32=1e30),
    }
    out = []
    for what, attempt in attempts.items():
        try:
            attempt()
        except (AttributeError, TypeError) as e:
            out.append((what, e))
        else:
            out.append((what, None))
    return out


def test_every_tampering_raises_and_the_zero_backend_still_fails():
    spec = catalogue()["rms_norm"]
    before = (spec.tolerance, spec.reference, spec.signature, spec._check, spec._cases, dict(spec.params_since))
    results = _tamper(spec)
    assert [w for w, e in results if e is None] == [], "tampering went through"
    for what, e in results:
        if what.startswith(("tolerance.", "params_since[")):
            continue   # a frozen dataclass / read-only mapping: Python's own error
        assert isinstance(e, FrozenSpecError) and isinstance(e, HALError), (what, e)
        assert "'rms_norm'" in str(e) and "frozen" in str(e), (what, e)
        attr = what.split()[-1] if what.startswith("del ") else what
        if "decorator" not in what:
            assert repr(attr) in str(e), (what, e)
    assert (spec.tolerance, spec.reference, spec.signature, spec._check, spec._cases,
            dict(spec.params_since)) == before
    report = run(_zero_backend(), ops=["rms_norm"], shapes="small", dtypes="float32")
    assert [o.status for o in report.ops if o.op == "rms_norm"] == [FAILED]
    assert report.exit_code() == 1


def test_every_spec_is_frozen_and_the_catalogue_dict_is_a_copy():
    specs = catalogue()
    assert specs is not catalogue() and specs == catalogue()
    for name, spec in specs.items():
        with pytest.raises(FrozenSpecError, match=f"op '{name}': cannot set 'tolerance'"):
            spec.tolerance = LOOSE
    real = specs["rms_norm"]
    fake = catalogue()
    fake["rms_norm"] = fake["rms_norm"].__class__(_zero_rms_norm, "norms", LOOSE, (1, 0))   # an unfrozen look-alike
    del fake["linear"]
    assert catalogue()["rms_norm"] is real and "linear" in catalogue()
    report = run(_zero_backend(), ops=["rms_norm"], shapes="small", dtypes="float32")
    assert [o.status for o in report.ops if o.op == "rms_norm"] == [FAILED]


def test_tolerance_floors_are_read_only_and_keep_their_behaviour():
    given = {"bfloat16": 2.0 ** -10}
    t = Tolerance(k=2.0, floor=1e-6, why="test", floors=given)
    given["bfloat16"] = 1e30                     # the caller's dict is copied, not aliased
    assert t.floor_for(torch.bfloat16) == 2.0 ** -10 and t.floor_for(torch.float32) == 1e-6
    with pytest.raises(TypeError):
        t.floors["bfloat16"] = 1e30
    # floors take no part in equality or hashing (as before)
    u = Tolerance(k=2.0, floor=1e-6, why="test")
    assert t == u and hash(t) == hash(u) and dict(u.floors) == {}
