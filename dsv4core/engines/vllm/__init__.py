"""dsv4core as vLLM's DeepSeek-V4 (docs/vllm.md).

Importable without vLLM: `layout` (the caches as an engine's allocator sees them, the bytes
they take), `pools` (dsv4core's pools over engine memory), `metadata` (the step builder),
`checkpoint` (a checkpoint directory vLLM's `LLM` / server load). The
vLLM-facing parts import vLLM when used: `specs` (the caches as vLLM spec objects), `model` (the
model class vLLM runs) and `plugin` (the `vllm.general_plugins` entry point).
"""

from .layout import CachePart, cache_parts, kv_bytes_per_token, request_bytes
from .metadata import EngineStep, build_step
from .pools import EnginePools, allocate_packed, rows_view

__all__ = ["CachePart", "EnginePools", "EngineStep", "allocate_packed", "build_step", "cache_parts",
           "kv_bytes_per_token", "request_bytes", "rows_view"]
