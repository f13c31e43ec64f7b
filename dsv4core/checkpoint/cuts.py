"""Reading only a rank's slices of checkpoint tensors (tensor / expert parallelism).

`Checkpoint.load_into(module, cut=...)` fills a module whose parameters are one rank's slices
(same names, smaller shapes). The `cut` object (duck-typed; `dsv4core.model.parallel.RankCut`
implements it) says, per target parameter (transformers name), which region of the full tensor
the rank holds, as a rule: a list of `(dim, start, stop)` in the full, dequantised weight's
coordinates (several spans of one dim are joined in order):

    cut.rule(target) -> list[(dim, start, stop)] | None     # None: the whole tensor
    cut.full_dims(target) -> {dim: full size}               # checked against the checkpoint
    cut.expert(target, e) -> int | None                     # routed expert e: its local index, or
                                                            # None when it lives on another rank

Here the rules are translated to each stored tensor (packed FP4: the last dim holds two values a
byte; FP8 block scales: one cell per 128 x 128 block of the last two dims; FP4 scales: one per
32 of the last dim; an official per-expert tensor: one expert of a packed target), the pieces'
`TensorInfo` shapes become the cut shapes, and the safetensors handles are wrapped so that every
read returns only the cut region (memory-mapped `get_slice` reads: rows and columns outside the
rank's share are never copied).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from dsv4core.hal import quant

from .errors import CheckpointError

Rule = list[tuple[int, int, int]]


def _spans(rule: Rule, shape: tuple[int, ...]) -> list[list[tuple[int, int]]]:
    """Per dim, the (start, stop) spans a rule keeps (the whole dim when the rule does not cut it)."""
    out: list[list[tuple[int, int]]] = [[(0, n)] for n in shape]
    cut: dict[int, list[tuple[int, int]]] = {}
    for d, a, b in rule:
        cut.setdefault(d, []).append((a, b))
    for d, spans in cut.items():
        out[d] = spans
    return out


def _div(rule: Rule, dims: dict[int, int], full: tuple[int, ...], what: str, label: str, file) -> Rule:
    """Divide the cuts on `dims` (dim -> elements a cell) into cell coordinates; a cut inside a
    cell (except at the end of the weight) is an error."""
    out = []
    for d, a, b in rule:
        k = dims.get(d, 1)
        if k > 1:
            if a % k or (b % k and b != full[d]):
                raise CheckpointError(f"this rank's cut {a}:{b} of dim {d} splits a {k}-element {what}",
                                      tensor=label, file=file)
            a, b = a // k, math.ceil(b / k)
        out.append((d, a, b))
    return out


def stored_rules(rule: Rule, info, scale_info) -> tuple[Rule, Rule | None]:
    """(rule for the stored weight, rule for its scale) from a rule in dequantised coordinates."""
    return tensor_rules(rule, info.torch_dtype, tuple(info.shape), scale_info is not None, info.name, info.file)


def tensor_rules(rule: Rule, dtype: torch.dtype | None, shape: tuple[int, ...], has_scale: bool,
                 label: str = "", file=None) -> tuple[Rule, Rule | None]:
    """`stored_rules` for a weight of `dtype` stored with `shape` (packed FP4: int8 / uint8 with a
    scale, two values a byte in the last dim; FP8: a 128 x 128 block scale; else no scale)."""
    nd = len(shape)
    packed = has_scale and dtype is not None and quant.is_fp4_packed(dtype)
    full = tuple(shape[:-1]) + ((shape[-1] * 2,) if packed else (shape[-1],)) if nd else ()
    w_rule = _div(rule, {nd - 1: 2}, full, "packed FP4 byte", label, file) if packed else list(rule)
    if not has_scale:
        return w_rule, None
    if packed:
        s_rule = _div(rule, {nd - 1: quant.FP4_GROUP}, full, "FP4 scale group", label, file)
    else:
        s_rule = _div(rule, {nd - 2: quant.FP8_BLOCK, nd - 1: quant.FP8_BLOCK}, full, "FP8 scale block", label, file)
    return w_rule, s_rule


def cut_tensor(t: torch.Tensor, rule: Rule) -> torch.Tensor:
    """A new tensor holding the region of `t` that `rule` (stored coordinates) keeps."""
    return CutSlice(t, tuple(t.shape), rule)[:].clone()


def expert_rule(target_rule: Rule, part: str, expert_shape: tuple[int, ...]) -> Rule:
    """The rule of one official per-expert tensor (w1 / w3 `[I, H]`, w2 `[H, I]`) from the rule of
    its packed target (`gate_up_proj [E, 2I, H]`: gate rows 0..I, up rows I..2I; `down_proj
    [E, H, I]`): dim 0 (experts) dropped, the part's row range taken and shifted to 0."""
    out = []
    I = expert_shape[0]
    lo, hi = {"gate": (0, I), "up": (I, 2 * I)}.get(part, (None, None))
    for d, a, b in target_rule:
        if d == 0:
            continue
        if d == 1 and lo is not None:
            if a >= lo and b <= hi:
                out.append((0, a - lo, b - lo))
            continue
        out.append((d - 1, a, b))
    return out


