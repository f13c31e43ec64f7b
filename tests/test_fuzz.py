"""Bounded fuzzing (Hypothesis) of the input checks that face untrusted data: the safetensors
header parser, config parsing and `forward_batch`'s argument checks. Each property: the input is
accepted with its invariants holding, or refused with the documented error type (never a raw
exception), and a refused step changes no state. A few dozen examples each: seconds in all; no
per-example deadline (timings are not asserted)."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv4core.checkpoint import CheckpointError, read_header
from dsv4core.checkpoint.safetensors_io import ST_DTYPES
from dsv4core.model import CacheError, ConfigError, DSV4Config, InputError
from dsv4core.model.api import TINY_CONFIG, load_model
from dsv4core.model.config import SIZE_LIMITS

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_scalar = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8)
json_value = st.recursive(json_scalar, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c,
                                                                                            max_size=4), max_leaves=12)
small_int = st.integers(-3, 40)
# header entries near the valid form, so the checks past "is it a dict" are reached
entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(sorted(ST_DTYPES) + ["F33", ""]) | json_scalar,
    "shape": st.lists(small_int, max_size=3) | json_value,
    "data_offsets": st.lists(small_int | st.integers(0, 400), min_size=0, max_size=3) | json_value,
})
header = st.dictionaries(st.text(min_size=1, max_size=6), entry | json_value, max_size=4)

@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _write(d: Path, raw_header: bytes, data_len: int, length: int | None = None) -> Path:
    p = d / "x.safetensors"
    n = len(raw_header) if length is None else length
    p.write_bytes(struct.pack("<Q", n) + raw_header + b"\0" * data_len)
    return p


def _check_header(p: Path, data_len: int) -> None:
    try:
        infos, meta = read_header(p)
    except CheckpointError as e:
        assert str(p) in str(e)
        return
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items())
    spans = []
    for name, i in infos.items():
        itemsize = ST_DTYPES[i.dtype][1]
        assert all(isinstance(s, int) and s >= 0 for s in i.shape)
        assert i.nbytes == math.ceil(math.prod(i.shape) * itemsize) >= 0
        spans.append(i.nbytes)
    assert sum(spans) <= data_len             # disjoint spans inside the data section


@FUZZ
@given(header, st.integers(0, 512))
def test_fuzz_safetensors_header(fuzz_dir, h, data_len):
    _check_header(_write(fuzz_dir, json.dumps(h).encode(), data_len), data_len)


@FUZZ
@given(st.binary(max_size=64), st.integers(0, 64), st.none() | st.integers(0, 2**64 - 1))
def test_fuzz_safetensors_raw_bytes(fuzz_dir, raw, data_len, length):
    _check_header(_write(fuzz_dir, raw, data_len, length), data_len)


# ------------------------------------------------------------------ config
config_keys = st.sampled_from(sorted(set(TINY_CONFIG) | {"compress_ratios", "num_hash_layers", "qk_rope_head_dim",
                                                         "rope_scaling", "num_nextn_predict_layers"}))
near_value = json_value | st.integers(-2, 2**25) | st.lists(st.sampled_from(
    ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention", "moe", "hash_moe", 0, 4]),
    max_size=6)


@FUZZ
@given(st.dictionaries(config_keys, near_value, min_size=1, max_size=3), st.sets(config_keys, max_size=2))
def test_fuzz_config(changes, dropped):
    d = {k: v for k, v in {**TINY_CONFIG, **changes}.items() if k not in dropped}
    if "compress_ratios" in changes:
        d.pop("layer_types", None)
    try:
        cfg = DSV4Config.from_dict(d)
    except ConfigError:
        return
    L = cfg.num_hidden_layers
    assert len(cfg.layer_types) == L and len(cfg.mlp_layer_types) == L
    for name, hi in SIZE_LIMITS.items():
        assert 0 < getattr(cfg, name) <= hi
    assert cfg.sliding_window <= cfg.max_position_embeddings
    assert all(math.isfinite(x) for x in (cfg.rms_norm_eps, cfg.routed_scaling_factor, cfg.rope_main.theta,
                                          cfg.rope_compress.theta))


# ------------------------------------------------------------------ forward_batch
@pytest.fixture(scope="module")
def tiny():
    m = load_model("tiny", backend="reference")
    m.configure_cache(max_requests=3, max_tokens=256, max_request_tokens=64, max_step_tokens=16, window_block=8,
                      block_tokens=32)
    return m


ints = st.lists(st.integers(-2, 300), max_size=10)
arg = ints | st.lists(st.floats(-2, 300) | st.booleans(), min_size=1, max_size=4) | st.lists(ints, max_size=2)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_forward_batch_arguments(tiny, data):
    cache = tiny.cache
    states = [tiny.new_state() for _ in range(2)]
    try:
        for s, n in zip(states, data.draw(st.tuples(st.integers(0, 6), st.integers(0, 6)))):
            if n:
                tiny.forward_batch(torch.arange(2, 2 + n), torch.arange(n), torch.zeros(n, dtype=torch.long), [s])
        valid = data.draw(st.booleans())
        if valid:      # near-valid: a contiguous request layout with the right positions, then perturbed
            counts = data.draw(st.lists(st.integers(0, 5), min_size=2, max_size=2))
            rid = [r for r, c in enumerate(counts) for _ in range(c)]
            pos = [states[r].length + j for r, c in enumerate(counts) for j in range(c)]
            ids = data.draw(st.lists(st.integers(0, 255), min_size=len(rid), max_size=len(rid)))
            k = data.draw(st.integers(0, 3))
            if k == 1 and pos:
                pos[data.draw(st.integers(0, len(pos) - 1))] += data.draw(st.sampled_from([-1, 1, 100]))
            elif k == 2 and ids:
                ids[data.draw(st.integers(0, len(ids) - 1))] = data.draw(st.sampled_from([-1, 256, 10**6]))
            elif k == 3 and rid:
                rid[data.draw(st.integers(0, len(rid) - 1))] = data.draw(st.sampled_from([-1, 2, 5]))
        else:
            ids, pos, rid = data.draw(arg), data.draw(arg), data.draw(arg)
        rows = data.draw(st.none() | ints)
        before = ([s.length for s in states], len(cache.win_pool.free), len(cache.comp_pool.free),
                  cache.window_table.copy(), cache.comp_table.copy())
        try:
            out = tiny.forward_batch(ids, pos, rid, states, logits_rows=rows)
        except (InputError, CacheError):      # refused: nothing changed
            after = ([s.length for s in states], len(cache.win_pool.free), len(cache.comp_pool.free))
            assert after == before[:3]
            assert (cache.window_table == before[3]).all() and (cache.comp_table == before[4]).all()
            return
        n_rows = len(ids) if rows is None else len(rows)
        assert out.shape == (n_rows, tiny.config.vocab_size) and torch.isfinite(out).all()
        assert [s.length for s in states] == [L + rid.count(r) for r, L in enumerate(before[0])]
    finally:
        for s in states:
            s.release()
