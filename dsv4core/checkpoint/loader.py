"""Open a DeepSeek-V4 checkpoint (transformers or official layout) and stream it into a module.

``open_checkpoint(path)`` reads only headers (and ``config.json`` / the shard index). ``load_into``
fills a module whose ``state_dict`` names are transformers' ``DeepseekV4ForCausalLM`` names,
one shard at a time, through memory-mapped ``safe_open`` reads (row chunks for large tensors), so
the resident memory during the load is about the final model plus one shard of page cache plus
one chunk being converted.
"""

from __future__ import annotations

import json
import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from dsv4core.hal import quant

from . import cuts
from .errors import CheckpointError
from .names import HF_SCALE_SUFFIX, hf_scale_name, is_mtp, official_to_hf
from .safetensors_io import TensorInfo, read_header

log = logging.getLogger("dsv4core.checkpoint")

INDEX_NAME = "model.safetensors.index.json"
FORMATS = ("transformers", "official")

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


def _detect_format(names: Iterable[str], config: dict, where: Path) -> str:
    """``transformers``: HF names under ``model.`` / ``lm_head.`` (transformers' own
    ``save_pretrained`` writes official leaf names under ``model.layers.N.`` and ``head.weight``;
    that is still the transformers layout). ``official``: unprefixed ``embed.weight``,
    ``layers.N.*``, ``hc_head_*`` names."""
    hf = off = 0
    for n in names:
        if is_mtp(n):
            continue
        if n.startswith(("model.", "lm_head.")):
            hf += 1
        elif n in ("embed.weight", "norm.weight") or n.startswith(("layers.", "hc_head_")):
            off += 1
    if hf and not off:
        return "transformers"
    if off and not hf:
        return "official"
    if hf and off:
        raise CheckpointError(f"mixes transformers names ({hf}) and official names ({off}); cannot tell the format",
                              file=where)
    if "compress_ratios" in config or "expert_dtype" in config:
        return "official"
    if config.get("model_type") == "deepseek_v4":
        return "transformers"
    raise CheckpointError("no DeepSeek-V4 tensors found (neither transformers nor official names)", file=where)


