"""Portable Triton kernels (written once; reused by the cuda, rocm and xpu plugins and the
interpreter-mode CPU backend, each with its own launch table: ``launch``).

How an op reaches its kernel (three files): a plugin calls :func:`registry.register_ops`, which
adds, per op listed in :data:`OPS`, a wrapper guarded by the op's predicate
(``predicates.SUPPORTS``); at the op's first call the wrapper imports the kernel module, where the
kernel function is marked ``@implements("<op>", supports=<predicate>)`` (e.g. ``norm.rms_norm``).

Importing this package is cheap: it imports neither triton nor any kernel module (the kernel
module, and triton with it, is imported on the op's first call).
"""

#: op name -> the kernel module (dsv4core.kernels.triton.<module>) whose function carries
#: ``@implements(op, ...)``. The index the registration reads without importing the kernels;
#: ``registry.implements`` refuses a kernel declared in another module.
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
