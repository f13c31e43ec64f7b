"""The model's caches as vLLM KV-cache specs (imports vLLM: `vllm.v1.kv_cache_interface`).

As vLLM's own DeepSeek-V4 declares them (docs/vllm.md): the window rows and the compressor
states as `SlidingWindowMLASpec` (64-token blocks for the window; 4 / 8-token blocks for the
states of rate 4 / 128), the compressed entries and indexer keys as `MLAAttentionSpec` of
256-token blocks with `tokens_per_state = m`. The rows are dsv4core's (`layout.cache_parts`):
a spec's `state_content_bytes` is one row's bytes, so its page is the part's page, and every
spec asks for a physical block stride that is a multiple of the bytes of every row viewed flat
(`block_stride_alignment`), which the flat pool views need (`pools.rows_view`; FP8 rows and FP4
keys are viewed paged, `pools.paged_layer_view`).
"""

from __future__ import annotations

from .layout import CachePart, block_stride_alignment


def kv_cache_spec(part: CachePart, align: int | None = None):
    """The vLLM spec of one cache part (`align`: the block stride alignment, default none)."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

    common = dict(block_size=part.block_tokens, num_kv_heads=1, max_tp_shards=1, head_size=part.row_width,
                  dtype=part.dtype, state_content_bytes=part.row_bytes, block_stride_alignment=align)
    if part.paging == "sliding":
        return SlidingWindowMLASpec(sliding_window=part.window, **common)
    return MLAAttentionSpec(tokens_per_state=part.tokens_per_row, **common)


def kv_cache_specs(parts: list[CachePart], prefix: str = "") -> dict[str, object]:
    """layer name (`prefix` + part.key) -> vLLM spec, for every part; one block stride alignment
    for all (vLLM packs the pages of several groups into one physical block)."""
    align = block_stride_alignment(parts)
    return {prefix + p.key: kv_cache_spec(p, align) for p in parts}
