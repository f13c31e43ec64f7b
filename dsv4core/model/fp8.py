"""Keep FP8 checkpoint weights as FP8 + block scale where the bound backend computes with them.

Official DeepSeek-V4 checkpoints hold the attention projections (and shared experts) as FP8 e4m3
with 128x128 block dequantisation multipliers. ``load_model(..., quantized=...)`` decides per
projection, at build time (before any data is read), whether the model keeps the weight as FP8:

* ``"dequantize"``: never; every weight is dequantised to the model dtype at load (fp32 math).
* ``"keep"``: always, where possible (below).
* ``"auto"`` (default): when the implementation SERVING the projection's op (``linear`` or
  ``wo_a``) declares that it reads quantised weights natively (``OpTable.native_quantized``) and
  ``OpTable.accepts`` says it takes an FP8 weight with a float32 block scale for this shape. The
  reference takes FP8 too, but dequantises the whole weight on every call (slow; it does not
  declare ``native_quantized``), so under ``auto`` a reference-served op gets dequantised weights.

Possible means: the checkpoint holds this tensor as float8_e4m3fn with a block scale (official
``.scale`` or HF ``_scale_inv``; a bf16 checkpoint never yields FP8 parameters), the module is
routed through ``linear`` / ``wo_a`` (``Linear`` / ``GroupedLinear``), and, for ``wo_a``, the rows
per group are a multiple of 128 so the scale grid splits per group. Routed experts are decided in
``dsv4core.model.experts_quant`` (``moe_experts`` takes FP4 / FP8 scales since HAL 1.1); the shared
experts (run as one packed expert) are dequantised.

Everything is decided through the HAL's declared capabilities; no backend is named here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from .modules import FP8, FP32, GroupedLinear, Linear, SharedMLP

MODES = ("auto", "keep", "dequantize")


@dataclass
class FP8Decision:
    weight: str  # parameter name (transformers naming)
    op: str  # "linear" or "wo_a"
    backend: str  # backend serving the op
    kept: bool
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def check_mode(quantized) -> str:
    if quantized not in MODES:
        raise ValueError(f"quantized must be one of {', '.join(repr(m) for m in MODES)}; got {quantized!r}")
    return quantized


def candidates(model: nn.Module):
    """(weight name, module, op) of every projection that could hold FP8: the `Linear` modules
    routed through `linear` and the grouped `wo_a` projection; not the shared experts (their
    Linears are concatenated for `moe_experts` and stay dequantised)."""
    skip: list[str] = []
    for name, mod in model.named_modules():
        if isinstance(mod, SharedMLP):
            skip.append(name + ".")
            continue
        if any(name.startswith(p) for p in skip):
            continue
        if isinstance(mod, GroupedLinear):
            yield name + ".weight", mod, "wo_a"
        elif isinstance(mod, Linear):
            yield name + ".weight", mod, "linear"


def checkpoint_fp8_weights(ckpt) -> set[str]:
    """Transformers names of the weights ``ckpt`` stores as float8_e4m3fn with a block scale
    (official ``X.weight`` + ``X.scale``, or HF ``X.weight`` + ``X.weight_scale_inv``). Headers only."""
    from dsv4core.checkpoint import hf_scale_name, is_mtp, official_to_hf

    infos = ckpt.infos()
    out: set[str] = set()
    for name, info in infos.items():
        if is_mtp(name) or info.torch_dtype != torch.float8_e4m3fn:
            continue
        if ckpt.format == "official":
            if not name.endswith(".weight") or name[: -len("weight")] + "scale" not in infos:
                continue
            t = official_to_hf(name[len("model."):] if name.startswith("model.") else name)
            if t is not None and not t.is_scale and t.expert is None:
                out.add(t.hf_name)
        elif hf_scale_name(name) in infos:
            out.add(name)
    return out


def _probe(module, op: str, act_dtype: torch.dtype, device: torch.device):
    """Arguments shaped, typed and placed like the module's real call with FP8 weights (one token).

    Allocated (uninitialised) on the target device rather than on the meta device: a backend's
    ``supports`` may rightly check where its inputs live (and a meta tensor lives nowhere)."""
    (w, s) = module.fp8_shapes()
    weight = torch.empty(w, dtype=FP8, device=device)
    scale = torch.empty(s, dtype=FP32, device=device)
    if op == "linear":
        return (torch.empty(1, w[1], dtype=act_dtype, device=device), weight, scale, None)
    return (torch.empty(1, w[0], w[2], dtype=act_dtype, device=device), weight, scale)


def plan(model: nn.Module, ops, mode: str, fp8_in_checkpoint: set[str], act_dtype: torch.dtype,
         device: torch.device) -> list[FP8Decision]:
    """One decision per candidate projection (see the module docstring). Nothing is changed."""
    check_mode(mode)
    out: list[FP8Decision] = []
    verdicts: dict[tuple, bool] = {}  # (op, weight shape) -> accepts
    for name, mod, op in candidates(model):
        backend = ops.bindings[op].backend if hasattr(ops, "bindings") and op in ops.bindings else "?"

        def decide(kept: bool, reason: str) -> None:
            out.append(FP8Decision(name, op, backend, kept, reason))

        if name not in fp8_in_checkpoint:
            decide(False, "not FP8 in the checkpoint")
            continue
        if mode == "dequantize":
            decide(False, "quantized='dequantize'")
            continue
        if op == "wo_a" and not mod.fp8_ok():
            decide(False, "rows per group not a multiple of 128 (block scales do not split per group)")
            continue
        key = (op, mod.fp8_shapes())
        if key not in verdicts:
            verdicts[key] = bool(ops.accepts(op, *_probe(mod, op, act_dtype, device)))
        accepts = verdicts[key]
        if mode == "keep":
            decide(True, "quantized='keep'" + ("" if accepts else
                                               f" ({backend!r} declines FP8 here: calls fall back per call)"))
        elif not accepts:
            decide(False, f"{backend!r} {op} declines FP8 weights of this shape")
        elif not (hasattr(ops, "native_quantized") and ops.native_quantized(op)):
            # e.g. the reference: it takes FP8 but dequantises the whole weight on every call
            decide(False, f"{backend!r} {op} would dequantise per call (not declared native_quantized)")
        else:
            decide(True, f"{backend!r} {op} accepts FP8 + float32 block scale")
    return out


def apply(model: nn.Module, decisions: list[FP8Decision]) -> None:
    """Give every kept projection its FP8 weight + float32 ``weight_scale_inv`` parameters."""
    kept = {d.weight for d in decisions if d.kept}
    for name, mod, _ in candidates(model):
        if name in kept:
            mod.keep_fp8()


def report(model: nn.Module, mode: str, decisions: list[FP8Decision]) -> dict:
    """Summary: mode, the per-weight decisions, and bytes of the kept weights (FP8 + scales)."""
    params = dict(model.named_parameters())
    kept = [d for d in decisions if d.kept]
    from dsv4core.checkpoint.names import hf_scale_name

    fp8_bytes = 0
    for d in kept:
        for n in (d.weight, hf_scale_name(d.weight)):
            p = params.get(n)
            if p is not None:
                fp8_bytes += p.numel() * p.element_size()
    return {"mode": mode, "kept": [d.weight for d in kept], "kept_bytes": fp8_bytes,
            "decisions": [d.as_dict() for d in decisions]}
