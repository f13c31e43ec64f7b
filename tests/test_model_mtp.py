"""The multi-token-prediction (MTP, "NextN") block and speculative decoding: loading and writing
the block (official and transformers layouts), the engine API (a step's pre-hc_head stream, the
MTP draft call, verification and rollback), the proposer interface and `generate` with
`speculative_tokens`. CPU reference backend, the built-in tiny model with an MTP block."""

from __future__ import annotations

import argparse
import io
from contextlib import redirect_stdout

import pytest
import torch

from dsv4core.checkpoint import open_checkpoint, save
from dsv4core.model import InputError
from dsv4core.model.api import load_model


@pytest.fixture(scope="module")
def tiny_mtp():
    return load_model("tiny-mtp", backend="reference")


def test_tiny_mtp_has_the_block_and_the_main_weights_of_tiny(tiny_mtp):
    plain = load_model("tiny", backend="reference")
    sd, base = tiny_mtp.state_dict(), plain.state_dict()
    assert tiny_mtp.has_mtp and tiny_mtp.speculation_why == ""
    assert not plain.has_mtp and "num_nextn_predict_layers = 0" in plain.speculation_why
    assert all(torch.equal(base[k], sd[k]) for k in base)
    extra = sorted(k[len("model.mtp.0."):] for k in sd.keys() - base.keys())
    assert all(k.startswith("model.mtp.0.") for k in sd.keys() - base.keys())
    for leaf in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight", "hc_head.hc_fn",
                 "hc_head.hc_base", "hc_head.hc_scale", "self_attn.q_a_proj.weight", "attn_hc.fn", "ffn_hc.fn",
                 "mlp.experts.gate_up_proj", "mlp.gate.e_score_correction_bias"):
        assert leaf in extra, leaf
    assert not any("compressor" in k for k in extra)        # sliding-window attention only
    assert "mlp.gate.tid2eid" not in extra                  # a top-k MoE
    # its state is one more (sliding) layer of the cache
    assert len(tiny_mtp.cache.rows) == tiny_mtp.config.num_hidden_layers + 1
    assert tiny_mtp.cache.rings[-1] is None and tiny_mtp.cache.keys[-1] is None


def test_mtp_round_trip_transformers_and_official(tiny_mtp, tmp_path):
    from dsv4core.checkpoint.writer import write_official

    save(tiny_mtp, tmp_path / "hf")
    a = load_model(str(tmp_path / "hf"), backend="reference")
    assert a.has_mtp and a.config.num_nextn_predict_layers == 1
    sa, sd = a.state_dict(), tiny_mtp.state_dict()
    assert sa.keys() == sd.keys() and all(torch.equal(sa[k], sd[k]) for k in sd)
    # official layout: mtp.0.* names, e_proj / h_proj FP8 with block scales, experts FP4
    ref = write_official(sd, tiny_mtp.config.to_hf_dict(), tmp_path / "off", max_shard_bytes=300_000)
    ck = open_checkpoint(tmp_path / "off")
    names = set(ck.tensor_names())
    assert ck.format == "official" and ck.config_dict["compress_ratios"][-1] == 0
    for n in ("mtp.0.e_proj.weight", "mtp.0.e_proj.scale", "mtp.0.h_proj.scale", "mtp.0.enorm.weight",
              "mtp.0.hnorm.weight", "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.hc_head_base",
              "mtp.0.hc_head_scale", "mtp.0.attn.wq_a.scale", "mtp.0.hc_attn_fn", "mtp.0.ffn.experts.7.w2.scale"):
        assert n in names, n
    assert ck.tensor_info("mtp.0.e_proj.weight").torch_dtype == torch.float8_e4m3fn
    b = load_model(str(tmp_path / "off"), backend="reference", dtype="float32", numerics="exact")
    sb = b.state_dict()
    assert b.has_mtp and sb.keys() == ref.keys()
    assert all(torch.equal(sb[k], ref[k].to(sb[k].dtype)) for k in ref)
    # inspect reports the block
    from dsv4core.commands import inspect as insp

    for path, want in ((tmp_path / "off", "1 MTP block"), (tmp_path / "hf", "1 MTP block")):
        buf = io.StringIO()
        with redirect_stdout(buf):
            insp.run(argparse.Namespace(path=str(path), json=False))
        assert want in buf.getvalue(), buf.getvalue()


