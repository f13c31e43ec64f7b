"""Portable Triton kernels (written once; reused by the cuda, rocm and xpu plugins and the
interpreter-mode CPU backend, each with its own launch table: ``launch``).

Importing this package is cheap: it imports neither triton nor any kernel module. ``registry``
registers lazy wrappers (the kernel module, and triton with it, is imported on the first call) and
pure-torch ``supports`` predicates (``predicates``).
"""

#: op name -> kernel module (dsv4core.kernels.triton.<module>) holding a function of the same name
OPS = {
    "rms_norm": "norm",
    "hc_post": "mhc",
    "hc_pre": "mhc",
    "hc_head": "mhc",
    "rope": "rope",
    "q_norm_rope": "rope",
    "kv_norm_rope": "rope",
    "sparse_mqa_attention": "attention",
    "compress_pool": "compress",
    "compress_windows": "compress",
    "cache_store": "cache",
    "indexer_scores_rows": "indexer",
    "indexer_rotate_quant": "indexer",
    "indexer_topk": "topk",
    "linear": "linear",
    "wo_a": "wo_a",
    "moe_route": "route",
    "moe_experts": "moe",
}
