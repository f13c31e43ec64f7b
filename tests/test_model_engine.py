"""The engine-grade model core: pooled state (fork, truncate, release, pool exhaustion),
exception safety, the static (graph) decode step, continuous batching, and the pure index
builder (dsv4core/model/indexing.py). fp32 on the CPU reference backend; logits compared with a
bound of 2e-5 x max|logit| (fp32 rounding of a 4-layer model, measured ~1e-6), or bit-identical
where the same computation runs on the same inputs."""

from __future__ import annotations

import pytest
import torch

from dsv4core.model import CacheConfig, CacheError, InputError, PoolFullError
from dsv4core.model import indexing as ix
from dsv4core.model.api import build_model, load_model

TOL = 2e-5


@pytest.fixture()
def tiny():
    m = load_model("tiny", backend="reference")
    m.configure_cache(max_requests=6, max_tokens=2048, max_request_tokens=512, max_step_tokens=512,
                      max_rollback=8, window_block=8, block_tokens=32)
    return m


def _seq(n, seed=0, V=256):
    return torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(seed))


def _prefill(m, st, ids):
    n = ids.numel()
    return m.forward_batch(ids, torch.arange(st.length, st.length + n), torch.zeros(n, dtype=torch.long), [st])


def _decode(m, sts, toks):
    return m.forward_batch(torch.tensor(toks), torch.tensor([s.length for s in sts]), torch.arange(len(sts)), sts)


def _close(a, b, scale):
    assert (a - b).abs().max().item() <= TOL * scale, (a - b).abs().max().item()


def test_fork_continues_exactly_as_its_original(tiny):
    ids = _seq(90)
    ref = tiny.logits(ids)
    a = tiny.new_state()
    _prefill(tiny, a, ids[:45])                 # mid-block: the fork shares partial blocks
    b = a.fork()
    assert b.length == 45 and b.slot != a.slot
    la = _prefill(tiny, a, ids[45:])
    lb = _prefill(tiny, b, ids[45:])            # copy-on-write: a's blocks stay intact
    assert torch.equal(la, lb)
    _close(la, ref[45:], ref.abs().max())
    # the original, after its fork wrote, still continues correctly (its blocks were not touched)
    c = tiny.new_state()
    _prefill(tiny, c, ids[:45])
    d = c.fork()
    _prefill(tiny, d, _seq(30, seed=5))         # the fork diverges
    _close(_prefill(tiny, c, ids[45:]), ref[45:], ref.abs().max())


def test_truncate_then_redecode_equals_never_having_decoded(tiny):
    ids, other = _seq(70, 1), _seq(6, 2)
    ref = tiny.logits(ids)
    st = tiny.new_state()
    _prefill(tiny, st, ids[:60])
    for t in other.tolist():                    # drafts that get rejected
        _decode(tiny, [st], [t])
    st.truncate(60)
    assert st.length == 60
    out = [_decode(tiny, [st], [t]) for t in ids[60:].tolist()]
    _close(torch.cat(out), ref[60:], ref.abs().max())


def test_truncate_and_fork_errors_change_nothing(tiny):
    st = tiny.new_state()
    _prefill(tiny, st, _seq(100))
    lo = tiny.cache.truncate_limit(st)
    assert 0 < lo <= 100
    for bad in (101, -1, lo - 1):
        with pytest.raises(CacheError, match=r"slot|truncate"):
            st.truncate(bad)
        assert st.length == 100
    st.release()
    with pytest.raises(CacheError, match="released"):
        st.fork()
    with pytest.raises(CacheError, match="released"):
        st.truncate(3)
    with pytest.raises(InputError, match="released"):
        _decode(tiny, [st], [3])


