"""Device-neutral DeepSeek-V4 model core: config, modules, pooled request state (KVCache), batched
steps on HAL ops (no vendor code here). Public entry point: ``dsv4core.load_model``
(implemented in :mod:`dsv4core.model.api`)."""

from .config import ConfigError, DSV4Config, RopeSpec, rope_inv_freq
from .model import DeviceTokens, DSV4ForCausalLM, InputError
from .tiny import randomize_weights_
from .cache_layout import CacheConfig, state_bytes
from .kvcache import CacheError, KVCache, PoolFullError, RequestState

__all__ = [
    "ConfigError", "DSV4Config", "RopeSpec", "rope_inv_freq", "DeviceTokens", "DSV4ForCausalLM", "InputError",
    "randomize_weights_", "CacheConfig", "CacheError", "KVCache", "PoolFullError", "RequestState", "state_bytes",
]
