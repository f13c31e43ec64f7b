"""Graph steps of any shape (dsv4core/model/step_graphs.py): prefill chunks, mixed steps, verify
steps (1 + k tokens a request), replayed through a CPU stand-in capture whose replay re-runs the
recorded function on the static buffers, as a device graph would.

Tolerance: the replayed step computes the eager step's formula on the same inputs, padded to the
token bucket and with entry tables as wide as the context bucket. On the CPU reference kernels a
token's rounding depends on those shapes (GEMMs of fewer than 4 rows take another path; the
vectorised elementwise loops round the last < 16 values of a tensor in scalar code; the batched
products of attention and indexer block their contraction by the table width), the same fp32
rounding that separates two eager steps of different sizes: logits and stored rows agree to 2e-5 x
their largest magnitude (measured ~1e-6, test_model_engine's bound). A step with the eager
step's shapes is checked bit for bit, and so is what padding must not do: write anything outside
the step's own requests."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv4core.model.api import TINY_CONFIG, build_model
from dsv4core.model.config import CSA, HCA

TOL = 2e-5


class _ReplayByRerun:
    """Stand-in graph capture: 'replay' re-runs the recorded function and refills its outputs."""

    def __init__(self) -> None:
        self.pools: list = []

    def new_pool(self, device):
        self.pools.append(object())
        return self.pools[-1]

    def capture(self, fn, device, pool=None):
        assert pool is not None and pool is self.pools[0]        # every graph of the model shares one pool
        out = fn()

        def replay():
            new = fn()
            for o, n in zip(out if isinstance(out, tuple) else (out,), new if isinstance(new, tuple) else (new,)):
                o.copy_(n)
        return replay, out


@pytest.fixture()
def m():
    """The tiny model with HCA at rate 128 (CSA 4, window 16), blocks of 128 tokens."""
    model = build_model({**TINY_CONFIG, "compress_rates": {CSA: 4, HCA: 128}}, backend="reference", seed=3)
    model.configure_cache(max_requests=10, max_tokens=4096, max_request_tokens=512, max_step_tokens=512,
                          max_rollback=8, window_block=8, block_tokens=128)
    model.use_graphs = True
    model.step_graph_buckets = (16, 32, 64, 128, 256)
    model._graph_why = ((id(model.ops), model.device), "", _ReplayByRerun())
    return model


def _ids(n, seed):
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _batch(states, counts, seed):
    """Flattened ids / positions / request ids of `counts[k]` new tokens of states[k] (0: absent)."""
    ks = [k for k, c in enumerate(counts) if c]
    ids = torch.cat([_ids(counts[k], seed + k) for k in ks])
    pos = torch.cat([torch.arange(states[k].length, states[k].length + counts[k]) for k in ks])
    rid = torch.cat([torch.full((counts[k],), j) for j, k in enumerate(ks)])
    return ids, pos, rid, [states[k] for k in ks]


def _close(a, b):
    assert a.shape == b.shape
    scale = max(a.abs().max().item(), 1e-30)
    assert (a - b).abs().max().item() <= TOL * scale, ((a - b).abs().max().item(), scale)


def _twin_step(m, eager, graph, counts, seed, rows=None, hidden=False):
    """One step eagerly on `eager` and through the graphs on their twins `graph`; compare."""
    out = []
    for use, sts in ((False, eager), (True, graph)):
        m.use_graphs = use
        ids, pos, rid, part = _batch(sts, counts, seed)
        h = torch.arange(ids.numel() - 1, -1, -1) if hidden else None
        out.append(m.forward_batch(ids, pos, rid, part, logits_rows=rows, hidden_rows=h))
    assert m.graph_status(last_step=True) == ""                  # the graph step replayed
    for a, b in zip(*out) if hidden else [out]:
        _close(a, b)
    _same_state(m, eager, graph)
    return out


def _same_state(m, eager, graph):
    """Twin requests hold the same state: lengths, and every row their next steps can read."""
    c = m.cache
    Bw = c.window_block
    for a, b in zip(eager, graph):
        assert (a.length, a.ring_hi, a.win_lo) == (b.length, b.ring_hi, b.win_lo)
        L = a.length
        win = np.arange(max(0, L - c.window_keep), L)
        for i, kind in enumerate(c.layer_kind):
            def rows(st, p, table, per, base=0):
                return base + table[st.slot, p // per].astype(np.int64) * per + p % per
            _close(c.rows[i][rows(a, win, c.window_table, Bw)], c.rows[i][rows(b, win, c.window_table, Bw)])
            m_ = m.config.compress_ratio(i)
            if not m_:
                continue
            ent, epb = np.arange(L // m_), c.epb[i]
            if ent.size:
                ra, rb = (rows(s, ent, c.comp_table, epb) for s in (a, b))
                _close(c.rows[i][c.Rw + ra], c.rows[i][c.Rw + rb])
                if c.keys[i] is not None:
                    _close(c.keys[i][ra], c.keys[i][rb])
            cap = c.ring_cap[i]
            held = np.arange(max(0, L - cap), L) % cap
            for ring in c.ring_pairs[i].values():
                _close(ring[a.slot * cap + held], ring[b.slot * cap + held])


def test_prefill_mixed_and_verify_steps_replay_the_eager_step(m):
    """Chunked prefill next to decodes and verify rounds, across window (16), CSA (4), HCA (128)
    and block (128) boundaries, with logits rows of every kind and hidden rows; then rollback
    (truncate) and fork of graph-stepped requests: logits and state as the eager twins'."""
    eager = [m.new_state() for _ in range(3)]
    m.use_graphs = False
    for k, (s, n) in enumerate(zip(eager, (119, 5, 30))):
        m.forward_batch(_ids(n, k), torch.arange(n), torch.zeros(n, dtype=torch.long), [s])
    graph = [s.fork() for s in eager]
    _twin_step(m, eager, graph, [1, 20, 4], 10)                                    # T 25: bucket 32
    _twin_step(m, eager, graph, [5, 1, 40], 20, rows=torch.tensor([4, 5, 45]))      # A: 120..125
    _twin_step(m, eager, graph, [5, 1, 1], 30, hidden=True)                         # A crosses 128 (HCA, block)
    eager.append(m.new_state())
    graph.append(m.new_state())
    for j in range(3):                                                              # D: chunks of 16
        rows = (None, torch.tensor([3, -1, 3, 0, -2]), torch.arange(-17, 0).repeat(3))[j]    # 51 rows > 32
        _twin_step(m, eager, graph, [3, 2, 1, 16], 40 + j, rows=rows)
    for s in (eager[0], graph[0]):                                                   # rejected drafts
        s.truncate(s.length - 3)
    eager.append(eager[2].fork())
    graph.append(graph[2].fork())
    _twin_step(m, eager, graph, [4, 0, 6, 1, 9], 60, hidden=True)
    _twin_step(m, eager, graph, [1, 1, 1, 1, 1], 70)                                # a decode step: decode graphs
    sg = m._step_graphs
    assert sg.replays == 7 and not sg.failed and m._graphs.replays == 1
    assert {k[0] for k in sg.graphs} == {16, 32, 64} and {k[3] for k in sg.graphs} == {False, True}
    for s in eager + graph:
        s.release()


