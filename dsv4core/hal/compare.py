"""Error metrics, structural invariants and the discrete comparisons (index sets, routes).

Every comparison is made against the fp64 evaluation of the op's reference math on the same
inputs (float tensors upcast to float64; integer and fp8/e8m0 tensors unchanged). The backend's
error and the reference backend's own error (the reference run in the case dtype) are measured the
same way; the op's :class:`~dsv4core.hal.Tolerance` turns the reference error into a bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

#: Float dtypes upcast to float64 for the fp64 evaluation. fp8 / e8m0 are stored values (exact in
#: fp64 after dequantisation) and stay as they are, like integer tensors.
UPCAST = (torch.float32, torch.bfloat16, torch.float16)

#: Names of the components of ops that return tuples (for readable failure messages).
OUTPUT_NAMES = {"hc_pre": ("y", "post", "comb"), "moe_route": ("weights", "ids")}


def upcast(value: Any) -> Any:
    """fp64 view of one op argument: float tensors -> float64, float dtype arguments -> float64."""
    if isinstance(value, torch.Tensor):
        return value.to(torch.float64) if value.dtype in UPCAST else value
    if isinstance(value, torch.dtype) and value.is_floating_point and value in UPCAST:
        return torch.float64
    return value


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


@dataclass
class Check:
    """One comparison of one output component (or one invariant)."""

    what: str                  # e.g. "y", "comb", "invariant: comb row/col sums"
    metric: str
    err: float                 # the backend's error
    err_ref: float             # the reference backend's error (same inputs, same dtype)
    bound: float
    ok: bool
    detail: str = ""

    @property
    def ratio(self) -> float:
        if self.bound > 0:
            return self.err / self.bound
        return 0.0 if self.err == 0 else math.inf

    def as_dict(self) -> dict:
        return {"what": self.what, "metric": self.metric, "err": _num(self.err), "err_ref": _num(self.err_ref),
                "bound": _num(self.bound), "ratio": _num(self.ratio), "ok": self.ok, "detail": self.detail}


def _num(x: float) -> float | None:
    """A JSON number, or null for a non-finite one (an exact comparison with bound 0 that differs:
    the case's ``failure`` and ``message`` say what differs)."""
    return x if math.isfinite(x) else None


class Mismatch(Exception):
    """A structural failure (type, device, shape, dtype, non-finite values): no error number.
    ``kind`` is the CaseResult failure kind ("structure", "shape", "dtype", "device", "non-finite")."""

    def __init__(self, message: str, kind: str = "structure"):
        super().__init__(message)
        self.kind = kind


@dataclass
class Outputs:
    """An op result split into named tensor components."""

    names: tuple[str, ...]
    tensors: tuple[torch.Tensor, ...] = field(repr=False)


def split_outputs(op: str, out: Any, like: Outputs | None = None) -> Outputs:
    """Name the components of ``out``; with ``like`` (the reference's), require the same structure."""
    if isinstance(out, (tuple, list)):
        comps = tuple(out)
        names = OUTPUT_NAMES.get(op, tuple(f"output[{i}]" for i in range(len(comps))))
        if len(names) != len(comps):
            names = tuple(f"output[{i}]" for i in range(len(comps)))
    else:
        comps, names = (out,), ("output",)
    if like is not None:
        if len(comps) != len(like.tensors) or (len(like.tensors) > 1) != isinstance(out, (tuple, list)):
            raise Mismatch(f"returned {_describe(out)}; expected {_describe_like(like)}")
    for name, t in zip(names, comps):
        if not isinstance(t, torch.Tensor):
            raise Mismatch(f"{name}: returned {type(t).__name__}, expected a torch.Tensor")
    return Outputs(names, comps)


def _describe(out: Any) -> str:
    if isinstance(out, (tuple, list)):
        return f"a {type(out).__name__} of {len(out)}"
    return type(out).__name__


def _describe_like(like: Outputs) -> str:
    return "a tensor" if len(like.tensors) == 1 else f"a tuple of {len(like.tensors)} tensors ({', '.join(like.names)})"


def check_structure(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Device, shape and dtype of a backend output must equal the reference's."""
    if got.device != want.device:
        raise Mismatch(f"{name}: device expected {want.device}, got {got.device}", "device")
    if tuple(got.shape) != tuple(want.shape):
        zero = " (zero-token case: the output must be empty with the right shape)" if want.numel() == 0 else ""
        raise Mismatch(f"{name}: shape expected {tuple(want.shape)}, got {tuple(got.shape)}{zero}", "shape")
    if got.dtype != want.dtype:
        raise Mismatch(f"{name}: dtype expected {dtype_name(want.dtype)}, got {dtype_name(got.dtype)}", "dtype")


def _in_f64(fn, got: torch.Tensor, exact: torch.Tensor):
    """``fn(got, exact)`` on both as float64: on their device when they share one and it computes
    in float64, else on the CPU. The values, and so every max and comparison ``fn`` makes, are the
    same either way; on a GPU the tensors are then not copied to the host for the check."""
    g, e = got.detach(), exact.detach()
    if g.device == e.device and g.device.type != "cpu":
        try:
            return fn(g.to(torch.float64), e.to(torch.float64))
        except (TypeError, RuntimeError):      # a device without float64 (or some of its kernels)
            pass
    return fn(g.cpu().to(torch.float64), e.cpu().to(torch.float64))


def nonfinite_problem(name: str, got: torch.Tensor, exact: torch.Tensor) -> str:
    """'' if ``got`` is non-finite exactly where the fp64 evaluation is (same infs, NaN for NaN)."""
    if not got.is_floating_point():
        return ""
    return _in_f64(partial(_nonfinite, name), got, exact)


def _nonfinite(name: str, g: torch.Tensor, e: torch.Tensor) -> str:
    bad = ~torch.isfinite(g) & torch.isfinite(e)
    if bad.any():
        n_nan = int((torch.isnan(g) & bad).sum())
        first = tuple(int(i) for i in bad.nonzero()[0].tolist())
        return (f"{name}: {int(bad.sum())} non-finite values ({n_nan} NaN) where the fp64 evaluation is finite; "
                f"first at index {first}")
    e_inf = torch.isinf(e)
    if e_inf.any() and not torch.equal(g[e_inf], e[e_inf]):
        return f"{name}: {int((g[e_inf] != e[e_inf]).sum())} entries differ from the fp64 evaluation's +-inf"
    e_nan = torch.isnan(e)
    if e_nan.any() and not torch.isnan(g[e_nan]).all():
        return f"{name}: the fp64 evaluation is NaN at {int(e_nan.sum())} entries and the output is not"
    return ""


def error(metric: str, got: torch.Tensor, exact: torch.Tensor) -> float:
    """``max_abs`` = max |got - exact|; ``max_rel`` = max |got - exact| / max |exact| (finite
    entries; max_abs when every exact entry is 0)."""
    return _in_f64(partial(_error, metric), got, exact)


def _error(metric: str, g: torch.Tensor, e: torch.Tensor) -> float:
    fin = torch.isfinite(e)
    if not fin.any():
        return 0.0
    diff = (g - e)[fin].abs().max().item()
    if metric == "max_abs":
        return diff
    scale = e[fin].abs().max().item()
    return diff / scale if scale > 0 else diff


def output_rounding(metric: str, dtype: torch.dtype, exact: torch.Tensor) -> float:
    """Half an ulp of the output dtype, in the metric's units: no output can be closer to the fp64
    evaluation than one rounding to its own dtype, so this is always allowed on top of the bound
    (2^-8 relative for bfloat16, 2^-24 for float32)."""
    if not dtype.is_floating_point or dtype == torch.float64:
        return 0.0
    half_ulp = 0.5 * torch.finfo(dtype).eps
    if metric == "max_rel":
        return half_ulp
    e = exact.detach().cpu().to(torch.float64)
    fin = e[torch.isfinite(e)]
    return half_ulp * (fin.abs().max().item() if fin.numel() else 0.0)


def _sums_dev(comb: torch.Tensor) -> float:
    if comb.numel() == 0:
        return 0.0

    def dev(c, _):
        return max((c.sum(-1) - 1).abs().max().item(), (c.sum(-2) - 1).abs().max().item())
    return _in_f64(dev, comb, comb)


def _pair_norm_dev(x: torch.Tensor, y: torch.Tensor, d_r: int) -> float:
    if x.numel() == 0 or d_r == 0:
        return 0.0

    def dev(x, y):
        xp = x[..., x.shape[-1] - d_r:].unflatten(-1, (d_r // 2, 2)).norm(dim=-1)
        yp = y[..., y.shape[-1] - d_r:].unflatten(-1, (d_r // 2, 2)).norm(dim=-1)
        scale = xp.abs().max().item()
        return (yp - xp).abs().max().item() / scale if scale > 0 else 0.0
    return _in_f64(dev, x, y)


def invariants(op: str, kwargs: dict, got: Outputs, ref: Outputs, exact: Outputs, k: float, floor: float
               ) -> list[Check]:
    """Structural invariants. Each is a deviation measured on the backend output, the reference
    output (case dtype) and the fp64 evaluation; the backend's EXCESS deviation over the fp64
    evaluation's must be <= k x the reference's + floor.

    * hc_pre: comb rows and columns sum to 1. (After the spec's 20 Sinkhorn sweeps comb is not exactly
      doubly stochastic: at sharp logits rows deviate by percents, so the deviation is judged against
      the fp64 evaluation's, not against 0.)
    * rope: the rotation preserves the norm of each interleaved pair (2i, 2i+1).
    """
    out: list[Check] = []

    def judge(what, f):
        d_b, d_r, d_e = f(got), f(ref), f(exact)
        e_b, e_r = max(0.0, d_b - d_e), abs(d_r - d_e)
        bound = k * e_r + floor
        out.append(Check(what, "excess deviation", e_b, e_r, bound, e_b <= bound,
                         f"deviation {d_b:.3g} vs fp64 evaluation {d_e:.3g}"))

    if op == "hc_pre":
        judge("invariant: comb rows and columns sum to 1", lambda o: _sums_dev(o.tensors[2]))
    if op == "rope":
        d_r = 2 * kwargs["inv_freq"].shape[0]
        judge("invariant: rotation preserves the norm of each interleaved pair (2i, 2i+1)",
              lambda o: _pair_norm_dev(kwargs["x"], o.tensors[0], d_r))
    return out


# ---------------------------------------------------------------------------------------------
# Discrete outputs
# ---------------------------------------------------------------------------------------------

def _topk_suspects(scores: torch.Tensor, lengths: torch.Tensor, got: torch.Tensor, topk: int,
                   tie_tol: float) -> torch.Tensor:
    """The queries ``index_set_check`` must walk (int64 indices, on the inputs' device): every
    query whose set breaks one of its rules is among them (the row walk then decides and words
    it); a query left out satisfies them all. In float64 on the inputs' device (the caller falls
    back to the CPU where it has none). Rows with a NaN score, and every row of a case without
    keys, are walked."""
    dev = scores.device
    sc = scores.detach().to(torch.float64)
    T, N = sc.shape
    if T == 0 or N == 0:
        return torch.arange(T, device=dev)
    g = got.detach().to(dev).long()
    ln = lengths.detach().to(dev).long()
    cols = torch.arange(N, device=dev)[None, :] < ln[:, None]               # the query's valid keys
    picked = g >= 0
    n = picked.sum(1)
    n_min = (torch.isfinite(sc) & cols).sum(1).clamp(max=topk)
    bad = (g < -1).any(1) | (n < n_min) | (n > ln.clamp(max=topk)) | (picked & (g >= ln[:, None])).any(1)
    bad |= (torch.isnan(sc) & cols).any(1)
    srt = g.sort(1).values                                                  # duplicates: equal neighbours
    bad |= ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(1) if g.shape[1] > 1 else torch.zeros_like(bad)
    valid = sc.masked_fill(~cols, float("-inf"))
    kth = valid.sort(1, descending=True).values.gather(1, (n - 1).clamp(0, max(N - 1, 0))[:, None])   # [T, 1]
    chosen = valid.gather(1, g.clamp(0, max(N - 1, 0)))
    has = n > 0
    bad |= has & (picked & (chosen < kth - tie_tol)).any(1)
    mark = torch.zeros((T, N + 1), dtype=torch.bool, device=dev)       # column N: where -1 entries land
    mark.scatter_(1, g.where(picked & (g < N), N), True)
    bad |= has & (cols & (valid > kth + tie_tol) & ~mark[:, :N]).any(1)
    return bad.nonzero().flatten()


def index_set_check(kwargs: dict, got: torch.Tensor, ref: torch.Tensor, tie_tol: float) -> list[Check]:
    """indexer_topk: per query, the backend's indices must be ``min(topk, k_lengths[t])`` distinct
    valid positions (-1 elsewhere) forming a correct top-k set: every pick scores at least the
    k-th largest valid score (minus ``tie_tol``), and every valid entry scoring strictly above it
    (plus ``tie_tol``) is picked. Ties may be broken either way; order is free. Valid entries
    scored -inf may be picked or left as -1."""
    topk = int(kwargs["topk"])
    try:
        suspects = _topk_suspects(kwargs["scores"], kwargs["k_lengths"], got, topk, tie_tol)
    except (TypeError, RuntimeError):       # a device without float64 (or some of its kernels)
        suspects = _topk_suspects(kwargs["scores"].cpu(), kwargs["k_lengths"].cpu(), got.cpu(), topk, tie_tol)
    scores = kwargs["scores"].detach()[suspects].to(torch.float64).cpu()
    lengths = kwargs["k_lengths"].detach()[suspects].cpu().long()
    g = got.detach()[suspects].cpu().long()
    problems: list[str] = []
    bad_rows = 0
    for i, t in enumerate(suspects.cpu().tolist()):
        n_valid = int(lengths[i])
        n_max = min(topk, n_valid)
        # a valid key scored -inf may be picked or left out (-1): ambiguous in the spec, never
        # produced by indexer_scores within k_lengths
        n_min = min(topk, int(torch.isfinite(scores[i, :n_valid]).sum()) if n_valid else 0)
        row = g[i]
        picks = row[row >= 0]
        n = picks.numel()
        why = ""
        if (row < -1).any():
            why = f"values below -1: {row[row < -1][:4].tolist()}"
        elif not n_min <= n <= n_max:
            want = f"{n_max}" if n_min == n_max else f"{n_min}..{n_max}"
            why = f"{n} indices, expected {want} (k_lengths={n_valid}, topk={topk})"
        elif (picks >= lengths[i]).any():
            why = f"index {int(picks[picks >= lengths[i]][0])} outside the query's {int(lengths[i])} valid keys"
        elif picks.unique().numel() != picks.numel():
            why = "duplicate indices"
        elif n:
            valid = scores[i, :int(lengths[i])]
            kth = valid.topk(n).values[-1].item()
            chosen = valid[picks]
            if (chosen < kth - tie_tol).any():
                w = int(picks[chosen < kth - tie_tol][0])
                why = f"picked key {w} (score {valid[w].item():.6g}) below the k-th largest score {kth:.6g}"
            else:
                must = (valid > kth + tie_tol).nonzero().flatten()
                missing = must[~torch.isin(must, picks)]
                if missing.numel():
                    w = int(missing[0])
                    why = f"missed key {w} (score {valid[w].item():.6g} > k-th largest {kth:.6g})"
        if why:
            bad_rows += 1
            if len(problems) < 3:
                problems.append(f"query {t}: {why}")
    T = max(1, got.shape[0])
    frac = bad_rows / T
    detail = "; ".join(problems) + (f" (+{bad_rows - len(problems)} more queries)" if bad_rows > len(problems) else "")
    return [Check("index sets", "index_set: fraction of queries with a wrong top-k set", frac, 0.0, 0.0,
                  bad_rows == 0, detail)]


def _route_keys(kwargs: dict) -> torch.Tensor:
    """fp64 scores sqrt(softplus(logits)) (the caller adds the bias to get the selection keys)."""
    return torch.sqrt(torch.nn.functional.softplus(kwargs["logits"].detach().to(torch.float64).cpu()))


def _route_suspects(key: torch.Tensor, ids: torch.Tensor, topk: int, tie_tol: float,
                    hash_ids: torch.Tensor | None) -> torch.Tensor:
    """The tokens ``route_check`` must walk (int64 indices; ``key`` and ``ids`` on the CPU): every
    token whose ids break one of its rules is among them (the walk decides and words it); a token
    left out satisfies them all. Tokens with a NaN key are always walked."""
    T, E = key.shape
    if T == 0 or ids.shape[0] != T:
        return torch.arange(ids.shape[0])
    inside = (ids >= 0) & (ids < E)
    bad = ~inside.all(1)
    srt = ids.sort(1).values
    if ids.shape[1] > 1:
        bad |= (srt[:, 1:] == srt[:, :-1]).any(1)
    if hash_ids is not None:
        want = hash_ids.detach().cpu().long()
        if want.shape != ids.shape:
            return torch.arange(T)
        bad |= (srt != want.sort(1).values).any(1)
        return bad.nonzero().flatten()
    bad |= torch.isnan(key).any(1)
    kth = key.topk(topk, 1).values[:, -1:]                                 # [T, 1]
    g = ids.clamp(0, E - 1)
    bad |= (key.gather(1, g) < kth - tie_tol).any(1)
    mark = torch.zeros((T, E + 1), dtype=torch.bool)
    mark.scatter_(1, ids.where(inside, E), True)
    bad |= ((key > kth + tie_tol) & ~mark[:, :E]).any(1)
    return bad.nonzero().flatten()


def route_check(kwargs: dict, got: Outputs, ref: Outputs, k: float, floor: float) -> list[Check]:
    """moe_route: ids compared per token as sets (a swap is allowed only between experts whose
    fp64 selection keys are equal within fp32 rounding); weights compared elementwise after
    aligning by expert id, against the fp64 weights of the SAME id set (so a legal tie swap is not
    penalised); bound = k x the reference's error + floor."""
    s = _route_keys(kwargs)
    bias = kwargs.get("correction_bias")
    key = s if bias is None else s + bias.detach().to(torch.float64).cpu()
    scaling = float(kwargs["scaling"])
    hash_ids = kwargs.get("hash_ids")
    topk = int(kwargs["topk"])
    tie_tol = 4 * 2.0 ** -23 * max(1.0, key.abs().max().item() if key.numel() else 1.0)

    def judge(ids_t: torch.Tensor) -> tuple[str, int]:
        ids = ids_t.detach().cpu().long()
        bad, first = 0, ""
        for t in _route_suspects(key, ids, topk, tie_tol, hash_ids).tolist():
            row = ids[t]
            why = ""
            if (row < 0).any() or (row >= key.shape[1]).any():
                why = f"expert id out of range: {row.tolist()}"
            elif row.unique().numel() != row.numel():
                why = f"duplicate expert ids {row.tolist()}"
            elif hash_ids is not None:
                want = hash_ids[t].detach().cpu().long()
                if sorted(row.tolist()) != sorted(want.tolist()):
                    why = f"ids {sorted(row.tolist())} != hash_ids {sorted(want.tolist())}"
            else:
                kth = key[t].topk(topk).values[-1].item()
                chosen = key[t, row]
                if (chosen < kth - tie_tol).any():
                    e = int(row[chosen < kth - tie_tol][0])
                    why = f"picked expert {e} (key {key[t, e].item():.8g}) below the k-th largest key {kth:.8g}"
                else:
                    must = (key[t] > kth + tie_tol).nonzero().flatten()
                    missing = must[~torch.isin(must, row)]
                    if missing.numel():
                        e = int(missing[0])
                        why = f"missed expert {e} (key {key[t, e].item():.8g} > k-th largest {kth:.8g})"
            if why:
                bad += 1
                first = first or f"token {t}: {why}"
        return first, bad

    def weight_err(w: torch.Tensor, ids_t: torch.Tensor) -> float:
        if w.numel() == 0:
            return 0.0
        ids = ids_t.detach().cpu().long()
        sel = s.gather(-1, ids)
        exact = sel / (sel.sum(-1, keepdim=True) + 1e-20) * scaling
        return error("max_rel", w.detach().cpu(), exact)

    first, bad = judge(got.tensors[1])
    checks = [Check("ids", "route: fraction of tokens with a wrong expert set", bad / max(1, s.shape[0]), 0.0, 0.0,
                    bad == 0, first + (f" (+{bad - 1} more tokens)" if bad > 1 else ""))]
    if bad == 0:
        e_b = weight_err(got.tensors[0], got.tensors[1])
        e_r = weight_err(ref.tensors[0], ref.tensors[1])
        bound = k * e_r + floor + output_rounding("max_rel", got.tensors[0].dtype, got.tensors[0])
        checks.append(Check("weights (aligned by expert id)", "max_rel", e_b, e_r, bound, e_b <= bound))
    return checks


# ---------------------------------------------------------------------------------------------
# Judging one call (shared by the conformance runner and the runtime verify mode)
# ---------------------------------------------------------------------------------------------

def device_of(kw: dict) -> str:
    """The device of the first tensor argument ("cpu" when there is none)."""
    for v in kw.values():
        if isinstance(v, torch.Tensor):
            return str(v.device)
    return "cpu"


def _in_fp64(fn, kw: dict, prep=lambda v: v, keep: tuple[str, ...] = ()):
    """``fn(**prepared kw)`` on the inputs' device (the arguments named in ``keep`` as given); on
    the CPU if that device has no float64."""
    def call(args):
        return fn(**{k: v if k in keep else prep(v) for k, v in args.items()})
    try:
        return call(kw)
    except Exception:
        if device_of(kw).startswith("cpu"):
            raise
        return call({k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})


def eval64(spec, kw: dict):
    """The fp64 evaluation of ``spec``'s reference math, on the inputs' device; on the CPU if that
    device has no float64. Arguments the reference converts where it uses them
    (``spec.converts_per_use``) are passed as given: the same values, without a float64 copy of
    the whole tensor."""
    return _in_fp64(spec.reference, kw, upcast, spec.converts_per_use)


def with_copies(spec, kw: dict) -> dict:
    """``kw`` with every argument the op writes in place (``spec.writes``) replaced by a copy of the
    same layout: the whole underlying buffer is copied and viewed with the same strides and
    offset, so a pool that is a strided view of a larger buffer stays one."""
    if not spec.writes:
        return kw
    out = dict(kw)
    for name in spec.writes:
        t = kw[name]
        n = t.untyped_storage().nbytes() // t.element_size()
        flat = torch.as_strided(t, (n,), (1,), 0).clone()
        out[name] = torch.as_strided(flat, t.shape, t.stride(), t.storage_offset())
    return out


def written_values(spec, kw: dict):
    """What the written arguments of an in-place op hold (one tensor, or a tuple)."""
    vals = tuple(kw[n] for n in spec.writes)
    return vals[0] if len(vals) == 1 else vals


def expected_outputs(spec, kw: dict) -> tuple[Outputs, Outputs]:
    """(reference in the case dtype, fp64 evaluation), split. For an op that writes in place the
    reference runs on copies of the written arguments and its output is what they hold after;
    a store has no arithmetic, so the case-dtype reference is also its exact value."""
    if spec.writes:
        copies = with_copies(spec, kw)
        if spec.reference(**copies) is not None:
            raise RuntimeError(f"{spec.name}: the reference returned a value but declares writes={spec.writes}")
        ref = split_outputs(spec.name, written_values(spec, copies))
        return ref, ref
    return split_outputs(spec.name, spec.reference(**kw)), split_outputs(spec.name, eval64(spec, kw))


def _rows_differing(g: torch.Tensor, r: torch.Tensor) -> tuple[int, int]:
    """(how many rows differ bitwise, the index of the first), (0, -1) when none does."""
    gb = g.detach().contiguous().reshape(max(1, g.shape[0] if g.dim() else 1), -1).view(torch.uint8)
    rb = r.detach().contiguous().reshape(max(1, r.shape[0] if r.dim() else 1), -1).view(torch.uint8)
    bad = torch.nonzero((gb != rb).any(1)).flatten()
    return int(bad.numel()), (int(bad[0]) if bad.numel() else -1)


def tolerance_check(name: str, tol, floor: float, got: torch.Tensor, ref: torch.Tensor,
                    exact: torch.Tensor) -> Check:
    """The error bound of a floating output: the backend's ``tol.metric`` error against the fp64
    evaluation ``exact`` may be ``tol.k`` times the reference's, plus ``floor``, plus (when the
    tolerance has a floor) one rounding of the output to its dtype."""
    e_b, e_r = error(tol.metric, got, exact), error(tol.metric, ref, exact)
    bound = tol.k * e_r + floor + (output_rounding(tol.metric, got.dtype, exact) if tol.floor else 0.0)
    return Check(name, tol.metric, e_b, e_r, bound, e_b <= bound)


#: the arguments whose being set makes a call quantised (see Tolerance.quantized_rows)
QUANT_ARGS = ("act_block", "nope_quant_block")


def _quantized_call(spec, kw: dict) -> bool:
    """An op with a quantisation argument, called with it set; or an op that always quantises."""
    args = [a for a in QUANT_ARGS if a in spec.signature.parameters]
    return not args or any(kw.get(a) is not None for a in args)


#: values of one allowed row that may exceed the bound (a boundary crossing moves one value's code)
QUANT_VALUES_PER_ROW = 2


def _rows_rel(got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor):
    """(ref, exact as float64 rows [dim 0, rest], exact's finite mask, the scale max |exact| (1 if
    0), |got - exact| / scale per value: NaN in got stays NaN, never "within")."""
    g, r, e = (t.detach().cpu().to(torch.float64).reshape(max(1, t.shape[0]), -1) for t in (got, ref, exact))
    fin = torch.isfinite(e)
    scale = e[fin].abs().max().item() if fin.any() else 0.0
    scale = scale if scale > 0 else 1.0
    return r, e, fin, scale, torch.where(fin, (g - e).abs(), torch.zeros_like(e)) / scale


def quantized_rows_check(name: str, tol, floor: float, got: torch.Tensor, ref: torch.Tensor,
                         exact: torch.Tensor) -> Check:
    """The bound of ``tolerance_check`` per output row (dim 0; errors in units of the whole
    output's max |exact|). At most ``rows // tol.quantized_rows`` rows may exceed it, and each of
    those only in at most QUANT_VALUES_PER_ROW values, each off by at most ``tol.quantized_step``
    times its row's max |exact| (one step of the format's grid: a value whose code moved to its
    neighbour). A wrong, zeroed or NaN row exceeds it everywhere and fails."""
    if not exact.numel():
        return tolerance_check(name, tol, floor, got, ref, exact)
    r, e, fin, scale, db = _rows_rel(got, ref, exact)
    zero = torch.zeros_like(e)
    er = torch.where(fin, (r - e).abs(), zero).amax(1) / scale
    bound = tol.k * er + floor + (output_rounding("max_rel", got.dtype, exact) if tol.floor else 0.0)
    eb = db.amax(1)
    beyond = ~(db <= bound[:, None])                            # per value
    over = beyond.any(1)
    row_max = torch.where(fin, e.abs(), zero).amax(1) / scale
    step_ok = ~(torch.where(beyond, db, zero) > tol.quantized_step * row_max[:, None]).any(1)
    movable = over & (beyond.sum(1) <= QUANT_VALUES_PER_ROW) & step_ok
    allowed = e.shape[0] // tol.quantized_rows
    n_over, n_bad = int(over.sum()), int((over & ~movable).sum())
    ok = n_bad == 0 and n_over <= allowed
    worst = int((eb / bound.clamp(min=1e-300)).nan_to_num(float("inf")).argmax())
    detail = "" if ok else (f"{n_over} of {e.shape[0]} rows beyond the bound ({n_bad} of them in more than "
                            f"{QUANT_VALUES_PER_ROW} values or by more than one grid step; at most {allowed} rows may "
                            f"differ by a moved code, quantised call); worst row {worst}")
    return Check(name, "max_rel_rows", float(eb[worst]), float(er[worst]), float(bound[worst]), ok, detail)


def _moved_code_allowance(spec, kw: dict):
    """The error a legal computation may add per output value by moving quantised intermediate values
    to neighbouring codes (float64, the output's shape, absolute), or None: for ops whose quantised
    values are computed inside the op from fp32 intermediates (the official expert math:
    ``moe.moved_code_allowance``)."""
    if spec.name != "moe_experts":
        return None
    from .ops.moe import moved_code_allowance

    return _in_fp64(moved_code_allowance, kw)


def moved_codes_check(name: str, tol, floor: float, got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor,
                      allow: torch.Tensor) -> Check:
    """``tolerance_check``'s bound (in units of the whole output's max |exact|), plus per value the
    allowance of its moved codes; every value must be within it."""
    if not exact.numel():
        return tolerance_check(name, tol, floor, got, ref, exact)
    _, e, _, scale, db = _rows_rel(got, ref, exact)
    e_r = error("max_rel", ref, exact)          # relative units throughout, as db
    base = tol.k * e_r + floor + (output_rounding("max_rel", got.dtype, exact) if tol.floor else 0.0)
    bound = base + allow.detach().cpu().to(torch.float64).reshape(e.shape) / scale
    within = db <= bound
    ratio = (db / bound.clamp(min=1e-300)).nan_to_num(float("inf")).reshape(-1)
    worst = int(ratio.argmax())
    ok = bool(within.all())
    moved = int((db > base).sum())
    detail = (f"{moved} of {e.numel()} values within the allowance of moved codes" if ok else
              f"{int((~within).sum())} of {e.numel()} values beyond the bound plus the allowance of moved codes "
              f"(worst: value {worst}, allowance {float(bound.reshape(-1)[worst]) - base:.3g})")
    return Check(name, "max_rel_moved", float(db.reshape(-1)[worst]), e_r, float(bound.reshape(-1)[worst]), ok, detail)


COMPUTE = object()    # judge's ``allowance`` default: compute it here from ``kw``


def judge(spec, kw: dict, raw: Any, ref: Outputs, exact: Outputs, dtype: torch.dtype,
          allowance: Any = COMPUTE) -> list[Check]:
    """The checks of one output ``raw`` of ``spec`` on arguments ``kw`` (by name), given the
    reference's output in the case dtype (``ref``) and the fp64 evaluation (``exact``), both
    split. ``allowance``: the moved-code allowance (``_moved_code_allowance(spec, kw)``, a tensor
    or None) computed elsewhere with the expected outputs; by default computed here. Raises
    :class:`Mismatch` for a structural failure (type, shape, dtype, device, NaN)."""
    tol = spec.tolerance
    floor = tol.floor_for(dtype)
    got = split_outputs(spec.name, raw, like=ref)
    differing = {}      # stores: rows differing bitwise from the reference, per output
    for name, g, r, e in zip(got.names, got.tensors, ref.tensors, exact.tensors):
        check_structure(name, g, r)
        if tol.metric == "bitwise":
            differing[name] = _rows_differing(g, r)
            if e is r and differing[name][0] == 0:
                continue    # bit for bit the fp64 evaluation (a store's): nothing non-finite can differ
        msg = nonfinite_problem(name, g, e)
        if msg:
            raise Mismatch(msg, "non-finite")
    checks: list[Check] = []
    if tol.metric == "bitwise":            # stores: every row of the written pool, bit for bit
        for name, g in zip(got.names, got.tensors):
            n, first = differing[name]
            checks.append(Check(name, "exact", 0.0 if n == 0 else 1.0, 0.0, 0.0, n == 0,
                                "" if n == 0 else f"differs from the reference bitwise in {n} of "
                                f"{g.shape[0] if g.dim() else 1} rows (first: row index {first})"))
        return checks
    if tol.metric == "index_set":
        checks += index_set_check(kw, got.tensors[0], ref.tensors[0], tie_tol=floor)
    elif tol.metric == "route":
        checks += route_check(kw, got, ref, tol.k, floor)
    else:
        for name, g, r, e in zip(got.names, got.tensors, ref.tensors, exact.tensors):
            if not g.is_floating_point():
                ok = torch.equal(g, r)
                checks.append(Check(name, "exact", 0.0 if ok else 1.0, 0.0, 0.0, ok,
                                    "" if ok else "integer output differs from the reference"))
                continue
            if not g.dim():
                allow = None
            else:
                if allowance is COMPUTE:
                    allowance = _moved_code_allowance(spec, kw)
                allow = allowance
            if allow is not None:
                checks.append(moved_codes_check(name, tol, floor, g, r, e, allow))
            elif tol.quantized_rows and g.dim() and _quantized_call(spec, kw):
                checks.append(quantized_rows_check(name, tol, floor, g, r, e))
            else:
                checks.append(tolerance_check(name, tol, floor, g, r, e))
    checks += invariants(spec.name, kw, got, ref, exact, max(tol.k, 2.0), floor)
    return checks


def describe_check(c: Check, k: float, floor: float) -> str:
    """One failed check as a sentence: measured value, bound and how the bound was made."""
    if c.metric.startswith(("index_set", "route", "exact")):
        return f"{c.what}: {c.detail or c.metric}"
    return (f"{c.what}: {c.metric} error {c.err:.3g} > bound {c.bound:.3g} "
            f"(k {k:g} x reference error {c.err_ref:.3g} + floor {floor:g} + output rounding; "
            f"{c.ratio:.3g}x the bound)"
            + (f" [{c.detail}]" if c.detail else ""))
