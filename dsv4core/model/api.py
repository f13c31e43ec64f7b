"""`load_model`: the public way to get a runnable DSV4 model (re-exported as `dsv4core.load_model`).

    model = dsv4core.load_model("tiny")                       # built-in tiny DSV4, fixed-seed weights
    model = dsv4core.load_model("/ckpt/dir", dtype="bfloat16", device="cpu", backend="reference")
    model.logits([1, 2, 3])            # float32 [3, vocab], one full prefill
    model.generate([[1, 2, 3], [4]], max_new_tokens=8)   # greedy, batched, new tokens only
    model.hal_report()                 # which backend serves each op

The checkpoint path may hold a transformers `save_pretrained` directory (safetensors, sharded or
not) or an official DeepSeek checkpoint; `dsv4core.checkpoint` maps names and dequantises.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .config import CSA, HASH_MOE, HCA, MOE, SLIDING, DSV4Config
from .model import DSV4ForCausalLM
from .tiny import randomize_weights_
from .parallel import RankCut, setup as _setup_parallel, shard_state_dict

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}

TINY_SEED = 20260401

#: The built-in tiny DSV4 (transformers-style config dict): every layer type, hash and top-k MoE,
#: hc_mult 4, windows and ratios small enough that a few dozen tokens cross several boundaries.
TINY_CONFIG: dict[str, Any] = dict(
    model_type="deepseek_v4", vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    routed_scaling_factor=1.5, swiglu_limit=10.0, max_position_embeddings=4096, sliding_window=16,
    layer_types=[SLIDING, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 16},
    mlp_layer_types=[HASH_MOE, HASH_MOE, MOE, MOE], hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    index_n_heads=16, index_head_dim=32, index_topk=4, rms_norm_eps=1e-6, rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    bos_token_id=0, eos_token_id=1,
)
#: "tiny-official": the tiny model with dims that carry the official numerics' blocks (hidden,
#: q_lora, o_groups * o_lora and the expert width multiples of 128, 64 non-rope head channels, a
#: power-of-two indexer head dim); loaded with numerics="official" unless asked otherwise.
TINY_OFFICIAL_CONFIG: dict[str, Any] = dict(
    TINY_CONFIG, hidden_size=128, head_dim=128, qk_rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=64,
    moe_intermediate_size=128, index_n_heads=4, index_head_dim=64)
#: "tiny-mtp" / "tiny-official-mtp": the tiny models with an MTP block (num_nextn_predict_layers
#: = 1) for speculative decoding; their main weights equal "tiny"'s / "tiny-official"'s.
TINY_MTP_CONFIG: dict[str, Any] = dict(TINY_CONFIG, num_nextn_predict_layers=1)
TINY_OFFICIAL_MTP_CONFIG: dict[str, Any] = dict(TINY_OFFICIAL_CONFIG, num_nextn_predict_layers=1)
#: the built-in models by name: (config, the numerics "auto" means for it)
BUILT_IN = {"tiny": (TINY_CONFIG, "exact"), "tiny-official": (TINY_OFFICIAL_CONFIG, "official"),
            "tiny-mtp": (TINY_MTP_CONFIG, "exact"), "tiny-official-mtp": (TINY_OFFICIAL_MTP_CONFIG, "official")}


def resolve_dtype(dtype: torch.dtype | str | None, default: torch.dtype) -> torch.dtype:
    if dtype is None:
        return default
    if isinstance(dtype, torch.dtype):
        dt = dtype
    else:
        key = str(dtype).removeprefix("torch.")
        if key not in _DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}: use float32 or bfloat16")
        dt = _DTYPES[key]
    if dt not in (torch.float32, torch.bfloat16):
        raise ValueError(f"unsupported activation dtype {dt}: use torch.float32 or torch.bfloat16")
    return dt


def _bind(device: torch.device, backend: str | None, verify=None):
    from dsv4core.hal import bind

    return bind(device, backend=backend, verify=verify)


def _requested(backend: str | None) -> str:
    from dsv4core.hal import backend_request

    return backend_request(backend)


def build_model(config: DSV4Config | dict, *, dtype: torch.dtype | str | None = None,
                device: torch.device | str | None = None, backend: str | None = None,
                seed: int | None = None, ops=None, verify: float | str | None = None, tp: int = 1,
                ep: int = 1, numerics: str = "auto") -> DSV4ForCausalLM:
    """A model for `config` with deterministic random weights (seed) or empty weights (seed=None).

    tp / ep: tensor- and expert-parallel sizes (see `dsv4core.model.parallel`; the process group
    is initialised from the torchrun environment when needed). With a seed, every rank holds its
    slices of the same weights the single-process model gets (the full model is drawn on the
    host, then cut: fine for test-sized configs)."""
    from . import numerics as num

    num.check(numerics)
    cfg = config if isinstance(config, DSV4Config) else DSV4Config.from_dict(config)
    dt = resolve_dtype(dtype, torch.float32)
    dev = torch.device(device if device is not None else "cpu")
    ops = ops if ops is not None else _bind(dev, backend, verify)
    par = _setup_parallel(cfg, tp, ep, ops=ops, device=dev)
    with torch.device(dev):
        model = DSV4ForCausalLM(cfg, ops, dtype=dt, parallel=par)
    if seed is not None and par.world > 1:
        full = DSV4ForCausalLM(cfg, ops, dtype=dt)
        randomize_weights_(full, cfg, seed=seed)
        model.load_state_dict(shard_state_dict(full.state_dict(), cfg, par), strict=True)
        del full
    elif seed is not None:
        randomize_weights_(model, cfg, seed=seed)
    model.backend = _requested(backend)
    num.apply(model, num.auto_or(numerics, num.resolve(numerics, None, config if isinstance(config, dict) else None),
                                 model))
    return model.eval()


def load_model(path_or_name: str | Path, *, backend: str | None = None, dtype: torch.dtype | str | None = None,
               device: torch.device | str | None = None, quantized: str = "auto",
               verify: float | str | None = None, tp: int = 1, ep: int = 1,
               numerics: str = "auto", allow_nonfinite: bool = False) -> DSV4ForCausalLM:
    """Load a DSV4 model: a checkpoint directory (transformers or official format), `"tiny"` (the
    built-in tiny DSV4, exact numerics) or `"tiny-official"` (its variant whose dims carry the
    official numerics, which it computes by default); `"tiny-mtp"` / `"tiny-official-mtp"`: the
    same with an MTP block. A checkpoint's MTP block (`mtp.*` tensors, and the config's
    num_nextn_predict_layers = 1) is loaded too (`model.has_mtp`; speculative decoding), else
    `model.speculation_why` says why there is none.

    backend: HAL backend name or "auto" (the available backend for the device with the highest
    priority, falling back per op to the reference); default (None): env DSV4CORE_BACKEND, else
    "auto". Per-op overrides come from env DSV4CORE_OPS. One precedence rule everywhere: an
    explicit argument > the environment > "auto" (`dsv4core.hal.backend_request`). dtype:
    activation dtype (torch dtype or its name; default float32 for "tiny"; for a checkpoint the
    dtype its weights are in: config.json's `dtype` / `torch_dtype` unless it would narrow the
    stored weights, else the stored token embedding's dtype, and an error asking for dtype= when
    that is neither float32 nor bfloat16; an explicit dtype always wins).
    device: default "cpu".
    Parameters that are fp32 in DSV4 (mHC, sinks, position bias, router bias, norms) stay fp32.
    quantized: what to do with FP8 block-scaled checkpoint weights (see `dsv4core.model.fp8`):
    "auto" keeps a projection FP8 (+ float32 `weight_scale_inv`) when the non-reference backend
    serving its `linear` / `wo_a` accepts FP8 weights (asked through `OpTable.accepts`), else
    dequantises; "keep" keeps every FP8 projection that can be; "dequantize" never keeps.
    Routed experts stored packed (FP4 / FP8 + scales) follow the same rule through `moe_experts`
    (see `dsv4core.model.experts_quant`); shared experts are dequantised.
    `model.quantization_report()` lists every decision.
    numerics: "exact" (activations as they are, bf16 KV: the transformers math), "official"
    (DeepSeek-V4's quantisation-aware inference: W8A8 projections, FP8-rounded KV rows, the FP4
    indexer; `dsv4core.model.numerics`) or "auto" (official for an official-format or FP8 / FP4
    checkpoint, else exact); `model.numerics` says which.
    Text: `model.tokenizer` is the checkpoint's `tokenizer.json` (read with `tokenizers`; its
    chat template, from `chat_template.jinja` or `tokenizer_config.json`, is
    `model.tokenizer.chat_template`), the built-in byte tokenizer for "tiny", or None (the reason
    in `model.tokenizer_why`); `generate` then takes prompts as text.
    verify: fraction of op calls re-checked against the reference (default: env DSV4CORE_VERIFY,
    else off; see `dsv4core.hal.verify`); the counts are in `model.hal_report()`.
    tp / ep: tensor- and expert-parallel sizes (`dsv4core.model.parallel`): run under
    `torchrun --nproc-per-node tp*ep` (or inside an initialised process group of that size);
    each rank reads only its slices of the checkpoint (`dsv4core.checkpoint.cuts`) and every
    rank returns the same logits.
    Checks before anything is allocated: the config's fields against their types and bounds
    (`dsv4core.model.config.SIZE_LIMITS`, `max_position_embeddings`); while loading: every
    weight finite (a NaN / Inf is a CheckpointError naming the tensor; `allow_nonfinite=True`
    keeps them, for debugging) and the hash-routing tables (`tid2eid`) within the expert count.
    """
    from . import experts_quant, fp8
    from . import numerics as num

    fp8.check_mode(quantized)
    num.check(numerics)
    dev = torch.device(device if device is not None else "cpu")
    if str(path_or_name) in BUILT_IN:
        config, auto = BUILT_IN[str(path_or_name)]
        model = build_model(config, dtype=dtype, device=dev, backend=backend, seed=TINY_SEED, verify=verify,
                            tp=tp, ep=ep, numerics=auto if numerics == "auto" else numerics)
        model._quantization = fp8.report(model, quantized, [])
        _attach_tokenizer(model, None)
        return model

    from dsv4core.checkpoint import open_checkpoint

    ckpt = open_checkpoint(path_or_name)
    if not ckpt.config_dict:
        raise ValueError(f"{path_or_name}: no config.json next to the weights")
    cfg = DSV4Config.from_dict(ckpt.config_dict)
    stored, where = ckpt.weights_dtype()   # never narrowed silently: another dtype must be asked for
    if dtype is None and stored not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{path_or_name}: the weights' dtype is {str(stored).removeprefix('torch.') if stored else 'unknown'} "
                         f"({where}); activations are float32 or bfloat16: give dtype= (--dtype)")
    dt = resolve_dtype(dtype, stored)
    ops = _bind(dev, backend, verify)
    par = _setup_parallel(cfg, tp, ep, ops=ops, device=dev)
    mtp = None if ckpt.has_mtp else False      # the MTP block only where the checkpoint holds it
    with torch.device("meta"):
        model = DSV4ForCausalLM(cfg, ops, dtype=dt, parallel=par, mtp=mtp)   # this rank's shapes
    if mtp is False and cfg.num_nextn_predict_layers and par.world == 1:
        model.speculation_why = (f"the config declares an MTP layer (num_nextn_predict_layers = "
                                 f"{cfg.num_nextn_predict_layers}) but the checkpoint has no mtp.* tensors")
    decisions = fp8.plan(model, ops, quantized, fp8.checkpoint_fp8_weights(ckpt), dt, dev)
    fp8.apply(model, decisions)  # kept projections get FP8 (+ scale) parameters: the loader fills them raw
    formats = experts_quant.checkpoint_expert_formats(ckpt)
    expert_decisions = experts_quant.plan(model, ops, quantized, formats, dt, dev, ckpt.format == "official")
    experts_quant.apply(model, expert_decisions, formats)  # kept experts: packed bytes + scales, filled raw
    decisions = decisions + expert_decisions
    ckpt.load_into(model, device=dev, strict=True, cut=RankCut(cfg, par) if par.world > 1 else None,
                   allow_nonfinite=allow_nonfinite, value_ranges={"tid2eid": (0, cfg.n_routed_experts)})
    model._quantization = fp8.report(model, quantized, decisions)
    model.backend = _requested(backend)
    num.apply(model, num.auto_or(numerics, num.resolve(numerics, ckpt.format, ckpt.config_dict), model))
    p = Path(path_or_name)
    _attach_tokenizer(model, p if p.is_dir() else p.parent)
    return model.eval()


def _attach_tokenizer(model: DSV4ForCausalLM, directory: Path | None) -> None:
    """`model.tokenizer`: the checkpoint's tokenizer.json (with its chat template), the byte
    tokenizer for the tiny model (directory None), or None with the reason in
    `model.tokenizer_why` (no tokenizer.json; `tokenizers` not installed)."""
    from . import tokenizer as tk

    model.tokenizer, model.tokenizer_why = None, ""
    if directory is not None:     # the tokenizer's files are the checkpoint's: confined to its directory
        from dsv4core.checkpoint.loader import confined

        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (directory / name).exists():
                confined(directory, name, name)
    try:
        model.tokenizer = tk.byte_tokenizer() if directory is None else tk.from_directory(directory)
    except tk.TokenizerUnavailable as e:
        model.tokenizer_why = str(e)
        return
    if model.tokenizer is None:
        model.tokenizer_why = f"{directory} has no tokenizer.json"
    elif model.tokenizer.vocab_size > model.config.vocab_size:
        model.tokenizer_why = (f"{model.tokenizer.source}: {model.tokenizer.vocab_size} tokens, more than the "
                               f"model's vocab_size {model.config.vocab_size}; not used")
        model.tokenizer = None
