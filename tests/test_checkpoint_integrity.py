"""Every integrity error, each raised by corrupting a real (synthetic) checkpoint on disk.
Each error must name the tensor and the file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoint_fixtures import build_pair, tiny_model
from safetensors import safe_open
from safetensors.torch import save_file

from dsv4core.checkpoint import INDEX_NAME, CheckpointError, open_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    _, off, hf, _ = build_pair(tmp_path_factory.mktemp("integrity"), mtp=False)
    return off, hf


@pytest.fixture
def off(base, tmp_path):
    return shutil.copytree(base[0], tmp_path / "official")


@pytest.fixture
def hf(base, tmp_path):
    return shutil.copytree(base[1], tmp_path / "transformers")


def _index(d):
    return json.loads((d / INDEX_NAME).read_text())


def edit(d, fn, name_in_file):
    """Rewrite the shard holding ``name_in_file``: ``fn(dict)`` edits its tensors in place.
    The index follows (removed names dropped, added names mapped to this shard). Returns the shard."""
    idx = _index(d)
    fname = idx["weight_map"][name_in_file]
    path = d / fname
    with safe_open(str(path), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    fn(tensors)
    save_file(tensors, str(path))
    wm = {k: v for k, v in idx["weight_map"].items() if v != fname or k in tensors}
    wm.update({k: fname for k in tensors})
    idx["weight_map"] = wm
    (d / INDEX_NAME).write_text(json.dumps(idx))
    return path


def load(d):
    m = tiny_model(meta=True)
    open_checkpoint(d).load_into(m)
    return m


def expect(d, match, tensor, file, loader=load):
    with pytest.raises(CheckpointError, match=match) as ei:
        loader(d)
    e = ei.value
    assert e.tensor == tensor, (e.tensor, str(e))
    assert e.file is not None and str(file) in e.file, (e.file, str(e))
    assert tensor in str(e) and str(file) in str(e)
    return e


def test_missing_tensor(off):
    f = edit(off, lambda t: t.pop("layers.2.attn.q_norm.weight"), "layers.2.attn.q_norm.weight")
    e = expect(off, "missing tensor", "model.layers.2.self_attn.q_a_norm.weight", off)
    assert "layers.2.attn.q_norm.weight" in str(e)
    assert f.exists()


def test_missing_expert(off):
    def drop(t):
        t.pop("layers.1.ffn.experts.2.w3.weight")
        t.pop("layers.1.ffn.experts.2.w3.scale")

    f = edit(off, drop, "layers.1.ffn.experts.2.w3.weight")
    # the other experts of that tensor may live in other shards: the error names one of its files
    with pytest.raises(CheckpointError, match="missing tensor for expert 2") as ei:
        load(off)
    assert ei.value.tensor == "layers.1.ffn.experts.2.w3.weight" and ei.value.file.endswith(".safetensors")
    assert f.exists()


def test_missing_tensor_transformers(hf):
    f = edit(hf, lambda t: t.pop("model.layers.3.mlp.experts.down_proj"), "model.layers.3.mlp.experts.down_proj")
    expect(hf, "missing tensor", "model.layers.3.mlp.experts.down_proj", hf)
    assert f.exists()


def test_unexpected_tensor(off):
    f = edit(off, lambda t: t.__setitem__("layers.0.attn.bogus.weight", torch.zeros(2, 2)), "layers.0.attn.wq_a.weight")
    expect(off, "unexpected tensor", "layers.0.attn.bogus.weight", f)


def test_unexpected_expert_index(off):
    f = edit(off, lambda t: t.__setitem__("layers.0.ffn.experts.9.w2.weight", torch.zeros(256, 64, dtype=torch.int8))
             or t.__setitem__("layers.0.ffn.experts.9.w2.scale", torch.zeros(256, 4, dtype=torch.float8_e8m0fnu)),
             "layers.0.ffn.experts.0.w2.weight")
    expect(off, "out of range", "layers.0.ffn.experts.9.w2.weight", f)


def test_shape_mismatch(off):
    f = edit(off, lambda t: t.__setitem__("layers.1.attn.attn_sink", torch.zeros(5)), "layers.1.attn.attn_sink")
    expect(off, r"shape mismatch: checkpoint \[5\] vs model \[4\]", "layers.1.attn.attn_sink", f)


def test_shape_mismatch_packed_fp4(off):
    name = "layers.2.ffn.experts.1.w1.weight"

    def cut(t):
        t[name] = t[name][:, :64].contiguous()

    f = edit(off, cut, name)
    expect(off, "shape mismatch", name, f)


def test_shape_mismatch_transformers(hf):
    n = "model.layers.0.self_attn.kv_proj.weight"
    f = edit(hf, lambda t: t.__setitem__(n, torch.zeros(64, 128)), n)
    expect(hf, "shape mismatch", n, f)


def test_dtype_mismatch(off):
    n = "layers.0.ffn.gate.tid2eid"
    f = edit(off, lambda t: t.__setitem__(n, t[n].float()), n)
    expect(off, "dtype mismatch", n, f)


def test_dtype_mismatch_int_weight(off):
    n = "layers.1.ffn.gate.weight"
    f = edit(off, lambda t: t.__setitem__(n, torch.zeros(t[n].shape, dtype=torch.int32)), n)
    expect(off, "dtype mismatch", n, f)


def test_scale_without_weight(off):
    f = edit(off, lambda t: t.pop("layers.3.attn.wo_b.weight"), "layers.3.attn.wo_b.weight")
    expect(off, "block scale without its weight", "layers.3.attn.wo_b.scale", f)


def test_weight_without_scale(off):
    f = edit(off, lambda t: t.pop("layers.3.attn.wo_b.scale"), "layers.3.attn.wo_b.scale")
    expect(off, "without its block scale", "layers.3.attn.wo_b.weight", f)


def test_fp4_expert_without_scale(off):
    n = "layers.0.ffn.experts.3.w2"
    f = edit(off, lambda t: t.pop(n + ".scale"), n + ".weight")
    expect(off, "without its block scale", n + ".weight", f)


def test_truncated_shard(off):
    idx = _index(off)
    p = off / idx["weight_map"]["layers.1.attn.wq_b.weight"]
    data = p.read_bytes()
    p.write_bytes(data[:-1000])
    with pytest.raises(CheckpointError, match="truncated file") as ei:
        open_checkpoint(off)
    assert ei.value.file == str(p) and ei.value.tensor in str(ei.value)
    # the named tensor is one whose data runs past the new end of the file
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    assert header[ei.value.tensor]["data_offsets"][1] > len(data) - 1000 - 8 - n


def test_corrupt_header(off):
    fname = _index(off)["weight_map"]["layers.2.attn.wkv.weight"]
    p = off / fname
    data = bytearray(p.read_bytes())
    data[8:20] = b"#garbage!{[]"
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header") as ei:
        open_checkpoint(off)
    assert ei.value.file == str(p)


def test_corrupt_header_offsets(off):
    """A header whose byte span disagrees with dtype x shape names that tensor."""
    fname = _index(off)["weight_map"]["layers.2.attn.wkv.weight"]
    p = off / fname
    data = bytearray(p.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    header["layers.2.attn.wkv.weight"]["shape"][0] += 1
    new = json.dumps(header, separators=(",", ":")).encode()
    new += b" " * (n - len(new))
    assert len(new) == n
    data[8:8 + n] = new
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt header") as ei:
        open_checkpoint(off)
    assert ei.value.tensor == "layers.2.attn.wkv.weight" and ei.value.file == str(p)


def test_corrupt_scale_data(off):
    """A scale byte of 0xFF (e8m0 NaN) makes the dequantised weight non-finite: an error."""
    n = "layers.0.attn.wo_a"

    def bad(t):
        s = t[n + ".scale"].view(torch.uint8).clone()
        s[0, 0] = 255
        t[n + ".scale"] = s.view(torch.float8_e8m0fnu)

    f = edit(off, bad, n + ".scale")
    expect(off, "non-finite", n + ".weight", f)


def test_index_points_at_missing_file(off):
    idx = _index(off)
    fname = idx["weight_map"]["layers.3.ffn.gate.weight"]
    (off / fname).unlink()
    first = next(k for k, v in idx["weight_map"].items() if v == fname)
    with pytest.raises(CheckpointError, match="does not exist") as ei:
        open_checkpoint(off)
    assert ei.value.tensor == first and ei.value.file == str(off / fname)


def test_index_lists_tensor_absent_from_file(off):
    idx = _index(off)
    idx["weight_map"]["layers.0.attn.ghost.weight"] = idx["weight_map"]["embed.weight"]
    (off / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="does not contain it") as ei:
        open_checkpoint(off)
    assert ei.value.tensor == "layers.0.attn.ghost.weight"
    assert ei.value.file == str(off / idx["weight_map"]["embed.weight"])


def test_nothing_left_on_meta_and_failed_load_leaves_no_zeros(off):
    """A failed load raises before any parameter is silently initialised: everything stays on
    meta (no zero-filled stand-ins)."""
    edit(off, lambda t: t.pop("norm.weight"), "norm.weight")
    m = tiny_model(meta=True)
    with pytest.raises(CheckpointError, match="missing tensor"):
        open_checkpoint(off).load_into(m)
    assert all(p.is_meta for p in m.parameters())


def test_fp8_nan_code_in_weight(off):
    n = "layers.3.attn.wq_b"

    def bad(t):
        w = t[n + ".weight"].view(torch.uint8).clone()
        w[5, 7] = 0x7F  # e4m3fn NaN
        t[n + ".weight"] = w.view(torch.float8_e4m3fn)

    f = edit(off, bad, n + ".weight")
    expect(off, "non-finite", n + ".weight", f)


@pytest.mark.parametrize("what", ["weight", "scale"])
def test_corrupt_fp8_kept_quantised_is_an_error(off, what):
    """Weights kept FP8 (load_model(quantized="keep")) get the same corruption check as the
    dequantising path: an FP8 NaN code or an e8m0 NaN scale is an error naming tensor and file."""
    import dsv4core

    n = "layers.3.attn.wq_b"

    def bad(t):
        key = f"{n}.{what}"
        raw = t[key].view(torch.uint8).clone()
        raw.view(-1)[-1] = 0x7F if what == "weight" else 0xFF
        t[key] = raw.view(t[key].dtype)

    f = edit(off, bad, f"{n}.{what}")
    with pytest.raises(CheckpointError, match="non-finite") as ei:
        dsv4core.load_model(off, backend="reference", quantized="keep")
    assert ei.value.file == str(f)


@pytest.mark.parametrize("name, value", [("layers.2.attn.q_norm.weight", float("nan")),
                                         ("layers.1.ffn.gate.weight", float("inf")),
                                         ("layers.0.attn.attn_sink", float("-inf"))])
def test_nonfinite_weight_is_refused_unless_allowed(off, name, value):
    def poison(t):
        t[name] = t[name].clone()
        t[name].view(-1)[3] = value

    f = edit(off, poison, name)
    e = expect(off, "non-finite values", name, f)
    assert ("1 NaN" if value != value else "1 Inf") in str(e)
    m = tiny_model(meta=True)
    open_checkpoint(off).load_into(m, allow_nonfinite=True)       # the debugging opt-out keeps them
    bad = [n for n, t in m.state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    assert len(bad) == 1


@pytest.mark.parametrize("bad", [4, 1000, -1])
def test_hash_table_out_of_range_is_refused(off, bad):
    from dsv4core.model.api import load_model

    n = "layers.0.ffn.gate.tid2eid"

    def poison(t):
        t[n] = t[n].clone()
        t[n][7, 1] = bad

    f = edit(off, poison, n)
    e = expect(off, r"integer values out of range \[0, 4\)", n, f,
               loader=lambda d: open_checkpoint(d).load_into(tiny_model(meta=True), value_ranges={"tid2eid": (0, 4)}))
    assert str(bad) in str(e)
    if bad == 1000:       # load_model checks it (the tables' range is the config's expert count)
        with pytest.raises(CheckpointError, match=r"out of range \[0, 4\)") as ei:
            load_model(off, backend="reference", dtype="float32")
        assert ei.value.tensor == n
