"""The two numerics a model computes with (docs/model-core.md, "Numerics").

* ``"exact"``: activations as they are (bf16 / fp32) times exactly dequantised weights, bf16 KV
  rows, no indexer simulation: the transformers reference's math, kept for the parity tests.
* ``"official"``: DeepSeek-V4's quantisation-aware inference (its official ``inference/model.py``):
  W8A8 projections (the activation quantised per token per 128 columns, ``linear`` /
  ``moe_experts`` ``act_block=128``) for the projections it runs in FP8 (attention ``q_a``,
  ``q_b``, ``kv``, ``o_b``; the indexer's ``q_b``; routed and shared experts, with the routing
  weight applied before the down projection's quantisation), FP8-rounded KV rows (the non-rope
  channels of window rows and compressed entries, per 64: ``kv_norm_rope`` ``nope_quant_block``),
  pooled compressor rows rounded to the activation dtype before their norm, and the indexer's
  queries and keys Hadamard-rotated and FP4-simulated (``indexer_rotate_quant``). ``wo_a``, the
  router, ``hc_*``, the compressors' projections and the lm_head keep their exact paths (the
  official inference runs them in bf16 / fp32 too).

``"auto"`` picks ``"official"`` for a checkpoint in the official DeepSeek format or one whose
config declares FP8 / FP4 quantisation, else ``"exact"`` (and ``"exact"``, with a warning, for
a quantised checkpoint whose dims cannot carry the official block sizes: test-sized ones). The quantisation points are op
arguments (HAL 1.2); under ``"exact"`` the model never passes them. The FP8 state format
(``CacheConfig(kv_dtype="fp8")``) stores the official rows losslessly and is refused under ``"exact"``.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

NUMERICS = ("auto", "exact", "official")

#: the projections the official inference runs as W8A8 FP8 GEMMs (module paths in a layer)
_W8A8 = ("self_attn.q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "self_attn.o_b_proj",
         "self_attn.compressor.indexer.q_b_proj")
#: the MTP block's own W8A8 projections (besides its layer's)
_MTP_W8A8 = ("e_proj", "h_proj")


def w8a8_projections(model) -> list[tuple[str, object]]:
    """(name, Linear) of every projection the official inference runs as a W8A8 FP8 GEMM (the MTP
    block's too, with its ``e_proj`` / ``h_proj``). The attention's four are in every layer (a missing one is an error: a renamed module must not
    silently lose its quantisation); the indexer's where the layer has one."""
    out = []
    layers = [(f"model.layers.{i}", layer) for i, layer in enumerate(model.model.layers)]
    layers += [(f"model.mtp.{i}", layer) for i, layer in enumerate(getattr(model.model, "mtp", ()))]
    for prefix, layer in layers:
        for path in _W8A8 + (_MTP_W8A8 if prefix.startswith("model.mtp.") else ()):
            mod = layer
            for part in path.split("."):
                mod = getattr(mod, part, None)
                if mod is None:
                    break
            if mod is None:
                if "indexer" in path:
                    continue
                raise AttributeError(f"numerics: {prefix} has no {path} (the official W8A8 projections)")
            out.append((f"{prefix}.{path}", mod))
    return out


def check(numerics: str) -> None:
    if numerics not in NUMERICS:
        raise ValueError(f"numerics must be one of {', '.join(repr(n) for n in NUMERICS)}, got {numerics!r}")


def resolve(numerics: str, checkpoint_format: str | None = None, config: dict | None = None) -> str:
    """``"auto"`` -> ``"official"`` for an official-format or FP8 / FP4-quantised checkpoint, else
    ``"exact"``; the other values as they are."""
    check(numerics)
    if numerics != "auto":
        return numerics
    if checkpoint_format == "official":
        return "official"
    q = (config or {}).get("quantization_config") or {}
    fmt = str(q.get("quant_method", "")).lower() + " " + str(q.get("fmt", "")).lower()
    if any(tag in fmt for tag in ("fp8", "fp4", "e4m3", "mxfp4")) or (config or {}).get("expert_dtype") == "fp4":
        return "official"
    return "exact"


def dims_problem(cfg) -> str:
    """Why this config's dims cannot run the official numerics ("" when they can)."""
    from .modules import ACT_BLOCK, KV_QUANT_BLOCK

    need: list[tuple[str, Any, int]] = [
        ("hidden_size", cfg.hidden_size, ACT_BLOCK), ("q_lora_rank", cfg.q_lora_rank, ACT_BLOCK),
        ("o_groups * o_lora_rank", cfg.o_groups * cfg.o_lora_rank, ACT_BLOCK),
        ("moe_intermediate_size", cfg.moe_intermediate_size, ACT_BLOCK),
        ("head_dim - qk_rope_head_dim", cfg.head_dim - cfg.qk_rope_head_dim, KV_QUANT_BLOCK),
        ("index_head_dim", cfg.index_head_dim, 32)]
    bad = [f"{name} = {v} (a multiple of {m})" for name, v, m in need if v % m]
    dI = cfg.index_head_dim
    if dI & (dI - 1):
        bad.append(f"index_head_dim = {dI} (a power of two)")
    return "; ".join(bad)


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside the dsv4core package (the user's call)."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    level, f = 1, sys._getframe(1)
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(pkg + os.sep):
        f, level = f.f_back, level + 1
    return level


def auto_or(requested: str, resolved: str, model) -> str:
    """``resolved``; but when "auto" resolved to "official" for a model whose dims cannot carry the
    official block sizes (test-sized checkpoints), "exact" with a warning naming the dims (an
    explicit numerics="official" is an error instead, in ``apply``)."""
    if requested == "auto" and resolved == "official":
        why = dims_problem(model.config)
        if why:
            warnings.warn(f"numerics='auto': the checkpoint is quantised, but its dims cannot carry the official "
                          f"block sizes ({why}); computing with numerics='exact'", stacklevel=_caller_level())
            return "exact"
    return resolved


def apply(model, numerics: str) -> None:
    """Set ``model`` (a DSV4ForCausalLM) to compute with ``numerics`` ("exact" or "official")."""
    from .modules import ACT_BLOCK

    if numerics not in ("exact", "official"):
        raise ValueError(f"numerics must be 'exact' or 'official' here (resolve 'auto' first), got {numerics!r}")
    if numerics == "official":
        why = dims_problem(model.config)
        if why:
            raise ValueError(f"numerics='official' needs the official block sizes to divide the model's dims: {why}")
    if model._cache is not None:
        model._cache.check_numerics(numerics)       # FP8 rows hold only what the official numerics write
    block = ACT_BLOCK if numerics == "official" else None
    for _, lin in w8a8_projections(model):
        lin.act_block = block
    model._ops.numerics = numerics
    model._graphs = None          # captured graphs recorded the other numerics' calls
    model._graph_why = None
