"""The model's state: every name of the cache, from the two modules that hold it.

- `dsv4core.model.cache_layout`: the layout as data: `CacheConfig` (capacities, `kv_dtype`),
  `kv_formats` (the row formats a `kv_dtype` stores), `state_bytes` (the computed memory of one
  request), `Component` (one pool described as data), the sizing rules `ring_capacity` /
  `default_block_tokens`, and `CacheAccounting` (`components()`, `bytes_report()`,
  `request_bytes()` of a built cache).
- `dsv4core.model.kvcache`: the state at run time: `KVCache` (the preallocated pools, block
  tables, request slots; fork, truncate, step staging, table uploads), `RequestState` (a
  request's handle), `StepPlan` (a step's staged changes), `CacheError` / `PoolFullError`.
"""

from __future__ import annotations

from .cache_layout import (KV_DTYPES, CacheAccounting, CacheConfig, Component, default_block_tokens, kv_formats,
                           ring_capacity, state_bytes)
from .kvcache import CacheError, KVCache, PoolFullError, RequestState, StepPlan

__all__ = ["KV_DTYPES", "CacheAccounting", "CacheConfig", "CacheError", "Component", "KVCache", "PoolFullError",
           "RequestState", "StepPlan", "default_block_tokens", "kv_formats", "ring_capacity", "state_bytes"]
