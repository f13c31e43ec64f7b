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