def _kept(c, states):
    """Per pool tensor, a mask of the rows a step over other requests must leave alone: the
    blocks `states` hold, the null blocks (block 0: unheld table entries point there), and
    the ring rows of their slots."""
    masks = []
    for i in range(len(c.layer_kind)):
        e = c.epb[i]
        row = torch.zeros(c.rows[i].shape[0], dtype=torch.bool)
        key = torch.zeros(c.keys[i].shape[0] if c.keys[i] is not None else 0, dtype=torch.bool)
        row[:c.window_block] = True
        row[c.Rw:c.Rw + e] = True
        key[:e] = True
        for s in states:
            for b in c.window_table[s.slot][c.window_table[s.slot] > 0]:
                row[b * c.window_block:(b + 1) * c.window_block] = True
            for b in c.comp_table[s.slot][c.comp_table[s.slot] > 0] if e else ():
                row[c.Rw + b * e:c.Rw + (b + 1) * e] = True
                key[b * e:(b + 1) * e] = True
        masks.append((c.rows[i], row))
        if c.keys[i] is not None:
            masks.append((c.keys[i], key))
        for ring in (c.ring_pairs[i] or {}).values():
            cap, ro = c.ring_cap[i], torch.zeros(ring.shape[0], dtype=torch.bool)
            for s in states:
                ro[s.slot * cap:(s.slot + 1) * cap] = True
            masks.append((ring, ro))
    return masks