def test_release_frees_blocks_and_slots_for_reuse(tiny):
    c = tiny.cache
    free0 = (len(c.win_pool.free), len(c.comp_pool.free), len(c.free_slots))
    sts = [tiny.new_state() for _ in range(3)]
    for i, s in enumerate(sts):
        _prefill(tiny, s, _seq(70, i))
    f = sts[0].fork()
    for s in sts + [f]:
        s.release()
    assert (len(c.win_pool.free), len(c.comp_pool.free), len(c.free_slots)) == free0
    g = tiny.new_state()                         # garbage collection releases too
    _prefill(tiny, g, _seq(40))
    del g
    import gc

    gc.collect()
    assert (len(c.win_pool.free), len(c.comp_pool.free), len(c.free_slots)) == free0


def test_full_pool_is_an_error_with_nothing_changed(tiny):
    tiny.configure_cache(max_requests=2, max_tokens=64, max_request_tokens=512, max_step_tokens=512,
                         window_block=8, block_tokens=32)
    a, b = tiny.new_state(), tiny.new_state()
    with pytest.raises(PoolFullError, match="request slot"):
        tiny.new_state()
    # 64 tokens in 32-token blocks, one partial block per request: 2 + 2 blocks
    assert tiny.cache.comp_pool.n - 1 == 4
    _prefill(tiny, a, _seq(40))                  # 2 of the 4 compressed blocks
    snap = [t.clone() for t in tiny.cache.rows], tiny.cache.comp_table.copy(), len(tiny.cache.comp_pool.free)
    with pytest.raises(PoolFullError, match="compressed-entry block"):   # b needs 3 more
        tiny.forward_batch(torch.cat([_seq(3), _seq(70)]), torch.tensor([40, 41, 42] + list(range(70))),
                           torch.tensor([0] * 3 + [1] * 70), [a, b])
    assert a.length == 40 and b.length == 0
    assert all(torch.equal(x, y) for x, y in zip(snap[0], tiny.cache.rows))
    assert (tiny.cache.comp_table == snap[1]).all() and len(tiny.cache.comp_pool.free) == snap[2]


def test_failure_in_a_late_layer_then_retry_gives_clean_logits(tiny):
    ids = _seq(50, 3)
    ref = tiny.logits(ids)
    st = tiny.new_state()
    _prefill(tiny, st, ids[:41])
    layer = tiny.model.layers[3].mlp              # this layer's module only (every MoE shares the class)
    reached = []

    def boom(x, input_ids):
        reached.append(3)
        raise RuntimeError("injected MoE failure")

    for n in (1, 9):                              # a decode step and a prefill chunk
        layer.forward = boom
        try:
            with pytest.raises(RuntimeError, match="injected"):
                _prefill(tiny, st, ids[41:41 + n])
        finally:
            del layer.forward                     # the class's forward again
        assert st.length == 41
    assert reached == [3, 3]                      # the failure fired in layer 3, after layers 0..2 ran
    _close(_prefill(tiny, st, ids[41:]), ref[41:], ref.abs().max())


def test_failed_step_leaves_a_block_shared_with_a_longer_holder_intact(tiny):
    """A fork and its truncated original share the blocks holding positions 42..44, which only
    the fork has committed. A step writing both (the fork first) copies the block for the fork
    and used to let the original, then its last holder, write it in place; when the step then
    failed, the rollback handed the block back to the fork with the original's rows at 42..45
    (window rows and compressed entry 10). No holder writes a shared block in place."""
    ids = _seq(60, 7)
    ref = tiny.logits(ids)
    a = tiny.new_state()
    _prefill(tiny, a, ids[:45])
    b = a.fork()
    a.truncate(42)                               # mid window block and mid compressed block
    layer = tiny.model.layers[3].mlp             # the last layer: every compressor has stored

    def boom(x, input_ids):
        raise RuntimeError("injected MoE failure")

    layer.forward = boom
    try:
        with pytest.raises(RuntimeError, match="injected"):
            tiny.forward_batch(torch.cat([ids[45:46], _seq(4, 9)]), torch.tensor([45, 42, 43, 44, 45]),
                               torch.tensor([0, 1, 1, 1, 1]), [b, a])
    finally:
        del layer.forward
    assert (a.length, b.length) == (42, 45)
    _close(_prefill(tiny, b, ids[45:]), ref[45:], ref.abs().max())
    _close(_prefill(tiny, a, ids[42:]), ref[42:], ref.abs().max())


