"""Open a DeepSeek-V4 checkpoint (transformers or official layout) and stream it into a module.

``open_checkpoint(path)`` reads only headers (and ``config.json`` / the shard index). ``load_into``
fills a module whose ``state_dict`` names are transformers' ``DeepseekV4ForCausalLM`` names,
one shard at a time, through memory-mapped ``safe_open`` reads (row chunks for large tensors), so
the resident memory during the load is about the final model plus one shard of page cache plus
one chunk being converted.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
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

#: config.json dtype names (`dtype` / `torch_dtype`) of floating weights
_FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

INDEX_NAME = "model.safetensors.index.json"
FORMATS = ("transformers", "official")

#: the callback `load_progress` installs for the `load_into` calls inside its block
_LOAD_PROGRESS: contextvars.ContextVar = contextvars.ContextVar("dsv4core_checkpoint_load_progress", default=None)


@contextlib.contextmanager
def load_progress(callback):
    """Within the block, every `Checkpoint.load_into` (also the one inside `load_model`) reports
    its progress: `callback(done_bytes, total_bytes, shard_name)` after each tensor read, the
    bytes counted as stored in the checkpoint (weight and scale) for the tensors this module
    takes."""
    token = _LOAD_PROGRESS.set(callback)
    try:
        yield
    finally:
        _LOAD_PROGRESS.reset(token)


def _hub_blobs(root: Path) -> Path | None:
    """huggingface_hub's cache keeps a snapshot's files as symlinks into its repository's blob
    store (``models--org--name/snapshots/<rev>/f -> ../../blobs/<hash>``): that folder, resolved,
    when ``root`` is such a snapshot, else None."""
    blobs = root.parent.parent / "blobs"
    return blobs.resolve() if root.parent.name == "snapshots" and blobs.is_dir() else None


def confined(root: Path, rel: str | Path, what: str, *, tensor: str | None = None) -> Path:
    """``root / rel``, refused with a CheckpointError unless it stays inside the checkpoint
    directory ``root``: ``rel`` must be relative with no ``..`` step leaving ``root``, and the
    path it resolves to (symlinks followed) must lie in ``root`` resolved (or, for a
    huggingface_hub cache snapshot, in that repository's ``blobs/`` folder)."""
    if not isinstance(rel, (str, Path)) or not str(rel):
        raise CheckpointError(f"{what}: expected a file name relative to the checkpoint directory; got {rel!r}",
                              tensor=tensor, file=root)
    where = root / rel
    if Path(rel).is_absolute() or os.path.normpath(rel).split(os.sep)[0] == os.pardir:
        raise CheckpointError(f"{what} {str(rel)!r} points outside the checkpoint directory {str(root)!r} "
                              f"(expected a file name relative to it); refused", tensor=tensor, file=where)
    real, base = where.resolve(), root.resolve()
    if real.is_relative_to(base):
        return where
    blobs = _hub_blobs(base)
    if blobs is not None and real.is_relative_to(blobs):
        return where
    raise CheckpointError(f"{what} {str(rel)!r} resolves to {str(real)!r}, outside the checkpoint directory "
                          f"{str(base)!r} (a symlink leaving it); refused", tensor=tensor, file=where)


def _read_index(idx: Path) -> dict[str, str]:
    """The shard index's ``weight_map``: a JSON object of tensor name -> shard file name."""
    try:
        doc = json.loads(idx.read_text())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"shard index is not valid JSON ({type(e).__name__}: {str(e)[:200]})",
                              file=idx) from None
    wm = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wm, dict):
        got = type(doc).__name__ if not isinstance(doc, dict) else (
            "no weight_map" if "weight_map" not in doc else f"weight_map of type {type(wm).__name__}")
        raise CheckpointError(f"shard index must be a JSON object with a 'weight_map' object of tensor name -> "
                              f"file name; got {got}", file=idx)
    for name, fname in wm.items():
        if not isinstance(fname, str):
            raise CheckpointError(f"shard index maps this tensor to {fname!r} ({type(fname).__name__}); expected a "
                                  f"file name (str)", tensor=name, file=idx)
    return wm


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