def _cut_shape(shape: tuple[int, ...], rule: Rule) -> tuple[int, ...]:
    return tuple(sum(b - a for a, b in spans) for spans in _spans(rule, shape))


class CutSlice:
    """A safetensors slice seen through a rule: `[:]` / `[r0:r1]` (rows of the cut tensor) read
    only the kept region."""

    def __init__(self, raw, shape: tuple[int, ...], rule: Rule) -> None:
        self.raw, self.shape, self.rule = raw, shape, rule
        self.spans = _spans(rule, shape)
        if len(self.spans[0]) != 1:
            raise ValueError("a cut joins spans of dim 0")  # no rule does (joins are on dim 1)

    def get_shape(self) -> list[int]:
        return list(_cut_shape(self.shape, self.rule))

    def __getitem__(self, key) -> torch.Tensor:
        a0, b0 = self.spans[0][0]
        r = range(a0, b0)[key if isinstance(key, slice) else slice(None)]
        rows = (r.start, r.stop) if len(r) else (a0, a0)

        def read(prefix: list[slice], d: int) -> torch.Tensor:
            if d == len(self.spans):
                return self.raw[tuple(prefix)]
            spans = [rows] if d == 0 else self.spans[d]
            parts = [read(prefix + [slice(a, b)], d + 1) for a, b in spans]
            return parts[0] if len(parts) == 1 else torch.cat(parts, d)

        return read([], 0)


class CutHandle:
    """A safetensors file handle whose reads of the cut tensors return only their regions."""

    def __init__(self, raw, cuts: dict[str, tuple[tuple[int, ...], Rule]]) -> None:
        self.raw, self.cuts = raw, cuts

    def get_slice(self, name: str):
        sl = self.raw.get_slice(name)
        c = self.cuts.get(name)
        return sl if c is None else CutSlice(sl, *c)

    def get_tensor(self, name: str) -> torch.Tensor:
        c = self.cuts.get(name)
        return self.raw.get_tensor(name) if c is None else CutSlice(self.raw.get_slice(name), *c)[:]


def apply(pieces: dict, cut) -> dict:
    """Rewrite the pieces of `Checkpoint._pieces` for `cut`: each cut piece's weight (and scale)
    `TensorInfo` gets the cut shape. Returns {file: {tensor name: (stored shape, stored rule)}}
    for `CutHandle`."""
    by_file: dict = {}

    def record(info, rule):
        by_file.setdefault(info.file, {})[info.name] = (tuple(info.shape), rule)
        return dataclasses.replace(info, shape=_cut_shape(tuple(info.shape), rule))

    for target, ps in pieces.items():
        rule = cut.rule(target)
        if rule is None:
            continue
        full = cut.full_dims(target)
        for pc in ps:
            info = pc.weight
            packed = pc.scale is not None and info.torch_dtype is not None and quant.is_fp4_packed(info.torch_dtype)
            shape = tuple(info.shape[:-1]) + (info.shape[-1] * (2 if packed else 1),)
            if pc.index:                       # one expert of a packed target (official format)
                part = "down" if len(pc.index) == 1 else ("gate" if pc.index[1].start == 0 else "up")
                r = expert_rule(rule, part, shape)
                want = {d - 1: n for d, n in full.items() if d > 0}
                if part in ("gate", "up") and 0 in want:
                    want[0] //= 2
            else:
                r, want = rule, full
            for d, n in want.items():
                if d >= len(shape) or shape[d] != n:
                    raise CheckpointError(f"shape mismatch: checkpoint {list(shape)} cannot be cut for this rank: "
                                          f"dim {d} should be the config's full size {n}", tensor=pc.label,
                                          file=info.file)
            w_rule, s_rule = stored_rules(r, info, pc.scale)
            pc.weight = record(info, w_rule)
            if pc.scale is not None:
                pc.scale = record(pc.scale, s_rule)
    return by_file
