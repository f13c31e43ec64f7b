"""Write DeepSeek-V4 checkpoints from a transformers-named state dict (tests, tools, benchmarks).

``write_official`` produces the official layout: official names, FP8 e4m3 dense weights with
128x128 ``.scale`` (float8_e8m0fnu or float32), routed experts split per expert and FP4-packed
(int8 ``[N, K/2]`` low nibble first, UE8M0 scale per 32), BF16 / fp32 tensors as in the real
checkpoints, sharded with ``model.safetensors.index.json``. It returns the *reference* state dict:
the exact values a loader must produce (the dequantised weights, in float32), so the same values
can be written in the transformers layout with ``write_transformers`` and compared.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Callable, Iterator, Mapping

import torch

from dsv4core.hal import quant

from .loader import INDEX_NAME
from .names import hf_to_official

# HF weights stored as FP8 + 128x128 block scale in the official checkpoints
_FP8_RE = re.compile(
    r"\.self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|compressor\.indexer\.q_b_proj)\.weight$"
    r"|\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$"
    r"|^model\.mtp\.\d+\.(e_proj|h_proj)\.weight$")
# kept in float32 on disk
_FP32_RE = re.compile(r"(_hc\.(fn|base|scale)|hc_head\.hc_(fn|base|scale)|\.sinks|position_bias|"
                      r"e_score_correction_bias)$")
_EXPERTS_RE = re.compile(r"^model\.(layers|mtp)\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def official_config(hf_config: Mapping) -> dict:
    """An official-style ``config.json`` dict from a transformers ``DeepseekV4Config.to_dict()``:
    legacy ``compress_ratios`` / ``num_hash_layers`` / ``qk_rope_head_dim`` keys, ``expert_dtype`` and
    the FP8 ``quantization_config``."""
    c = dict(hf_config)
    ratio = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    rates = c.pop("compress_rates", None) or {}
    ratio.update({k: v for k, v in rates.items()})
    layer_types = c.pop("layer_types")
    mlp_types = c.pop("mlp_layer_types")
    c["compress_ratios"] = [ratio[t] for t in layer_types] + [0] * int(c.get("num_nextn_predict_layers", 0) or 0)
    if ratio["compressed_sparse_attention"] != 4:  # readers take ratio 4 as CSA unless told otherwise
        c["compress_rate_csa"] = ratio["compressed_sparse_attention"]
    c["num_hash_layers"] = sum(1 for t in mlp_types if t == "hash_moe")
    if mlp_types != ["hash_moe"] * c["num_hash_layers"] + ["moe"] * (len(mlp_types) - c["num_hash_layers"]):
        raise ValueError("hash layers must lead the schedule to be expressible as num_hash_layers")
    prf = c.pop("partial_rotary_factor", None)
    if prf is not None:
        c["qk_rope_head_dim"] = int(round(c["head_dim"] * prf))
    rope = c.pop("rope_parameters", None) or {}
    main, comp = rope.get("main", {}), rope.get("compress", {})
    if "rope_theta" in main:
        c["rope_theta"] = main["rope_theta"]
    if "rope_theta" in comp:
        c["compress_rope_theta"] = comp["rope_theta"]
    if comp.get("rope_type") == "yarn":  # the official spelling of the compress rope's YaRN
        c["rope_scaling"] = {"type": "yarn", **{k: comp[k] for k in (
            "factor", "original_max_position_embeddings", "beta_fast", "beta_slow") if k in comp}}
    for k in ("id2label", "label2id", "transformers_version", "_name_or_path", "dtype"):
        c.pop(k, None)
    c["expert_dtype"] = "fp4"
    c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    c["architectures"] = ["DeepseekV4ForCausalLM"]
    c["model_type"] = "deepseek_v4"
    return c


def _official_items(sd: Mapping[str, torch.Tensor], scale_dtype: torch.dtype, fp4_experts: bool,
                    bf16: bool, ref: dict) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in sd.items():
        t = t.detach().cpu()
        m = _EXPERTS_RE.match(name)
        if m:
            where, layer, kind = m.group(1), m.group(2), m.group(3)
            keep = not isinstance(ref, _Discard)
            out_ref = torch.empty(t.shape, dtype=torch.float32) if keep else None
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    i = t.shape[1] // 2
                    parts = [("w1", t[e, :i], (e, slice(0, i))), ("w3", t[e, i:], (e, slice(i, None)))]
                else:
                    parts = [("w2", t[e], (e,))]
                for wn, w, idx in parts:
                    base = f"{where}.{layer}.ffn.experts.{e}.{wn}"
                    if fp4_experts:
                        q, s = quant.quantize_fp4(w)
                        if keep:
                            out_ref[idx] = quant.dequantize_fp4(q, s)
                    else:
                        q, s = quant.quantize_fp8_block(w, scale_dtype)
                        if keep:
                            out_ref[idx] = quant.dequantize_fp8(q, s)
                    yield base + ".weight", q.contiguous()
                    yield base + ".scale", s.contiguous()
            if keep:
                ref[name] = out_ref
            continue
        off = hf_to_official(name)
        if off is None:
            raise KeyError(f"no official name for {name}")
        if _FP8_RE.search(name):
            q, s = quant.quantize_fp8_block(t, scale_dtype)
            if not isinstance(ref, _Discard):
                ref[name] = quant.dequantize_fp8(q, s)
            yield off, q.contiguous()
            yield off[: -len(".weight")] + ".scale", s.contiguous()
        elif not t.is_floating_point():
            ref[name] = t.clone()
            yield off, t.contiguous()
        elif _FP32_RE.search(name):
            v = t.to(torch.float32)
            ref[name] = v.clone()
            yield off, v.contiguous()
        else:  # BF16 on disk: embed, head, norms, gate.weight, compressor wkv/wgate, weights_proj
            v = t.to(torch.bfloat16) if bf16 else t
            ref[name] = v.to(torch.float32)
            yield off, v.contiguous()


def _write_sharded(items: Iterator[tuple[str, torch.Tensor]], out: Path, max_shard_bytes: int,
                   metadata: dict | None = None) -> list[Path]:
    """Write shards as they fill (only one shard is held in memory), then name them
    ``model-0000i-of-0000n.safetensors`` and write the index."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tmp_names: list[Path] = []
    keys: list[list[str]] = []
    total = 0
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        nonlocal shard, size
        if not shard:
            return
        p = out / f".shard-{len(tmp_names):05d}.tmp"
        save_file(shard, str(p), metadata=metadata or {"format": "pt"})
        tmp_names.append(p)
        keys.append(list(shard))
        shard, size = {}, 0

    for name, t in items:
        nb = t.numel() * t.element_size()
        if shard and size + nb > max_shard_bytes:
            flush()
        shard[name] = t
        size += nb
        total += nb
    flush()
    n = len(tmp_names)
    weight_map: dict[str, str] = {}
    paths = []
    for i, (tmp, ks) in enumerate(zip(tmp_names, keys)):
        fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tmp.rename(out / fname)
        paths.append(out / fname)
        weight_map.update({k: fname for k in ks})
    (out / INDEX_NAME).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                             indent=1))
    return paths


