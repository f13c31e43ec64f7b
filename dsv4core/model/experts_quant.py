"""Keep routed experts packed (FP4 e2m1 / FP8 e4m3 + scales) where the bound `moe_experts` reads them.

Official DSV4 checkpoints store the routed experts as packed FP4 (int8, two e2m1 codes a byte, one
UE8M0 scale per 32 columns; DSV4-Flash) or FP8 (128x128 block scales). ``load_model(...,
quantized=...)`` decides per `Experts` module (one `gate_up_proj` + `down_proj` pair), before any
data is read, the same way as for the FP8 projections (`dsv4core.model.fp8`):

* ``"dequantize"``: never; ``"keep"``: whenever possible;
* ``"auto"``: when the backend SERVING `moe_experts` is not the reference and `OpTable.accepts`
  says its implementation takes weights of that format (probed with one expert of the real
  shapes, on the target device).

Possible means: every expert of both tensors has the same quantised format with scales in the
checkpoint, FP4 bytes are int8 / uint8, and for FP8 stored per expert (official layout) the
intermediate size is a multiple of 128 (the w1 / w3 halves take whole scale blocks). A kept
module holds the raw bytes in `gate_up_proj` / `down_proj` and the scales in
`gate_up_proj_scale_inv` / `down_proj_scale_inv` (FP4: float8_e8m0fnu; FP8: float32), which the
checkpoint loader fills as stored and `SparseMoeBlock` passes to `moe_experts`.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4core.hal.quant import E8M0, FP4_BYTE_DTYPES, FP4_GROUP, FP8_BLOCK, FP8_E4M3 as FP8

from .fp8 import FP8Decision

PARTS = ("gate_up_proj", "down_proj")


def checkpoint_expert_formats(ckpt) -> dict[str, tuple[str, torch.dtype]]:
    """HF expert tensor name -> ("fp4" | "fp8", stored dtype) for routed-expert tensors that the
    checkpoint holds quantised with scales, every expert alike (headers only)."""
    from dsv4core.checkpoint.names import hf_scale_name, is_mtp, official_to_hf

    infos = ckpt.infos()
    seen: dict[str, set] = {}
    for name, info in infos.items():
        if is_mtp(name):
            continue
        if ckpt.format == "official":
            t = official_to_hf(name[len("model."):] if name.startswith("model.") else name)
            if t is None or t.expert is None or t.is_scale:
                continue
            has_scale = name[: -len("weight")] + "scale" in infos
            target = t.hf_name
        else:
            if not name.endswith(PARTS):
                continue
            has_scale, target = hf_scale_name(name) in infos, name
        dt = info.torch_dtype
        fmt = ("fp8" if dt == FP8 else "fp4" if dt in FP4_BYTE_DTYPES else None) if has_scale else None
        seen.setdefault(target, set()).add((fmt, dt))
    return {t: next(iter(v)) for t, v in seen.items() if len(v) == 1 and next(iter(v))[0] is not None}


def _shapes(experts: nn.Module, fmt: str) -> dict[str, tuple]:
    """part -> (weight shape, weight dtype, scale shape, scale dtype) of the kept form."""
    out = {}
    for part in PARTS:
        E, R, C = getattr(experts, part).shape
        if fmt == "fp4":
            out[part] = ((E, R, C // 2), None, (E, R, C // FP4_GROUP), E8M0 if E8M0 is not None else torch.uint8)
        else:
            out[part] = ((E, R, C), FP8, (E, -(-R // FP8_BLOCK), -(-C // FP8_BLOCK)), torch.float32)
    return out


def _probe(experts: nn.Module, fmt: str, byte_dtype, act_dtype, device, limit: float):
    """`moe_experts` arguments shaped like the real call with ONE expert (a predicate checks layout
    and dtypes, not the expert count; a full-size probe would allocate the whole weight)."""
    shp = _shapes(experts, fmt)
    ws, ss = [], []
    for part in PARTS:
        w, wdt, s, sdt = shp[part]
        ws.append(torch.empty((1, *w[1:]), dtype=wdt or byte_dtype, device=device))
        ss.append(torch.empty((1, *s[1:]), dtype=sdt, device=device))
    H = experts.gate_up_proj.shape[2]
    x = torch.empty(1, H, dtype=act_dtype, device=device)
    ids = torch.zeros(1, 1, dtype=torch.int64, device=device)
    wts = torch.ones(1, 1, dtype=torch.float32, device=device)
    return (x, ids, wts, ws[0], ws[1], limit, ss[0], ss[1])


def plan(model: nn.Module, ops, mode: str, formats: dict, act_dtype: torch.dtype, device,
         official: bool) -> list[FP8Decision]:
    """One decision per routed-experts tensor (both parts of a module decided together)."""
    from .modules import SparseMoeBlock

    out: list[FP8Decision] = []
    backend = ops.bindings["moe_experts"].backend if hasattr(ops, "bindings") else "?"
    verdicts: dict[tuple, bool] = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, SparseMoeBlock):
            continue
        ex = mod.experts
        names = [f"{name}.experts.{p}" for p in PARTS]
        got = [formats.get(n) for n in names]

        def decide(kept: bool, reason: str, fmt=None) -> None:
            for n in names:
                out.append(FP8Decision(n, "moe_experts", backend, kept, reason + (f" ({fmt})" if fmt else "")))

        if any(g is None for g in got) or got[0] != got[1]:
            decide(False, "not quantised (with scales, every expert alike) in the checkpoint")
            continue
        fmt, byte_dtype = got[0]
        if mode == "dequantize":
            decide(False, "quantized='dequantize'", fmt)
            continue
        I = ex.down_proj.shape[2]
        if fmt == "fp8" and official and I % FP8_BLOCK:
            decide(False, f"FP8 w1 / w3 stored per expert need I % {FP8_BLOCK} == 0 to split the scale grid", fmt)
            continue
        key = (fmt, byte_dtype, tuple(ex.gate_up_proj.shape), tuple(ex.down_proj.shape))
        if key not in verdicts:
            verdicts[key] = bool(ops.accepts("moe_experts", *_probe(ex, fmt, byte_dtype, act_dtype, device,
                                                                     float(mod.limit))))
        accepts = verdicts[key]
        if mode == "keep":
            decide(True, "quantized='keep'" + ("" if accepts else
                                               f"; {backend!r} declines them: calls fall back per call"), fmt)
        elif not accepts:
            decide(False, f"{backend!r} moe_experts declines these packed experts", fmt)
        elif not (hasattr(ops, "native_quantized") and ops.native_quantized("moe_experts")):
            # e.g. the reference: it takes them but dequantises every expert on every call
            decide(False, f"{backend!r} moe_experts would dequantise per call (not declared native_quantized)", fmt)
        else:
            decide(True, f"{backend!r} moe_experts accepts these packed experts", fmt)
    return out


def apply(model: nn.Module, decisions: list[FP8Decision], formats: dict) -> None:
    """Give every kept Experts module empty quantised weights and scales (the loader fills them)."""
    from dsv4core.checkpoint.names import hf_scale_name

    kept = {d.weight for d in decisions if d.kept}
    for name, mod in model.named_modules():
        if not hasattr(mod, "gate_up_proj_scale_inv") or f"{name}.gate_up_proj" not in kept:
            continue
        fmt, byte_dtype = formats[f"{name}.gate_up_proj"]
        dev = mod.gate_up_proj.device
        for part, (w, wdt, s, sdt) in _shapes(mod, fmt).items():
            setattr(mod, part, nn.Parameter(torch.empty(w, dtype=wdt or byte_dtype, device=dev), requires_grad=False))
            setattr(mod, hf_scale_name(part), nn.Parameter(torch.empty(s, dtype=sdt, device=dev), requires_grad=False))
