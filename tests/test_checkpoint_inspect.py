"""``dsv4core inspect PATH [--json]`` on synthetic official and transformers checkpoints."""

from __future__ import annotations

import json

import pytest
from checkpoint_fixtures import build_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("inspect"))


def _args(*argv):
    """Parse through the command's own ``add_parser`` (the lead wires it into dsv4core.cli)."""
    import argparse

    from dsv4core.commands import inspect

    parser = argparse.ArgumentParser(prog="dsv4core")
    inspect.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["inspect", *map(str, argv)])


def _run(capsys, *argv):
    args = _args(*argv)
    rc = args.func(args)
    out = capsys.readouterr().out
    assert rc == 0
    return out


def test_inspect_json_official(pair, capsys):
    model, off, _, _ = pair
    info = json.loads(_run(capsys, off, "--json"))
    n_params = sum(t.numel() for t in model.state_dict().values())
    assert info["format"] == "official"
    assert info["parameters"] == n_params  # FP4 counted unpacked, scales not counted, mtp separate
    assert info["mtp_parameters"] == 8 * 8 + 8
    assert info["files"] > 2 and info["sharded"]
    assert info["size_bytes"] == sum(p.stat().st_size for p in off.glob("*.safetensors"))
    assert info["largest_shard"]["bytes"] == max(p.stat().st_size for p in off.glob("*.safetensors"))
    q = info["quantization"]
    n_layers = model.config.num_hidden_layers
    n_exp = model.config.n_routed_experts
    assert q["fp4_packed_weights"] == {"F8_E8M0": n_layers * n_exp * 3}
    # per layer: wq_a wq_b wkv wo_a wo_b + 3 shared; + indexer wq_b on the 2 CSA layers
    assert q["fp8_block_scaled_weights"] == {"F8_E8M0": n_layers * 8 + 2}
    assert {"F8_E4M3", "I8", "BF16", "F32", "I64", "F8_E8M0"} <= set(info["dtypes"])
    sched = [(s["attention"], s["moe"]) for s in info["layer_schedule"]]
    assert sched == [("SWA", "hash"), ("CSA", "topk"), ("HCA", "topk"), ("CSA", "topk")]


def test_inspect_text_transformers(pair, capsys):
    _, _, hf, _ = pair
    out = _run(capsys, hf)
    assert "format:      transformers" in out
    assert "0:SWA/hash 1:CSA/topk 2:HCA/topk 3:CSA/topk" in out
    assert "FP8 128x128: none" in out


def test_inspect_error_names_the_file(tmp_path):
    from dsv4core.checkpoint import CheckpointError

    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00")
    args = _args(tmp_path)
    with pytest.raises(CheckpointError, match="truncated") as ei:
        args.func(args)
    assert ei.value.file == str(tmp_path / "model.safetensors")


def test_layer_schedule_uses_the_configs_rates():
    """Ratios other than the published 4 / 128 are read from the config, in both dialects."""
    from dsv4core.checkpoint.summary import layer_schedule

    hf = {"num_hidden_layers": 3, "compress_rates": {"compressed_sparse_attention": 3, "heavily_compressed_attention": 16},
          "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]}
    off = {"num_hidden_layers": 3, "compress_ratios": [0, 4, 16, 0]}
    for cfg, csa in ((hf, 3), (off, 4)):
        sched = layer_schedule(cfg)
        assert [(s["attention"], s["compress_ratio"]) for s in sched] == [("SWA", 0), ("CSA", csa), ("HCA", 16)]