def write_official(state_dict: Mapping[str, torch.Tensor], config: Mapping, out_dir: str | Path, *,
                   scale_dtype: torch.dtype | None = None, fp4_experts: bool = True, bf16: bool = True,
                   max_shard_bytes: int = 2 ** 30, mtp: Mapping[str, torch.Tensor] | None = None,
                   reference: bool = True) -> dict[str, torch.Tensor]:
    """Write ``state_dict`` (transformers names) as an official-format checkpoint in ``out_dir``.

    ``config``: a transformers config dict (converted with :func:`official_config`) or an
    official one (has ``compress_ratios``; written as is). ``scale_dtype``: ``torch.float8_e8m0fnu``
    (default) or ``torch.float32`` for the FP8 block scales. ``mtp``: extra ``mtp.*`` tensors.
    Returns the reference state dict (float32 values the loader must reproduce; ints as given);
    with ``reference=False`` nothing is kept (streams: one tensor and one shard in memory).
    """
    scale_dtype = quant.E8M0 if scale_dtype is None else scale_dtype
    out = Path(out_dir)
    ref: dict[str, torch.Tensor] = {} if reference else _Discard()

    def items():
        yield from _official_items(state_dict, scale_dtype, fp4_experts, bf16, ref)
        for k, v in (mtp or {}).items():
            yield k, v.contiguous()

    _write_sharded(items(), out, max_shard_bytes)
    cfg = dict(config) if "compress_ratios" in config else official_config(config)
    if not fp4_experts:
        cfg["expert_dtype"] = "fp8"
    if scale_dtype == torch.float32:
        cfg["quantization_config"] = {**cfg["quantization_config"], "scale_fmt": None}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return ref


class _Discard(dict):
    def __setitem__(self, key, value):
        pass


def write_transformers(state_dict: Mapping[str, torch.Tensor], config: Mapping, out_dir: str | Path, *,
                       max_shard_bytes: int = 2 ** 30, dtype: torch.dtype | None = None,
                       keep: Callable[[str], bool] | None = None) -> list[Path]:
    """Write ``state_dict`` with transformers names (sharded + index) and ``config.json``.
    ``dtype`` casts floating tensors except fp32-on-disk ones (mHC, sinks, ape, bias)."""
    def items():
        for k, v in state_dict.items():
            if keep is not None and not keep(k):
                continue
            v = v.detach().cpu()
            if dtype is not None and v.is_floating_point() and not _FP32_RE.search(k):
                v = v.to(dtype)
            yield k, v.contiguous()

    paths = _write_sharded(items(), Path(out_dir), max_shard_bytes)
    (Path(out_dir) / "config.json").write_text(json.dumps(dict(config), indent=1, default=str))
    return paths


__all__ = ["official_config", "write_official", "write_transformers"]
