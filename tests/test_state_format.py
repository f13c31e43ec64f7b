"""The FP8 state format: `hal.rowformats` (the FP8 KV row, the FP4 indexer key), the HAL ops that
write and read it, and `CacheConfig(kv_dtype="fp8")` in the model.

The format's rule is `hal.quant`'s (checked bit-exact against an fp64 transcription in
test_quant_rules.py); here: the byte layout from hand-computed examples, that storing the values
the official numerics produce is lossless (bit for bit), and that a model whose state is stored
as FP8 computes the same logits as one storing bf16 rows (bound 1e-6 x max|logit|; measured: equal).
"""

from __future__ import annotations

import pytest
import torch

from dsv4core.hal import OpInputError
from dsv4core.hal import rowformats as rf
from dsv4core.hal.quant import fake_quant, hadamard
from dsv4core.hal import bind
from dsv4core.model import CacheConfig, DSV4Config, state_bytes
from dsv4core.model.api import load_model

OPS = bind("cpu", backend="reference", policy="strict")


def _official_rows(n: int, d: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 rows as kv_norm_rope(nope_quant_block=64) makes them: non-rope channels fake-quantised
    per 64 (magnitudes over 40 binades, a zero group), rope channels bf16."""
    x = torch.randn(n, d, generator=gen) * torch.logspace(-12, 12, n, base=2.0)[:, None]
    x[:, :64] *= 2.0 ** torch.randint(-8, 8, (n, 1), generator=gen)
    x[3, 64:128] = 0.0
    x = x.bfloat16()
    return torch.cat((fake_quant(x[:, :d - 64], "fp8", 64), x[:, d - 64:]), -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def test_row_sizes_are_the_engine_formats():
    assert rf.row_bytes("fp8", 512) == 584          # 448 e4m3 + 128 (64 bf16) + 7 scales + 1 pad
    assert rf.row_bytes("fp4", 128) == 68           # 64 bytes of nibbles + 4 scales
    assert rf.row_bytes("fp8", 128) == 64 + 128 + 8
    for fmt, d in (("fp8", 64), ("fp8", 100), ("fp4", 48), ("fp9", 128)):
        with pytest.raises(ValueError):
            rf.row_bytes(fmt, d)


def test_fp8_row_layout_from_a_hand_computed_row():
    # group 0: amax 56 -> s = 2^ceil(log2(56/448)) = 2^-3 (byte 124); 1.0 / s = 8 = e4m3 0x50,
    # -56 / s = -448 = e4m3 0xFE; group 1..6 zero -> amax clamped to 1e-4 -> s = 2^-22 (byte 105)
    row = torch.zeros(1, 512)
    row[0, 0], row[0, 1] = 1.0, -56.0
    row[0, 448], row[0, 511] = 1.5, -2.0              # rope channels: bf16 0x3FC0, 0xC000
    b = rf.pack("fp8", row)[0]
    assert b[0].item() == 0x50 and b[1].item() == 0xFE and b[2:448].eq(0).all()
    assert (b[448].item(), b[449].item()) == (0xC0, 0x3F) and (b[574].item(), b[575].item()) == (0x00, 0xC0)
    assert b[576].item() == 124 and b[577:583].eq(105).all() and b[583].item() == 0


def test_fp4_key_layout_from_a_hand_computed_key():
    # group 0: amax 6 -> s = 1 (byte 127); element 0 = 1.5 (code 3) in the low nibble, element 1 =
    # -6 (code 0xF) in the high one; group 1: amax 3 -> s = 2^-1 (byte 126), 3 / s = 6 (code 7)
    key = torch.zeros(1, 64)
    key[0, 0], key[0, 1], key[0, 32] = 1.5, -6.0, 3.0
    b = rf.pack("fp4", key)[0]
    assert b[0].item() == 0xF3 and b[16].item() == 0x07 and b[1:16].eq(0).all()
    assert b[32].item() == 127 and b[33].item() == 126


def test_storing_official_rows_is_lossless_and_other_rows_follow_the_rule():
    gen = torch.Generator().manual_seed(0)
    for d in (128, 512):
        x = _official_rows(4000, d, gen)
        back = rf.unpack("fp8", rf.pack("fp8", x), d, torch.bfloat16)
        assert torch.equal(_bits(back), _bits(x))
        # any bf16 row: stored as the official rule's fake-quantised value (rope channels as they are)
        y = (torch.randn(500, d, generator=gen) * 30).bfloat16()
        want = torch.cat((fake_quant(y[:, :d - 64], "fp8", 64), y[:, d - 64:]), -1)
        assert torch.equal(_bits(rf.unpack("fp8", rf.pack("fp8", y), d, torch.bfloat16)), _bits(want))
    for dI in (64, 128):
        k = hadamard(torch.randn(4000, dI, generator=gen) * torch.logspace(-30, 30, 4000, base=2.0)[:, None])
        k = fake_quant(k.bfloat16(), "fp4", 32)
        assert torch.equal(_bits(rf.unpack("fp4", rf.pack("fp4", k), dI, torch.bfloat16)), _bits(k))


def test_paged_layout_round_trip():
    gen = torch.Generator().manual_seed(1)
    block = rf.pack("fp8", _official_rows(64, 512, gen))
    page = rf.split_page(block, "fp8", 512)
    assert page.numel() == 64 * 584 and torch.equal(page[:576], block[0, :576])
    assert torch.equal(page[64 * 576:64 * 576 + 8], block[0, 576:])
    assert torch.equal(rf.join_page(page, "fp8", 512), block)


def test_ops_read_and_write_the_formats():
    gen = torch.Generator().manual_seed(2)
    d, h = 128, 4
    rows = _official_rows(20, d, gen)
    pool = torch.zeros(24, rf.row_bytes("fp8", d), dtype=torch.uint8)
    idx = torch.arange(20)
    OPS.cache_store(pool, idx, rows, row_format="fp8")
    plain = torch.zeros(24, d, dtype=torch.bfloat16)
    OPS.cache_store(plain, idx, rows)
    q = torch.randn(3, h, d, generator=gen).bfloat16()
    ind = torch.randint(0, 20, (3, 9), generator=gen)
    ind[1, 4:] = -1
    sink = torch.randn(h, generator=gen)
    a = OPS.sparse_mqa_attention(q, pool, ind, sink, d ** -0.5, kv_format="fp8")
    assert torch.equal(a, OPS.sparse_mqa_attention(q, plain, ind, sink, d ** -0.5))
    with pytest.raises(OpInputError, match="cache_store: argument 'pool'.*200 bytes"):
        OPS.cache_store(pool[:, :199], idx, rows, row_format="fp8")
    with pytest.raises(OpInputError, match="argument 'row_format'"):
        OPS.cache_store(pool, idx, rows, row_format="fp6")
    with pytest.raises(OpInputError, match="sparse_mqa_attention: argument 'kv_format'"):
        OPS.sparse_mqa_attention(q, pool, ind, sink, 1.0, kv_format="fp4")


def _flash() -> DSV4Config:
    return DSV4Config.from_dict({"num_hidden_layers": 43, "num_hash_layers": 3,
                                 "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0]})


def test_state_bytes_at_flash_dims():
    cfg = _flash()
    bf, f8 = state_bytes(cfg, 65536), state_bytes(cfg, 65536, CacheConfig(kv_dtype="fp8"))
    assert f8["window_rows"] * 1024 == bf["window_rows"] * 584
    assert f8["compressed_entries"] * 1024 == bf["compressed_entries"] * 584
    assert f8["indexer_keys"] * 256 == bf["indexer_keys"] * 68
    assert f8["compressor_rings"] == bf["compressor_rings"]


@pytest.fixture(scope="module")
def pair():
    """tiny-official in bf16 twice: one storing bf16 rows, one storing the FP8 format."""
    cc = dict(max_requests=4, max_tokens=1024, max_request_tokens=256, max_step_tokens=256, max_rollback=8,
              window_block=8, block_tokens=32)
    out = []
    for kv in (None, "fp8"):
        m = load_model("tiny-official", dtype="bfloat16", backend="reference")
        m.configure_cache(kv_dtype=kv, **cc)
        out.append(m)
    return out


def _run(m, ids):
    """A chunked prefill, a fork, decodes on both requests, a truncate and decodes again: the
    logits of every step, concatenated."""
    outs = []
    st = m.new_state()
    for lo, hi in ((0, 13), (13, 40)):
        n = hi - lo
        outs.append(m.forward_batch(ids[lo:hi], torch.arange(lo, hi), torch.zeros(n, dtype=torch.long), [st]))
    other = st.fork()
    sts, toks = [st, other], [int(ids[40]), int(ids[41])]
    for k in range(64):
        if k == 40:
            st.truncate(st.length - 5)
        lg = m.forward_batch(torch.tensor(toks), torch.tensor([s.length for s in sts]), torch.arange(2), sts)
        outs.append(lg)
        toks = lg.argmax(-1).tolist()
    return torch.cat(outs), (st, other)


def test_fp8_state_gives_the_bf16_state_logits(pair):
    plain, fp8 = pair
    assert fp8.cache.kv_format == "fp8" and fp8.cache.rows[1].dtype == torch.uint8
    ids = torch.randint(2, 256, (48,), generator=torch.Generator().manual_seed(3))
    a, keep_a = _run(plain, ids)
    b, keep_b = _run(fp8, ids)
    assert (a - b).abs().max().item() <= 1e-6 * a.abs().max().item()
    # the pools hold the same values: every FP8 row unpacks to the bf16 pool's row, bit for bit
    c1, c2 = plain.cache, fp8.cache
    d, dI = plain.config.head_dim, plain.config.index_head_dim
    for i in range(plain.config.num_hidden_layers):
        assert torch.equal(_bits(rf.unpack("fp8", c2.rows[i], d, torch.bfloat16)), _bits(c1.rows[i])), i
        if c1.keys[i] is not None:
            assert torch.equal(_bits(rf.unpack("fp4", c2.keys[i], dI, torch.bfloat16)), _bits(c1.keys[i])), i
    rb, rf8 = c1.bytes_report(), c2.bytes_report()
    row, key = rf.row_bytes("fp8", d), rf.row_bytes("fp4", dI)
    assert rf8["window_rows"] * 2 * d == rb["window_rows"] * row
    assert rf8["indexer_keys"] * 2 * dI == rb["indexer_keys"] * key
    assert {c.format for c in c2.components() if c.name == "rows"} == {"fp8"}


def test_fp8_state_is_refused_where_it_would_lose_precision(pair):
    fp8 = pair[1]
    with pytest.raises(ValueError, match="official"):
        fp8.set_numerics("exact")
    assert fp8.numerics == "official"
    exact = load_model("tiny-official", dtype="bfloat16", backend="reference", numerics="exact")
    with pytest.raises(ValueError, match="numerics='official'"):
        exact.configure_cache(kv_dtype="fp8")
    f32 = load_model("tiny-official", dtype="float32", backend="reference")
    with pytest.raises(ValueError, match="bfloat16 model"):
        f32.configure_cache(kv_dtype="fp8")
    with pytest.raises(ValueError, match="kv_dtype"):
        CacheConfig(kv_dtype="fp16")
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        load_model("tiny", dtype="bfloat16", backend="reference").configure_cache(kv_dtype="fp8")