def test_padding_writes_nothing_outside_the_steps_requests(m):
    """Padding tokens (position 0, slot 0) write nothing: a request in slot 0 that is not in the
    step (its blocks, its ring rows) and the null blocks stay bit for bit as they were, through
    the recordings (padding only) and the replays."""
    by = m.new_state()
    assert by.slot == 0
    m.use_graphs = False
    m.forward_batch(_ids(37, 1), torch.arange(37), torch.zeros(37, dtype=torch.long), [by])
    sts = [m.new_state() for _ in range(2)]
    m.forward_batch(_ids(9, 2), torch.arange(9), torch.zeros(9, dtype=torch.long), [sts[0]])
    m.use_graphs = True
    for j, counts in enumerate(([3, 5], [1, 30], [2, 1])):
        before = [(t.clone(), keep) for t, keep in _kept(m.cache, [by])]
        ids, pos, rid, part = _batch(sts, counts, 80 + j)
        m.forward_batch(ids, pos, rid, part)
        assert m.graph_status(last_step=True) == ""
        for (old, keep), (t, _) in zip(before, _kept(m.cache, [by])):
            assert torch.equal(t[keep], old[keep])
    assert by.length == 37 and m._step_graphs.replays == 3 and len(m._step_graphs.graphs) == 2
    # and no expert work: every moe_experts call of a replay gets ids -1 in the padding rows
    seen, table = [], m._ops.t

    class Spy:
        def __getattr__(self, name):
            f = getattr(table, name)
            if name != "moe_experts":
                return f
            return lambda x, ids, *a, **k: (seen.append(ids.clone()), f(x, ids, *a, **k))[1]

    m._ops.t = Spy()
    m._graph_why = ((id(m._ops.t), m.device), "", _ReplayByRerun())
    ids, pos, rid, part = _batch(sts, [2, 3], 90)
    m.forward_batch(ids, pos, rid, part)
    m._ops.t = table
    assert len(seen) == 2 * m.config.num_hidden_layers and all(s.shape[0] == 16 for s in seen)
    assert all((s[5:] == -1).all() and (s[:5] >= 0).all() for s in seen)


def test_steps_no_graph_serves_run_eagerly_and_say_why(m):
    """A step larger than every bucket, or whose recording fails, runs eagerly (the same logits
    as with graphs off) and `graph_status(last_step=True)` says why; a replay that fails leaves
    every request as it was."""
    st = m.new_state()
    m.step_graph_buckets = (16,)
    ids = _ids(20, 5)
    out = m.forward_batch(ids, torch.arange(20), torch.zeros(20, dtype=torch.long), [st])
    assert m.graph_status() == ""
    assert "a step of 20 tokens exceeds the largest step graph bucket" in m.graph_status(last_step=True)
    m.step_graph_buckets = (16, 32)
    m._step_graphs.max_rows = 16                       # every row of 20 tokens: 32 rows > 16
    twin = st.fork()
    out2 = m.forward_batch(ids, torch.arange(20, 40), torch.zeros(20, dtype=torch.long), [st])
    assert m.graph_status(last_step=True) == ("a step graph computes at most 16 logits rows; this step over 20 "
                                              "tokens asks for every row")
    m.forward_batch(ids[:3], torch.arange(40, 43), torch.zeros(3, dtype=torch.long), [st],
                    logits_rows=torch.tensor([2]))
    assert m.graph_status(last_step=True) == "" and m._step_graphs.replays == 1
    m.use_graphs = False
    assert torch.equal(out2, m.forward_batch(ids, torch.arange(20, 40), torch.zeros(20, dtype=torch.long), [twin]))
    twin.release()
    ref = m.logits(ids)
    assert m.graph_status(last_step=True) == "disabled (model.use_graphs = False)"
    assert torch.equal(out, ref)
    m.use_graphs = True

    class Refuses(_ReplayByRerun):
        def capture(self, fn, device, pool=None):
            fn()                                       # the warm-up ran (padding only), then the recording failed
            raise RuntimeError("a synchronising op was reached")

    m._graph_why = ((id(m.ops), m.device), "", Refuses())
    m._graphs = None
    twin = st.fork()
    for j in range(2):
        got = m.forward_batch(_ids(3, 6 + j), torch.arange(st.length, st.length + 3), torch.zeros(3, dtype=torch.long),
                              [st])
        why = m.graph_status(last_step=True)
        assert "could not be recorded: RuntimeError: a synchronising op was reached" in why, why
        m.use_graphs = False
        want = m.forward_batch(_ids(3, 6 + j), torch.arange(twin.length, twin.length + 3),
                               torch.zeros(3, dtype=torch.long), [twin])
        m.use_graphs = True
        assert torch.equal(got, want)                  # the eager step, on a state the failed recording left alone
    twin.release()
    assert len(m._step_graphs.failed) == 1 and m._step_graphs.replays == 0

    m._graph_why = ((id(m.ops), m.device), "", _ReplayByRerun())
    m._graphs = None
    m.forward_batch(_ids(3, 7), torch.arange(st.length, st.length + 3), torch.zeros(3, dtype=torch.long), [st])
    assert m._step_graphs.replays == 1
    (key, (_, inputs, out, every)), = m._step_graphs.graphs.items()
    m._step_graphs.graphs[key] = (lambda: 1 / 0, inputs, out, every)
    c = m.cache
    before = (st.length, st.ring_hi, st.win_lo, c.window_table.copy(), c.comp_table.copy(),
              c.win_pool.ref.copy(), c.comp_pool.ref.copy())
    with pytest.raises(ZeroDivisionError):
        m.forward_batch(_ids(3, 8), torch.arange(st.length, st.length + 3), torch.zeros(3, dtype=torch.long), [st])
    after = (st.length, st.ring_hi, st.win_lo, c.window_table, c.comp_table, c.win_pool.ref, c.comp_pool.ref)
    assert before[:3] == after[:3] and all((x == y).all() for x, y in zip(before[3:], after[3:]))


