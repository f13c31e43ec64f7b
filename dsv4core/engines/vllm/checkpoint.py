"""A checkpoint directory vLLM loads as dsv4core's model (no vLLM needed to write it).

    python -m dsv4core.engines.vllm.checkpoint OUT_DIR [--model tiny] [--dtype float32]

writes a dsv4core model (default: the built-in "tiny") as vLLM's `LLM(model=OUT_DIR)` and
`vllm serve OUT_DIR` take it (docs/vllm.md, "Running vLLM's engine"):

- ``config.json`` in the official key set (`checkpoint.writer.official_config`: ``compress_ratios``,
  ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``), ``architectures``
  ``["DeepseekV4ForCausalLM"]``, without a ``quantization_config`` (the weights are unquantized).
  vLLM 0.32 builds its own ``DeepseekV4Config`` on transformers' ``PreTrainedConfig``, whose
  validator (transformers 5.19) refuses the transformers-format ``mlp_layer_types`` entries
  (``hash_moe`` / ``moe``: it allows ``sparse`` / ``dense``), so the transformers key set does not load;
- ``dsv4core_numerics: "official"`` when the model computes with the official numerics (the
  unquantized weights would otherwise mean the exact ones; `model.checkpoint_numerics`);
- the weights with transformers names (`checkpoint.writer.write_transformers`), which
  `DeepseekV4ForCausalLM.load_weights` takes;
- the tokenizer (``tokenizer.json``, ``tokenizer_config.json``) when the model has one (the tiny
  model's byte tokenizer: token id = byte value).

dsv4core's own `load_model(OUT_DIR)` loads the same directory (same config, same weights; it
ignores ``dsv4core_numerics``: pass ``numerics="official"`` there).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dsv4core.checkpoint.writer import official_config, write_transformers


def vllm_config_dict(model) -> dict:
    """The ``config.json`` of `model` (a `DSV4ForCausalLM`) for vLLM (module docstring)."""
    c = official_config(model.config.to_hf_dict())
    c.pop("quantization_config", None)
    c.pop("expert_dtype", None)
    c["torch_dtype"] = str(model.act_dtype).removeprefix("torch.")
    if model.numerics == "official":    # unquantized weights would otherwise mean the exact numerics
        c["dsv4core_numerics"] = "official"
    return c


def write_checkpoint(model, out_dir: str | Path) -> Path:
    """Write `model` (a `DSV4ForCausalLM` with unquantized weights) to `out_dir` as a checkpoint
    vLLM loads (module docstring). Returns the directory."""
    quantized = [n for n, t in model.state_dict().items() if t.dtype in (torch.uint8, torch.int8)
                 or t.dtype.is_floating_point and t.dtype.itemsize == 1]
    if quantized:
        raise ValueError(f"write_checkpoint: unquantized weights only; {len(quantized)} are stored quantized, "
                         f"e.g. {quantized[:3]}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_transformers(model.state_dict(), vllm_config_dict(model), out)
    tok = getattr(model, "tokenizer", None)
    if tok is not None:
        tok._tok.save(str(out / "tokenizer.json"))
        special = dict(tok.special)
        cfg = model.config
        for key in ("bos_token", "eos_token"):
            tid = getattr(cfg, f"{key}_id", None)
            if key not in special and isinstance(tid, int) and tok._tok.id_to_token(tid) is not None:
                special[key] = tok._tok.id_to_token(tid)
        tc = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_position_embeddings,
              "add_bos_token": False, "add_eos_token": False, **special}
        if tok.chat_template:
            tc["chat_template"] = tok.chat_template
        (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m dsv4core.engines.vllm.checkpoint",
                                description="Write a dsv4core model as a checkpoint directory vLLM loads "
                                            "(DSV4CORE_VLLM=1 vllm serve OUT_DIR ...).")
    p.add_argument("out_dir")
    p.add_argument("--model", default="tiny", help="'tiny' (default), another built-in name or a checkpoint dir")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: the model's)")
    a = p.parse_args(argv)
    from dsv4core.model.api import load_model

    m = load_model(a.model, backend="reference", dtype=a.dtype)
    print(write_checkpoint(m, a.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
