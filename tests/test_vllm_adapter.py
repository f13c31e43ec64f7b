"""The vLLM adapter without vLLM (dsv4core/engines/vllm): the caches described as an engine's
allocator sees them and their bytes (against `state_bytes`), the pool views over engine-owned
block memory, and the step builder. The builder is driven by a small engine stand-in that pages
like vLLM (one packed backing allocation, one block table per cache group, block ids handed out
in a shuffled order, blocks below a sliding window released to the null block, slot mappings
`block * block_tokens + offset`, -1 for padding); its steps must give logits bit-identical to
dsv4core's own path on the same requests (fp32, reference backend: the same rows read in the same
order, so the same arithmetic)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from dsv4core.engines.vllm import (EnginePools, allocate_packed, build_step, cache_parts, kv_bytes_per_token,
                                   request_bytes, rows_view)
from dsv4core.engines.vllm.layout import block_stride_alignment
from dsv4core.model import CacheConfig, DSV4Config, state_bytes
from dsv4core.model.api import load_model

from _vllm_engine import MiniEngine, allocate_overlaid, groups_like_vllm, native_logits, step_plan, tokens


def _flash() -> DSV4Config:
    return DSV4Config.from_dict({"num_hidden_layers": 43, "num_hash_layers": 3,
                                 "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0]})


# ------------------------------------------------------------------ bytes


@pytest.mark.parametrize("kv", [None, "fp8"])
def test_flash_parts_and_bytes_per_token_match_state_bytes(kv):
    cfg = _flash()
    parts = cache_parts(cfg, torch.bfloat16, kv)
    by = {(p.layer, p.part): p for p in parts}
    row, key = (584, 68) if kv else (1024, 256)
    # the page sizes of ENGINES.md section 1.1 (before vLLM's 576 B FlashMLA padding, which the
    # row-major dsv4core rows do not need): a window / C4 page 64 rows, a C128 page 2 rows
    assert by[(0, "window")].page_bytes == 64 * row and by[(2, "entries")].page_bytes == 64 * row
    assert by[(3, "entries")].page_bytes == 2 * row and by[(2, "keys")].page_bytes == 64 * key
    assert (by[(2, "state")].page_bytes, by[(2, "index_state")].page_bytes, by[(3, "state")].page_bytes) == \
        (4 * 8192, 4 * 2048, 8 * 4096)
    n_c4, n_c128 = 21, 20
    per = kv_bytes_per_token(parts)
    assert per["compressed"] == Fraction(n_c4 * (row + key), 4) + Fraction(n_c128 * row, 128)
    assert per["window"] == 43 * row
    # the growing part: every 256 tokens add one block of entries and keys, in both
    cc = CacheConfig(kv_dtype=kv, block_tokens=256, window_block=64, max_rollback=1)
    t = 65536
    a, b = state_bytes(cfg, t, cc), state_bytes(cfg, t + 256, cc)
    grow = (b["compressed_entries"] + b["indexer_keys"]) - (a["compressed_entries"] + a["indexer_keys"])
    assert grow == 256 * per["compressed"]
    # what a request holds: the window rows as state_bytes with max_rollback = the tokens in flight
    eng = request_bytes(parts, t, in_flight=1)
    for k in ("window_rows", "compressed_entries", "indexer_keys"):
        assert eng[k] == a[k], k
    # the compressor states: a sliding window of (1 + o) m positions plus one partial block, where
    # dsv4core keeps a ring of (1 + o) m + max_rollback rows: 12 / 136 rows against 9 / 129
    ring = a["compressor_rings"]
    assert ring == n_c4 * 9 * (8192 + 2048) + n_c128 * 129 * 4096
    assert eng["compressor_states"] == n_c4 * 12 * (8192 + 2048) + n_c128 * 136 * 4096


def test_tiny_parts_and_bytes_per_token_match_state_bytes():
    m = load_model("tiny", backend="reference")
    cfg = m.config
    parts = cache_parts(cfg, torch.bfloat16)            # tiny: 4 layers, d = 64, d_I = 32, rates 4 / 16
    per = kv_bytes_per_token(parts)
    assert per["compressed"] == 2 * Fraction(128 + 64, 4) + Fraction(128, 16)
    assert per["window"] == 4 * 128 and per["state"] == 2 * (1024 + 512) + 512
    cc = CacheConfig(block_tokens=256, window_block=64, max_rollback=1)
    for t in (5, 300, 4096):
        s, e = state_bytes(cfg, t, cc), request_bytes(parts, t)
        assert (s["window_rows"], s["compressed_entries"], s["indexer_keys"]) == \
            (e["window_rows"], e["compressed_entries"], e["indexer_keys"]), t


def test_cache_parts_refuse_bad_blocks():
    cfg = _flash()
    with pytest.raises(ValueError, match="block_tokens=200.*\\[128\\]"):
        cache_parts(cfg, torch.bfloat16, block_tokens=200)
    with pytest.raises(ValueError, match="state_block\\(4\\) must be an int >= 1"):
        cache_parts(cfg, torch.bfloat16, state_block=lambda m: 0)


# ------------------------------------------------------------------ pool views


def test_rows_view_addresses_block_rows_through_the_block_stride():
    buf = torch.arange(5 * 40, dtype=torch.float32)
    blocks = torch.as_strided(buf, (5, 3, 4), (40, 4, 1), 8)       # 3 rows of 4 a block, blocks 40 apart
    view, per = rows_view(blocks)
    assert per == 10 and view.shape == (43, 4)
    for b in range(5):
        for o in range(3):
            assert torch.equal(view[b * per + o], blocks[b, o])
    view[2 * per + 1] = -1.0                                       # a write through the view lands in the block
    assert (blocks[2, 1] == -1).all()
    bad = torch.as_strided(buf, (4, 3, 4), (42, 4, 1))
    with pytest.raises(ValueError, match="keys: block stride 168 B is not a multiple of the row stride 16 B"):
        rows_view(bad, "keys")


# ------------------------------------------------------------------ an engine stand-in


@pytest.fixture()
def tiny():
    m = load_model("tiny", backend="reference")
    m.use_graphs = False
    return m


@pytest.mark.parametrize("order", [1, -1], ids=["window-first", "entries-first"])
def test_engine_steps_give_the_native_logits_bit_for_bit(tiny, order):
    m = tiny
    m.configure_cache(max_requests=8, max_tokens=4096, max_request_tokens=512, max_step_tokens=512)
    parts = cache_parts(m.config, m.act_dtype)
    groups = groups_like_vllm(parts)
    eng = MiniEngine(parts, groups, num_blocks=256, order=order)
    pools = EnginePools(m.config, parts, eng.tensors, groups)
    # layers 0 / 2 (window tables swa0) and 1 / 3 (swa1, CSA): the CSA layers share their index
    # lists (same tables, same relative page layout), every other pair differs
    assert len(set(pools.signature)) == 3 and pools.signature[1] == pools.signature[3]
    assert (pools.addr[1]["window"].base > 0) == (order == -1) and (pools.views[1].Rw > 0) == (order == 1)
    prompts = {r: tokens(n, r) for r, n in enumerate((300, 70, 5, 140))}
    states = {r: m.new_state() for r in prompts}
    plan = step_plan(prompts)
    for s, sched in enumerate(plan):
        inp = eng.step(sched, slot_mappings=s % 2 == 0)      # the write rows from the slot mappings, or the tables
        n = int(inp["query_start_loc"][-1])
        want = native_logits(m, states, sched, inp["positions"])
        got = m.forward_step(build_step(m, pools, **inp))
        assert got.shape == (n, m.config.vocab_size) and torch.isfinite(want).all()
        assert torch.equal(got, want), (s, (got - want).abs().max().item())
    # the final hidden states and the head, split (vLLM's forward / compute_logits)
    sched = [(r, tokens(1, 90 + r)) for r in range(4)]
    inp = eng.step(sched)
    want = native_logits(m, states, sched, inp["positions"])
    hidden = m.forward_step(build_step(m, pools, **inp), head=False)
    assert hidden.shape == (4, m.config.hidden_size)
    assert torch.equal(m.head_logits(hidden), want)
    # a decode step padded to 8 tokens (slot -1, past query_start_loc[-1]), then one more: the
    # padding writes nothing. More rows through the GEMMs and the experts may round differently in
    # fp32 (and so the state this step writes): bound as in tests/test_model_engine.py, 2e-5 x
    # max|logit| (measured ~1e-6)
    for s in range(2):
        sched = [(r, tokens(1, 95 + 4 * s + r)) for r in range(4)]
        inp = eng.step(sched, pad_to=8 if s == 0 else None)
        if s == 0:      # slot mappings of the real tokens only (the padding then gets -1)
            inp["slot_mappings"] = {g: sm[:4] for g, sm in inp["slot_mappings"].items()}
        want = native_logits(m, states, sched, inp["positions"][:4])
        got = m.forward_step(build_step(m, pools, **inp))
        assert got.shape == (8 if s == 0 else 4, m.config.vocab_size)
        assert (got[:4] - want).abs().max() <= 2e-5 * want.abs().max(), s


def test_a_prefix_shared_at_a_block_boundary_continues_exactly(tiny):
    """Request 1 starts from request 0's 256 tokens, its tables listing request 0's blocks (a
    prefix-cache hit at a 256-token boundary, which is a block boundary of every group); both then
    go on writing their own blocks: the logits of dsv4core's fork, bit for bit."""
    m = tiny
    m.configure_cache(max_requests=8, max_tokens=4096, max_request_tokens=512, max_step_tokens=512)
    parts = cache_parts(m.config, m.act_dtype)
    groups = groups_like_vllm(parts)
    eng = MiniEngine(parts, groups, num_blocks=256)
    pools = EnginePools(m.config, parts, eng.tensors, groups)
    prompt = tokens(256, 3)
    states = {0: m.new_state()}
    for sched in ([(0, prompt[:200])], [(0, prompt[200:])]):
        inp = eng.step(sched)
        assert torch.equal(m.forward_step(build_step(m, pools, **inp)), native_logits(m, states, sched, inp["positions"]))
    states[1] = states[0].fork()
    eng.share(0, 1)
    plan = [[(0, tokens(1, 40)), (1, tokens(30, 41))]] + [[(0, tokens(1, 50 + s)), (1, tokens(1, 60 + s))]
                                                          for s in range(4)]
    for s, sched in enumerate(plan):
        inp = eng.step(sched)
        want = native_logits(m, states, sched, inp["positions"])
        assert torch.equal(m.forward_step(build_step(m, pools, **inp)), want), s


