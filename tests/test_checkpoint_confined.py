"""Every file a checkpoint directory names stays inside it: shard index entries, shards found by
name and config.json, with symlinks followed; a malformed index is a CheckpointError."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from dsv4core.checkpoint import INDEX_NAME, CheckpointError, open_checkpoint

NAME = "model.embed_tokens.weight"


def shard(path, name=NAME):
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: torch.zeros(2, 2)}, str(path))
    return path


def index(d, weight_map):
    (d / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    return d


def test_a_plain_checkpoint_opens(ckpt):
    shard(ckpt / "model.safetensors")
    index(ckpt, {NAME: "model.safetensors"})
    assert open_checkpoint(ckpt).tensor_names() == [NAME]


@pytest.mark.parametrize("where", ["parent", "absolute", "nested-parent"])
def test_index_entry_outside_the_directory_is_refused(ckpt, tmp_path, where):
    evil = shard(tmp_path / "outside" / "evil.safetensors")
    entry = {"parent": "../outside/evil.safetensors", "absolute": str(evil),
             "nested-parent": "sub/../../outside/evil.safetensors"}[where]
    index(ckpt, {NAME: entry})
    with pytest.raises(CheckpointError, match="outside the checkpoint directory") as ei:
        open_checkpoint(ckpt)
    assert ei.value.tensor == NAME and entry in str(ei.value)


def test_index_entry_through_a_symlink_leaving_the_directory_is_refused(ckpt, tmp_path):
    evil = shard(tmp_path / "outside" / "evil.safetensors")
    os.symlink(evil, ckpt / "model.safetensors")
    index(ckpt, {NAME: "model.safetensors"})
    with pytest.raises(CheckpointError, match="a symlink leaving it") as ei:
        open_checkpoint(ckpt)
    assert str(evil) in str(ei.value) and ei.value.tensor == NAME


def test_symlinked_subdirectory_leaving_the_directory_is_refused(ckpt, tmp_path):
    shard(tmp_path / "outside" / "evil.safetensors")
    os.symlink(tmp_path / "outside", ckpt / "sub")
    index(ckpt, {NAME: "sub/evil.safetensors"})
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        open_checkpoint(ckpt)


def test_globbed_shard_symlinked_outside_is_refused(ckpt, tmp_path):
    evil = shard(tmp_path / "outside" / "evil.safetensors")
    os.symlink(evil, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        open_checkpoint(ckpt)


def test_config_symlinked_outside_is_refused(ckpt, tmp_path):
    shard(ckpt / "model.safetensors")
    (tmp_path / "other.json").write_text(json.dumps({"model_type": "deepseek_v4"}))
    (ckpt / "config.json").unlink()
    os.symlink(tmp_path / "other.json", ckpt / "config.json")
    with pytest.raises(CheckpointError, match="config.json.*outside the checkpoint directory"):
        open_checkpoint(ckpt)


def test_symlinks_inside_the_directory_are_followed(ckpt):
    shard(ckpt / "data" / "real.safetensors")
    os.symlink(ckpt / "data" / "real.safetensors", ckpt / "model.safetensors")
    index(ckpt, {NAME: "model.safetensors"})
    assert open_checkpoint(ckpt).tensor_names() == [NAME]


def test_huggingface_cache_snapshot_symlinks_into_its_blobs(tmp_path):
    repo = tmp_path / "models--org--name"
    blob = shard(repo / "blobs" / "0123abcd")
    snap = repo / "snapshots" / "rev1"
    snap.mkdir(parents=True)
    os.symlink("../../blobs/0123abcd", snap / "model.safetensors")
    index(snap, {NAME: "model.safetensors"})
    ck = open_checkpoint(snap)
    assert ck.tensor_names() == [NAME] and ck.tensor_info(NAME).file.resolve() == blob.resolve()
    # ... but an index entry may not name the blob store itself
    index(snap, {NAME: "../../blobs/0123abcd"})
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        open_checkpoint(snap)


@pytest.mark.parametrize("doc, match", [
    ({"weight_map": [NAME, "model.safetensors"]}, "weight_map of type list"),
    ({"metadata": {}}, "no weight_map"),
    ([1, 2], "got list"),
    ({"weight_map": {NAME: 3}}, "expected a file name"),
    ({"weight_map": {NAME: ["model.safetensors"]}}, "expected a file name"),
])
def test_malformed_index_is_a_checkpoint_error(ckpt, doc, match):
    shard(ckpt / "model.safetensors")
    (ckpt / INDEX_NAME).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=match) as ei:
        open_checkpoint(ckpt)
    assert INDEX_NAME in str(ei.value)


@pytest.mark.parametrize("fname", ["config.json", INDEX_NAME])
def test_deeply_nested_json_is_a_checkpoint_error(ckpt, fname):
    shard(ckpt / "model.safetensors")
    index(ckpt, {NAME: "model.safetensors"})
    (ckpt / fname).write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError, match=fname.replace(".", r"\.") + "|shard index"):
        open_checkpoint(ckpt)


def test_tokenizer_symlinked_outside_is_refused(tmp_path):
    """load_model reads tokenizer.json / chat template files only from inside the checkpoint."""
    from dsv4core.checkpoint import save
    from dsv4core.model.api import load_model

    d = tmp_path / "tiny"
    save(load_model("tiny", backend="reference"), d, format="transformers")
    (tmp_path / "tok.json").write_text("{}")
    os.symlink(tmp_path / "tok.json", d / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer.json.*outside the checkpoint directory"):
        load_model(d, backend="reference")
