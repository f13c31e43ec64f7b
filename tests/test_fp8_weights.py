"""FP8 weights kept as FP8 + block scale when the bound backend computes with them.

* HAL: ``OpTable.accepts`` asks the SERVING implementation only (its ``supports``), not the chain.
* Model: ``load_model(..., quantized="auto" | "keep" | "dequantize")`` on a tiny official-format
  checkpoint (FP8 e4m3 + e8m0 128x128 block scales, FP4 experts) written by the checkpoint writer.
  Kept vs dequantised float32 logits agree bit-for-bit (asserted): the reference
  ``linear`` / ``wo_a`` dequantise ``float(Wq) * S`` in fp32 per call, the loader computes the very
  same fp32 product once at load (an e4m3 value times a power of two is exact in fp32), so both
  models multiply by identical fp32 weights in the same op.
* In-process backends (injected into ``discover()``'s statuses, ``reset()`` after) decide ``auto``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from checkpoint_fixtures import build_pair

import dsv4core
from dsv4core.hal import Backend, HALError, bind, discover, reset
from dsv4core.hal.discovery import _status_for

FP8 = torch.float8_e4m3fn
IDS = list(range(3, 43))  # 40 tokens: crosses the sliding window and several compress windows


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    _, off, hf, _ = build_pair(tmp_path_factory.mktemp("fp8w"), mtp=False)
    return off, hf


@pytest.fixture
def inject():
    """Register in-process backends for this test; forget them afterwards."""
    reset()
    status = discover()

    def add(b: Backend) -> None:
        status[b.name] = _status_for(b, "test")

    yield add
    reset()


def _reference_impl(op: str):
    return discover()["reference"].backend.impls[op].fn


def _fp8_args(n=256, k=256):
    return (torch.zeros(2, k), torch.zeros(n, k, dtype=FP8), torch.ones(-(-n // 128), -(-k // 128)), None)


def _linear_backend(name: str, fp8: bool, priority: int = 500) -> Backend:
    """A cpu backend whose `linear` (the reference math) accepts act-dtype weights, and FP8 weights
    with float32 block scales only if `fp8` (then it declares reading them natively)."""
    b = Backend(name=name, device_types=("cpu",), priority=priority)

    def supports(x, weight, weight_scale=None, out_dtype=None, act_block=None):
        if weight.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
            return False
        if weight_scale is None:
            return weight.dtype == x.dtype
        return fp8 and weight.dtype == FP8 and weight_scale.dtype == torch.float32

    b.add("linear", _reference_impl("linear"), supports=supports, native_quantized=fp8)
    return b


# ------------------------------------------------------------------------------------- HAL
def test_accepts_asks_the_serving_implementation_only(inject):
    ref = bind("cpu", backend="reference")
    assert ref.accepts("linear", *_fp8_args())  # no predicate: accepts all
    inject(_linear_backend("fp8-test", fp8=True))
    inject(_linear_backend("nofp8-test", fp8=False, priority=400))
    yes = bind("cpu", backend="fp8-test")
    no = bind("cpu", backend="nofp8-test")
    assert yes.bindings["linear"].backend == "fp8-test" and yes.accepts("linear", *_fp8_args())
    assert yes.accepts("linear", x=torch.zeros(1, 8), weight=torch.zeros(4, 8))
    assert not yes.accepts("linear", torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.float64))
    # the reference further down the chain would take it; accepts() says what the server does
    assert not no.accepts("linear", *_fp8_args())
    assert no.linear(*_fp8_args()).shape == (2, 256)  # ... and the call still works, by fallback
    assert no.bindings["linear"].runtime_fallbacks == 1
    # ops the backend does not implement are served by the reference: accepted
    assert no.accepts("wo_a", torch.zeros(1, 2, 128), torch.zeros(2, 128, 128, dtype=FP8), torch.ones(2, 1, 1))
    # a predicate that raises is a no; unknown op names raise
    assert not yes.accepts("linear", "not a tensor", None)
    with pytest.raises(HALError, match="no HAL op named 'lineer'"):
        yes.accepts("lineer", torch.zeros(1))


# ------------------------------------------------------------------------------------- model
def _load(path, **kw):
    return dsv4core.load_model(path, dtype="float32", **kw)


def _fp8_params(model):
    return {n: p for n, p in model.named_parameters() if p.dtype == FP8}


def test_keep_matches_dequantize_and_is_smaller(official):
    off, _ = official
    kept = _load(off, backend="reference", quantized="keep")
    deq = _load(off, backend="reference", quantized="dequantize")
    rep = kept.quantization_report()
    fp8 = _fp8_params(kept)
    # the attention projections of all 4 layers (q_a, q_b, kv, o_a, o_b) + the 2 CSA indexer q_b
    # (the routed experts are FP4 in this checkpoint: kept packed, see test_packed_experts.py)
    kept_proj = [d["weight"] for d in rep["decisions"] if d["kept"] and d["op"] != "moe_experts"]
    assert set(fp8) == set(kept_proj) and len(fp8) == 4 * 5 + 2
    assert any(n.endswith("o_a_proj.weight") for n in fp8) and any(n.endswith("kv_proj.weight") for n in fp8)
    assert not any("experts" in n for n in fp8), "FP8 parameters are projections only (experts here are FP4)"
    kp = dict(kept.named_parameters())
    for n in fp8:
        s = kp[n + "_scale_inv"]
        assert s.dtype == torch.float32 and s.shape == (-(-kp[n].shape[0] // 128), -(-kp[n].shape[1] // 128))
    assert not _fp8_params(deq) and not deq.quantization_report()["kept"]
    assert not any(n.endswith("_scale_inv") for n, _ in deq.named_parameters())

    dp = dict(deq.named_parameters())
    kept_bytes = sum(kp[n].nbytes + kp[n + "_scale_inv"].nbytes for n in fp8)
    deq_bytes = sum(dp[n].nbytes for n in fp8)
    all_kept = sum(kp[n].nbytes + kp[n + "_scale_inv"].nbytes for n in rep["kept"])
    assert all_kept == rep["kept_bytes"] and kept_bytes < deq_bytes / 3.9  # fp32 -> fp8 + 1/4096 scale
    logging.getLogger(__name__).info("kept %d bytes vs dequantised fp32 %d bytes", kept_bytes, deq_bytes)

    a, b = kept.logits(IDS), deq.logits(IDS)
    assert a.dtype == b.dtype == torch.float32
    assert torch.equal(a, b)  # bit-for-bit (module docstring)
    assert kept.generate([IDS[:9]], max_new_tokens=3) == deq.generate([IDS[:9]], max_new_tokens=3)


def test_auto_on_reference_keeps_nothing_and_bf16_checkpoints_never_fp8(official):
    off, hf = official
    m = _load(off, backend="reference")  # quantized="auto"
    rep = m.quantization_report()
    assert rep["mode"] == "auto" and rep["kept"] == [] and not _fp8_params(m)
    assert any("'reference'" in d["reason"] and "native_quantized" in d["reason"] for d in rep["decisions"])
    # a transformers checkpoint (plain float tensors) never yields FP8 parameters, even with "keep"
    t = _load(hf, backend="reference", quantized="keep")
    assert not _fp8_params(t) and t.quantization_report()["kept"] == []
    assert dsv4core.load_model("tiny", quantized="keep").quantization_report()["kept"] == []


def test_auto_keeps_fp8_where_the_serving_backend_accepts_it(official, inject):
    off, _ = official
    inject(_linear_backend("fp8-test", fp8=True))
    m = _load(off, backend="auto")
    rep = m.quantization_report()
    by_op = {}
    for d in rep["decisions"]:
        by_op.setdefault((d["op"], d["backend"], d["kept"]), []).append(d["weight"])
    # linear is served by fp8-test (accepts FP8): every FP8 linear weight kept; wo_a is served by
    # the reference (fp8-test does not implement it): dequantised
    assert len(by_op[("linear", "fp8-test", True)]) == 4 * 4 + 2
    assert len(by_op[("wo_a", "reference", False)]) == 4
    assert set(_fp8_params(m)) == set(by_op[("linear", "fp8-test", True)])
    # same bindings (other installed plugins may serve other ops under "auto"), weights dequantised:
    # fp8-test runs the reference math, so bit-for-bit (module docstring)
    ref = _load(off, backend="auto", quantized="dequantize")
    assert not _fp8_params(ref)
    assert torch.equal(m.logits(IDS), ref.logits(IDS))
    assert m.ops.bindings["linear"].runtime_fallbacks == 0, "fp8-test served every linear call itself"


def test_auto_dequantises_where_the_serving_backend_declines_fp8(official, inject):
    off, _ = official
    inject(_linear_backend("nofp8-test", fp8=False))
    m = _load(off, backend="auto")
    rep = m.quantization_report()
    assert rep["kept"] == [] and not _fp8_params(m)
    assert any("declines" in d["reason"] for d in rep["decisions"] if d["backend"] == "nofp8-test")


def test_quantized_is_validated(official):
    off, _ = official
    for bad in ("fp8", None, True):
        with pytest.raises(ValueError, match="quantized must be one of 'auto', 'keep', 'dequantize'"):
            dsv4core.load_model(off, quantized=bad)
    with pytest.raises(ValueError, match="quantized must be one of"):
        dsv4core.load_model("tiny", quantized="yes")


@pytest.mark.parametrize("levels,dtype", [(3, torch.float32), (7, torch.float32), (7, torch.bfloat16)])
def test_block_varied_scales_each_block_by_its_power_of_two(levels, dtype):
    """The one helper behind the FP8 cases' and the FP8 tiny model's varied block scales: block
    (i, j) times 2^((i + 2j) mod levels - (levels - 1) / 2), ragged edge blocks included, exactly."""
    from dsv4core.hal.ops._cases import block_varied

    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(0)).to(dtype)
    got = block_varied(w, levels)
    assert got.dtype == dtype
    for i in range(3):
        for j in range(3):
            blk = (slice(128 * i, 128 * (i + 1)), slice(128 * j, 128 * (j + 1)))
            assert torch.equal(got[blk], w[blk] * 2.0 ** ((i + 2 * j) % levels - (levels - 1) // 2))
    with pytest.raises(ValueError, match="levels must be odd, got 4"):
        block_varied(w, 4)
