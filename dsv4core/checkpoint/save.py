"""`save(model, path, format=...)`: write a loaded DSV4 model as a checkpoint directory that
`dsv4core.load_model` (and transformers, for the transformers format) reads back.

    dsv4core.checkpoint.save(model, "out/", format="transformers")   # safetensors + config.json
    dsv4core.checkpoint.save(model, "out/", format="official")       # FP8 / FP4 DeepSeek layout

The model is read through `state_dict()` and `config.to_hf_dict()` only. transformers format: the
tensors as the model holds them (no cast), and `config.json` records the activation dtype, so the
checkpoint loads back in the dtype it was written in. Official format: the weights are quantised
as DeepSeek ships them (FP8 e4m3 with 128x128 block scales, FP4 e2m1 routed experts), so loading
it back gives the quantised values, not the saved ones, in bfloat16 unless `dtype=` is given. The tokenizer files of the model's
checkpoint are not copied."""

from __future__ import annotations

from pathlib import Path

import torch

from .errors import CheckpointError
from .writer import write_official, write_transformers

FORMATS = ("transformers", "official")


def save(model, path: str | Path, *, format: str = "transformers", max_shard_bytes: int = 2 ** 30) -> list[Path]:
    """Write `model` (from `load_model` / `build_model`) to the directory `path`; returns the
    weight files written. Refused with a CheckpointError naming the reason: an unknown format, a
    model split over several ranks (each holds only its slices), weights kept quantised (load with
    quantized="dequantize" first)."""
    if format not in FORMATS:
        raise CheckpointError(f"save: format must be one of {', '.join(FORMATS)}; got {format!r}")
    par = getattr(model, "parallel", None)
    if par is not None and getattr(par, "world", 1) > 1:
        raise CheckpointError(f"save: the model is split over {par.world} ranks (tp / ep); save a single-rank model")
    sd = model.state_dict()
    # FP8 / packed FP4 weights and their scales are one byte a value; FP8 block scales are `*_scale_inv`
    quantised = sorted(k for k, v in sd.items() if v.element_size() == 1 or k.endswith("_scale_inv"))
    if quantised:
        raise CheckpointError(f"save: {len(quantised)} tensors are kept quantised ({quantised[0]}, ...); load the "
                              f"model with quantized='dequantize' to save it")
    config = model.config.to_hf_dict()
    config["dtype"] = str(getattr(model, "act_dtype", torch.bfloat16)).removeprefix("torch.")
    out = Path(path)
    if format == "transformers":
        return write_transformers(sd, config, out, max_shard_bytes=max_shard_bytes)
    write_official(sd, config, out, max_shard_bytes=max_shard_bytes, reference=False)
    return sorted(out.glob("*.safetensors"))
