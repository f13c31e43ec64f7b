"""The dtype a checkpoint loads in when none is asked: config.json's `dtype` / `torch_dtype` unless
it would narrow the stored weights, else the stored token embedding's dtype (neither a config
without a dtype nor one declaring bfloat16 narrows float32 weights); an explicit dtype= wins; a
float16 checkpoint is an error asking for dtype=."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4core import load_model
from dsv4core.checkpoint import open_checkpoint
from dsv4core.checkpoint.writer import write_transformers
from dsv4core.model.api import TINY_CONFIG


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", backend="reference")


def _write(tiny, d, config_extra: dict, dtype=None):
    cfg = {k: v for k, v in TINY_CONFIG.items() if k not in ("dtype", "torch_dtype")}
    write_transformers(tiny.state_dict(), {**cfg, **config_extra}, d, dtype=dtype)
    assert ("dtype" in json.loads((d / "config.json").read_text())) == ("dtype" in config_extra)
    return d


def test_no_dtype_in_config_loads_float32_weights_as_float32_unchanged(tiny, tmp_path):
    d = _write(tiny, tmp_path, {})
    assert open_checkpoint(d).weights_dtype()[0] == torch.float32
    m = load_model(d, backend="reference")
    assert m.act_dtype == torch.float32
    a, b = tiny.state_dict(), m.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)            # nothing narrowed


def test_no_dtype_in_config_follows_bfloat16_storage(tiny, tmp_path):
    d = _write(tiny, tmp_path, {}, dtype=torch.bfloat16)
    dt, where = open_checkpoint(d).weights_dtype()
    assert dt == torch.bfloat16 and "model.embed_tokens.weight (BF16" in where and "no dtype" in where
    assert load_model(d, backend="reference").act_dtype == torch.bfloat16


def test_a_quantisation_tag_in_config_falls_back_to_the_stored_dtype(tiny, tmp_path):
    d = _write(tiny, tmp_path, {"dtype": "fp8"})
    dt, where = open_checkpoint(d).weights_dtype()
    assert dt == torch.float32 and "dtype='fp8'" in where


def test_config_dtype_is_followed(tiny, tmp_path):
    d = _write(tiny, tmp_path, {"torch_dtype": "bfloat16"}, dtype=torch.bfloat16)
    assert open_checkpoint(d).weights_dtype() == (torch.bfloat16, "config.json torch_dtype='bfloat16'")
    assert load_model(d, backend="reference").act_dtype == torch.bfloat16


def test_a_wider_config_dtype_is_followed(tiny, tmp_path):
    d = _write(tiny, tmp_path, {"dtype": "float32"}, dtype=torch.bfloat16)
    assert open_checkpoint(d).weights_dtype() == (torch.float32, "config.json dtype='float32'")
    assert load_model(d, backend="reference").act_dtype == torch.float32


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_a_bfloat16_config_never_narrows_float32_weights(tiny, tmp_path, key):
    d = _write(tiny, tmp_path, {key: "bfloat16"})           # the tensors are stored float32
    dt, where = open_checkpoint(d).weights_dtype()
    assert dt == torch.float32
    assert f"config.json {key}='bfloat16'" in where and "model.embed_tokens.weight (F32" in where
    m = load_model(d, backend="reference")
    assert m.act_dtype == torch.float32
    a, b = tiny.state_dict(), m.state_dict()
    assert a.keys() == b.keys() and all(b[k].dtype == a[k].dtype and torch.equal(a[k], b[k]) for k in a)
    # an explicit dtype still wins
    assert load_model(d, backend="reference", dtype="bfloat16").act_dtype == torch.bfloat16


def test_a_bfloat16_config_over_float16_weights_asks_for_a_dtype(tiny, tmp_path):
    d = _write(tiny, tmp_path, {"dtype": "bfloat16"}, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"float16 \(config.json dtype='bfloat16' .*embed_tokens.*F16.*give dtype="):
        load_model(d, backend="reference")
    assert load_model(d, backend="reference", dtype="bfloat16").act_dtype == torch.bfloat16


def test_float16_weights_ask_for_a_dtype(tiny, tmp_path):
    d = _write(tiny, tmp_path, {}, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"float16 .*embed_tokens.*give dtype= \(--dtype\)"):
        load_model(d, backend="reference")
    assert load_model(d, backend="reference", dtype="float32").act_dtype == torch.float32


def test_cli_reports_the_float16_refusal_in_one_line(tiny, tmp_path, capsys):
    from dsv4core.cli import main

    d = _write(tiny, tmp_path, {"dtype": "float16"}, dtype=torch.float16)
    assert main(["generate", "--model", str(d), "--backend", "reference", "--input-ids", "1,2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json dtype='float16'" in err and "--dtype" in err
