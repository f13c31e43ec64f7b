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
