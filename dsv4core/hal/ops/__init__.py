"""The HAL op catalogue, one module per op family. Importing this package declares every op.

| family       | ops |
|--------------|-----|
| norms        | rms_norm |
| mhc          | hc_pre, hc_post, hc_head |
| rope         | rope, q_norm_rope, kv_norm_rope |
| attention    | sparse_mqa_attention |
| compression  | compress_pool, compress_windows, indexer_scores, indexer_scores_rows, indexer_topk |
| cache        | cache_store |
| projections  | linear, wo_a |
| moe          | moe_route, moe_experts |
| collectives  | all_reduce, all_gather, reduce_scatter, all_to_all |
"""

from . import norms, mhc, rope, attention, compression, cache, projections, moe, collectives  # noqa: F401