def test_official_numerics_quantise_the_mtp_projections():
    m = load_model("tiny-official-mtp", backend="reference")
    blk = m.model.mtp[0]
    assert m.numerics == "official"
    assert blk.e_proj.act_block == blk.h_proj.act_block == blk.self_attn.q_a_proj.act_block == 128
    m.set_numerics("exact")
    assert blk.e_proj.act_block is None and blk.h_proj.act_block is None


# --------------------------------------------------------------------------------------------
# speculative decoding

from dsv4core.model.speculative import MTPProposer, mtp_draft  # noqa: E402

CC = dict(max_requests=4, max_tokens=2048, max_request_tokens=512, max_step_tokens=512, max_rollback=4,
          window_block=8, block_tokens=32)
# prompt lengths across the tiny model's CSA (4) / HCA (16) windows, its sliding window (16) and
# the 32-token compressed blocks; more prompts than request slots (continuous batching)
LENGTHS = (1, 3, 4, 5, 15, 16, 17, 31, 33)


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture()
def spec():
    m = load_model("tiny-mtp", backend="reference")
    m.configure_cache(**CC)
    return m


class Scripted(MTPProposer):
    """The MTP proposer (its state kept up to date), its drafts replaced by the true greedy
    continuation with one draft in `period` made wrong, so the rounds accept 0..k drafts."""

    def __init__(self, prompts, want, period=3):
        self.prompts, self.want, self.period, self.offers = prompts, want, period, []
        self.calls = 0

    def propose(self, model, batch):
        super().propose(model, batch)
        out = []
        for r in batch:
            i = next(j for j, p in enumerate(self.prompts) if list(r.tokens[:len(p)]) == p)
            done = len(r.tokens) - len(self.prompts[i])           # generated so far (the next token included)
            true = self.want[i][done:done + r.k]
            d = [t if (done + j + i) % self.period else (t + 1) % 256 for j, t in enumerate(true)]
            self.offers.append((true, d))
            out.append(d)
        return out


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_generate_equals_plain_greedy(spec, k):
    prompts = _prompts()
    want = spec.generate(prompts, 10)
    assert want.speculation is None
    got = spec.generate(prompts, 10, speculative_tokens=k)          # the MTP block's own drafts
    assert got == want and got.speculation["speculative_tokens"] == k
    sc = Scripted(prompts, want)
    got = spec.generate(prompts, 10, speculative_tokens=k, proposer=sc)
    assert got == want
    # the statistics, recounted from the offers: accepted = the matching prefix of each round
    acc = [next((j for j, (t, d) in enumerate(zip(true, dr)) if t != d), len(dr)) for true, dr in sc.offers if dr]
    s = got.speculation
    assert s["rounds"] == len(acc) and s["accepted_tokens"] == sum(acc) > 0
    assert s["mean_acceptance_length"] == pytest.approx((len(acc) + sum(acc)) / len(acc))
    for j, row in enumerate(s["per_position"]):
        offered = sum(1 for true, dr in sc.offers if len(dr) > j)
        assert row["offered"] == offered and row["accepted"] == sum(1 for a in acc if a > j)
    assert not spec.cache.live                                     # every request released
    eos = want[5][4]                                               # stops inside an accepted run too
    want_eos = spec.generate(prompts, 10, eos_token_id=eos)
    assert any(len(o) < 10 for o in want_eos)
    assert spec.generate(prompts, 10, eos_token_id=eos, speculative_tokens=k,
                         proposer=Scripted(prompts, want)) == want_eos


def test_speculation_errors(spec):
    plain = load_model("tiny", backend="reference")
    with pytest.raises(InputError, match="speculative decoding is unavailable.*num_nextn_predict_layers = 0"):
        plain.generate([[3, 4]], 4, speculative_tokens=1)
    with pytest.raises(InputError, match="unavailable"):
        plain.new_state(mtp=True)
    with pytest.raises(InputError, match="greedy only"):
        spec.generate([[3, 4]], 4, speculative_tokens=1, temperature=0.7)
    with pytest.raises(InputError, match="max_rollback=4"):
        spec.generate([[3, 4]], 4, speculative_tokens=5)
    with pytest.raises(InputError, match="speculative_tokens must be an int"):
        spec.generate([[3, 4]], 4, speculative_tokens=-1)
    st = spec.new_state()
    with pytest.raises(InputError, match="does not track the MTP block"):
        mtp_draft(spec, [st], [[]], [torch.zeros(0, 4, 64)], 1)
    st = spec.new_state(mtp=True)
    lg, h = spec.forward_batch(torch.tensor([5, 6, 7]), torch.arange(3), torch.zeros(3, dtype=torch.long), [st],
                               hidden_rows=torch.arange(3))
    assert h.shape == (3, 4, 64) and st.mtp_length == 0
    with pytest.raises(InputError, match=r"tokens must be the 3 ids of positions 1..3"):
        mtp_draft(spec, [st], [[6, 7]], [h], 1)
    with pytest.raises(InputError, match=r"hidden must be \[3, 4, 64\]"):
        mtp_draft(spec, [st], [[6, 7, 8]], [h[:2]], 1)
    assert st.mtp_length == 0 and st.length == 3
    assert len(mtp_draft(spec, [st], [[6, 7, 8]], [h], 2)[0]) == 2 and st.mtp_length == 3
    with pytest.raises(InputError, match="drafting"):
        mtp_draft(spec, [st], [[]], [h[:0]], 1)