def test_static_decode_step_equals_the_eager_one(tiny):
    """The step a recorded graph replays (bucket padding, every token an emission candidate,
    entry tables at full capacity) computes what the eager step computes: run here without
    recording (the CPU), on requests crossing window, compressor and block boundaries."""
    from dsv4core.model.graphs import DecodeGraphs

    sts = [tiny.new_state() for _ in range(3)]
    for i, s in enumerate(sts):
        _prefill(tiny, s, _seq(13 + 9 * i, i))
    forks = [s.fork() for s in sts]
    g = DecodeGraphs(tiny, (4,), capture=None)
    for step in range(12):                   # crosses CSA windows (m=4) and a window block (8)
        toks = [int(t) for t in _seq(3, 100 + step)]
        eager = _decode(tiny, sts, toks)
        c = tiny.cache
        plan = c.prepare(forks, [1, 1, 1])
        c.sync_tables()
        inputs = torch.zeros(4, 4, dtype=torch.int64)
        inputs[0, :3], inputs[1, :3] = torch.tensor(toks), torch.tensor([s.length for s in forks])
        inputs[2, :3], inputs[3, :3] = torch.tensor([s.slot for s in forks]), 1
        ctx = g.context_bucket(int(inputs[1].max()) + 1) if step % 2 else None   # bucketed, or full width
        static = tiny._forward(g._step(inputs, 4, ctx))[:3]
        plan.commit()
        _close(static, eager, eager.abs().max())


class _ReplayByRerun:
    """A stand-in graph capture for the CPU: the 'replay' re-runs the recorded function, which
    reads the static input buffer and refills the static outputs, as a device graph would."""

    def new_pool(self, device):
        return None

    def capture(self, fn, device, pool=None):
        out = fn()
        return (lambda: out.copy_(fn())), out


def test_graph_decode_path_equals_the_eager_one(tiny):
    """forward_batch's graph path (bucket padding, the host staging buffer, logits_rows picked
    after the replay) returns the eager step's logits and leaves the same state; a step that
    fails in the replay changes nothing."""
    sts = [tiny.new_state() for _ in range(3)]
    for i, s in enumerate(sts):
        _prefill(tiny, s, _seq(13 + 9 * i, i))
    forks = [s.fork() for s in sts]
    tiny._graph_why = ((id(tiny.ops), tiny.device), "", _ReplayByRerun())
    # rows: a permutation with a repeat and a negative row; more rows than the bucket (4) holds
    choices = (None, torch.tensor([2, -3, 0, 2]), torch.tensor([1, -1, 0, 2, 2, -2]))
    for step in range(10):                               # crosses CSA windows (m=4) and a window block (8)
        toks = [int(t) for t in _seq(3, 100 + step)]
        tiny.use_graphs = False
        eager = _decode(tiny, sts, toks)
        tiny.use_graphs = True
        rows = choices[step % 3]
        picked = tiny.forward_batch(torch.tensor(toks), torch.tensor([s.length for s in forks]), torch.arange(3),
                                    forks, logits_rows=rows)
        _close(picked, eager if rows is None else eager[rows], eager.abs().max())
    assert tiny._graphs.replays == 10 and [s.length for s in forks] == [s.length for s in sts]
    c = tiny.cache
    c.sync_tables()                                      # the device tables mirror the host ones
    assert torch.equal(c.window_table_dev, torch.from_numpy(c.window_table))
    assert torch.equal(c.comp_table_dev, torch.from_numpy(c.comp_table))
    replay, inputs, out = tiny._graphs.graphs[next(iter(tiny._graphs.graphs))]
    tiny._graphs.graphs = {k: (lambda: 1 / 0, inputs, out) for k in tiny._graphs.graphs}
    before = [(s.length, s.ring_hi, s.win_lo) for s in forks], tiny.cache.window_table.copy()
    with pytest.raises(ZeroDivisionError):
        _decode(tiny, forks, [5, 6, 7])
    assert [(s.length, s.ring_hi, s.win_lo) for s in forks] == before[0]
    assert (tiny.cache.window_table == before[1]).all()