def test_build_step_refuses_inconsistent_inputs(tiny):
    m = tiny
    parts = cache_parts(m.config, m.act_dtype)
    groups = groups_like_vllm(parts)
    eng = MiniEngine(parts, groups, num_blocks=16)
    pools = EnginePools(m.config, parts, eng.tensors, groups)
    inp = eng.step([(0, tokens(6, 1))])
    bad = dict(inp, positions=inp["positions"] + 1)
    with pytest.raises(ValueError, match="request 0: token 0 has position 1, expected 0"):
        build_step(m, pools, **bad)
    with pytest.raises(ValueError, match="query_start_loc must be \\[2\\]"):
        build_step(m, pools, **dict(inp, query_start_loc=torch.tensor([0, 9])))
    tables = dict(inp["block_tables"])
    del tables["compressed"]
    with pytest.raises(ValueError, match="block table 'compressed' must be"):
        build_step(m, pools, **dict(inp, block_tables=tables))
    sm = dict(inp["slot_mappings"], swa0=inp["slot_mappings"]["swa0"][:3])
    with pytest.raises(ValueError, match="slot mapping 'swa0' must be a 1-D integer vector of at least the 6"):
        build_step(m, pools, **dict(inp, slot_mappings=sm))
    with pytest.raises(ValueError, match="no block tensor / cache group for \\['layers.0.window'"):
        EnginePools(m.config, parts, {}, groups)