class _F64:
    """The bound op table with every float32 tensor argument evaluated in float64 (the reference
    ops' fp64 evaluation) and the results rounded back to float32. fp32 GEMMs round differently
    for different row counts (a 1 + k token verification against 1-token decode steps), so
    bit-identity of two runs with different step shapes is tested on this table: an fp64 result
    that differs in its last bits rounds to the same fp32 value unless it lies within ~2^-52
    relative of a rounding boundary of fp32 (probability ~2^-29 per value). `cache_store` writes
    the pool as it is (its values rounded first)."""

    def __init__(self, table):
        self._t = table

    def __getattr__(self, name):
        f = getattr(self._t, name)
        if name in ("report", "capturable", "accepts", "native_quantized") or not callable(f):
            return f
        if name == "cache_store":
            return lambda pool, index, values, *a, **kw: f(pool, index, values.to(pool.dtype), *a, **kw)

        def up(v):
            return v.double() if isinstance(v, torch.Tensor) and v.dtype == torch.float32 else v

        def down(v):
            return v.float() if isinstance(v, torch.Tensor) and v.dtype == torch.float64 else v

        def call(*args, **kw):
            out = f(*map(up, args), **{k: up(v) for k, v in kw.items()})
            return tuple(map(down, out)) if isinstance(out, tuple) else down(out)
        return call


