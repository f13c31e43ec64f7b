"""How checkpoint tensors become module tensors: the pieces a target is made of, the module
slots they fill, coverage checks, and the reads that convert one piece (FP8 / FP4 dequantised or
kept raw, row-chunked, into the target's dtype and device). Used by ``loader.Checkpoint``."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from dsv4core.hal import quant

from .errors import CheckpointError
from .names import hf_scale_name
from .safetensors_io import TensorInfo

log = logging.getLogger("dsv4core.checkpoint")

# rows per converted chunk (a multiple of the FP8 block so chunks align with scale rows)
_CHUNK_ROWS = 4096


@dataclass
class _Piece:
    """One checkpoint tensor (plus its scale) written into (a region of) one target."""

    target: str
    weight: TensorInfo
    scale: TensorInfo | None = None
    index: tuple = ()  # region of the target (e.g. (expert, slice(0, I)))
    label: str = ""  # name to use in errors (official name)


@dataclass
class _Slot:
    """A module tensor to fill: its (sub)module, attribute and original (maybe meta) tensor."""

    name: str
    owner: nn.Module
    attr: str
    is_param: bool
    orig: torch.Tensor
    aliases: list[str] = field(default_factory=list)
    alias_refs: list[tuple[nn.Module, str, bool]] = field(default_factory=list)


def _scale_label(fmt: str, weight_label: str) -> str:
    if fmt == "official":
        return weight_label[: -len(".weight")] + ".scale" if weight_label.endswith(".weight") else weight_label + ".scale"
    return hf_scale_name(weight_label)


def _expected_label(fmt: str, hf_name: str) -> str:
    if fmt != "official":
        return hf_name
    from .names import hf_to_official

    o = hf_to_official(hf_name)
    if o is not None:
        return o
    if hf_name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        where, layer = hf_name.split(".")[1:3]          # model.layers.N / model.mtp.N
        w = "w1.weight / w3.weight" if hf_name.endswith("gate_up_proj") else "w2.weight"
        return f"{where}.{layer}.ffn.experts.*.{w}"
    return hf_name


def _collect_slots(module: nn.Module) -> dict[str, _Slot]:
    sd = module.state_dict(keep_vars=True)
    slots: dict[str, _Slot] = {}
    seen: dict[int, str] = {}
    for name, t in sd.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        is_param = attr in owner._parameters
        if id(t) in seen:  # tied weights: fill once, share
            slots[seen[id(t)]].aliases.append(name)
            slots[seen[id(t)]].alias_refs.append((owner, attr, is_param))
            continue
        seen[id(t)] = name
        slots[name] = _Slot(name, owner, attr, is_param, t)
    return slots


def _check_coverage(target: str, ps: list[_Piece], slot: _Slot, fmt: str) -> None:
    whole = [p for p in ps if not p.index]
    if whole and len(ps) > 1:
        raise CheckpointError(f"several checkpoint tensors map to {target}: {[p.label for p in ps]}",
                              tensor=ps[1].label, file=ps[1].weight.file)
    if whole:
        return
    shape = slot.orig.shape
    n_exp = shape[0]
    seen: dict[tuple, _Piece] = {}
    for p in ps:
        key = (p.index[0], None if len(p.index) == 1 else p.index[1].start)
        if key in seen:
            raise CheckpointError(f"duplicate expert tensor (also {seen[key].label})", tensor=p.label,
                                  file=p.weight.file)
        seen[key] = p
    layer = target.split(".")[2]
    parts = ([("w1", 0), ("w3", shape[1] // 2)] if target.endswith("gate_up_proj") else [("w2", None)])
    for e in range(n_exp):
        for wn, start in parts:
            if (e, start) not in seen:
                label = (f"layers.{layer}.ffn.experts.{e}.{wn}.weight" if fmt == "official" else target)
                raise CheckpointError(f"missing tensor for expert {e} of {target}", tensor=label,
                                      file=ps[0].weight.file)


def _target_buffer(slot: _Slot, dt: torch.dtype, dev: torch.device) -> torch.Tensor:
    o = slot.orig
    if not o.is_meta and o.device == dev and o.dtype == dt:
        return o.detach()
    return torch.empty(o.shape, dtype=dt, device=dev)


def _assign(slots: dict[str, _Slot], name: str, value: torch.Tensor) -> None:
    s = slots[name]
    o = s.orig
    if not o.is_meta and o.device == value.device and o.dtype == value.dtype and o.shape == value.shape:
        if value.data_ptr() != o.data_ptr():
            with torch.no_grad():
                o.copy_(value)
        return
    if s.is_param:
        new = nn.Parameter(value, requires_grad=o.requires_grad and value.is_floating_point())
        s.owner._parameters[s.attr] = new
    else:
        new = value
        s.owner._buffers[s.attr] = new
    s.orig = new
    for owner, attr, is_param in s.alias_refs:  # tied weights point at the same tensor
        (owner._parameters if is_param else owner._buffers)[attr] = new


def _region_shape(full: torch.Size, index: tuple) -> tuple[int, ...]:
    return tuple(torch.empty(full, device="meta")[index].shape)


def _scale_index(pc: _Piece, weight_dtype: torch.dtype) -> tuple:
    """Region of the scale tensor that goes with the region ``pc.index`` of a kept-quantised
    weight. Packed FP4 scales have one row per weight row (same index); FP8 scales one row per
    128 weight rows, so a row slice (w1 / w3 half of ``gate_up_proj``) is divided by the block."""
    if len(pc.index) != 2 or not quant.is_fp8(weight_dtype):
        return pc.index
    e, rows = pc.index
    if rows.start % quant.FP8_BLOCK or rows.stop % quant.FP8_BLOCK:
        raise CheckpointError(f"kept FP8 expert rows {rows.start}..{rows.stop} are not whole {quant.FP8_BLOCK}-row "
                              f"scale blocks", tensor=pc.label, file=pc.weight.file)
    return (e, slice(rows.start // quant.FP8_BLOCK, rows.stop // quant.FP8_BLOCK))


def _read_raw(handle, info: TensorInfo, label: str, full_shape, index, dt, dev, is_scale=False) -> torch.Tensor:
    """Read a tensor as stored (quantised kept as is) and check it fits the region."""
    try:
        t = handle(info.file).get_tensor(info.name)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"cannot read tensor data ({e})", tensor=info.name, file=info.file) from None
    want = _region_shape(full_shape, index) if index else tuple(full_shape)
    if tuple(t.shape) != want:
        raise CheckpointError(f"shape mismatch: checkpoint {list(t.shape)} vs model {list(want)}",
                              tensor=label, file=info.file)
    if t.dtype != dt:
        if is_scale:
            t32 = quant.scale_to_float32(t)
            if dt in (quant.E8M0, torch.uint8):
                t = quant.encode_scale(t32, dt)
                if not torch.equal(quant.scale_to_float32(t), t32):
                    raise CheckpointError(f"dtype mismatch: scale {t.dtype} values are not powers of two and cannot "
                                          f"be stored as {dt}", tensor=label, file=info.file)
            else:
                t = t32.to(dt)
        else:
            raise CheckpointError(f"dtype mismatch: checkpoint {t.dtype} vs model {dt} (kept quantised)",
                                  tensor=label, file=info.file)
    # kept-quantised data gets the same corruption check as the dequantising path
    if _has_nonfinite_codes(None if is_scale else t, t if is_scale else None):
        raise CheckpointError("quantised data holds NaN / non-finite codes (corrupt data or scale)",
                              tensor=label, file=info.file)
    return t.to(dev)


def _has_nonfinite_codes(weight: torch.Tensor | None, scale: torch.Tensor | None) -> bool:
    """A NaN / 0xFF scale, or an FP8 e4m3 NaN code (|byte| = 0x7F) in the weight."""
    if scale is not None and not torch.isfinite(quant.scale_to_float32(scale)).all():
        return True
    return weight is not None and weight.dtype == torch.float8_e4m3fn and bool(
        ((weight.view(torch.uint8) & 0x7F) == 0x7F).any())


def _check_values(t: torch.Tensor, label: str, file, allow_nonfinite: bool, value_range) -> None:
    """The values a chunk put into a target: finite (floating targets, unless ``allow_nonfinite``)
    and, for an integer target with a ``value_range`` (lo, hi), within [lo, hi)."""
    if t.is_floating_point():
        if not allow_nonfinite and not bool(torch.isfinite(t).all()):
            n_nan, n_inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            raise CheckpointError(f"non-finite values ({n_nan} NaN, {n_inf} Inf): a corrupt or diverged weight "
                                  f"(load with allow_nonfinite=True / --allow-nonfinite to keep them)",
                                  tensor=label, file=file)
    elif value_range is not None and t.numel():
        lo, hi = value_range
        bad = (t < lo) | (t >= hi)
        if bool(bad.any()):
            raise CheckpointError(f"integer values out of range [{lo}, {hi}): {t[bad][:5].tolist()} "
                                  f"({int(bad.sum())} entries)", tensor=label, file=file)


def _convert(handle, pc: _Piece, slot: _Slot, dt: torch.dtype, dev: torch.device, dst, fmt: str,
             allow_nonfinite: bool = False, value_range: tuple[int, int] | None = None) -> torch.Tensor:
    """Read one piece (chunked by rows), dequantise / cast to ``dt`` on ``dev``; write into ``dst``
    (a view of the target) when given, else return a new tensor. Every chunk's values are checked
    (`_check_values`) before the next one is read."""
    info = pc.weight
    src_dt = info.torch_dtype
    want = tuple(dst.shape) if dst is not None else tuple(slot.orig.shape)
    label = pc.label
    if src_dt is None:
        raise CheckpointError(f"dtype mismatch: checkpoint dtype {info.dtype} is not supported by this torch",
                              tensor=label, file=info.file)
    # expected on-disk shape
    if pc.scale is not None:
        if not (quant.is_fp8(src_dt) or quant.is_fp4_packed(src_dt)):
            raise CheckpointError(f"has a block scale ({pc.scale.name}) but dtype {info.dtype} is not FP8 or packed FP4",
                                  tensor=label, file=info.file)
        if not dt.is_floating_point:
            raise CheckpointError(f"dtype mismatch: quantised weight for non-floating parameter ({dt})",
                                  tensor=label, file=info.file)
        if quant.is_fp8(src_dt):
            disk_shape = want
            sshape = quant.fp8_scale_shape(want) if len(want) >= 2 else None
        else:
            disk_shape = (*want[:-1], want[-1] // 2) if want and want[-1] % 2 == 0 else None
            sshape = quant.fp4_scale_shape(want) if want else None
        if disk_shape is None or tuple(info.shape) != tuple(disk_shape):
            raise CheckpointError(f"shape mismatch: checkpoint {list(info.shape)} ({info.dtype}) vs model {list(want)}"
                                  + (f" (packed FP4 expects {list(disk_shape)})" if disk_shape and disk_shape != want else ""),
                                  tensor=label, file=info.file)
        if sshape is None or tuple(pc.scale.shape) != tuple(sshape):
            raise CheckpointError(f"shape mismatch: scale {list(pc.scale.shape)} vs expected {list(sshape or ())} for "
                                  f"weight {list(want)}", tensor=pc.scale.name, file=pc.scale.file)
        if pc.scale.torch_dtype not in quant.SCALE_DTYPES:
            raise CheckpointError(f"dtype mismatch: scale dtype {pc.scale.dtype} is not e8m0/uint8/float",
                                  tensor=pc.scale.name, file=pc.scale.file)
    else:
        if tuple(info.shape) != want:
            raise CheckpointError(f"shape mismatch: checkpoint {list(info.shape)} vs model {list(want)}",
                                  tensor=label, file=info.file)
        if dt.is_floating_point != src_dt.is_floating_point or src_dt == torch.bool or quant.is_fp8(src_dt):
            raise CheckpointError(f"dtype mismatch: checkpoint {info.dtype} cannot fill a {dt} parameter",
                                  tensor=label, file=info.file)

    out = dst if dst is not None else torch.empty(want, dtype=dt, device=dev)

    def decode_scale(w, sc):
        # non-finite dequantised values can only come from a NaN / 0xFF scale or an FP8 NaN code
        s32 = quant.scale_to_float32(sc)
        if _has_nonfinite_codes(w if src_dt == torch.float8_e4m3fn else None, sc):
            raise CheckpointError("quantised data holds NaN / non-finite codes (corrupt data or scale)",
                                  tensor=label, file=info.file)
        return s32

    try:
        wsl = handle(info.file).get_slice(info.name)
        ssl = handle(pc.scale.file).get_slice(pc.scale.name) if pc.scale is not None else None
        rows = want[0] if want else 0
        if len(want) >= 2 and rows > _CHUNK_ROWS:
            chunks = [(r0, min(rows, r0 + _CHUNK_ROWS)) for r0 in range(0, rows, _CHUNK_ROWS)]
        else:
            chunks = [None]
        for ch in chunks:
            if ch is None:
                w = wsl[:] if want else handle(info.file).get_tensor(info.name)
                sc = ssl[:] if ssl is not None else None
                dst_view = out
            else:
                r0, r1 = ch
                w = wsl[r0:r1]
                if ssl is not None and quant.is_fp8(src_dt) and len(want) == 2:
                    sc = ssl[r0 // quant.FP8_BLOCK: math.ceil(r1 / quant.FP8_BLOCK)]
                else:  # FP4 rows, or FP8 with leading batch dims (whole scale rows per chunk)
                    sc = ssl[r0:r1] if ssl is not None else None
                dst_view = out[r0:r1]
            if sc is None:
                dst_view.copy_(w.to(dev))
            else:
                s32 = decode_scale(w, sc)
                dst_view.copy_(quant.dequantize(w.to(dev), s32.to(dev), dt))
            _check_values(dst_view, label, info.file, allow_nonfinite, value_range)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"cannot read or convert tensor data ({type(e).__name__}: {e})", tensor=label,
                              file=info.file) from None
    return out


def _verify_not_meta(module: nn.Module) -> None:
    bad = [n for n, p in module.named_parameters() if p.is_meta]
    sd_names = set(module.state_dict().keys())
    bad += [n for n, b in module.named_buffers() if b.is_meta and n in sd_names]
    if bad:
        raise CheckpointError(f"{len(bad)} parameters are still on the meta device after loading: {bad[:8]}",
                              tensor=bad[0])
    np_meta = [n for n, b in module.named_buffers() if b.is_meta and n not in sd_names]
    if np_meta:
        log.warning("%d non-persistent buffers are on the meta device (not checkpoint data; the model must "
                    "compute them): %s", len(np_meta), np_meta[:4])
