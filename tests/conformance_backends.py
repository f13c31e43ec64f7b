"""Backends for the conformance suite's own tests.

* :func:`make_alt_backend` — a LEGAL pure-torch CPU backend whose ops are computed differently from
  the reference (chunked / split-K accumulation, online softmax, other formulations). It must pass.
* :data:`BROKEN` — each entry replaces ONE op of the alt backend with a subtly wrong version; the
  suite must fail exactly that op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4core.hal import Backend, catalogue
from dsv4core.hal.ops.mhc import sinkhorn
from dsv4core.hal.ops.projections import dequant_block_fp8
from dsv4core.hal.quant import act_quant, fake_quant

CHUNK = 48  # deliberately not a power of two: other summation order than torch's kernels


def _ct(t):
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _chunked_sum(x: torch.Tensor, dim: int = -1, chunk: int = CHUNK) -> torch.Tensor:
    """Sum along ``dim`` chunk by chunk, sequentially (a different order from torch.sum)."""
    parts = torch.split(x, chunk, dim=dim)
    acc = parts[0].sum(dim, keepdim=True)
    for p in parts[1:]:
        acc = acc + p.sum(dim, keepdim=True)
    return acc.squeeze(dim)


def _splitk_matmul(a: torch.Tensor, b_t: torch.Tensor, chunk: int = 3 * CHUNK) -> torch.Tensor:
    """a [..., K] @ b_t[N, K]^T accumulated over K chunks (split-K)."""
    K = a.shape[-1]
    out = None
    for s in range(0, max(K, 1), chunk):
        part = a[..., s:s + chunk] @ b_t[:, s:s + chunk].T
        out = part if out is None else out + part
    return out


def _rms(xf, weight, eps):
    ms = _chunked_sum(xf * xf, -1) / xf.shape[-1]
    y = xf / torch.sqrt(ms + eps)[..., None]
    return y if weight is None else y * weight.to(xf.dtype)


def rms_norm(x, weight, eps):
    return _rms(x.to(_ct(x)), weight, eps).to(x.dtype)


def _mix(x, fn, rms_eps, mm=None):
    ct = _ct(x)
    xf = x.flatten(1).to(ct)
    rho = 1.0 / torch.sqrt(_chunked_sum(xf * xf, -1) / xf.shape[-1] + rms_eps)
    z = (mm or _splitk_matmul)(xf, fn.to(ct))
    return z * rho[:, None]


def _collapse(x, pre):
    acc = pre[:, 0, None] * x[:, 0].to(pre.dtype)
    for j in range(1, x.shape[1]):
        acc = acc + pre[:, j, None] * x[:, j].to(pre.dtype)
    return acc.to(x.dtype)


def hc_pre(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
    T, n, _ = x.shape
    z = _mix(x, fn, rms_eps)
    s, b = scale.to(z.dtype), base.to(z.dtype)
    pre = 1.0 / (1.0 + torch.exp(-(s[0] * z[:, :n] + b[:n]))) + hc_eps
    post = post_mult / (1.0 + torch.exp(-(s[1] * z[:, n:2 * n] + b[n:2 * n])))
    comb = sinkhorn((s[2] * z[:, 2 * n:] + b[2 * n:]).view(T, n, n), hc_eps, iters)
    return _collapse(x, pre), post, comb


def hc_post(o, residual, post, comb):
    ct = torch.promote_types(post.dtype, _ct(residual))
    r, c = residual.to(ct), comb.to(ct)
    out = post.to(ct)[:, :, None] * o.to(ct)[:, None, :]
    for j in range(residual.shape[1]):
        out = out + c[:, j, :, None] * r[:, j, None, :]
    return out.to(residual.dtype)


def hc_head(x, fn, scale, base, rms_eps, hc_eps):
    z = _mix(x, fn, rms_eps)
    pre = torch.sigmoid(scale.to(z.dtype)[0] * z + base.to(z.dtype)) + hc_eps
    return _collapse(x, pre)


def _rotate_complex(xf, positions, inv_freq, inverse):
    """Rotation as a complex multiplication (a different formulation from the reference's)."""
    d_r = 2 * inv_freq.shape[0]
    angle = (positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]).to(xf.dtype)
    if inverse:
        angle = -angle
    angle = angle.view(angle.shape[0], *([1] * (xf.dim() - 2)), angle.shape[1])
    tail = xf[..., xf.shape[-1] - d_r:].contiguous()
    z = torch.view_as_complex(tail.unflatten(-1, (d_r // 2, 2)))
    rot = torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2)
    return torch.cat((xf[..., :xf.shape[-1] - d_r], rot), -1)


def rope(x, positions, inv_freq, inverse=False):
    return _rotate_complex(x.to(_ct(x)), positions, inv_freq, inverse).to(x.dtype)


def q_norm_rope(q, positions, inv_freq, eps):
    return _rotate_complex(_rms(q.to(_ct(q)), None, eps), positions, inv_freq, False).to(q.dtype)


def kv_norm_rope(kv, weight, positions, inv_freq, eps, nope_quant_block=None):
    return _kv_norm_rope(kv, weight, positions, inv_freq, eps, nope_quant_block)


def _kv_norm_rope(kv, weight, positions, inv_freq, eps, nope_quant_block=None, quant_rope=False):
    ct = _ct(kv)
    y = _rms(kv.to(ct), weight, eps)
    if nope_quant_block is None:
        return _rotate_complex(y, positions, inv_freq, False).to(kv.dtype)
    y = _rotate_complex(y.to(torch.bfloat16).to(ct), positions, inv_freq, False).to(torch.bfloat16)
    nope = y.shape[-1] if quant_rope else y.shape[-1] - 2 * inv_freq.shape[0]
    y = y.clone()
    y[:, :nope] = fake_quant(y[:, :nope], "fp8", nope_quant_block)
    return y.to(kv.dtype)


def _fwht(x):
    """Sylvester Hadamard by butterflies (the reference multiplies by the matrix), unscaled."""
    d = x.shape[-1]
    h = 1
    y = x.clone()
    while h < d:
        y = y.unflatten(-1, (d // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), -2).flatten(-3)
        h *= 2
    return y


def indexer_rotate_quant(x):
    return _indexer_rotate_quant(x)


def _indexer_rotate_quant(x, scaled=True, order=None, fp4_scale=None):
    y = _fwht(x.to(_ct(x)))
    if order is not None:
        y = y[..., order(x.shape[-1])]
    if scaled:
        y = y * x.shape[-1] ** -0.5
    y = y.to(torch.bfloat16)
    if fp4_scale is None:
        return fake_quant(y, "fp4", 32).to(x.dtype)
    g = y.float().unflatten(-1, (-1, 32))
    s = fp4_scale(g.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0 ** -126))
    v = (g / s).clamp(-6, 6)
    a = v.abs()
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    q = torch.copysign(torch.round(a / step) * step, v)
    return (q * s).flatten(-2).to(x.dtype)


def _attention(q, kv, indices, sink, scale, use_sink=True):
    """Online softmax over chunks of the row list (flash-attention style)."""
    T, h, d = q.shape
    ct = _ct(q)
    qf = q.to(ct)
    m = sink.to(ct)[None, :].expand(T, h).clone() if use_sink else torch.full((T, h), float("-inf"), dtype=ct)
    l = torch.ones((T, h), dtype=ct) if use_sink else torch.zeros((T, h), dtype=ct)
    acc = torch.zeros((T, h, d), dtype=ct)
    idx_all = indices.long()
    for s in range(0, indices.shape[1], 5):
        idx = idx_all[:, s:s + 5]
        valid = idx >= 0
        rows = kv[idx.clamp_min(0)].to(ct)
        lg = torch.einsum("thd,tkd->thk", qf, rows) * scale
        lg = lg.masked_fill(~valid[:, None, :], float("-inf"))
        m_new = torch.maximum(m, lg.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - m_safe)
        p = torch.exp(lg - m_safe[..., None])
        l = l * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("thk,tkd->thd", p, rows)
        m = m_new
    out = torch.where(l[..., None] > 0, acc / l.clamp_min(1e-38)[..., None], torch.zeros_like(acc))
    return out.to(q.dtype)


# ---- the stored row formats, computed another way than dsv4core.hal.rowformats: float64 scales
# from frexp, per-element decoding (the format is SPEC.md section 0.2)
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _pow2_ceil_scale(amax: torch.Tensor, qmax: float, lo: float, floor: bool = False) -> torch.Tensor:
    """2^ceil(log2(fl32(max(amax, lo) * fl32(1/qmax)))) in float64 (frexp: v = m 2^e, m in [0.5, 1))."""
    v = (amax.float().clamp(min=lo) * torch.tensor(1.0 / qmax, dtype=torch.float32)).double()
    m, e = torch.frexp(v)
    k = e - 1 if floor else torch.where(m == 0.5, e - 1, e)      # floor: the mutant's floor(log2 v)
    return torch.ldexp(torch.ones_like(v), k)


def _decode_fp8_rows(b: torch.Tensor, d: int, use_scales: bool = True) -> torch.Tensor:
    n = d - 64
    q = b[..., :n].contiguous().view(torch.float8_e4m3fn).double()
    s = torch.ldexp(torch.ones(b.shape[:-1] + (n // 64,), dtype=torch.float64),
                    b[..., n + 128:n + 128 + n // 64].long() - 127)
    nope = q * (s.repeat_interleave(64, -1) if use_scales else 1.0)
    rope = b[..., n:n + 128].contiguous().view(torch.bfloat16).double()
    return torch.cat((nope, rope), -1)


def _decode_fp4_keys(b: torch.Tensor, d: int, high_first: bool = False) -> torch.Tensor:
    table = torch.tensor(_E2M1 + tuple(-v for v in _E2M1), dtype=torch.float64)
    lo, hi = (b[..., :d // 2] & 0xF).long(), (b[..., :d // 2] >> 4).long()
    if high_first:
        lo, hi = hi, lo
    v = torch.stack((table[lo], table[hi]), -1).flatten(-2)
    s = torch.ldexp(torch.ones(b.shape[:-1] + (d // 32,), dtype=torch.float64), b[..., d // 2:].long() - 127)
    return v * s.repeat_interleave(32, -1)


def _encode_fp8_rows(rows: torch.Tensor, floor: bool = False) -> torch.Tensor:
    E, d = rows.shape
    n = d - 64
    x = rows.float().double()
    g = x[:, :n].reshape(E, n // 64, 64)
    s = _pow2_ceil_scale(g.abs().amax(-1), 448.0, 1e-4, floor)
    q = (g / s[..., None]).clamp(-448, 448).float().to(torch.float8_e4m3fn).reshape(E, n).view(torch.uint8)
    rope = rows[:, n:].to(torch.bfloat16).contiguous().view(torch.uint8)
    sb = (torch.frexp(s)[1] - 1 + 127).to(torch.uint8)
    pad = torch.zeros(E, -(-(n // 64) // 8) * 8 - n // 64, dtype=torch.uint8)
    return torch.cat((q, rope, sb, pad), 1)


def _encode_fp4_keys(rows: torch.Tensor) -> torch.Tensor:
    E, d = rows.shape
    g = rows.float().double().reshape(E, d // 32, 32)
    s = _pow2_ceil_scale(g.abs().amax(-1), 6.0, 6.0 * 2.0 ** -126)
    v = (g / s[..., None]).clamp(-6, 6).reshape(E, d)
    grid = torch.tensor(_E2M1, dtype=torch.float64)
    dist = (v.abs()[..., None] - grid).abs()
    best = dist.min(-1, keepdim=True).values
    cand = (dist == best)                                 # a tie takes the even code
    even = cand & (torch.arange(8) % 2 == 0)
    idx = torch.where(cand.sum(-1) > 1, even.int().argmax(-1), cand.int().argmax(-1))
    codes = (idx | (torch.signbit(v).long() << 3)).to(torch.uint8)
    sb = (torch.frexp(s)[1] - 1 + 127).to(torch.uint8)
    return torch.cat((codes[:, 0::2] | (codes[:, 1::2] << 4), sb), 1)


def _rows_of(t, paged):
    """A paged pool (HAL 1.4, [B, J, W]) as its [B * J, W] rows (a copy; row r = t[r // J, r % J])."""
    return t.reshape(-1, t.shape[-1]) if paged else t


def sparse_mqa_attention(q, kv, indices, sink, scale, kv_format=None, kv_paged=False):
    kv = _rows_of(kv, kv_paged)
    if kv_format == "fp8":
        kv = _decode_fp8_rows(kv, q.shape[-1]).to(q.dtype)
    return _attention(q, kv, indices, sink, scale)


def compress_pool(kv, score, ape, overlap, prev_kv=None, prev_score=None):
    ct = _ct(kv)
    Wn, m, cd = kv.shape
    if not overlap:
        s = score.to(ct) + ape.to(ct)
        mx = s.amax(1, keepdim=True)
        e = torch.exp(s - mx)
        return ((e * kv.to(ct)).sum(1) / e.sum(1)).to(kv.dtype)
    dp = cd // 2
    out = torch.empty((Wn, dp), dtype=ct)
    for w in range(Wn):
        if w == 0:
            if prev_kv is None:
                a_kv, a_s = None, None
            else:
                a_kv, a_s = prev_kv.to(ct), prev_score.to(ct) + ape.to(ct)[:, :dp]
        else:
            a_kv, a_s = kv[w - 1, :, :dp].to(ct), score[w - 1, :, :dp].to(ct) + ape.to(ct)[:, :dp]
        b_kv, b_s = kv[w, :, dp:].to(ct), score[w, :, dp:].to(ct) + ape.to(ct)[:, dp:]
        if a_kv is None:
            vals, sc = b_kv, b_s
        else:
            vals, sc = torch.cat((a_kv, b_kv)), torch.cat((a_s, b_s))
        wts = torch.softmax(sc, 0)
        out[w] = (wts * vals).sum(0)
    return out.to(kv.dtype)


def indexer_scores(q, k, weights, k_offsets, k_lengths, scale):
    T = q.shape[0]
    L = int(k_lengths.max()) if T else 0
    ct = _ct(q)
    out = torch.full((T, L), float("-inf"), dtype=torch.promote_types(ct, torch.float32))
    for t in range(T):
        n = int(k_lengths[t])
        if n == 0:
            continue
        keys = k[int(k_offsets[t]):int(k_offsets[t]) + n].to(ct)
        acc = torch.zeros(n, dtype=ct)
        for hh in range(q.shape[1]):          # heads one at a time: another summation order
            acc = acc + weights[t, hh].to(ct) * torch.relu(keys @ q[t, hh].to(ct))
        out[t, :n] = acc * scale
    return out


def compress_windows(kv, score, overlap):
    """Per entry, per channel: an online (running max) softmax over the slots, one at a time."""
    ct = _ct(kv)
    E, S, cd = kv.shape
    dp = cd // 2 if overlap else cd
    out = torch.zeros((E, dp), dtype=ct)
    for e in range(E):
        mx = torch.full((dp,), float("-inf"), dtype=ct)
        num, den = torch.zeros(dp, dtype=ct), torch.zeros(dp, dtype=ct)
        for j in range(S):
            half = slice(0, dp) if (overlap and j < S // 2) else slice(cd - dp, cd)
            s_j, v_j = score[e, j, half].to(ct), kv[e, j, half].to(ct)
            new = torch.maximum(mx, s_j)
            fin = torch.isfinite(new)
            scale = torch.where(fin, torch.exp(torch.where(fin, mx - new, 0)), 1)
            w = torch.where(fin, torch.exp(torch.where(fin, s_j - new, 0)), 0)
            num, den, mx = num * scale + w * v_j, den * scale + w, new
        out[e] = torch.where(den > 0, num / torch.where(den > 0, den, 1), 0)
    return out


def indexer_scores_rows(q, k, weights, rows, scale, k_format=None, k_paged=False):
    k = _rows_of(k, k_paged)
    if k_format == "fp4":
        k = _decode_fp4_keys(k, q.shape[-1]).to(q.dtype)
    T, L = rows.shape
    ct = _ct(q)
    out = torch.full((T, L), float("-inf"), dtype=torch.promote_types(ct, torch.float32))
    for t in range(T):
        for w in range(L):
            r = int(rows[t, w])
            if r < 0:
                continue
            acc = torch.zeros((), dtype=ct)
            for hh in range(q.shape[1]):
                acc = acc + weights[t, hh].to(ct) * torch.relu(q[t, hh].to(ct) @ k[r].to(ct))
            out[t, w] = acc * scale
    return out


def cache_store(pool, index, rows, row_format=None, paged=False):
    if row_format is not None:
        rows = (_encode_fp8_rows if row_format == "fp8" else _encode_fp4_keys)(rows)
    for i in range(index.shape[0]):            # one row at a time
        r = int(index[i])
        if r >= 0:
            dst = pool[r // pool.shape[1], r % pool.shape[1]] if paged else pool[r]
            dst.copy_(rows[i].to(pool.dtype))


def _topk(scores, k_lengths, topk, off_by_one=False):
    """Sort-based top-k (stable descending sort) instead of torch.topk."""
    T, L = scores.shape
    out = torch.full((T, topk), -1, dtype=torch.int32)
    for t in range(T):
        n_valid = int(k_lengths[t]) + (1 if off_by_one else 0)
        n_valid = min(n_valid, L)
        order = torch.sort(scores[t, :n_valid], descending=True, stable=True).indices[:topk]
        out[t, :order.numel()] = order.to(torch.int32)
    return out


def indexer_topk(scores, k_lengths, topk):
    return _topk(scores, k_lengths, topk)


def _w8a8(x, w, act_block, scale=None):
    """x quantised per act_block columns (codes and scales, then a K-blocked GEMM applying each
    block's activation scale to its partial product: the FP8 x FP8 GEMM formulation)."""
    ct = _ct(x)
    if scale is None:
        q, s = act_quant(x.reshape(-1, x.shape[-1]), act_block)
    else:
        q, s = scale(x.reshape(-1, x.shape[-1]).to(torch.float32), act_block)
    out = 0
    for b in range(s.shape[-1]):
        cols = slice(b * act_block, (b + 1) * act_block)
        out = out + (q[:, cols].to(ct) @ w[:, cols].T) * s[:, b:b + 1].to(ct)
    return out.reshape(*x.shape[:-1], w.shape[0])


def linear(x, weight, weight_scale=None, out_dtype=None, act_block=None):
    return _linear(x, weight, weight_scale, out_dtype, act_block)


def _linear(x, weight, weight_scale=None, out_dtype=None, act_block=None, _scale=None):
    ct = _ct(x)
    w = weight.to(ct) if weight_scale is None else dequant_block_fp8(weight, weight_scale, ct)
    if act_block is not None:
        return _w8a8(x, w, act_block, _scale).to(out_dtype or x.dtype)
    return _splitk_matmul(x.to(ct), w).to(out_dtype or x.dtype)


def wo_a(o, weight, weight_scale=None):
    ct = _ct(o)
    w = weight.to(ct) if weight_scale is None else dequant_block_fp8(weight, weight_scale, ct)
    outs = [_splitk_matmul(o[:, g].to(ct), w[g]) for g in range(o.shape[1])]
    return torch.stack(outs, 1).to(o.dtype) if outs else torch.empty((o.shape[0], 0, w.shape[1]), dtype=o.dtype)


def moe_route(logits, topk, scaling, correction_bias=None, hash_ids=None):
    s = torch.sqrt(torch.log1p(torch.exp(-logits.abs().to(_ct(logits)))) + logits.clamp_min(0).to(_ct(logits)))
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        key = s if correction_bias is None else s + correction_bias.to(s.dtype)
        ids = torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :topk]
    w = s.gather(-1, ids)
    return w / (w.sum(-1, keepdim=True) + 1e-20) * scaling, ids.to(torch.int32)


def _swiglu(gu, limit, clamp=True):
    g, u = gu.chunk(2, -1)
    if clamp:
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
    return g * torch.sigmoid(g) * u


def _dequant_experts(w, scale, ct, fp4_high_first=False):
    """Whole-tensor dequantisation through the checkpoint formats module (the reference dequantises
    per expert in its own code); ``fp4_high_first`` is the broken variant's nibble order."""
    if scale is None:
        return w
    from dsv4core.hal import quant

    if fp4_high_first and quant.is_fp4_packed(w.dtype):
        u = w.view(torch.uint8)
        w = ((u >> 4) | (u << 4)).view(w.dtype)
    return quant.dequantize(w, scale, torch.float64 if ct == torch.float64 else torch.float32)


def _experts(x, ids, weights, w13, w2, swiglu_limit, clamp=True, w13_scale=None, w2_scale=None,
             fp4_high_first=False, act_block=None, weight_after_w2=False, scale=None):
    """Slot-major (the reference is expert-major with index_add), split-K GEMMs, per-slot partial
    sums added in slot order; the official math (act_block) through the K-blocked W8A8 GEMM."""
    ct = _ct(x)
    w13 = _dequant_experts(w13, w13_scale, ct, fp4_high_first)
    w2 = _dequant_experts(w2, w2_scale, ct, fp4_high_first)
    out = torch.zeros(x.shape, dtype=ct)
    xf = x.to(ct)
    for i in range(ids.shape[1]):
        part = torch.zeros(x.shape, dtype=ct)
        for e in torch.unique(ids[:, i][ids[:, i] >= 0]).tolist():
            tok = (ids[:, i] == e).nonzero().flatten()
            wt = weights[tok, i].to(ct)[:, None]
            if act_block is None:
                h = _swiglu(_splitk_matmul(xf[tok], w13[e].to(ct)), swiglu_limit, clamp)
                part[tok] = _splitk_matmul(h, w2[e].to(ct)) * wt
                continue
            gu = _w8a8(x[tok], w13[e].to(ct), act_block, scale).to(torch.bfloat16).to(ct)
            h = _swiglu(gu, swiglu_limit, clamp)
            h = (h if weight_after_w2 else h * wt).to(torch.bfloat16)
            y = _w8a8(h, w2[e].to(ct), act_block, scale)
            part[tok] = y * wt if weight_after_w2 else y
        out = out + part
    return out.to(x.dtype)


def moe_experts(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None, act_block=None):
    return _experts(x, ids, weights, w13, w2, swiglu_limit, w13_scale=w13_scale, w2_scale=w2_scale,
                    act_block=act_block)


def _gather_padded(x, dim, group, sizes):
    """Every rank's ``x`` (extents ``sizes`` along ``dim``; None = equal), through one broadcast per
    source rank (not torch's all_gather: another transport pattern)."""
    import torch.distributed as dist

    from dsv4core.hal.ops.collectives import rank_in, world_size

    ws, me = world_size(group), rank_in(group)
    sizes = sizes if sizes is not None else [x.shape[dim]] * ws
    pad = list(x.shape)
    pad[dim] = max(sizes) if sizes else 0
    parts = []
    for src in range(ws):
        buf = x.new_zeros(pad)
        if src == me:
            buf.narrow(dim, 0, x.shape[dim]).copy_(x)
        dist.broadcast(buf, dist.get_global_rank(group, src) if group is not None else src, group=group)
        parts.append(buf.narrow(dim, 0, sizes[src]))
    return parts


def all_reduce(x, group=None):
    from dsv4core.hal.ops.collectives import world_size

    if world_size(group) == 1:
        return x.clone()
    parts = _gather_padded(x, 0, group, None)
    acc = parts[0].to(torch.float32)
    for p in parts[1:]:                         # fp32 sum in rank order, one rounding to x.dtype
        acc = acc + p.to(torch.float32)
    return acc.to(x.dtype)


def all_gather(x, dim=0, group=None, sizes=None):
    from dsv4core.hal.ops.collectives import world_size

    if world_size(group) == 1:
        return torch.cat([x], dim=dim)
    return torch.cat(_gather_padded(x, dim, group, sizes), dim=dim)


def reduce_scatter(x, dim=0, group=None, sizes=None):
    from dsv4core.hal.ops.collectives import rank_in, world_size

    ws = world_size(group)
    if ws == 1:
        return x.clone()
    sizes = sizes if sizes is not None else [x.shape[dim] // ws] * ws
    me = rank_in(group)
    return all_reduce(x, group).narrow(dim, sum(sizes[:me]), sizes[me]).contiguous()


def all_to_all(x, output_split_sizes=None, input_split_sizes=None, group=None):
    from dsv4core.hal.ops.collectives import rank_in, world_size

    ws = world_size(group)
    if ws == 1:
        return x.clone()
    me = rank_in(group)
    ins = input_split_sizes if input_split_sizes is not None else [x.shape[0] // ws] * ws
    all_ins = _gather_padded(torch.tensor(ins, dtype=torch.int64), 0, group, None)
    rows = [int(t.sum()) for t in all_ins]
    everyone = _gather_padded(x, 0, group, rows)
    out = [everyone[s].narrow(0, int(all_ins[s][:me].sum()), int(all_ins[s][me])) for s in range(ws)]
    return torch.cat(out, 0)


ALT_IMPLS = {name: globals()[name] for name in catalogue()}


def make_backend(name: str, impls: dict, supports: dict | None = None) -> Backend:
    b = Backend(name=name, version="test", device_types=("cpu",), priority=10)
    for op, fn in impls.items():
        b.add(op, fn, supports=(supports or {}).get(op))
    return b


def make_alt_backend(name: str = "alt") -> Backend:
    return make_backend(name, ALT_IMPLS)


# ---------------------------------------------------------------------------------------------
# Deliberately broken ops (each wrong in one subtle way)
# ---------------------------------------------------------------------------------------------

def hc_pre_sinkhorn_short(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
    return hc_pre(x, fn, scale, base, rms_eps, hc_eps, iters - 1, post_mult)


def hc_pre_bf16_accum(x, fn, scale, base, rms_eps, hc_eps, iters, post_mult=2.0):
    """The mixes GEMM in bfloat16 (inputs rounded to bf16, bf16 result) instead of fp32."""
    T, n, _ = x.shape
    ct = _ct(x)
    xf = x.flatten(1).to(ct)
    rho = 1.0 / torch.sqrt((xf * xf).mean(-1) + rms_eps)
    z = (xf.to(torch.bfloat16) @ fn.to(torch.bfloat16).T).to(ct) * rho[:, None]
    s, b = scale.to(ct), base.to(ct)
    pre = torch.sigmoid(s[0] * z[:, :n] + b[:n]) + hc_eps
    post = post_mult * torch.sigmoid(s[1] * z[:, n:2 * n] + b[n:2 * n])
    comb = sinkhorn((s[2] * z[:, 2 * n:] + b[2 * n:]).view(T, n, n), hc_eps, iters)
    return _collapse(x, pre), post, comb


def hc_post_comb_transposed(o, residual, post, comb):
    return hc_post(o, residual, post, comb.transpose(1, 2))


def rope_neox(x, positions, inv_freq, inverse=False):
    """Rotates (i, i + d_r/2) pairs (NeoX / rotate-half) instead of interleaved (2i, 2i+1)."""
    xf = x.to(_ct(x))
    d_r = 2 * inv_freq.shape[0]
    angle = (positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]).to(xf.dtype)
    angle = angle.view(angle.shape[0], *([1] * (xf.dim() - 2)), angle.shape[1])
    cos, sin = angle.cos(), angle.sin() * (-1 if inverse else 1)
    tail = xf[..., xf.shape[-1] - d_r:]
    a, b = tail[..., :d_r // 2], tail[..., d_r // 2:]
    rot = torch.cat((a * cos - b * sin, a * sin + b * cos), -1)
    return torch.cat((xf[..., :xf.shape[-1] - d_r], rot), -1).to(x.dtype)


def attention_no_sink(q, kv, indices, sink, scale, kv_format=None, kv_paged=False):
    kv = _rows_of(kv, kv_paged)
    kv = _decode_fp8_rows(kv, q.shape[-1]).to(q.dtype) if kv_format == "fp8" else kv
    return _attention(q, kv, indices, sink, scale, use_sink=False)


def attention_sink_scaled(q, kv, indices, sink, scale, kv_format=None, kv_paged=False):
    kv = _rows_of(kv, kv_paged)
    kv = _decode_fp8_rows(kv, q.shape[-1]).to(q.dtype) if kv_format == "fp8" else kv
    """Multiplies the sink by the softmax scale (the spec's sink is a raw logit)."""
    return _attention(q, kv, indices, sink * scale, scale)


def attention_scale_ignored(q, kv, indices, sink, scale, kv_format=None, kv_paged=False):
    kv = _rows_of(kv, kv_paged)
    kv = _decode_fp8_rows(kv, q.shape[-1]).to(q.dtype) if kv_format == "fp8" else kv
    """Hard-codes the model's softmax scale d^-0.5 (found by an outside test: every case used to pass
    exactly that value)."""
    return _attention(q, kv, indices, sink, q.shape[-1] ** -0.5)


def linear_fp8_scale_per_row(x, weight, weight_scale=None, out_dtype=None, act_block=None):
    """Applies each row of blocks' FIRST scale to the whole row (found by an outside test: every
    linear case used to have one scale value for all blocks)."""
    if weight_scale is not None:
        weight_scale = weight_scale[:, :1].expand_as(weight_scale)
    return linear(x, weight, weight_scale, out_dtype, act_block)


def compress_pool_ape_halves_swapped(kv, score, ape, overlap, prev_kv=None, prev_score=None):
    """CSA: the A slots get ape's B half and the B slots its A half."""
    if overlap:
        dp = ape.shape[1] // 2
        ape = torch.cat((ape[:, dp:], ape[:, :dp]), 1)
    return compress_pool(kv, score, ape, overlap, prev_kv, prev_score)


def _route(logits, topk, scaling, correction_bias, hash_ids, bias_in_weights=False, renorm_eps=1e-20):
    s = torch.sqrt(F.softplus(logits.to(_ct(logits))))
    key = s if correction_bias is None else s + correction_bias.to(s.dtype)
    ids = hash_ids.long() if hash_ids is not None else key.topk(topk, dim=-1).indices
    w = (key if bias_in_weights else s).gather(-1, ids)
    return w / (w.sum(-1, keepdim=True) + renorm_eps) * scaling, ids.to(torch.int32)


def moe_route_bias_in_weights(logits, topk, scaling, correction_bias=None, hash_ids=None):
    return _route(logits, topk, scaling, correction_bias, hash_ids, bias_in_weights=True)


def moe_route_no_renorm_eps(logits, topk, scaling, correction_bias=None, hash_ids=None):
    return _route(logits, topk, scaling, correction_bias, hash_ids, renorm_eps=0.0)


def indexer_topk_off_by_one(scores, k_lengths, topk):
    return _topk(scores, k_lengths, topk, off_by_one=True)


def compress_windows_prev_b_half(kv, score, overlap):
    """Takes the B halves of the previous window too (the overlap halves mixed up)."""
    if not overlap:
        return compress_windows(kv, score, overlap)
    dp = kv.shape[2] // 2
    kv2, sc2 = kv.clone(), score.clone()
    kv2[:, :kv.shape[1] // 2, :dp] = kv[:, :kv.shape[1] // 2, dp:]
    sc2[:, :kv.shape[1] // 2, :dp] = score[:, :kv.shape[1] // 2, dp:]
    return compress_windows(kv2, sc2, overlap)


def indexer_scores_rows_no_relu(q, k, weights, rows, scale, k_format=None, k_paged=False):
    k = _rows_of(k, k_paged)
    k = _decode_fp4_keys(k, q.shape[-1]).to(q.dtype) if k_format == "fp4" else k
    r = rows.long()
    keys = k[r.clamp_min(0)].to(_ct(q))
    sc = torch.einsum("th,thl->tl", weights.to(_ct(q)), torch.einsum("thd,tld->thl", q.to(_ct(q)), keys)) * scale
    return sc.masked_fill(r < 0, float("-inf")).to(torch.promote_types(_ct(q), torch.float32))


def cache_store_skips_to_row0(pool, index, rows, row_format=None, paged=False):
    """Sends the -1 rows to row 0 (a null-row convention the spec does not allow)."""
    if row_format is not None:
        rows = (_encode_fp8_rows if row_format == "fp8" else _encode_fp4_keys)(rows)
    r = index.long().clamp_min(0)
    if paged:
        pool.index_put_((r // pool.shape[1], r % pool.shape[1]), rows.to(pool.dtype))
    else:
        pool.index_copy_(0, r, rows.to(pool.dtype))


def attention_paged_at_row_stride(q, kv, indices, sink, scale, kv_format=None, kv_paged=False):
    """Reads a paged pool's row r at r * row stride (the block stride ignored)."""
    if kv_paged:
        kv = torch.as_strided(kv, (kv.shape[0] * kv.shape[1], kv.shape[2]), (kv.stride(1), 1), kv.storage_offset())
    return sparse_mqa_attention(q, kv, indices, sink, scale, kv_format)


def moe_experts_no_clamp(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None, act_block=None):
    return _experts(x, ids, weights, w13, w2, swiglu_limit, clamp=False, w13_scale=w13_scale, w2_scale=w2_scale,
                    act_block=act_block)


def moe_experts_fp4_high_nibble_first(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None,
                                      act_block=None):
    return _experts(x, ids, weights, w13, w2, swiglu_limit, w13_scale=w13_scale, w2_scale=w2_scale,
                    fp4_high_first=True, act_block=act_block)


def _scale_rule(kind):
    """Activation quantisers with one classic mistake each (x float32 [M, K] -> codes, scales)."""
    def quant(x, block):
        g = x.unflatten(-1, (-1, block))
        amax = g.abs().amax(-1).clamp(min=1e-4)
        if kind == "floor":           # floor instead of ceil in the power-of-two exponent
            s = torch.exp2(torch.floor(torch.log2(amax / 448)))
        elif kind == "not-pow2":      # scale = amax / 448, no power of two
            s = amax / 448
        else:                         # one amax for the whole tensor ("per-tensor")
            s = torch.exp2(torch.ceil(torch.log2(amax.amax().expand_as(amax) / 448)))
        q = (g / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        return q.flatten(-2), s
    return quant


def linear_act_scale(kind):
    def f(x, weight, weight_scale=None, out_dtype=None, act_block=None):
        return _linear(x, weight, weight_scale, out_dtype, act_block, _scale=_scale_rule(kind))
    return f


def moe_experts_weight_after_w2(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None,
                                act_block=None):
    """The routing weight applied after the down projection (h quantised unweighted)."""
    return _experts(x, ids, weights, w13, w2, swiglu_limit, w13_scale=w13_scale, w2_scale=w2_scale,
                    act_block=act_block, weight_after_w2=True)


def kv_norm_rope_rope_dims_quantised(kv, weight, positions, inv_freq, eps, nope_quant_block=None):
    return _kv_norm_rope(kv, weight, positions, inv_freq, eps, nope_quant_block, quant_rope=True)


def _bit_reversed(d):
    n = d.bit_length() - 1
    return torch.tensor([int(format(i, f"0{n}b")[::-1], 2) for i in range(d)])


def moe_experts_act_scale_floor(x, ids, weights, w13, w2, swiglu_limit, w13_scale=None, w2_scale=None,
                                act_block=None):
    return _experts(x, ids, weights, w13, w2, swiglu_limit, w13_scale=w13_scale, w2_scale=w2_scale,
                    act_block=act_block, scale=_scale_rule("floor"))


def kv_norm_rope_one_row_zeroed(kv, weight, positions, inv_freq, eps, nope_quant_block=None):
    """Right but for the last token of a quantised call, which comes out zero (a tail bug)."""
    y = kv_norm_rope(kv, weight, positions, inv_freq, eps, nope_quant_block)
    if nope_quant_block is not None and y.shape[0]:
        y = y.clone()
        y[-1] = 0
    return y


#: official-numerics mutants: name -> (op, implementation); each must fail its op's quantised cases
QUANT_BROKEN = {
    "moe-act-scale-floor": ("moe_experts", moe_experts_act_scale_floor),
    "kv-row-last-token-zeroed": ("kv_norm_rope", kv_norm_rope_one_row_zeroed),
    "indexer-fp4-scale-floor": ("indexer_rotate_quant", lambda x: _indexer_rotate_quant(
        x, fp4_scale=lambda a: torch.exp2(torch.floor(torch.log2(a / 6)))),),
    "indexer-fp4-scale-not-pow2": ("indexer_rotate_quant", lambda x: _indexer_rotate_quant(
        x, fp4_scale=lambda a: a / 6)),
    "act-scale-floor": ("linear", linear_act_scale("floor")),
    "act-scale-not-pow2": ("linear", linear_act_scale("not-pow2")),
    "act-scale-per-tensor": ("linear", linear_act_scale("per-tensor")),
    "moe-routing-weight-after-w2": ("moe_experts", moe_experts_weight_after_w2),
    "kv-row-rope-dims-quantised": ("kv_norm_rope", kv_norm_rope_rope_dims_quantised),
    "indexer-hadamard-unscaled": ("indexer_rotate_quant", lambda x: _indexer_rotate_quant(x, scaled=False)),
    "indexer-hadamard-other-order": ("indexer_rotate_quant", lambda x: _indexer_rotate_quant(x, order=_bit_reversed)),
    "indexer-no-rotation": ("indexer_rotate_quant",
                            lambda x: fake_quant(x.to(torch.bfloat16), "fp4", 32).to(x.dtype)),
    # the stored row formats
    "kv-fp8-store-scale-floor": ("cache_store", lambda pool, index, rows, row_format=None, paged=False: cache_store(
        pool, index, _encode_fp8_rows(rows, floor=True) if row_format == "fp8" else rows, None, paged)
        if row_format != "fp4" else cache_store(pool, index, rows, row_format, paged)),
    "kv-fp8-read-without-scales": ("sparse_mqa_attention", lambda q, kv, indices, sink, scale, kv_format=None,
                                   kv_paged=False: _attention(
        q, _decode_fp8_rows(_rows_of(kv, kv_paged), q.shape[-1], use_scales=False).to(q.dtype), indices, sink, scale)
        if kv_format == "fp8" else _attention(q, _rows_of(kv, kv_paged), indices, sink, scale)),
    "key-fp4-high-nibble-first": ("indexer_scores_rows", lambda q, k, weights, rows, scale, k_format=None, k_paged=False:
                                  indexer_scores_rows(q, _decode_fp4_keys(_rows_of(k, k_paged), q.shape[-1],
                                                                          high_first=True).to(q.dtype),
                                                      weights, rows, scale) if k_format == "fp4"
                                  else indexer_scores_rows(q, k, weights, rows, scale, k_paged=k_paged)),
}


#: name -> (broken op, implementation)
def all_reduce_ignores_group(x, group=None):
    """Sums over the whole world whatever group it is given."""
    return all_reduce(x, None)


def all_gather_wrong_order(x, dim=0, group=None, sizes=None):
    """Concatenates the ranks in reverse order."""
    from dsv4core.hal.ops.collectives import world_size

    if world_size(group) == 1:
        return torch.cat([x], dim=dim)
    return torch.cat(_gather_padded(x, dim, group, sizes)[::-1], dim=dim)


def reduce_scatter_equal_chunks(x, dim=0, group=None, sizes=None):
    """Ignores ``sizes`` whenever the extent divides by the world size (keeps the equal chunk)."""
    from dsv4core.hal.ops.collectives import world_size

    if sizes is not None and x.shape[dim] % world_size(group) == 0:
        sizes = None
    return reduce_scatter(x, dim, group, sizes)


#: Broken collectives: caught only over real process groups (tests/test_conformance_distributed.py).
DIST_BROKEN = {
    "all-reduce-ignores-group": ("all_reduce", all_reduce_ignores_group),
    "all-gather-wrong-order": ("all_gather", all_gather_wrong_order),
    "reduce-scatter-equal-chunks": ("reduce_scatter", reduce_scatter_equal_chunks),
}


BROKEN = {
    "sinkhorn-one-short": ("hc_pre", hc_pre_sinkhorn_short),
    "hc-pre-bf16-accumulation": ("hc_pre", hc_pre_bf16_accum),
    "hc-post-comb-transposed": ("hc_post", hc_post_comb_transposed),
    "rope-neox-pairs": ("rope", rope_neox),
    "attention-sink-ignored": ("sparse_mqa_attention", attention_no_sink),
    "attention-paged-kv-at-row-stride": ("sparse_mqa_attention", attention_paged_at_row_stride),
    "attention-sink-scaled": ("sparse_mqa_attention", attention_sink_scaled),
    "compress-pool-ape-halves-swapped": ("compress_pool", compress_pool_ape_halves_swapped),
    "moe-route-bias-in-weights": ("moe_route", moe_route_bias_in_weights),
    "moe-route-no-renorm-eps": ("moe_route", moe_route_no_renorm_eps),
    "indexer-topk-off-by-one": ("indexer_topk", indexer_topk_off_by_one),
    "swiglu-clamp-missing": ("moe_experts", moe_experts_no_clamp),
    "compress-windows-prev-b-half": ("compress_windows", compress_windows_prev_b_half),
    "indexer-scores-rows-no-relu": ("indexer_scores_rows", indexer_scores_rows_no_relu),
    "cache-store-skips-to-row0": ("cache_store", cache_store_skips_to_row0),
    "fp4-high-nibble-first": ("moe_experts", moe_experts_fp4_high_nibble_first),
    "attention-scale-ignored": ("sparse_mqa_attention", attention_scale_ignored),
    "linear-fp8-scale-per-row": ("linear", linear_fp8_scale_per_row),
}


def make_broken_backend(kind: str) -> Backend:
    op, fn = BROKEN[kind]
    return make_backend(f"broken-{kind}", dict(ALT_IMPLS, **{op: fn}))


# Factories for the spawned ranks of the distributed run ("conformance_backends:<name>").
def dist_alt():
    return make_alt_backend("alt")


def dist_broken():
    """Every DIST_BROKEN op at once (one spawn checks them all; all_to_all stays correct)."""
    return make_backend("broken-collectives", dict(ALT_IMPLS, **dict(DIST_BROKEN.values())))