def test_device_tokens_decode_equals_host_ids(tiny):
    """Greedy decode fed by `greedy_tokens` (ids left on the device, never read by the host)
    computes bit for bit what the same decode fed host ids computes, on the eager path and on
    the graph path (the CPU stand-in capture), across window, compressor and block boundaries."""
    base = [tiny.new_state() for _ in range(2)]      # + 2 forks each: the 6 slots
    for i, s in enumerate(base):
        _prefill(tiny, s, _seq(13 + 9 * i, i))
    for graphs in (False, True):
        if graphs:
            tiny._graph_why = ((id(tiny.ops), tiny.device), "", _ReplayByRerun())
        tiny.use_graphs = graphs
        host, dev = [s.fork() for s in base], [s.fork() for s in base]
        lh = ld = _decode(tiny, host, [3, 4])
        _decode(tiny, dev, [3, 4])
        for _ in range(10):
            lh = _decode(tiny, host, lh.argmax(-1).tolist())
            toks = tiny.greedy_tokens(ld)
            assert len(toks) == 2 and toks.tensor.device == tiny.device
            ld = tiny.forward_batch(toks, torch.tensor([s.length for s in dev]), torch.arange(2), dev)
            assert torch.equal(ld, lh)
        assert [s.length for s in dev] == [s.length for s in host]
        for s in host + dev:
            s.release()
    assert tiny._graphs.replays == 22                  # 11 steps each on host and device ids


def test_device_tokens_bad_input_is_refused_with_nothing_changed(tiny):
    from dsv4core.model.model import DeviceTokens

    st = tiny.new_state()
    lg = _prefill(tiny, st, _seq(9))
    with pytest.raises(InputError, match=r"greedy_tokens: logits must be \[N, 256\]"):
        tiny.greedy_tokens(lg[:, :10])
    with pytest.raises(InputError, match="greedy_tokens: logits must be"):
        tiny.greedy_tokens(lg[0])
    toks = tiny.greedy_tokens(lg[-1:])
    with pytest.raises(InputError, match="must have the same length"):
        tiny.forward_batch(toks, torch.tensor([9, 10]), torch.tensor([0, 0]), [st])
    with pytest.raises(InputError, match="DeviceTokens of vocabulary 300"):
        tiny.forward_batch(DeviceTokens(toks.tensor, 300), torch.tensor([9]), torch.tensor([0]), [st])
    for bad in (toks.tensor.view(1, 1), toks.tensor.float()):
        with pytest.raises(InputError, match="DeviceTokens must hold a 1-D int64 / int32 tensor"):
            tiny.forward_batch(DeviceTokens(bad, 256), torch.tensor([9]), torch.tensor([0]), [st])
    assert st.length == 9
    tiny.forward_batch(toks, torch.tensor([9]), torch.tensor([0]), [st])
    assert st.length == 10


def test_uploads_fall_back_to_blocking_copies_without_page_locked_memory():
    """Where no page-locked memory can be had (this CPU-only build: pin_memory raises), an upload
    is a plain copy, exact, and the ring stops trying."""
    import numpy as np

    from dsv4core.model.staging import Uploads

    up = Uploads(torch.device("cpu"))
    assert not up.queued                               # the CPU never queues
    up.queued = True                                   # as on an accelerator whose pinning fails
    dst = torch.zeros(3, 4, dtype=torch.int32)
    src = np.arange(12, dtype=np.int32).reshape(3, 4)
    up.copy(dst, src)
    assert torch.equal(dst, torch.from_numpy(src)) and not up.queued
    assert torch.equal(up.to_device(src[1]), torch.from_numpy(src[1]))
    with pytest.raises(ValueError, match="upload: host torch.int64 x 12 into torch.int32 x 12"):
        up.copy(dst, src.astype(np.int64))


