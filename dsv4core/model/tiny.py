"""Deterministic random weights for a DSV4 module tree: the built-in tiny model, tests and
benchmarks (weights of a scale that keeps activations O(1), every parameter and buffer set)."""

from __future__ import annotations

import torch
from torch import nn

from .config import DSV4Config


@torch.no_grad()
def randomize_weights_(module: nn.Module, config: DSV4Config, seed: int = 0) -> None:
    """Fill every parameter/buffer of a DSV4 module tree (ours or transformers', the names are the
    same) with deterministic random values of a scale that keeps activations O(1)."""
    g = torch.Generator().manual_seed(seed)
    E, k = config.n_routed_experts, config.num_experts_per_tok

    def rnd(shape, std, mean=0.0):
        return torch.randn(*shape, generator=g) * std + mean

    # the MTP block ("mtp." in the name) last: a model with one gets the same main weights as without
    named = sorted(list(module.named_parameters()) + list(module.named_buffers()),
                   key=lambda kv: (".mtp." in f".{kv[0]}", kv[0]))
    for name, t in named:
        leaf = name.rsplit(".", 1)[-1]
        shape = tuple(t.shape)
        if "rotary" in name or "inv_freq" in name:
            continue
        if leaf == "tid2eid":
            v = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(shape[0])])
        elif leaf == "e_score_correction_bias":
            v = rnd(shape, 0.1)
        elif leaf == "sinks":
            v = rnd(shape, 0.5)
        elif leaf == "position_bias":
            v = rnd(shape, 0.5)
        elif leaf in ("fn", "hc_fn"):
            v = rnd(shape, 0.5 / shape[1] ** 0.5)
        elif leaf in ("base", "hc_base"):
            v = rnd(shape, 0.3)
        elif leaf in ("scale", "hc_scale"):
            v = rnd(shape, 0.2, 1.0)
        elif name.endswith("norm.weight"):
            v = rnd(shape, 0.1, 1.0)
        elif leaf in ("gate_up_proj", "down_proj") and len(shape) == 3:
            v = rnd(shape, shape[-1] ** -0.5)
        elif name.endswith("embed_tokens.weight"):
            v = rnd(shape, 1.0)
        elif leaf == "weight" and len(shape) == 2:
            v = rnd(shape, shape[-1] ** -0.5)
        else:
            raise RuntimeError(f"randomize_weights_: no rule for {name} {shape}")
        t.copy_(v.to(t.dtype))