def test_block_stride_alignment_is_a_multiple_of_every_row():
    # bf16: every row is viewed flat; fp8: the FP8 rows and FP4 keys are viewed paged and ask
    # nothing of the block stride (8192 B, the fp32 state rows' lcm, instead of 10,166,272 B)
    parts = cache_parts(_flash(), torch.bfloat16)
    a = block_stride_alignment(parts)
    assert all(a % p.row_bytes == 0 for p in parts)
    fp8 = cache_parts(_flash(), torch.bfloat16, "fp8")
    assert block_stride_alignment(fp8) == 8192 and all(8192 % p.row_bytes == 0 for p in fp8 if p.format is None)
    _, t = allocate_packed(cache_parts(_flash(), torch.bfloat16)[:6], 3)
    for x in t.values():
        rows_view(x)                                        # every part's block stride is a whole number of rows


def test_the_plugin_registers_nothing_unless_switched_on(monkeypatch):
    """Without DSV4CORE_VLLM=1 the entry point returns before importing vLLM (so it works, and
    changes nothing, where vLLM is not installed)."""
    import sys

    from dsv4core.engines.vllm import plugin

    monkeypatch.delenv(plugin.SWITCH, raising=False)
    had = "vllm" in sys.modules
    assert plugin.register() is False
    assert ("vllm" in sys.modules) == had