def test_generate_continuous_batching_equals_one_request_at_a_time(tiny):
    prompts = [list(range(5, 45)), [3, 4], list(range(100, 133)), [7] * 20]
    alone = [tiny.generate([p], 6)[0] for p in prompts]
    tiny.configure_cache(max_requests=2, max_tokens=2048, max_request_tokens=512, max_step_tokens=64)
    assert tiny.generate(prompts, 6) == alone            # 4 prompts through 2 slots
    assert tiny.generate(prompts, 6, prefill_chunk=9) == alone
    assert not tiny.cache.live and len(tiny.cache.free_slots) == 2


def _greedy_alone(m, prompt, max_new, eos):
    """The oracle: one request, host ids every step, stop at max_new or eos."""
    st = m.new_state()
    try:
        lg = _prefill(m, st, torch.tensor(prompt))[-1:]
        out = []
        while True:
            out.append(int(lg.argmax(-1)))
            if len(out) >= max_new or out[-1] == eos:
                return out
            lg = _decode(m, [st], out[-1:])
    finally:
        st.release()


def test_generate_queued_steps_equal_the_host_loop(tiny):
    """generate feeds all-decode steps the last step's tokens on the device and reads them one
    step late: the results equal a plain host loop per prompt, with eos stops (found one step
    late: that request's extra step is dropped), max_new stops, and slots reused by waiting
    prompts; most decode steps take the queued path."""
    from dsv4core.model.model import DeviceTokens

    prompts = [list(range(5, 45)), [3, 4], list(range(100, 133)), [7] * 20, [9, 8, 7, 6]]
    free = [_greedy_alone(tiny, p, 12, None) for p in prompts]
    eos = free[0][3]                                   # a token the first prompt emits early
    want = [_greedy_alone(tiny, p, 12, eos) for p in prompts]
    assert any(len(w) < 12 for w in want)              # some request stops at eos
    tiny.configure_cache(max_requests=2, max_tokens=2048, max_request_tokens=512, max_step_tokens=64)
    seen = []
    fb = tiny.forward_batch

    def spy(ids, *a, **k):
        seen.append(isinstance(ids, DeviceTokens))
        return fb(ids, *a, **k)

    tiny.forward_batch = spy
    try:
        assert tiny.generate(prompts, 12, eos_token_id=eos) == want
        assert tiny.generate(prompts, 12) == free
    finally:
        del tiny.forward_batch
    assert sum(seen) > len(seen) / 2, seen
    assert not tiny.cache.live and len(tiny.cache.free_slots) == 2


# ------------------------------------------------------------------ the index builder (pure)

