"""Limits before allocation: config sizes bounded (and bounded by max_position_embeddings) with
errors naming the field, the limit and the value; the sliding-window pool sized by what the
requests can hold, not by the window."""

from __future__ import annotations

import pytest
import torch

from dsv4core.model import ConfigError, DSV4Config
from dsv4core.model.api import TINY_CONFIG, build_model
from dsv4core.model.cache import CacheConfig, KVCache
from dsv4core.model.config import SIZE_LIMITS


@pytest.mark.parametrize("field", sorted(SIZE_LIMITS))
def test_every_size_field_has_an_upper_bound(field):
    v = SIZE_LIMITS[field] + 1
    with pytest.raises(ConfigError, match=rf"{field}.*{v}|{field}.*{SIZE_LIMITS[field]}") as ei:
        DSV4Config.from_dict({**TINY_CONFIG, field: v})
    assert field in str(ei.value) and str(SIZE_LIMITS[field]) in str(ei.value)


@pytest.mark.parametrize("change, msg", [
    ({"sliding_window": 4097}, "sliding_window=4097 must be <= max_position_embeddings=4096"),
    ({"index_topk": 5000}, "index_topk=5000 must be <= max_position_embeddings=4096"),
    ({"compress_rates": {"heavily_compressed_attention": 8192}},
     r"compress_rates\['heavily_compressed_attention'\]=8192 must be <= max_position_embeddings=4096"),
    ({"num_hidden_layers": 10 ** 6}, r"num_hidden_layers must be an integer in 1\.\.1024; got 1000000"),
])
def test_sizes_bounded_by_max_position_embeddings(change, msg):
    with pytest.raises(ConfigError, match=msg):
        DSV4Config.from_dict({**TINY_CONFIG, **change})


def _big_window_config(window: int, maxpos: int) -> DSV4Config:
    return DSV4Config.from_dict({**TINY_CONFIG, "sliding_window": window, "max_position_embeddings": maxpos})


def test_window_pool_is_sized_by_what_requests_hold_not_by_the_window():
    cfg = _big_window_config(1 << 20, 1 << 20)
    cc = CacheConfig()
    cache = KVCache(cfg, torch.float32, "meta", cc)          # meta: nothing is allocated
    S, Bw, Bc = cc.max_requests, cc.window_block, cache.block_tokens
    # the requests together hold at most the compressed pool's tokens, plus one partial block
    # each; a step in flight adds max_step_tokens
    bound = 2 * (cc.max_tokens + S * (Bc + 2 * Bw) + cc.max_step_tokens + Bw)
    assert cache.Rw <= bound, (cache.Rw, bound)
    # a small window keeps the per-request sizing it had
    small = KVCache(_big_window_config(128, 1 << 20), torch.float32, "meta", cc)
    per_req = -(-(127 + cc.max_rollback) // Bw) + 1
    assert small.Rw == (S * (per_req + 1) + -(-cc.max_step_tokens // Bw) + 1) * Bw


def test_generation_is_unchanged_when_the_window_pool_is_capped():
    """A window as long as the context: every row stays. The capped pool (4 requests in 512
    tokens) gives the same tokens as a pool sized per request (one request at a time)."""
    model = build_model({**TINY_CONFIG, "sliding_window": 4096}, backend="reference", seed=3)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 256, (30 + 23 * i,), generator=g).tolist() for i in range(4)]
    kw = dict(max_tokens=512, max_request_tokens=512, window_block=16, max_step_tokens=512)
    capped = model.configure_cache(max_requests=4, **kw)
    n_comp = capped.comp_pool.n
    held = capped.win_pool.n - 1 - 512 // 16            # less the null block and a step's blocks
    assert held < 4 * (512 // 16 + 2)                  # less than 4 whole requests: the cap applies
    got = model.generate(prompts, 6)
    assert capped.win_pool.n - 1 == len(capped.win_pool.free) and n_comp - 1 == len(capped.comp_pool.free)
    model.configure_cache(max_requests=1, **kw)
    want = [model.generate([p], 6)[0] for p in prompts]
    assert got == want