def _readable(m, st):
    """Every row a request's next step can read, by (pool, layer): the window rows of its last
    W - 1 positions (every layer, the MTP block's included), its visible compressed entries and
    indexer keys, its compressor-ring rows of the windows being pooled."""
    c, L, out = m.cache, st.length, {}
    Bw, Bc = c.window_block, c.block_tokens
    lt = m.cache_layers.layer_types
    for i in range(len(c.rows)):
        ps = torch.arange(max(0, L - (c.W - 1)), L)
        out["win", i] = c.rows[i][torch.from_numpy(c.window_table[st.slot])[ps // Bw].long() * Bw + ps % Bw].clone()
        r = m.cache_layers.compress_ratio(i)
        if not r:
            continue
        e, epb = torch.arange(L // r), c.epb[i]
        at = torch.from_numpy(c.comp_table[st.slot])[e // epb].long() * epb + e % epb
        out["entries", i] = c.rows[i][c.Rw + at].clone()
        if c.keys[i] is not None:
            out["keys", i] = c.keys[i][at].clone()
        ov = 2 if lt[i] == "compressed_sparse_attention" else 1
        ps = torch.arange(max(0, L - ov * r), L)
        for name, ring in c.ring_pairs[i].items():
            out[name, i] = ring[st.slot * c.ring_cap[i] + ps % c.ring_cap[i]].clone()
    return out


class Snapshots(Scripted):
    """Scripted drafts; after each proposal the readable state of every request is kept (the
    last one per prompt is its state after its last verification and catch-up)."""

    def propose(self, model, batch):
        out = super().propose(model, batch)
        self.snap = getattr(self, "snap", {})
        for r in batch:
            i = next(j for j, p in enumerate(self.prompts) if list(r.tokens[:len(p)]) == p)
            if r.state.length >= len(self.prompts[i]):
                self.snap[i] = (list(r.tokens[:r.state.length + 1]), r.state.mtp_length, _readable(model, r.state))
        return out


@pytest.mark.parametrize("k", [1, 3])
def test_state_after_speculation_is_bit_identical_to_plain_decoding(k):
    """Speculative generation (k drafts a round, some accepted, rejected ones rolled back, the
    MTP block catching up) leaves every request's state, main and MTP rows, bit-identical to
    prefilling its prompt and decoding its tokens one a step with the MTP block following each
    step (fp64-evaluated ops: `_F64`)."""
    m = load_model("tiny-mtp", backend="reference")
    m.bind_ops(_F64(m.ops))
    m.use_graphs = False
    m.configure_cache(**CC)
    prompts = [p for p in _prompts() if len(p) in (5, 16, 17, 33)]
    want = m.generate(prompts, 9)
    sc = Snapshots(prompts, want)
    assert m.generate(prompts, 9, speculative_tokens=k, proposer=sc) == want
    assert sorted(sc.snap) == list(range(len(prompts))) and sum(a for a in (
        next((j for j, (t, d) in enumerate(zip(*o)) if t != d), len(o[1])) for o in sc.offers)) > 0
    for i, (toks, mtp_len, got) in sc.snap.items():
        p = prompts[i]
        st = m.new_state(mtp=True)
        n = len(p)
        lg, h = m.forward_batch(torch.tensor(p), torch.arange(n), torch.zeros(n, dtype=torch.long), [st],
                                hidden_rows=torch.arange(n))
        m.mtp_draft([st], [toks[1:n + 1]], [h], 0)
        while st.length < len(toks) - 1:
            L = st.length
            lg, h = m.forward_batch(torch.tensor([toks[L]]), torch.tensor([L]), torch.tensor([0]), [st],
                                    hidden_rows=torch.tensor([0]))
            m.mtp_draft([st], [[toks[L + 1]]], [h], 0)
        assert st.mtp_length == mtp_len == st.length
        ref = _readable(m, st)
        assert ref.keys() == got.keys()
        bad = [key for key in ref if not torch.equal(ref[key], got[key])]
        assert not bad, bad
        st.release()


def _book(m, sts):
    c = m.cache
    return ([(s.length, s.mtp_length) for s in sts], c.window_table.copy(), c.comp_table.copy(),
            sorted(c.win_pool.free), sorted(c.comp_pool.free), c.win_pool.ref.copy(), c.comp_pool.ref.copy())


def _same(a, b):
    return a[0] == b[0] and all((x == y).all() for x, y in zip(a[1:3], b[1:3])) and a[3:5] == b[3:5] \
        and all((x == y).all() for x, y in zip(a[5:], b[5:]))


@pytest.mark.parametrize("fail_at", [1, 2, 3])
def test_failed_draft_call_changes_nothing(spec, fail_at):
    """An op failure in the MTP block (its catch-up forward: call 1, or a draft forward past the
    length: calls 2, 3) leaves every request as it was, a block shared with a fork included;
    the retry drafts what the fork (which never failed) drafts, and both states read the same rows."""
    ids = torch.randint(2, 256, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    a = spec.new_state(mtp=True)
    _, h = spec.forward_batch(torch.tensor(ids[:20]), torch.arange(20), torch.zeros(20, dtype=torch.long), [a],
                              hidden_rows=torch.arange(20))
    b = a.fork()                                  # shares every block, the MTP rows' too
    assert b.mtp_length == 0
    mlp, calls = spec.model.mtp[0].mlp, []

    def boom(x, step):
        calls.append(1)
        if len(calls) == fail_at:
            raise RuntimeError("injected MTP failure")
        return type(mlp).forward(mlp, x, step)

    before = _book(spec, [a, b])
    mlp.forward = boom
    try:
        with pytest.raises(RuntimeError, match="injected"):
            spec.mtp_draft([a], [ids[1:21]], [h], 3)
    finally:
        del mlp.forward
    assert len(calls) == fail_at and _same(_book(spec, [a, b]), before)
    da = spec.mtp_draft([a], [ids[1:21]], [h], 3)
    db = spec.mtp_draft([b], [ids[1:21]], [h], 3)
    assert da == db and len(da[0]) == 3 and a.mtp_length == b.mtp_length == 20
    ra, rb = _readable(spec, a), _readable(spec, b)
    assert all(torch.equal(ra[k], rb[k]) for k in ra)


def test_failed_verification_changes_nothing_and_rollback_is_exact(spec):
    """A verification step (1 + k tokens) whose forward fails leaves the request as it was; a
    verification whose drafts are rejected, truncated back, then the MTP catch-up: the request
    continues exactly as its fork that only ever saw the accepted token."""
    ids = torch.randint(2, 256, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    a = spec.new_state(mtp=True)
    _, h = spec.forward_batch(torch.tensor(ids[:24]), torch.arange(24), torch.zeros(24, dtype=torch.long), [a],
                              hidden_rows=torch.arange(24))
    d = spec.mtp_draft([a], [ids[1:25]], [h], 3)[0]
    b = a.fork()
    layer = spec.model.layers[3].mlp

    def boom(x, step):
        raise RuntimeError("injected MoE failure")

    before = _book(spec, [a, b])
    layer.forward = boom
    try:
        with pytest.raises(RuntimeError, match="injected"):
            spec.forward_batch(torch.tensor([ids[24]] + d), torch.arange(24, 28), torch.zeros(4, dtype=torch.long),
                               [a], hidden_rows=torch.arange(4))
    finally:
        del layer.forward
    assert _same(_book(spec, [a, b]), before)
    wrong = [(t + 1) % 256 for t in d]            # drafts all rejected
    lg, h = spec.forward_batch(torch.tensor([ids[24]] + wrong), torch.arange(24, 28),
                               torch.zeros(4, dtype=torch.long), [a], hidden_rows=torch.arange(4))
    a.truncate(25)
    assert (a.length, a.mtp_length) == (25, 24)
    lb, hb = spec.forward_batch(torch.tensor([ids[24]]), torch.tensor([24]), torch.tensor([0]), [b],
                                hidden_rows=torch.tensor([0]))
    # the same position from a 4-row and a 1-row step: equal up to fp32 GEMM rounding
    assert (lg[0] - lb[0]).abs().max() <= 2e-5 * lb.abs().max()
    for st, hh in ((a, h[:1]), (b, hb)):
        spec.mtp_draft([st], [[ids[25]]], [hh], 0)
    la, lb = (spec.forward_batch(torch.tensor(ids[25:30]), torch.arange(25, 30), torch.zeros(5, dtype=torch.long),
                                 [st]) for st in (a, b))   # both continue over the same tokens
    assert a.length == b.length == 30 and (la - lb).abs().max() <= 2e-5 * lb.abs().max()
    ref = spec.logits(ids[:30])[25:]              # and as one prefill of those tokens does
    assert (la - ref).abs().max() <= 2e-5 * ref.abs().max()


def test_cli_generate_speculative_tokens(capsys):
    import json

    from dsv4core.cli import main

    base = ["generate", "--model", "tiny-mtp", "--backend", "reference", "--input-ids", "3,4,5", "--input-ids",
            "9,8,7,6,5,4,3,2,1,9,8,7,6,5,4,3,2", "--max-new-tokens", "6", "--json", "--no-progress"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--speculative-tokens", "2"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert plain["speculation"] is None and got["new_tokens"] == plain["new_tokens"]
    sp = got["speculation"]
    assert sp["speculative_tokens"] == 2 and sp["rounds"] > 0 and len(sp["per_position"]) == 2
    assert sp["mean_acceptance_length"] == (sp["rounds"] + sp["accepted_tokens"]) / sp["rounds"]
    assert main(["generate", "--model", "tiny", "--backend", "reference", "--input-ids", "3,4",
                 "--speculative-tokens", "1"]) == 2
    assert "speculative decoding is unavailable" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# draft steps as device graphs (the CPU stand-in capture)


class _Rerun:
    """A stand-in graph capture for the CPU: the 'replay' re-runs the recorded function, which reads
    the static inputs and refills the static outputs (a tensor or a tuple of them), as a device graph would."""

    def __init__(self, fail=None):
        self.fail, self.recorded = fail, 0

    def new_pool(self, device):
        return None

    def capture(self, fn, device, pool=None):
        if self.fail:
            raise RuntimeError(self.fail)
        self.recorded += 1
        out = fn()
        outs = out if isinstance(out, tuple) else (out,)
        return (lambda: [o.copy_(n) for o, n in zip(outs, (lambda r: r if isinstance(r, tuple) else (r,))(fn()))]), out


def _pools(m):
    c = m.cache
    return [t.clone() for t in c.rows + [k for k in c.keys if k is not None]
            + [r for rp in c.ring_pairs if rp for r in rp.values()]]


class _Keep(MTPProposer):
    def propose(self, model, batch):
        self.mtp = getattr(self, "mtp", []) + [super().propose(model, batch)]
        return self.mtp[-1]


class _KeepDrafts(Scripted, _Keep):
    """Scripted drafts (rounds accepting 0..k), the MTP block's own drafts kept (`mtp`)."""


@pytest.mark.parametrize("k", [1, 3])
def test_draft_graphs_equal_eager_drafting(k):
    """Speculative generation with the MTP block's decode-shaped forwards replayed from recorded
    graphs (bucket padding) gives the MTP drafts, tokens, acceptance statistics and pool contents
    (every row ever written, bit for bit) of eager drafting; the replays counted are the
    decode-shaped MTP forwards eager drafting runs. fp64-evaluated ops (`_F64`): a padded bucket
    computes its rows with other GEMM shapes."""
    m = load_model("tiny-mtp", backend="reference")
    m.bind_ops(_F64(m.ops))
    m.configure_cache(**CC)
    prompts = [p for p in _prompts() if len(p) in (1, 5, 16, 17, 33)]
    m.use_graphs = False
    want = m.generate(prompts, 9)
    blk, shapes = m.model.mtp[0], []

    def spy(e, h, step):
        shapes.append(step.decode)
        return type(blk).forward(blk, e, h, step)

    runs = []
    for graphs in (False, True):
        m.configure_cache(**CC)
        m.use_graphs = graphs
        if graphs:
            m._graph_why = ((id(m.ops), m.device), "", _Rerun())
        sc = _KeepDrafts(prompts, want)
        blk.forward = spy
        try:
            got = m.generate(prompts, 9, speculative_tokens=k, proposer=sc)
        finally:
            del blk.forward
        runs.append((got, got.speculation, sc.mtp, _pools(m), shapes.copy()))
        shapes.clear()
    (t0, s0, d0, p0, calls), (t1, s1, d1, p1, _) = runs
    assert t1 == t0 == want and s1 == s0 and s0["accepted_tokens"] > 0 and d1 == d0
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    g = m._graphs.variants["mtp_draft"]
    assert g.replays == sum(calls) > 0 and g.eager == 0 and m._graphs.replays == 0
    assert {key[0] for key in g.graphs} <= {1, 2, 4} and not m.graph_failures()


def test_failed_draft_replay_changes_nothing_and_failed_recording_runs_eagerly(spec):
    """A draft replay that fails (the catch-up's: call 1, a draft past the length: call 2) leaves
    the request as it was and the retry drafts what eager drafting does; a recording that fails
    is reported (`graph_failures`) and its steps run eagerly."""
    ids = torch.randint(2, 256, (21,), generator=torch.Generator().manual_seed(3)).tolist()
    a = spec.new_state(mtp=True)
    spec.use_graphs = False
    _, h = spec.forward_batch(torch.tensor(ids[:19]), torch.arange(19), torch.zeros(19, dtype=torch.long), [a],
                              hidden_rows=torch.arange(19))
    spec.mtp_draft([a], [ids[1:20]], [h], 0)
    _, h = spec.forward_batch(torch.tensor(ids[19:20]), torch.tensor([19]), torch.tensor([0]), [a],
                              hidden_rows=torch.tensor([0]))          # the MTP rows one behind: a one-row catch-up
    b, c = a.fork(), a.fork()
    want = spec.mtp_draft([b], [ids[20:]], [h], 3)
    assert len(want[0]) == 3
    spec.use_graphs = True
    for fail_at in (1, 2):
        spec._graphs = None
        spec._graph_why = ((id(spec.ops), spec.device), "", _Rerun())
        f = a.fork()
        assert spec.mtp_draft([f], [ids[20:]], [h], 3) == want          # records the graph of bucket 1
        f.release()
        g = spec._graphs.variants["mtp_draft"]
        assert g.replays == 3 and list(g.graphs) == [(1, None)]
        calls = []

        def boom(replay=g.graphs[(1, None)][0]):
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError("injected replay failure")
            replay()

        g.graphs[(1, None)] = (boom, *g.graphs[(1, None)][1:])
        before = _book(spec, [a, c])
        with pytest.raises(RuntimeError, match="injected"):
            spec.mtp_draft([a], [ids[20:]], [h], 3)
        assert len(calls) == fail_at and _same(_book(spec, [a, c]), before)
    spec._graphs = None
    assert spec.mtp_draft([a], [ids[20:]], [h], 3) == want and a.mtp_length == 20
    assert spec._graphs.variants["mtp_draft"].replays == 3
    spec._graphs = None
    spec._graph_why = ((id(spec.ops), spec.device), "", _Rerun(fail="no capture here"))
    assert spec.mtp_draft([c], [ids[20:]], [h], 3) == want
    assert spec.graph_failures() == {("mtp_draft", 1, None): "RuntimeError: no capture here"}
    assert spec._graphs.variants["mtp_draft"].eager == 3