def _widens(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every `src` value is exactly a `dst` value (bfloat16 / float16 -> float32)."""
    return dst == torch.float32 and src in (torch.bfloat16, torch.float16)


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
            confined(root, "config.json", "config.json")
            try:
                self.config_dict = json.loads(cfg_path.read_text())
            except (ValueError, RecursionError) as e:
                raise CheckpointError(f"config.json is not valid JSON ({type(e).__name__}: {str(e)[:200]})",
                                      file=cfg_path) from None
            if not isinstance(self.config_dict, dict):
                raise CheckpointError(f"config.json must hold a JSON object; got {type(self.config_dict).__name__}",
                                      file=cfg_path)
        self.index_file: Path | None = None
        weight_map: dict[str, str] | None = None
        if p.is_dir():
            idx = p / INDEX_NAME
            if idx.is_file():
                self.index_file = idx
                confined(root, INDEX_NAME, "shard index")
                weight_map = _read_index(idx)
                files = sorted({confined(root, f, "shard index entry", tensor=n) for n, f in weight_map.items()})
                for f in files:
                    if not f.is_file():
                        first = next(n for n, v in weight_map.items() if root / v == f)
                        raise CheckpointError(f"the shard index {idx.name} maps this tensor to a file that does not "
                                              f"exist", tensor=first, file=f)
            else:
                files = sorted(confined(root, f.name, "shard") for f in p.glob("*.safetensors"))
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

    def weights_dtype(self) -> tuple[torch.dtype | None, str]:
        """(the floating dtype this checkpoint's weights are in, where that was read): config.json's
        `dtype` / `torch_dtype` when it names a floating dtype the stored weights convert to
        exactly; otherwise (absent, a quantisation tag such as "fp8", or a dtype that would
        narrow what is stored, e.g. "bfloat16" over float32 tensors) the dtype the token
        embedding is stored in (`model.embed_tokens.weight` / `embed.weight`): the embedding is
        never quantised and is stored in the model's dtype, unlike the fp32 norms / mHC / sinks.
        (None, why) when neither says."""
        names = ("dtype", "torch_dtype")
        stored = None
        for name in ("model.embed_tokens.weight", "embed.weight"):
            info = self._infos.get(name)
            if info is not None and info.torch_dtype is not None and info.torch_dtype.is_floating_point \
                    and info.torch_dtype.itemsize >= 2:
                stored = info.torch_dtype, f"the stored {name} ({info.dtype}, {info.file.name})"
                break
        for key in names:
            v = self.config_dict.get(key)
            if isinstance(v, str) and v.removeprefix("torch.") in _FLOAT_DTYPES:
                declared = _FLOAT_DTYPES[v.removeprefix("torch.")]
                if stored is None or stored[0] == declared or _widens(stored[0], declared):
                    return declared, f"config.json {key}={v!r}"
                return stored[0], f"config.json {key}={v!r} (it would narrow {stored[1]})"
        given = ", ".join(f"{k}={self.config_dict[k]!r}" for k in names if k in self.config_dict)
        where = f"config.json ({given or 'no dtype / torch_dtype'})"
        if stored is not None:
            return stored[0], f"{where}; {stored[1]}"
        return None, f"{where}; no floating token embedding stored"

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
                  device: torch.device | str | None = None, strict: bool = True, cut=None,
                  progress=None, allow_nonfinite: bool = False,
                  value_ranges: dict[str, tuple[int, int]] | None = None) -> nn.Module:
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
        * ``progress``: ``progress(done_bytes, total_bytes, shard_name)`` after each tensor
          (default: the callback of an enclosing `load_progress` block, if any).
        * Values are checked as they are read: a NaN / Inf in a floating tensor is an error naming
          it (``allow_nonfinite=True`` keeps them, for debugging); ``value_ranges`` maps the last
          component of an integer tensor's name (e.g. ``"tid2eid"``) to its legal [lo, hi).
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
        progress = progress if progress is not None else _LOAD_PROGRESS.get()
        size = {id(pc): pc.weight.nbytes + (pc.scale.nbytes if pc.scale is not None else 0)
                for ps in pieces.values() for pc in ps}
        total_bytes, done_bytes = sum(size.values()), 0
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
                    val = _convert(handle, pc, slot, tdtype[pc.target], dev, dst, self.format, allow_nonfinite,
                                   (value_ranges or {}).get(pc.target.rpartition(".")[2]))
                    if dst is None:
                        _assign(slots, pc.target, val)
                remaining[pc.target] -= 1
                done_bytes += size[id(pc)]
                if progress is not None:
                    progress(done_bytes, total_bytes, f.name)
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