def test_index_builder_against_a_python_model():
    g = torch.Generator().manual_seed(0)
    S, nb, B = 3, 6, 4
    table = torch.randint(1, 20, (S, nb), generator=g, dtype=torch.int32)
    slot = torch.tensor([2, 0, 1, 1])
    pos = torch.tensor([0, 5, 13, 22])
    valid = torch.tensor([True, True, True, False])
    win = ix.window_reads(table, slot, pos, ~valid, B, 5)
    for t in range(4):
        for j in range(5):
            q = int(pos[t]) - 4 + j
            want = -1 if (q < 0 or not valid[t]) else int(table[slot[t], q // B]) * B + q % B
            assert int(win[t, j]) == want
    ent = ix.entry_reads(table, slot, pos, ~valid, 4, 2, 7, base=100)
    for t in range(4):
        vis = (int(pos[t]) + 1) // 4 if valid[t] else 0
        for w in range(7):
            want = 100 + int(table[slot[t], w // 2]) * 2 + w % 2 if w < vis else -1
            assert int(ent[t, w]) == want
    e, dest = ix.emissions(table, slot, pos, ~valid, torch.arange(4), 2, 8)
    for t in range(4):
        p = int(pos[t])
        emits = (p + 1) % 2 == 0 and bool(valid[t])
        if valid[t]:                             # (a padding token's entry is never used)
            assert int(e[t]) == max((p + 1) // 2 - 1, 0)
        assert int(dest[t]) == (int(table[slot[t], int(e[t]) // 8]) * 8 + int(e[t]) % 8 if emits else -1)
    start = torch.tensor([0, 3, 12, 20])
    new, ring, from_new, masked = ix.window_sources(slot, pos, start, torch.arange(4), e * 2, 2, True, 5)
    for t in range(4):
        for s in range(4):
            q = int(e[t]) * 2 - 2 + s
            assert bool(masked[t, s]) == (q < 0)
            assert bool(from_new[t, s]) == (q >= int(start[t]))
            assert int(new[t, s]) == min(max(t + q - int(pos[t]), 0), 3)   # clamped to a flat index of the step
            assert int(ring[t, s]) == int(slot[t]) * 5 + q % 5   # Python's floor modulo, as torch's
    # a decode step (start = pos): the one slot from the step is the candidate itself
    full = ix.window_sources(slot, pos, pos, torch.arange(4), e * 2, 2, True, 5)
    dec = ix.window_sources(slot, pos, pos, torch.arange(4), e * 2, 2, True, 5, decode=True)
    assert dec[0].tolist() == [[0], [1], [2], [3]]
    assert all(torch.equal(a, b) for a, b in zip(full[1:], dec[1:]))
    assert all(int(full[0][t, s]) == t for t in range(4) for s in range(4) if full[2][t, s] and int(e[t]) * 2 + s - 2 <= int(pos[t]))
    rw = ix.ring_writes(slot, pos, torch.tensor([1, 6, 14, 23]), ~valid, torch.arange(4), 3)
    assert rw.tolist() == [2 * 3 + 0, 0 * 3 + 2, 1 * 3 + 1, -1]
    rw = ix.ring_writes(slot, pos, torch.tensor([1, 6, 19, 23]), ~valid, torch.tensor([1, 2, 3]), 3)
    assert rw.tolist() == [0 * 3 + 2, -1, -1]                 # 13 < 19 - 3: not among the last 3
    # a decode step (end=None: each token its request's last) and no padding (pad=None)
    assert ix.ring_writes(slot, pos, None, None, torch.arange(4), 3).tolist() == [6, 2, 4, 4]
    assert ix.window_reads(table, slot, pos, None, B, 5)[:3].tolist() == win[:3].tolist()
    assert ix.entry_reads(table, slot, pos, None, 4, 2, 7, base=100)[:3].tolist() == ent[:3].tolist()


def test_cache_config_errors():
    with pytest.raises(ValueError, match="max_requests"):
        CacheConfig(max_requests=0)
    m = build_model(load_model("tiny").config, backend="reference")
    with pytest.raises(ValueError, match="block_tokens"):
        m.configure_cache(block_tokens=30)
    st = m.new_state()
    with pytest.raises(CacheError, match="live"):
        m.configure_cache()
    st.release()
    m.configure_cache(max_request_tokens=16)
    with pytest.raises(CacheError, match="max_request_tokens"):
        m.forward_batch(_seq(17), torch.arange(17), torch.zeros(17, dtype=torch.long), [m.new_state()])


def _ring_write_fails(model, nth: int, run) -> None:
    """Run `run()` with the `nth` compressor-ring store of the step raising; returns after the raise."""
    c, ops = model.cache, model.ops
    rings = {r.data_ptr() for rs in c.rings if rs for r in rs.values()}
    real, calls = ops.cache_store, [0]

    def flaky(pool, index, rows):
        if pool.data_ptr() in rings:
            calls[0] += 1
            if calls[0] == nth:
                raise RuntimeError("injected ring-write failure")
        return real(pool, index, rows)

    object.__setattr__(ops, "cache_store", flaky)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            run()
    finally:
        object.__setattr__(ops, "cache_store", real)
    assert calls[0] == nth


def test_failure_in_the_ring_writes_then_retry_gives_clean_logits(tiny):
    """The compressor-ring writes come last; a 32-token chunk overwrites ring rows the committed
    state reads, so a failure part way through them must put those rows back."""
    ids = _seq(120)
    ref = tiny.logits(ids)
    a = tiny.new_state()
    _prefill(tiny, a, ids[:45])
    _ring_write_fails(tiny, 3, lambda: _prefill(tiny, a, ids[45:77]))
    assert a.length == 45
    _close(_prefill(tiny, a, ids[45:]), ref[45:], ref.abs().max())


def test_failed_decode_ring_write_then_deepest_truncation_gives_clean_logits(tiny):
    """A one-token step overwrites the ring row of position length - cap, which a truncation to
    `truncate_limit` can still need (CSA here: the previous window's A halves, at 48 for a
    truncation of 64 to 55): a decode step too keeps the rows it replaces until every ring write
    has landed, and puts them back when one fails."""
    ids = _seq(80, 5)
    ref = tiny.logits(ids)
    a = tiny.new_state()
    _prefill(tiny, a, ids[:64])
    # the last of the 5 ring writes (layers 1, 2, 3; CSA: compressor and indexer) fails
    _ring_write_fails(tiny, 5, lambda: _decode(tiny, [a], [int(ids[64])]))
    assert a.length == 64
    n = tiny.cache.truncate_limit(a)
    assert n <= 55                               # deep enough to read position 64 - cap = 48 again
    a.truncate(n)
    _close(_prefill(tiny, a, ids[n:]), ref[n:], ref.abs().max())


def test_generate_with_resources_held_outside_it(tiny):
    """generate waits for blocks other live requests hold, and says so when nothing can run."""
    tiny.configure_cache(max_requests=3, max_tokens=320, max_request_tokens=512, block_tokens=32)
    prompts = [list(range(5, 105)), list(range(9, 109))]
    alone = [tiny.generate([p], 12)[0] for p in prompts]
    held = tiny.new_state()
    _prefill(tiny, held, _seq(180))              # 6 of the pool's 13 blocks
    assert tiny.generate(prompts, 12) == alone   # one prompt (4 blocks) at a time
    other, third = tiny.new_state(), tiny.new_state()   # every slot now held outside generate
    with pytest.raises(PoolFullError, match="no free request slot"):
        tiny.generate(prompts, 2)
    other.release()
    third.release()
    with pytest.raises(PoolFullError, match="compressed blocks"):
        tiny.generate([list(range(2, 250))], 2)  # 8 blocks, 7 free


def test_positions_and_ids_must_be_1d_integers(tiny):
    st = tiny.new_state()
    with pytest.raises(InputError, match="positions must hold integers"):
        tiny.forward_batch(torch.tensor([3, 4]), torch.tensor([0.0, 1.0]), torch.zeros(2, dtype=torch.long), [st])
    with pytest.raises(InputError, match="input_ids must be 1-D"):
        tiny.forward_batch(torch.tensor([[3, 4]]), torch.arange(2), torch.zeros(2, dtype=torch.long), [st])
    assert st.length == 0


# ------------------------------------------------------------------ packed projections

def test_packed_projections_are_views_and_follow_replaced_weights():
    """A compressor's kv / gate projections (and the CSA indexer's head weights) run as one GEMM
    over one packed tensor whose row blocks the parameters become; state-dict names and values
    stay, an in-place load writes through, a replaced weight is packed again, and an FP8
    projection (block scale) is not packed: its outputs come from separate GEMMs, the same values."""
    from dsv4core.model.modules import FP8, _project, packed_weight

    m = load_model("tiny", backend="reference")
    ix_mod = m.model.layers[1].self_attn.compressor.indexer
    lins = (ix_mod.kv_proj, ix_mod.gate_proj, ix_mod.scorer.weights_proj)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    x = torch.randn(5, m.config.hidden_size, generator=torch.Generator().manual_seed(1))
    want = torch.cat([x @ lin.weight.T for lin in lins], dim=1)
    got = _project(m.ops, ix_mod, x, ix_mod.scorer.weights_proj)
    # fp32 throughout; a GEMM's blocking may depend on its width, so fp32 rounding (assert_close's
    # fp32 defaults, rtol 1.3e-6) rather than bit equality
    torch.testing.assert_close(got, want)
    packed = ix_mod._wkg
    assert all(lin.weight.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr() for lin in lins)
    assert m.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())
    with torch.no_grad():
        ix_mod.gate_proj.weight.mul_(2)                          # in place: seen by the packed GEMM
    assert packed_weight(lins, packed) is packed
    g = slice(2 * m.config.index_head_dim, 4 * m.config.index_head_dim)   # the gate columns
    torch.testing.assert_close(_project(m.ops, ix_mod, x, ix_mod.scorer.weights_proj)[:, g], 2 * want[:, g])
    ix_mod.kv_proj.weight = torch.nn.Parameter(torch.zeros_like(ix_mod.kv_proj.weight), requires_grad=False)
    assert packed_weight(lins, packed) is not packed             # replaced: packed again, zeros included
    assert not _project(m.ops, ix_mod, x, None)[:, :2 * m.config.index_head_dim].any()
    ix_mod.kv_proj.keep_fp8()                                    # FP8 + block scale: not packable
    with torch.no_grad():
        ix_mod.kv_proj.weight.copy_(torch.randn(ix_mod.kv_proj.weight.shape, generator=torch.Generator().manual_seed(2)).to(FP8))
        ix_mod.kv_proj.weight_scale_inv.fill_(0.5)
    assert packed_weight(lins, ix_mod._wkg) is None
    sep = torch.cat([lin(x, torch.float32) for lin in lins], dim=1)
    torch.testing.assert_close(_project(m.ops, ix_mod, x, ix_mod.scorer.weights_proj), sep, rtol=0, atol=0)  # same GEMMs


def test_shared_expert_hands_moe_experts_the_same_weight_tensors_while_unchanged():
    """The shared expert's [1, N, K] weights are the same tensor objects from step to step (a
    backend may cache per-weight work, e.g. a transposed copy keyed by the tensor), and new ones
    once a weight is replaced; the values are the packed gate/up rows and the down weight."""
    m = load_model("tiny", backend="reference")
    sh = m.model.layers[0].mlp.shared_experts
    from dsv4core.model.modules import OpsRef

    seen, table = [], sh._ops.t

    class Spy:                                      # the bound table, moe_experts recorded
        def __getattr__(self, name):
            return getattr(table, name)

        def moe_experts(self, x, ids, wts, w13, w2, *rest):
            seen.append((w13, w2))
            return table.moe_experts(x, ids, wts, w13, w2, *rest)

    x = torch.randn(3, m.config.hidden_size, generator=torch.Generator().manual_seed(3))
    sh._ops = OpsRef(Spy())
    sh(x), sh(x)
    assert seen[0][0] is seen[1][0] and seen[0][1] is seen[1][1]
    torch.testing.assert_close(seen[0][0][0], torch.cat([sh.gate_proj.weight, sh.up_proj.weight]), rtol=0, atol=0)
    sh.down_proj.weight = torch.nn.Parameter(torch.zeros_like(sh.down_proj.weight), requires_grad=False)
    assert not sh(x).any()                          # the new (zero) down weight is used
    assert seen[2][0] is seen[0][0] and seen[2][1] is not seen[0][1]
