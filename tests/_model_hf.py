"""Helpers for the model tests: tiny transformers DeepseekV4 models with random weights, saved
with `save_pretrained` and loaded back through `dsv4core.load_model`."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from dsv4core.model import DSV4Config, randomize_weights_

CSA, HCA, SW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

# Config A: hc_mult 4, every layer type twice over, hash and top-k MoE, window 8, CSA m=4, HCA m=8,
# 16 indexer heads with top-k 6 (so the indexer really selects once > 6 entries exist).
CONFIG_A = dict(
    vocab_size=211, hidden_size=48, moe_intermediate_size=24, num_hidden_layers=5, num_attention_heads=4,
    head_dim=32, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=6, o_groups=2, o_lora_rank=12,
    index_n_heads=16, index_head_dim=16, index_topk=6, sliding_window=8,
    compress_rates={CSA: 4, HCA: 8}, layer_types=[SW, CSA, HCA, CSA, HCA],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"], hc_mult=4, qk_rope_head_dim=8,
    rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=4096, routed_scaling_factor=1.5,
)
# Config B: hc_mult 2, odd ratios (CSA m=3, HCA m=5), o_groups 4, window 11, a different layer and
# MoE pattern (HCA first, hash layer in the middle), plain (non-YaRN) compress rope.
CONFIG_B = dict(
    vocab_size=173, hidden_size=40, moe_intermediate_size=20, num_hidden_layers=4, num_attention_heads=8,
    head_dim=24, q_lora_rank=20, num_experts_per_tok=3, n_routed_experts=5, o_groups=4, o_lora_rank=10,
    index_n_heads=16, index_head_dim=12, index_topk=5, sliding_window=11,
    compress_rates={CSA: 3, HCA: 5}, layer_types=[HCA, CSA, SW, CSA],
    mlp_layer_types=["moe", "hash_moe", "moe", "moe"], hc_mult=2, qk_rope_head_dim=8,
    rope_theta=10000.0, compress_rope_theta=40000.0, max_position_embeddings=2048, routed_scaling_factor=2.5,
    swiglu_limit=3.0,
)


def hf_model(kw: dict, seed: int):
    """A transformers DeepseekV4ForCausalLM (float32, eager) with deterministic random weights."""
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    transformers.logging.set_verbosity_error()
    logging.getLogger("transformers").setLevel(logging.ERROR)
    hcfg = DeepseekV4Config(**kw, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hcfg).eval()
    randomize_weights_(model, DSV4Config.from_dict(json.loads(hcfg.to_json_string())), seed=seed)
    return model


def hf_generate(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def rand_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Small tensors: intra-op threads only add overhead (and stall badly on a shared CPU)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