def test_generate_with_step_graphs_equals_eager_generate(m):
    """Continuous batching (chunked prefills next to decodes) with every step replayed: the
    tokens of the eager run."""
    prompts = [_ids(n, 90 + n).tolist() for n in (40, 7, 23)]
    m.use_graphs = False
    want = m.generate(prompts, 6, prefill_chunk=16)
    m.use_graphs = True
    got = m.generate(prompts, 6, prefill_chunk=16)
    assert got == want
    assert m._step_graphs.replays >= 3 and m._graphs.replays >= 3


def test_speculative_generate_with_step_graphs_equals_eager_generate():
    """Speculative decoding: every verify step ([next token, k drafts] a request, hidden rows for
    the MTP proposer, prefill chunks beside) replays a step graph; the tokens are the eager run's."""
    from dsv4core.model.api import load_model

    m = load_model("tiny-mtp", backend="reference")
    m.configure_cache(max_requests=4, max_tokens=1024, max_request_tokens=256, max_step_tokens=256,
                      max_rollback=4, window_block=8)
    prompts = [_ids(n, 95 + n).tolist() for n in (21, 6)]
    m.use_graphs = False
    want = m.generate(prompts, 8, speculative_tokens=2, prefill_chunk=16)
    m.use_graphs = True
    m._graph_why = ((id(m.ops), m.device), "", _ReplayByRerun())
    got = m.generate(prompts, 8, speculative_tokens=2, prefill_chunk=16)
    assert got == want and got.speculation == want.speculation
    sg = m._step_graphs
    assert sg.replays >= 4 and sg.eager == 0 and any(k[3] for k in sg.graphs)    # hidden-row graphs


def _same_state_bitwise(m, eager, graph):
    c = m.cache
    for a, b in zip(eager, graph):
        assert (a.length, a.ring_hi, a.win_lo) == (b.length, b.ring_hi, b.win_lo)
        L = a.length
        win = np.arange(max(0, L - c.window_keep), L)
        for i in range(len(c.layer_kind)):
            wa, wb = (c.window_table[s.slot, win // c.window_block].astype(np.int64) * c.window_block
                      + win % c.window_block for s in (a, b))
            assert torch.equal(c.rows[i][wa], c.rows[i][wb])
            r = m.config.compress_ratio(i)
            if not r:
                continue
            e, epb = np.arange(L // r), c.epb[i]
            ea, eb = (c.comp_table[s.slot, e // epb].astype(np.int64) * epb + e % epb for s in (a, b))
            assert torch.equal(c.rows[i][c.Rw + ea], c.rows[i][c.Rw + eb])
            if c.keys[i] is not None:
                assert torch.equal(c.keys[i][ea], c.keys[i][eb])
            cap = c.ring_cap[i]
            held = np.arange(max(0, L - cap), L) % cap
            for ring in c.ring_pairs[i].values():
                assert torch.equal(ring[a.slot * cap + held], ring[b.slot * cap + held])


@pytest.mark.parametrize("counts", [[13, 1, 2], [10, 1, 5], [7, 20, 5]])
def test_a_step_of_the_graphs_shapes_is_the_eager_step_bit_for_bit(m, counts):
    """A step that fills its token bucket and whose longest request ends at its context bucket
    (256: an HCA window, a block and CSA windows complete there) has the eager step's shapes:
    then the graph step gives the eager logits and state bit for bit (the static metadata, every
    token an emission and ring candidate, is the eager step's formula exactly)."""
    m.use_graphs = False
    base = [m.new_state() for _ in range(3)]
    for k, (s, n) in enumerate(zip(base, (256 - counts[0], 30, 57))):
        m.forward_batch(_ids(n, k), torch.arange(n), torch.zeros(n, dtype=torch.long), [s])
    eager, graph = [s.fork() for s in base], [s.fork() for s in base]
    out = []
    for use, sts in ((False, eager), (True, graph)):
        m.use_graphs = use
        ids, pos, rid, part = _batch(sts, counts, 7)
        out.append(m.forward_batch(ids, pos, rid, part))
    assert m.graph_status(last_step=True) == "" and list(m._step_graphs.graphs)[0][:2] == (sum(counts), 256)
    assert torch.equal(out[0], out[1])
    _same_state_bitwise(m, eager, graph)