@pytest.mark.parametrize("order", [1, -1, 0], ids=["window-first", "entries-first", "vllm-overlaid"])
def test_fp8_rows_in_engine_blocks_give_the_native_fp8_logits_bit_for_bit(order):
    # FP8 KV rows and FP4 keys (hal.rowformats) in the engine's packed blocks, viewed paged (HAL
    # 1.4): the block stride is a multiple of no 584 B / 68 B row, yet prefill chunks and decodes
    # through the adapter equal dsv4core's own FP8-KV cache bitwise (the same stored bytes, read in
    # the same order; the FP8 row's rope channels are bf16: a bf16 model)
    m = load_model("tiny-official", backend="reference", dtype=torch.bfloat16)   # head_dim 128: 64 + 64 rope
    m.use_graphs = False
    m.configure_cache(max_requests=8, max_tokens=4096, max_request_tokens=512, max_step_tokens=512, kv_dtype="fp8")
    # "vllm-overlaid": vLLM's packing (each group's pages side by side, the groups overlaid), whose
    # key pages lie between a layer's entries and the window pages: the key rows padded (tiny-official:
    # 34 B keys, 200 B KV rows -> 50 B, a key page of 64 rows = 16 KV rows; Flash dims: 68 -> 73 B)
    # make a key page whole KV rows; unpadded, the layer after a key page is refused
    parts = cache_parts(m.config, m.act_dtype, "fp8", align_key_pages=order == 0)
    assert {p.dtype for p in parts if p.part in ("window", "entries", "keys")} == {torch.uint8}
    groups = groups_like_vllm(parts)
    if order == 0:
        plain = cache_parts(m.config, m.act_dtype, "fp8")
        kv_b, key_b = (next(p.row_bytes for p in plain if p.part == k) for k in ("window", "keys"))
        assert (kv_b, key_b) == (200, 34) and {p.row_width for p in parts if p.part == "keys"} == {50}
        assert {p.row_width for p in cache_parts(_flash(), torch.bfloat16, "fp8", align_key_pages=True)
                if p.part == "keys"} == {73}
        with pytest.raises(ValueError, match=r"layers\.2: the entries pages start \d+ B after the layer's first page"):
            EnginePools(m.config, plain, allocate_overlaid(plain, groups_like_vllm(plain), 8), groups_like_vllm(plain))
    tensors = allocate_overlaid(parts, groups, 128) if order == 0 else None
    eng = MiniEngine(parts, groups, num_blocks=128, order=order or 1, tensors=tensors)
    kv_row = next(p.row_bytes for p in parts if p.part == "window")
    key_row = next(p.row_bytes for p in parts if p.part == "keys")
    stride = next(iter(eng.tensors.values())).untyped_storage().nbytes() // 128
    assert stride % kv_row and stride % key_row            # the flat row views could not address these
    pools = EnginePools(m.config, parts, eng.tensors, groups)
    assert pools.rows[1].dim() == 3 and pools.row_read == {"kv_format": "fp8", "kv_paged": True}
    prompts = {r: tokens(n, r) for r, n in enumerate((300, 70, 5, 140))}
    states = {r: m.new_state() for r in prompts}
    for s, sched in enumerate(step_plan(prompts)):
        inp = eng.step(sched, slot_mappings=s % 2 == 0)
        want = native_logits(m, states, sched, inp["positions"])
        got = m.forward_step(build_step(m, pools, **inp))
        assert torch.isfinite(want).all() and torch.equal(got, want), (s, (got - want).abs().max().item())


