"""The model's two numerics (`dsv4core.model.numerics`): "auto" picks "official" for an official
checkpoint and "exact" otherwise; the official quantisation is active (logits differ from exact);
its op arguments are passed only under "official"; dims that cannot carry it are a clear error."""

from __future__ import annotations

import pytest
import torch

from dsv4core import load_model
from dsv4core.model.numerics import resolve

from checkpoint_fixtures import build_pair

# the official block sizes need: hidden, q_lora, o_groups * o_lora, moe I multiples of 128; the
# non-rope channels (head_dim - rope) a multiple of 64; index_head_dim a power of two
OFFICIAL_DIMS = dict(head_dim=128, qk_rope_head_dim=64, index_head_dim=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import checkpoint_fixtures as cf

    saved = dict(cf.TINY)
    cf.TINY.update(OFFICIAL_DIMS)
    try:
        return build_pair(tmp_path_factory.mktemp("numerics"), mtp=False)
    finally:
        cf.TINY.clear()
        cf.TINY.update(saved)


def test_auto_resolution():
    assert resolve("auto", "official", {}) == "official"
    assert resolve("auto", "transformers", {}) == "exact"
    assert resolve("auto", "transformers", {"quantization_config": {"quant_method": "fp8"}}) == "official"
    assert resolve("exact", "official", {}) == "exact"
    with pytest.raises(ValueError, match="numerics must be one of"):
        resolve("fp8", None, {})


def test_official_checkpoint_loads_official_and_differs_from_exact(pair):
    _, off, hf, _ = pair
    m_auto = load_model(off, dtype="bfloat16")
    assert m_auto.numerics == "official"
    assert {r["numerics"] for r in m_auto.hal_report()} == {"official"}
    m_exact = load_model(off, dtype="bfloat16", numerics="exact")
    assert m_exact.numerics == "exact"
    assert load_model(hf, dtype="bfloat16").numerics == "exact"       # a transformers checkpoint
    ids = [int(t) for t in torch.randint(2, 256, (40,), generator=torch.Generator().manual_seed(0))]
    a, b = m_auto.logits(ids), m_exact.logits(ids)
    diff = (a.float() - b.float()).abs().max() / b.float().abs().max()
    # the quantisation is active (W8A8 rounds every projection's input to 3 mantissa bits) yet
    # the model is the same one (not a different network: differences of a few percent)
    assert 1e-3 < float(diff) < 0.5, float(diff)
    ga, gb = m_auto.generate([ids[:12]], 8), m_exact.generate([ids[:12]], 8)
    assert len(ga[0]) == len(gb[0]) == 8


def test_official_calls_carry_the_quantisation_arguments_and_exact_calls_do_not(pair):
    _, off, _, _ = pair
    seen: dict[str, list[dict]] = {}
    for numerics in ("official", "exact"):
        m = load_model(off, dtype="bfloat16", numerics=numerics)
        table = m.ops
        calls = seen.setdefault(numerics, [])
        for op in ("linear", "moe_experts", "kv_norm_rope", "indexer_rotate_quant"):
            fn = getattr(table, op)

            def spy(*a, _fn=fn, _op=op, **kw):
                calls.append(dict(kw, op=_op))
                return _fn(*a, **kw)
            object.__setattr__(table, op, spy)
        m.logits([3, 4, 5, 6, 7, 8, 9, 10, 11])
    off_calls, ex_calls = seen["official"], seen["exact"]
    assert any(c["op"] == "linear" and c.get("act_block") == 128 for c in off_calls)
    assert any(c["op"] == "linear" and "act_block" not in c for c in off_calls)   # fp32 paths stay exact
    assert all(c.get("act_block") == 128 for c in off_calls if c["op"] == "moe_experts")
    assert {c.get("nope_quant_block") for c in off_calls if c["op"] == "kv_norm_rope"} >= {64}
    assert any(c["op"] == "indexer_rotate_quant" for c in off_calls)
    assert not any("act_block" in c or "nope_quant_block" in c for c in ex_calls)
    assert not any(c["op"] == "indexer_rotate_quant" for c in ex_calls)


def test_exactly_the_official_w8a8_projections_get_act_block(pair):
    _, off, _, _ = pair
    m = load_model(off, dtype="bfloat16", numerics="official")
    got = {n.removesuffix(".act_block") for n, mod in m.named_modules() if getattr(mod, "act_block", None) == 128}
    want = set()
    for i, kind in enumerate(m.config.layer_types):
        want |= {f"model.layers.{i}.self_attn.{p}" for p in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj")}
        if m.model.layers[i].self_attn.compressor is not None and hasattr(m.model.layers[i].self_attn.compressor,
                                                                           "indexer"):
            want.add(f"model.layers.{i}.self_attn.compressor.indexer.q_b_proj")
    assert got == want
    m.set_numerics("exact")
    assert not any(getattr(mod, "act_block", None) for mod in m.modules())


def test_dims_that_cannot_carry_the_official_blocks_are_a_clear_error():
    with pytest.raises(ValueError, match=r"numerics='official' needs .*hidden_size = 64"):
        load_model("tiny", numerics="official")
    with pytest.raises(ValueError, match="numerics must be one of"):
        load_model("tiny", numerics="fp8")
