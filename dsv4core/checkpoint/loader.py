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
from collections import defaultdict
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from dsv4core.hal import quant

from . import cuts
from .convert import (_assign, _check_coverage, _collect_slots, _convert, _expected_label, _Piece,
                      _read_raw, _scale_index, _scale_label, _Slot, _target_buffer, _verify_not_meta)
from .errors import CheckpointError
from .names import HF_SCALE_SUFFIX, hf_scale_name, is_mtp, official_to_hf
from .safetensors_io import TensorInfo, read_header

log = logging.getLogger("dsv4core.checkpoint")

INDEX_NAME = "model.safetensors.index.json"
FORMATS = ("transformers", "official")



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

    @property
    def has_mtp(self) -> bool:
        """Whether the checkpoint holds MTP-block tensors (``mtp.*`` / ``model.mtp.*``)."""
        return any(is_mtp(n) for n in self._infos)

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
        wants_mtp = any(is_mtp(k) for k in slots)      # the module has an MTP block: its tensors load
        for name, info in self._infos.items():
            if is_mtp(name) and not wants_mtp:
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
          Missing tensors always raise. ``mtp.*`` tensors (the MTP block) fill the module's
          ``model.mtp.*`` parameters; a module without an MTP block skips them with one log line.
        * ``cut``: the module holds one rank's slices (tensor / expert parallelism); only those
          regions are read (see :mod:`dsv4core.checkpoint.cuts`).
        Returns ``module``.
        """
        device = torch.device(device) if device is not None else None
        slots = _collect_slots(module)
        pieces, mtp = self._pieces(slots, strict, cut)
        cut_reads = cuts.apply(pieces, cut) if cut is not None else {}
        if mtp:
            log.info("skipping %d mtp.* tensors (the model has no MTP block)", len(mtp))

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
