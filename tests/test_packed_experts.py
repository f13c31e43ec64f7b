"""Routed experts kept packed (FP4 e2m1 + UE8M0 / FP8 + block scales) where the bound
``moe_experts`` reads them (HAL 1.1; ``dsv4core.model.experts_quant``).

The tiny official checkpoint of ``checkpoint_fixtures`` stores its routed experts as packed FP4.
Kept vs dequantised float32 logits agree bit-for-bit (asserted): the reference ``moe_experts``
dequantises ``e2m1(code) * 2^(s-127)`` per expert in fp32, the loader computes the same exact
fp32 values once at load, and both then run the same formula.
"""

from __future__ import annotations

import torch
from test_fp8_weights import IDS, inject, official  # noqa: F401  (shared fixtures: checkpoint pair, backend injection)

import dsv4core
from dsv4core.hal import Backend, discover


def _experts_backend(name: str, fp4: bool) -> Backend:
    """A cpu backend serving moe_experts with the reference math; it accepts packed FP4 experts
    only if ``fp4``."""
    b = Backend(name=name, device_types=("cpu",), priority=500)

    def supports(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None, act_block=None):
        if w13_scale is None and w2_scale is None:
            return w13.dtype == x.dtype
        return fp4 and w13.dtype == torch.int8 and w2.dtype == torch.int8

    b.add("moe_experts", discover()["reference"].backend.impls["moe_experts"].fn, supports=supports,
          native_quantized=True)
    return b


def _packed(model):
    return {n: p for n, p in model.named_parameters() if ".experts." in n and p.dtype == torch.int8}


def test_keep_packs_fp4_experts_bit_exact_and_small(official):
    off, _ = official
    kept = dsv4core.load_model(off, dtype="float32", backend="reference", quantized="keep")
    deq = dsv4core.load_model(off, dtype="float32", backend="reference", quantized="dequantize")
    packed = _packed(kept)
    n_layers = len(kept.model.layers)
    assert len(packed) == 2 * n_layers and not _packed(deq)
    kp, dp = dict(kept.named_parameters()), dict(deq.named_parameters())
    for n, w in packed.items():
        s = kp[n + "_scale_inv"]
        full = dp[n]
        assert w.shape == (*full.shape[:2], full.shape[2] // 2)  # two e2m1 codes a byte
        assert s.dtype == torch.float8_e8m0fnu and s.shape == (*full.shape[:2], full.shape[2] // 32)
        # 4.25 bits per weight instead of 32
        assert w.nbytes + s.nbytes == full.nbytes * 17 // 128
    assert not any(n.endswith("experts.gate_up_proj_scale_inv") for n in dp)
    rep = kept.quantization_report()
    assert set(packed) <= set(rep["kept"])
    assert all("fp4" in d["reason"] for d in rep["decisions"] if d["op"] == "moe_experts")
    assert torch.equal(kept.logits(IDS), deq.logits(IDS))


def test_auto_keeps_packed_experts_only_where_the_serving_backend_accepts_them(official, inject):
    off, _ = official
    inject(_experts_backend("fp4-test", fp4=True))
    m = dsv4core.load_model(off, dtype="float32", backend="auto")
    dec = [d for d in m.quantization_report()["decisions"] if d["op"] == "moe_experts"]
    assert dec and all(d["kept"] and d["backend"] == "fp4-test" for d in dec)
    assert len(_packed(m)) == len(dec)
    ref = dsv4core.load_model(off, dtype="float32", backend="auto", quantized="dequantize")
    assert torch.equal(m.logits(IDS), ref.logits(IDS))
    assert m.ops.bindings["moe_experts"].runtime_fallbacks == 0, "fp4-test served every call itself"


def test_auto_dequantises_experts_on_a_declining_backend_or_the_reference(official, inject):
    off, hf = official
    assert not _packed(dsv4core.load_model(off, dtype="float32", backend="reference"))
    inject(_experts_backend("nofp4-test", fp4=False))
    m = dsv4core.load_model(off, dtype="float32", backend="auto")
    dec = [d for d in m.quantization_report()["decisions"] if d["op"] == "moe_experts"]
    assert dec and not any(d["kept"] for d in dec) and all("declines" in d["reason"] for d in dec)
    # a transformers checkpoint holds plain floats: nothing to keep, whatever the mode
    t = dsv4core.load_model(hf, dtype="float32", backend="reference", quantized="keep")
    assert not _packed(t)
