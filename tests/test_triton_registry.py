"""The op -> Triton kernel path: the index (OPS), the predicates (SUPPORTS) and the kernels'
``@implements`` declarations agree, and the registration serves each op with the declared kernel
guarded by the declared predicate. Imports the kernel modules (triton), launches nothing."""
from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from dsv4core.hal import Backend, catalogue
from dsv4core.kernels.triton import OPS, predicates, registry

PKG = "dsv4core.kernels.triton"


def _import_all():
    for mod in sorted(set(OPS.values())):
        importlib.import_module(f"{PKG}.{mod}")


def test_every_indexed_op_has_one_declared_kernel_in_its_module():
    _import_all()
    assert set(registry.KERNELS) == set(OPS)
    for op, mod in OPS.items():
        fn = registry.kernel(op)
        assert fn.__module__ == f"{PKG}.{mod}", op
        assert getattr(importlib.import_module(fn.__module__), fn.__name__) is fn, op


def test_predicates_and_kernels_take_the_ops_parameters():
    _import_all()
    specs = catalogue()
    assert set(predicates.SUPPORTS) == set(OPS)
    for op in OPS:
        want = list(specs[op].signature.parameters)
        assert list(inspect.signature(predicates.SUPPORTS[op]).parameters) == want, op
        assert list(inspect.signature(registry.kernel(op)).parameters) == want, op


def test_registration_guards_each_op_with_its_predicate():
    b = Backend(name="t-reg", device_types=("cpu",))
    registry.register_ops(b, "cpu")
    assert set(b.impls) == set(OPS)
    x, w = torch.randn(2, 8), torch.ones(8)
    sup = b.impls["rms_norm"].supports
    assert sup(x, w, 1e-6) is True
    assert sup(x.to(torch.int32), w, 1e-6) is False          # the predicate's dtype rule
    assert sup(x, torch.ones(4), 1e-6) is False                # the predicate's shape rule
    assert b.impls["rms_norm"].fn.__signature__ == inspect.signature(predicates.rms_norm_supports)


def _decl(op, supports, module):
    def fn(*a):
        return None
    fn.__module__ = module
    return registry.implements(op, supports=supports)(fn)


def test_implements_refuses_declarations_the_registration_would_not_follow():
    with pytest.raises(ValueError, match=r"'no_such_op' is not in the kernel index OPS"):
        _decl("no_such_op", predicates.rms_norm_supports, f"{PKG}.norm")
    with pytest.raises(ValueError, match=r"places 'rms_norm' in dsv4core\.kernels\.triton\.norm, not "
                                         r"dsv4core\.kernels\.triton\.rope"):
        _decl("rms_norm", predicates.rms_norm_supports, f"{PKG}.rope")
    with pytest.raises(ValueError, match=r"supports='rope_supports'.*predicates\.SUPPORTS\['rms_norm'\] = "
                                         r"'rms_norm_supports'"):
        _decl("rms_norm", predicates.rope_supports, f"{PKG}.norm")
    _import_all()
    with pytest.raises(ValueError, match=r"'rms_norm' is already implemented by rms_norm"):
        _decl("rms_norm", predicates.rms_norm_supports, f"{PKG}.norm")
    assert registry.KERNELS["rms_norm"] is importlib.import_module(f"{PKG}.norm").rms_norm


def test_kernel_names_the_op_it_does_not_know():
    with pytest.raises(KeyError, match="no Triton kernel for op 'all_reduce'"):
        registry.kernel("all_reduce")


def test_registration_declines_tensors_of_another_device_type_or_device():
    b = Backend(name="t-meta", device_types=("meta",))
    registry.register_ops(b, "meta", ops={"rms_norm"})
    sup = b.impls["rms_norm"].supports
    x, w = torch.randn(2, 8, device="meta"), torch.ones(8, device="meta")
    assert sup(x, w, 1e-6) is True
    assert sup(x, torch.ones(8), 1e-6) is False               # mixed devices
    assert sup(torch.randn(2, 8), torch.ones(8), 1e-6) is False  # another device type
    c = Backend(name="t-cpu", device_types=("cpu",))
    registry.register_ops(c, "cpu", ops={"rms_norm"})
    assert c.impls["rms_norm"].supports(torch.randn(2, 8), None, 1e-6) is True
    assert c.impls["rms_norm"].supports(x, None, 1e-6) is False
    assert c.impls["rms_norm"].supports(x=torch.randn(2, 8), weight=w, eps=1e-6) is False   # by keyword


def test_device_guard_only_where_a_device_type_has_several_devices(monkeypatch):
    """The wrapper makes a tensor's device current only on a device type with more than one
    device (or one whose count is unknown); with one, it reads no device per call."""
    import types

    assert registry._several(None) is False
    assert registry._several(types.SimpleNamespace(device_count=lambda: 1)) is False
    assert registry._several(types.SimpleNamespace(device_count=lambda: 2)) is True
    assert registry._several(types.SimpleNamespace()) is True                    # no count: guarded

    def broken():
        raise RuntimeError("no driver")
    assert registry._several(types.SimpleNamespace(device_count=broken)) is True
    looked = []
    monkeypatch.setattr(registry, "_first_device", lambda a, k: looked.append(1))
    monkeypatch.setitem(registry._mods, "norm", types.SimpleNamespace(TUNE=None))
    monkeypatch.setitem(registry.KERNELS, "rms_norm", lambda x, weight, eps: x)
    sig = inspect.signature(predicates.rms_norm_supports)
    x = torch.zeros(2, 4)
    for count, guarded in ((1, False), (2, True)):
        monkeypatch.setattr(torch, "fakedev", types.SimpleNamespace(device_count=lambda c=count: c), raising=False)
        impl = registry._lazy("rms_norm", "norm", sig, "fakedev")
        looked.clear()
        assert impl(x, None, 1e-6) is x and impl(x, None, 1e-6) is x
        assert len(looked) == (2 if guarded else 0), count


def test_supports_compares_device_indices_only_where_there_are_several(monkeypatch):
    """The registration's device check reads each tensor's device index only on a device type
    with several devices; a tensor of another type is declined either way."""
    import types

    from dsv4core.kernels.triton.predicates import rms_norm_supports

    class Indexed(torch.Tensor):                      # a CPU tensor that reports device index i
        def get_device(self):
            return self.i

    def on(i):
        t = torch.zeros(2, 8).as_subclass(Indexed)
        t.i = i
        return t
    w0 = torch.ones(8).as_subclass(Indexed)
    w0.i = 0
    for name, accel, compared in (("cpu", None, False),
                                  ("fakeone", types.SimpleNamespace(device_count=lambda: 1), False),
                                  ("fakemany", types.SimpleNamespace(device_count=lambda: 2), True),
                                  ("fakenone", None, True)):             # no torch module: compared
        if accel is not None:
            monkeypatch.setattr(torch, name, accel, raising=False)
        if name != "cpu":                             # the fake types' flag: every tensor has it
            monkeypatch.setattr(torch.Tensor, f"is_{name}", property(lambda self: True), raising=False)
        sup = registry._on_device(rms_norm_supports, name)
        assert sup(on(0), w0, 1e-6) is True, name
        assert sup(on(1), w0, 1e-6) is (not compared), name       # cuda:1 with cuda:0
    sup = registry._on_device(rms_norm_supports, "cpu")
    assert sup(torch.zeros(2, 8, device="meta"), None, 1e-6) is False
