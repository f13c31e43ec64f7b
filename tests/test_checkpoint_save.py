"""`dsv4core.checkpoint.save`: a transformers-format save loads back bit-identical, in the dtype it
was written in; an official-format save is what the official writer produces; refusals name why."""

from __future__ import annotations

import torch
import pytest

from dsv4core import load_model
from dsv4core.checkpoint import CheckpointError, save


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", backend="reference")


def test_transformers_save_loads_back_bit_identical_in_its_dtype(tiny, tmp_path):
    save(tiny, tmp_path, format="transformers")
    m = load_model(tmp_path, backend="reference")           # no dtype given: the saved float32
    assert m.act_dtype == torch.float32
    a, b = tiny.state_dict(), m.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(m.logits([0, 17, 42, 7]), tiny.logits([0, 17, 42, 7]))


def test_official_save_is_the_official_writer_output(tiny, tmp_path):
    from dsv4core.checkpoint.writer import write_official

    save(tiny, tmp_path / "a", format="official")
    config = dict(tiny.config.to_hf_dict(), dtype="float32")
    write_official(tiny.state_dict(), config, tmp_path / "b", reference=False)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir()) and any(f.endswith(".safetensors") for f in files)
    for f in files:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f
    m = load_model(tmp_path / "a", backend="reference")
    assert m.config.to_hf_dict() == tiny.config.to_hf_dict()


def test_save_refuses_naming_the_reason(tiny, tmp_path):
    with pytest.raises(CheckpointError, match="format must be one of transformers, official"):
        save(tiny, tmp_path, format="gguf")

    class Quantised:
        config = tiny.config

        def state_dict(self):
            return {"lm_head.weight": torch.zeros(2, 2, dtype=torch.float8_e4m3fn)}

    with pytest.raises(CheckpointError, match="kept quantised.*quantized='dequantize'"):
        save(Quantised(), tmp_path)
