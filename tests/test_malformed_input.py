"""Malformed checkpoint headers and configs are CheckpointError / ConfigError naming what is
wrong, never a raw RecursionError / TypeError / AttributeError / OverflowError; nothing is cut to
fit or replaced by a default."""

from __future__ import annotations

import json
import struct

import pytest

from dsv4core.checkpoint import CheckpointError, read_header
from dsv4core.model import ConfigError, DSV4Config
from dsv4core.model.api import TINY_CONFIG

SW, CSA = "sliding_attention", "compressed_sparse_attention"


def raw_file(path, header_text: str, data: bytes = b"\0" * 64):
    h = header_text.encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


GOOD = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}


@pytest.mark.parametrize("entry, match", [
    ({**GOOD, "data_offsets": ["0", "16"]}, "corrupt header entry"),
    ({**GOOD, "data_offsets": [0.0, 16.0]}, "corrupt header entry"),
    ({**GOOD, "data_offsets": [False, 16]}, "corrupt header entry"),
    ({**GOOD, "data_offsets": [0, 8, 16]}, "corrupt header entry"),
    ({**GOOD, "shape": "22"}, "corrupt header entry"),
    ({**GOOD, "shape": [2.5, 2]}, "corrupt header entry"),
    ({**GOOD, "dtype": 7}, "corrupt header entry"),
    ([GOOD], "corrupt header entry"),
    ("F32", "corrupt header entry"),
    ({"dtype": "F32", "shape": [-2, 2], "data_offsets": [16, 0]}, "negative dimension"),
    ({"dtype": "F32", "shape": [2, 2], "data_offsets": [32, 16]}, "data span"),
])
def test_malformed_header_entry(tmp_path, entry, match):
    p = raw_file(tmp_path / "x.safetensors", json.dumps({"w": entry}))
    with pytest.raises(CheckpointError, match=match) as ei:
        read_header(p)
    assert ei.value.tensor == "w" and str(p) in str(ei.value)


@pytest.mark.parametrize("text, match", [
    ("[" * 100_000 + "]" * 100_000, "corrupt safetensors header"),
    ('{"__metadata__": [1, 2]}', "__metadata__"),
    ('{"__metadata__": {"format": 1}}', "__metadata__"),
])
def test_malformed_header(tmp_path, text, match):
    p = raw_file(tmp_path / "x.safetensors", text)
    with pytest.raises(CheckpointError, match=match) as ei:
        read_header(p)
    assert str(p) in str(ei.value)


@pytest.mark.parametrize("change, match", [
    ({"head_dim": 1e309}, "head_dim must be an integer; got inf"),
    ({"head_dim": "64"}, "head_dim must be an integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers must be an integer"),
    ({"hidden_size": 64.0}, "hidden_size"),
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
    ({"rope_theta": float("inf")}, "rope_theta must be a finite number"),
    ({"compress_rates": [4, 16]}, "compress_rates must be an object"),
    ({"compress_rates": {CSA: "4"}}, "compress_rates.*must be an integer"),
    ({"layer_types": TINY_CONFIG["layer_types"] + [SW]}, r"len\(layer_types\)=5 != num_hidden_layers=4"),
    ({"layer_types": SW}, "layer_types must be a list"),
    ({"mlp_layer_types": TINY_CONFIG["mlp_layer_types"] + ["moe"]}, r"len\(mlp_layer_types\)=5"),
    ({"rope_parameters": {**TINY_CONFIG["rope_parameters"], "bet_fast": 8}}, r"unknown rope parameters \['bet_fast'\]"),
    ({"rope_parameters": {**TINY_CONFIG["rope_parameters"], "truncate": False}}, "truncate"),
    ({"rope_parameters": {**TINY_CONFIG["rope_parameters"], "beta_fast": "32"}}, "beta_fast must be a finite number"),
    ({"rope_parameters": {"rope_type": "default", "factor": 4.0}}, r"\['factor'\] given for a 'default' rope"),
    ({"rope_parameters": [1, 2]}, "rope_parameters must be an object"),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                          "compress": {"rope_type": "default", "rope_theta": 1.6e5}, "extra": 1}},
     r"unknown keys \['extra'\]"),
    ({"eos_token_id": [[[[[[1]]]]]]}, "eos_token_id"),
])
def test_malformed_config_field(change, match):
    with pytest.raises(ConfigError, match=match):
        DSV4Config.from_dict({**TINY_CONFIG, **change})


def test_deeply_nested_config_value():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ConfigError):
        DSV4Config.from_dict({**TINY_CONFIG, "eos_token_id": deep})


def test_compress_ratios_length_must_match_the_layers_and_mtp():
    d = {k: v for k, v in TINY_CONFIG.items() if k not in ("layer_types", "compress_rates")}
    d.update(compress_ratios=[0, 4, 16, 4, 0], num_nextn_predict_layers=1)
    assert DSV4Config.from_dict(d).layer_types == TINY_CONFIG["layer_types"]      # the MTP entry dropped
    d["compress_ratios"] = [0, 4, 16, 4, 0, 0]
    with pytest.raises(ConfigError, match="compress_ratios has 6 entries; expected num_hidden_layers=4"):
        DSV4Config.from_dict(d)