class Checkpoint:
    """A DeepSeek-V4 checkpoint on disk (headers parsed, no data read)."""

    def __init__(self, path: str | Path):
        p = Path(path)
        if not p.exists():
            raise CheckpointError("path does not exist", file=p)
        if p.is_file() and p.name == INDEX_NAME:
            p = p.parent
        self.path = p
        root = p if p.is_dir() else p.parent
        self.root = root
        cfg_path = root / "config.json"
        self.config_dict: dict = {}
        if cfg_path.is_file():
            try:
                self.config_dict = json.loads(cfg_path.read_text())
            except ValueError as e:
                raise CheckpointError(f"config.json is not valid JSON ({e})", file=cfg_path) from None
        self.index_file: Path | None = None
        weight_map: dict[str, str] | None = None
        if p.is_dir():
            idx = p / INDEX_NAME
            if idx.is_file():
                self.index_file = idx
                try:
                    weight_map = json.loads(idx.read_text())["weight_map"]
                except (ValueError, KeyError, TypeError) as e:
                    raise CheckpointError(f"shard index is not valid ({e!r})", file=idx) from None
                files = sorted({root / f for f in weight_map.values()})
                for f in files:
                    if not f.is_file():
                        first = next(n for n, v in weight_map.items() if root / v == f)
                        raise CheckpointError(f"the shard index {idx.name} maps this tensor to a file that does not "
                                              f"exist", tensor=first, file=f)
            else:
                files = sorted(p.glob("*.safetensors"))
        else:
            files = [p]
        if not files:
            raise CheckpointError("no .safetensors files found", file=p)
        self.files: list[Path] = files
        self.metadata: dict[Path, dict] = {}
        self._infos: dict[str, TensorInfo] = {}
        for f in files:
            infos, meta = read_header(f)
            self.metadata[f] = meta
            for n, info in infos.items():
                if n in self._infos:
                    raise CheckpointError(f"tensor appears in two shards (also in {self._infos[n].file})",
                                          tensor=n, file=f)
                if weight_map is not None and n not in weight_map:
                    log.warning("tensor %s in %s is not listed in the shard index; using it anyway", n, f)
                self._infos[n] = info
        if weight_map is not None:
            for n, fname in weight_map.items():
                info = self._infos.get(n)
                if info is None or info.file != root / fname:
                    raise CheckpointError(f"the shard index {INDEX_NAME} lists this tensor in this file, but the "
                                          f"file does not contain it", tensor=n, file=root / fname)
        self.format = _detect_format(self._infos, self.config_dict, p)

    # ------------------------------------------------------------------ queries
    def tensor_names(self) -> list[str]:
        return list(self._infos)

    def tensor_info(self, name: str) -> TensorInfo:
        return self._infos[name]

    def infos(self) -> dict[str, TensorInfo]:
        return dict(self._infos)

    @property
    def total_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.files)

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, format={self.format!r}, files={len(self.files)}, tensors={len(self._infos)})"

    # ------------------------------------------------------------------ planning
    def _pieces(self, slots: dict[str, _Slot], strict: bool, cut=None) -> tuple[dict[str, list[_Piece]], list[str]]:
        """Map checkpoint tensors to module targets. Returns (target -> pieces, skipped mtp names).
        With a rank `cut` (see `cuts`), routed experts of other ranks are skipped and the others
        get their local index."""
        weights: dict[str, tuple[TensorInfo, str, tuple, str]] = {}  # label -> (info, target, index, label)
        scales: dict[str, TensorInfo] = {}  # weight label -> scale info
        mtp: list[str] = []
        unexpected: list[TensorInfo] = []
        for name, info in self._infos.items():
            if is_mtp(name):
                mtp.append(name)
                continue
            if name.endswith(HF_SCALE_SUFFIX) and (name not in slots or name[: -len(HF_SCALE_SUFFIX)] in slots):
                # HF block-scale companion: X.weight_scale_inv / experts.gate_up_proj_scale_inv
                scales[name[: -len(HF_SCALE_SUFFIX)]] = info
                continue
            if name in slots:  # transformers name
                weights[name] = (info, name, (), name)
                continue
            if name.endswith("activation_scale"):
                log.warning("ignoring %s (%s)", name, info.file)
                continue
            # official name; transformers' save_pretrained writes them with a "model." prefix
            t = official_to_hf(name[len("model."):] if name.startswith("model.") else name)
            if t is None:
                unexpected.append(info)
                continue
            if t.is_scale:
                scales[name[: -len("scale")] + "weight"] = info
                continue
            weights[name] = (info, t.hf_name, (t.expert, t.part) if t.expert is not None else (), name)
        for wname, sinfo in scales.items():
            if wname not in weights:
                raise CheckpointError(f"block scale without its weight (expected {wname!r})", tensor=sinfo.name,
                                      file=sinfo.file)
        pieces: dict[str, list[_Piece]] = defaultdict(list)
        for label, (info, target, index, _) in weights.items():
            if target not in slots:
                unexpected.append(info)
                continue
            scale = scales.get(label)
            if scale is None and info.torch_dtype is not None and (
                    quant.is_fp8(info.torch_dtype) or
                    (info.torch_dtype in quant.FP4_PACKED_DTYPES and slots[target].orig.is_floating_point())):
                raise CheckpointError(f"quantised weight ({info.dtype}) without its block scale "
                                      f"({_scale_label(self.format, label)!r})", tensor=label, file=info.file)
            if index and cut is not None:
                e_local = cut.expert(target, index[0])
                if e_local is None:
                    continue                      # another rank's expert
                index = (e_local, index[1])
            if index:
                full = slots[target].orig.shape
                e, part = index
                if e >= full[0]:
                    raise CheckpointError(f"expert index {e} out of range for {target} with {full[0]} experts",
                                          tensor=label, file=info.file)
                if part == "gate":
                    index = (e, slice(0, full[1] // 2))
                elif part == "up":
                    index = (e, slice(full[1] // 2, full[1]))
                else:
                    index = (e,)
            pieces[target].append(_Piece(target, info, scale, index, label))
        if unexpected:
            msg = ", ".join(f"{i.name} ({i.file.name})" for i in unexpected[:8])
            if strict:
                u = unexpected[0]
                raise CheckpointError(f"unexpected tensor: the model has no parameter for it "
                                      f"({len(unexpected)} unexpected: {msg})", tensor=u.name, file=u.file)
            log.warning("ignoring %d unexpected tensors: %s", len(unexpected), msg)
        return pieces, mtp

    # ------------------------------------------------------------------ loading
    def load_into(self, module: nn.Module, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, strict: bool = True, cut=None) -> nn.Module:
        """Fill ``module`` (built on the meta device or on the target device) from this checkpoint.

        * Every parameter and persistent buffer of ``module.state_dict()`` is filled by its
          transformers name. A tensor takes the dtype of the parameter it fills (fp32 parameters
          stay fp32); ``dtype``, when given, replaces the dtype of the module's reduced-precision
          floating parameters (bf16/fp16), never that of fp32 ones.
        * Quantised tensors (FP8 e4m3 + ``.scale``, packed FP4 + UE8M0 scale) are dequantised with
          fp32 math, unless the module keeps them quantised: a target parameter whose dtype is
          FP8 (or int8 for packed FP4) and that has a ``<name>_scale_inv`` companion in the module
          receives the raw quantised tensor and its scale. (This is how a model built for a
          backend with FP8 ``linear`` asks for FP8 weights: it allocates FP8 parameters.)
        * ``device``: where the tensors go for parameters on the meta device (default: cpu);
          parameters already on a real device are filled in place (``copy_``) on that device.
        * ``strict``: unexpected checkpoint tensors raise (else they are logged and ignored).
          Missing tensors always raise. ``mtp.*`` tensors are skipped with one log line.
        * ``cut``: the module holds one rank's slices (tensor / expert parallelism); only those
          regions are read (see :mod:`dsv4core.checkpoint.cuts`).
        Returns ``module``.
        """
        device = torch.device(device) if device is not None else None
        slots = _collect_slots(module)
        pieces, mtp = self._pieces(slots, strict, cut)
        cut_reads = cuts.apply(pieces, cut) if cut is not None else {}
        if mtp:
            log.info("skipping %d mtp.* tensors (multi-token prediction is not built)", len(mtp))

        # target dtype / device per slot
        tdtype: dict[str, torch.dtype] = {}
        tdevice: dict[str, torch.device] = {}
        for name, s in slots.items():
            dt = s.orig.dtype
            if dtype is not None and dt in (torch.bfloat16, torch.float16):
                dt = dtype
            tdtype[name] = dt
            tdevice[name] = (device or torch.device("cpu")) if s.orig.is_meta else s.orig.device

        # missing / coverage checks before reading any data
        scale_targets = {}
        for name, s in slots.items():
            if name in pieces:
                continue
            base = name[: -len(HF_SCALE_SUFFIX)] if name.endswith(HF_SCALE_SUFFIX) else None
            if base is not None and base in pieces:
                scale_targets[name] = base
                continue
            if any(a in pieces for a in s.aliases):
                continue
            if not strict and not s.orig.is_meta:
                log.warning("%s not in the checkpoint; keeping the module's value", name)
                continue
            raise CheckpointError(f"missing tensor: the checkpoint has no tensor for parameter {name!r} "
                                  f"(expected {_expected_label(self.format, name)!r})",
                                  tensor=name, file=self.index_file or self.files[0])
        for target, ps in pieces.items():
            _check_coverage(target, ps, slots[target], self.format)
        for sname, base in scale_targets.items():  # the module keeps these quantised: every piece needs its scale
            for pc in pieces[base]:
                if pc.scale is None:
                    raise CheckpointError(f"dtype mismatch: the model keeps {base} quantised ({tdtype[base]}, with "
                                          f"{sname}) but the checkpoint holds {pc.weight.dtype} without a block scale",
                                          tensor=pc.label, file=pc.weight.file)

        # group by the shard holding the weight; process shards one by one
        by_file: dict[Path, list[_Piece]] = defaultdict(list)
        for ps in pieces.values():
            for pc in ps:
                by_file[pc.weight.file].append(pc)
        remaining = {t: len(ps) for t, ps in pieces.items()}
        partial: dict[str, torch.Tensor] = {}
        partial_scale: dict[str, torch.Tensor] = {}
        from safetensors import safe_open

        for f in self.files:
            plist = by_file.get(f)
            if not plist:
                continue
            handles: dict[Path, object] = {}

            def handle(path: Path):
                h = handles.get(path)
                if h is None:
                    try:
                        h = safe_open(str(path), framework="pt", device="cpu")
                    except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
                        raise CheckpointError(f"cannot open shard ({e})", file=path) from None
                    if path in cut_reads:
                        h = cuts.CutHandle(h, cut_reads[path])
                    handles[path] = h
                return h

            log.info("loading %s (%d tensors)", f.name, len(plist))
            for pc in plist:
                slot = slots[pc.target]
                scale_name = hf_scale_name(pc.target)
                keep_quant = pc.scale is not None and scale_name in slots
                dev = tdevice[pc.target]
                if pc.index:
                    buf = partial.get(pc.target)
                    if buf is None:
                        buf = _target_buffer(slot, tdtype[pc.target], dev)
                        partial[pc.target] = buf
                    dst = buf[pc.index]
                else:
                    dst = None
                if keep_quant:
                    val = _read_raw(handle, pc.weight, pc.label, slot.orig.shape, pc.index, tdtype[pc.target], dev)
                    sslot = slots[scale_name]
                    sdt = tdtype[scale_name]
                    sindex = _scale_index(pc, tdtype[pc.target])
                    sval = _read_raw(handle, pc.scale, pc.scale.name, sslot.orig.shape, sindex, sdt, dev,
                                     is_scale=True)
                    if pc.index:
                        sbuf = partial_scale.get(scale_name)
                        if sbuf is None:
                            sbuf = _target_buffer(sslot, sdt, dev)
                            partial_scale[scale_name] = sbuf
                        sbuf[sindex].copy_(sval)
                        dst.copy_(val)
                    else:
                        _assign(slots, scale_name, sval)
                        _assign(slots, pc.target, val)
                else:
                    val = _convert(handle, pc, slot, tdtype[pc.target], dev, dst, self.format)
                    if dst is None:
                        _assign(slots, pc.target, val)
                remaining[pc.target] -= 1
                if remaining[pc.target] == 0 and pc.target in partial:
                    _assign(slots, pc.target, partial.pop(pc.target))
                    if scale_name in partial_scale:
                        _assign(slots, scale_name, partial_scale.pop(scale_name))
            handles.clear()  # drops the shard's memory maps before the next shard
            del handle

        _verify_not_meta(module)
        return module


# ---------------------------------------------------------------------------------------------
def open_checkpoint(path: str | Path) -> Checkpoint:
    """Open a checkpoint directory (or single ``.safetensors`` file); detects the format."""
    return Checkpoint(path)


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
    if hf_name.endswith("experts.gate_up_proj"):
        layer = hf_name.split(".")[2]
        return f"layers.{layer}.ffn.experts.*.w1.weight / w3.weight"
    if hf_name.endswith("experts.down_proj"):
        layer = hf_name.split(".")[2]
        return f"layers.{layer}.ffn.experts.*.w2.weight"
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


def _convert(handle, pc: _Piece, slot: _Slot, dt: torch.dtype, dev: torch.device, dst, fmt: str) -> torch.Tensor:
    """Read one piece (chunked by rows), dequantise / cast to ``dt`` on ``dev``; write into ``dst``
    (a view of the target) when given, else return a new tensor."""
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