def test_paged_layer_view_addresses_both_pages_and_refuses_offsets_between_rows():
    from dsv4core.engines.vllm.pools import paged_layer_view

    # blocks of 100 B: a layer's window page (3 rows of 12 B) at byte 40, its entries (2 rows) at 4
    buf = torch.arange(5 * 100, dtype=torch.int32).to(torch.uint8)
    win = torch.as_strided(buf, (5, 3, 12), (100, 12, 1), 40)
    ent = torch.as_strided(buf, (5, 2, 12), (100, 12, 1), 4)
    view, (wb, J), (eb, J2) = paged_layer_view(win, ent, "layers.1")
    assert (wb, eb, J, J2) == (3, 0, 6, 6) and view.shape == (5, 6, 12)
    for b in range(5):
        for o in range(3):
            r = b * J + wb + o
            assert torch.equal(view[r // J, r % J], win[b, o])
        for o in range(2):
            r = b * J + eb + o
            assert torch.equal(view[r // J, r % J], ent[b, o])
    off = torch.as_strided(buf, (5, 2, 12), (100, 12, 1), 10)       # 30 B before the window: not whole rows
    with pytest.raises(ValueError, match="layers.1: the window pages start 30 B after"):
        paged_layer_view(win, off, "layers.1")
    after = torch.as_strided(buf, (5, 2, 12), (100, 12, 1), 76)     # the entries right after the window page
    _, (wb, J), (eb, _) = paged_layer_view(win, after, "layers.1")
    assert (wb, eb, J) == (0, 3, 5)
    far = torch.as_strided(buf, (4, 2, 12), (100, 12, 1), 40 + 7 * 12)   # 84 B after the window: past a block
    with pytest.raises(ValueError, match="span 108 B, more than the block stride 100 B"):
        paged_layer_view(win[:4], far, "layers.1")


# ------------------------------------------------------------------ prefix-cache hits

#: logits against dsv4core's own prefill of the whole prompt: the engine steps chunk the prompt
#: differently, so fp32 rounds differently; the bound of tests/test_model_engine.py for a chunked
#: against a whole prefill, 2e-5 x max|logit| (measured ~1e-6 there, under 1e-6 here)
TOL = 2e-5


class _CachingEngine(MiniEngine):
    """The engine stand-in with vLLM's prefix cache: a block a sliding group releases stays cached
    (it leaves the request's table but is not handed out again; vLLM evicts cached blocks only when
    it runs out of free ones, which these tests never do), and `hit` gives a new request another's
    blocks of its first n tokens (whole blocks of every group), as vLLM's allocator does."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.held = {g: {} for g in self.info}        # request -> every block its table listed

    def _release(self, b):
        pass

    def step(self, sched, **kw):
        inp = super().step(sched, **kw)
        for g, bt in inp["block_tables"].items():     # the tables as the step saw them, before releases
            for (rid, _), row in zip(sched, bt.tolist()):
                held = self.held[g].setdefault(rid, [])
                held += [0] * (len(row) - len(held))
                for j, b in enumerate(row):
                    held[j] = b or held[j]
        return inp

    def hit(self, src, dst, n):
        """Request `dst` starts with a prefix-cache hit on `src`'s first `n` tokens: its tables list
        `src`'s blocks of them, and the null block where a sliding group's block holds no position
        the first new token reads (vLLM's sliding-window hit). `src`'s blocks of tokens it has not
        computed yet are allocated now: `src` computes them in the step that `dst` first runs in."""
        for g, (bs, win) in self.info.items():
            assert n % bs == 0, (g, n, bs)
            t = self.tables[g].setdefault(src, [])
            while len(t) * bs < n:
                t.append(self.free.pop())
            held = self.held[g].setdefault(src, [])
            blocks = [t[j] or (held[j] if j < len(held) else 0) for j in range(n // bs)]
            if win is not None:
                blocks = [0 if (j + 1) * bs <= n - win + 1 else b for j, b in enumerate(blocks)]
            assert all(blocks[j] for j in range(len(blocks)) if win is None or (j + 1) * bs > n - win + 1), g
            self.tables[g][dst] = blocks
        self.computed[dst] = n


def _caching_engine(m):
    m.configure_cache(max_requests=8, max_tokens=4096, max_request_tokens=512, max_step_tokens=512)
    parts = cache_parts(m.config, m.act_dtype)
    groups = groups_like_vllm(parts)
    eng = _CachingEngine(parts, groups, num_blocks=512)
    # the tiny model's compressor states: blocks of 4 tokens (rate 4) and 8 (rate 16)
    assert {p.block_tokens for p in parts if p.part == "state"} == {4, 8}
    return eng, EnginePools(m.config, parts, eng.tensors, groups)


def _close(got, want, what):
    assert torch.isfinite(want).all()
    d, bound = (got - want).abs().max().item(), TOL * want.abs().max().item()
    assert d <= bound, f"{what}: max |logit - own prefill's| {d:.3g} > {bound:.3g}"


def test_a_prefix_hit_on_blocks_a_chunk_crossed_in_their_middle(tiny):
    """Request 0's prompt runs in two chunks split at position 254, inside a compressor-state block
    of both rates (4-token blocks 252..255, 8-token 248..255); request 1 then hits the cache on its
    first 256 tokens (one compressed block, whole blocks of every group), and its first entry of
    rate 4 (position 259) reads the state rows of positions 252..255 from request 0's blocks, rows
    of both of request 0's chunks. Request 1's logits equal dsv4core's own prefill of its whole
    prompt (within the bound of a chunked against a whole prefill): every state row a chunk
    computes is written, not only the last ones its own request reads again."""
    m = tiny
    eng, pools = _caching_engine(m)
    shared = tokens(256, 21)
    a, b = shared + tokens(44, 22), shared + tokens(40, 23)
    for sched in ([(0, a[:254])], [(0, a[254:])]):
        m.forward_step(build_step(m, pools, **eng.step(sched)))
    eng.hit(0, 1, 256)
    got = m.forward_step(build_step(m, pools, **eng.step([(1, b[256:])])))
    _close(got, m.logits(b)[256:], "request 1")


def test_a_prefix_hit_on_blocks_computed_in_the_same_step(tiny):
    """One step holds request 0's second prefill chunk (positions 200..299) and request 1, whose
    prefix-cache hit covers request 0's first 256 tokens (a hit on the prefix of a running prefill,
    as vLLM hands out blocks once they are scheduled): request 1's first entry of rate 4 reads the
    state rows of positions 252..255, which request 0 writes in this very step (the state writes
    land after the last layer), so it must take request 0's rows of this step. Both requests'
    logits equal dsv4core's own prefill of their whole prompts (the bound of a chunked against a
    whole prefill)."""
    m = tiny
    eng, pools = _caching_engine(m)
    shared = tokens(256, 31)
    a, b = shared + tokens(44, 32), shared + tokens(40, 33)
    m.forward_step(build_step(m, pools, **eng.step([(0, a[:200])])))
    eng.hit(0, 1, 256)
    got = m.forward_step(build_step(m, pools, **eng.step([(0, a[200:]), (1, b[256:])])))
    _close(got[:100], m.logits(a)[200:], "request 0")
    _close(got[100:], m.logits(b)[256:], "request 1")
