"""Emulations of vendor APIs for CPU tests of the vendor plugins' glue (never shipped).

Each emulation implements the documented semantics of the vendor functions the plugins call
(VENDORS.md A.2 / B.2: argument order, layouts, dtype and shape limits that raise like the real
op, and documented numerics such as npu_hc_pre_v2's HF32 round-toward-zero product), written
from those documents in plain torch. They are installed into ``sys.modules`` (or onto
``torch.ops``) only inside a test, through :func:`install_aiter` / :func:`install_ascend`.

An emulation passing the conformance suite shows the GLUE is right (argument order, layout
transposes, index conversions, declines). It is no evidence that the vendor kernel is right.
"""
from __future__ import annotations

import sys
import types


def _modules(tree: dict[str, dict]) -> dict[str, types.ModuleType]:
    mods = {}
    for name, attrs in tree.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        m.__path__ = []          # a package, so submodules import
        m.__dsv4core_emulated__ = True
        mods[name] = m
    for name, m in mods.items():   # parent.child attributes
        parent, _, child = name.rpartition(".")
        if parent in mods:
            setattr(mods[parent], child, m)
    return mods


def install_aiter(monkeypatch, *, with_mhc=True, with_batched_gemm=True):
    """Put an emulated aiter (``aiter.ops.mhc``, ``aiter.ops.triton.gemm.batched``) into sys.modules."""
    from . import aiter_emul as e

    tree = {"aiter": {}, "aiter.ops": {}, "aiter.ops.triton": {}, "aiter.ops.triton.gemm": {},
            "aiter.ops.triton.gemm.batched": {}}
    if with_mhc:
        tree["aiter.ops.mhc"] = {"mhc_pre": e.mhc_pre, "mhc_post": e.mhc_post}
    if with_batched_gemm:
        tree["aiter.ops.triton.gemm.batched.batched_gemm_bf16"] = {"batched_gemm_bf16": e.batched_gemm_bf16}
    for name in ("aiter.ops.mhc", "aiter.ops.triton.gemm.batched.batched_gemm_bf16"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name, m in _modules(tree).items():
        monkeypatch.setitem(sys.modules, name, m)
    return e


def install_ascend(monkeypatch, *, with_vllm_ascend=True):
    """Put an emulated torch_npu into sys.modules and (optionally) vllm-ascend's custom ops onto
    ``torch.ops._C_ascend``."""
    import torch

    from . import npu_emul as e

    mods = _modules({"torch_npu": {name: getattr(e, name) for name in e.TORCH_NPU}})
    monkeypatch.setitem(sys.modules, "torch_npu", mods["torch_npu"])
    ns = types.SimpleNamespace(**({name: getattr(e, name) for name in e.C_ASCEND} if with_vllm_ascend else {}))
    monkeypatch.setattr(torch.ops, "_C_ascend", ns, raising=False)
    return e


def install_flashinfer(monkeypatch, *, with_get_module=True):
    """Put an emulated ``flashinfer`` / ``flashinfer.mhc`` (``get_mhc_module()`` returning the raw
    mHC functions) into sys.modules."""
    import importlib.machinery

    from . import flashinfer_emul as e

    attrs = {"get_mhc_module": lambda: e.Module()} if with_get_module else {}
    mods = _modules({"flashinfer": {"__version__": "0.7.2.post1"}, "flashinfer.mhc": attrs})
    for name, m in mods.items():
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        monkeypatch.setitem(sys.modules, name, m)
    return e
