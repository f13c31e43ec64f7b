"""Synthetic DeepSeek-V4 checkpoints for the checkpoint tests (built here, never downloaded).

A tiny random transformers ``DeepseekV4ForCausalLM`` (float32; 16 indexer heads so indexer scores
do not tie) whose every tensor is randomised (norms, mHC, sinks, biases too), written
* in the official layout (renamed, FP8 e4m3 with e8m0 or fp32 block scales, FP4 experts, sharded),
* in the transformers layout with the *dequantised* values of the official one.
"""

from __future__ import annotations

import torch

# every dim a multiple of 128 where FP8 blocks apply, but not all: kv_proj has 64 rows and
# the indexer q_b 512, so partial (ceil) blocks are exercised through head_dim=64 rows.
TINY = dict(vocab_size=256, hidden_size=256, moe_intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, head_dim=64, q_lora_rank=128, num_experts_per_tok=2, n_routed_experts=4,
            o_groups=2, o_lora_rank=128, index_n_heads=16, index_head_dim=32, index_topk=4, sliding_window=8,
            compress_ratios=[0, 4, 128, 4], num_hash_layers=1, qk_rope_head_dim=16, hc_mult=2,
            num_nextn_predict_layers=0, hc_sinkhorn_iters=20)


def tiny_config(**over):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**{**TINY, **over})


def randomize_(model: torch.nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Give every parameter / persistent buffer a random value of a sensible size. Returns a copy
    of the state dict."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("tid2eid"):
                t.copy_(torch.randint(0, cfg.n_routed_experts, t.shape, generator=g))
            elif not t.is_floating_point():
                continue
            elif name.endswith(("norm.weight", "layernorm.weight")):
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
            elif name.endswith(("_hc.scale", "hc_scale")):
                t.copy_(0.5 + 0.1 * torch.rand(t.shape, generator=g))
            elif name.endswith(("_hc.fn", "hc_fn")):
                t.copy_(0.02 * torch.randn(t.shape, generator=g))
            elif name.endswith(("sinks", "position_bias", "e_score_correction_bias", "_hc.base", "hc_base")):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            else:
                # weights: 0.05 gives O(1) activations at these sizes; a few outliers per tensor so
                # FP8 / FP4 scales differ between blocks
                w = 0.05 * torch.randn(t.shape, generator=g)
                w.view(-1)[:: 97] *= 4
                t.copy_(w)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def tiny_model(seed: int = 0, meta: bool = False, **over):
    from transformers import DeepseekV4ForCausalLM

    cfg = tiny_config(**over)
    if meta:
        with torch.device("meta"):
            return DeepseekV4ForCausalLM(cfg).eval()
    torch.manual_seed(seed)
    m = DeepseekV4ForCausalLM(cfg).eval()
    randomize_(m, seed)
    return m


def build_pair(tmp_path, *, seed: int = 0, scale_dtype=None, shard_bytes: int = 300_000, mtp: bool = True):
    """(original model, official dir, transformers dir, reference state dict).

    The transformers dir holds the dequantised values of the official one (``reference``)."""
    from dsv4core.checkpoint.writer import write_official, write_transformers

    model = tiny_model(seed)
    sd = model.state_dict()
    off = tmp_path / "official"
    hf = tmp_path / "transformers"
    extra = {"mtp.0.e_proj.weight": torch.zeros(8, 8), "mtp.0.norm.weight": torch.ones(8)} if mtp else None
    ref = write_official(sd, model.config.to_dict(), off, scale_dtype=scale_dtype, max_shard_bytes=shard_bytes,
                         mtp=extra)
    write_transformers(ref, model.config.to_dict(), hf, max_shard_bytes=shard_bytes)
    return model, off, hf, ref
