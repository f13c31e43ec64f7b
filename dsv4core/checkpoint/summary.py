"""A description of a checkpoint from its headers and config (what ``dsv4core inspect`` prints)."""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from dsv4core.hal import quant

from .loader import Checkpoint
from .names import HF_SCALE_SUFFIX, is_mtp

_TYPE_NAME = {"sliding_attention": "SWA", "compressed_sparse_attention": "CSA", "heavily_compressed_attention": "HCA"}
# transformers' defaults when the config gives no compress_rates (as DSV4Config does)
_DEFAULT_RATES = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def _is_scale(name: str) -> bool:
    return name.endswith(".scale") or name.endswith(HF_SCALE_SUFFIX)


def _scale_of(name: str) -> str:
    return name[: -len("scale")] + "weight" if name.endswith(".scale") else name[: -len(HF_SCALE_SUFFIX)]


def layer_schedule(config: dict, n_layers: int | None = None) -> list[dict]:
    """Per layer: attention kind (SWA / CSA / HCA) with its compress ratio, and MoE routing
    (hash / topk). Ratios come from ``compress_rates`` (transformers) or ``compress_ratios``
    (official: 0 = SWA, the CSA rate (``compress_rate_csa``, default 4) = CSA, any other = HCA)."""
    n = config.get("num_hidden_layers", n_layers) or n_layers or 0
    kinds: list[tuple[int | None, str]]
    if "layer_types" in config and config["layer_types"]:
        rates = {**_DEFAULT_RATES, **(config.get("compress_rates") or {})}
        kinds = [(rates.get(t), _TYPE_NAME.get(t, "?")) for t in config["layer_types"]]
    elif "compress_ratios" in config:
        csa = config.get("compress_rate_csa") or _DEFAULT_RATES["compressed_sparse_attention"]
        kinds = [(r, "SWA" if r == 0 else "CSA" if r == csa else "HCA") for r in config["compress_ratios"]]
    else:
        kinds = []
    if "mlp_layer_types" in config and config["mlp_layer_types"]:
        mlp = list(config["mlp_layer_types"])
    else:
        nh = config.get("num_hash_layers", 3 if config else 0)
        mlp = ["hash_moe" if i < nh else "moe" for i in range(n)]
    out = []
    for i in range(n):
        r, kind = kinds[i] if i < len(kinds) else (None, "?")
        out.append({"layer": i, "compress_ratio": r, "attention": kind,
                    "moe": "hash" if i < len(mlp) and mlp[i] == "hash_moe" else "topk"})
    return out


def _mtp(cfg: dict, params: int) -> dict:
    """The MTP block: whether `load_model` builds it (config declares it and the tensors are there)
    and, if not, why speculative decoding is unavailable."""
    declared = int(cfg.get("num_nextn_predict_layers") or 0)
    if declared and params:
        why = ""
    elif params:
        why = "the checkpoint holds mtp.* tensors but its config declares no MTP layer (num_nextn_predict_layers = 0)"
    elif declared:
        why = f"the config declares an MTP layer (num_nextn_predict_layers = {declared}) but there are no mtp.* tensors"
    else:
        why = "no MTP layer (num_nextn_predict_layers = 0, no mtp.* tensors)"
    return {"declared": declared, "parameters": params, "loaded": not why, "speculation_unavailable": why}


def summarize(ckpt: Checkpoint) -> dict:
    infos = ckpt.infos()
    dtypes: dict[str, dict] = defaultdict(lambda: {"tensors": 0, "bytes": 0})
    scales = {_scale_of(n): i for n, i in infos.items() if _is_scale(n)}
    fp8 = Counter()
    fp4 = Counter()
    params = 0
    mtp_params = 0
    layers = set()
    for n, i in infos.items():
        dtypes[i.dtype]["tensors"] += 1
        dtypes[i.dtype]["bytes"] += i.nbytes
        m = _LAYER.match(n)
        if m:
            layers.add(int(m.group(1)))
        if _is_scale(n):
            continue
        numel = i.numel
        td = i.torch_dtype
        if n in scales and td is not None:
            if quant.is_fp8(td):
                fp8[scales[n].dtype] += 1
            elif quant.is_fp4_packed(td):
                fp4[scales[n].dtype] += 1
                numel *= 2
        if is_mtp(n):
            mtp_params += numel
        else:
            params += numel
    sizes = {f.name: f.stat().st_size for f in ckpt.files}
    largest = max(sizes, key=sizes.get)
    cfg = ckpt.config_dict
    n_layers = (max(layers) + 1) if layers else None
    return {
        "path": str(ckpt.path),
        "format": ckpt.format,
        "files": len(ckpt.files),
        "sharded": ckpt.index_file is not None,
        "size_bytes": sum(sizes.values()),
        "largest_shard": {"file": largest, "bytes": sizes[largest]},
        "tensors": len(infos),
        "parameters": params,
        "mtp_parameters": mtp_params,
        "mtp": _mtp(cfg, mtp_params),
        "dtypes": {k: dict(v) for k, v in sorted(dtypes.items())},
        "quantization": {
            "fp8_block_scaled_weights": dict(fp8),
            "fp4_packed_weights": dict(fp4),
            "quantization_config": cfg.get("quantization_config"),
            "expert_dtype": cfg.get("expert_dtype") or (cfg.get("quantization_config") or {}).get("expert_dtype"),
        },
        "num_layers_in_tensors": n_layers,
        "config": {k: cfg.get(k) for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                            "n_routed_experts", "num_experts_per_tok", "vocab_size", "hc_mult")
                   if k in cfg},
        "layer_schedule": layer_schedule(cfg, n_layers),
    }
