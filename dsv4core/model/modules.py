"""DSV4 modules: parameters laid out exactly as transformers 5.23.0 `DeepseekV4ForCausalLM`
(same attribute paths, names, shapes), math done only through the bound HAL op table.

Each module holds an `OpsRef` (shared by the whole model, rebindable) and exposes a forward
over *flattened* tokens of several requests (`Batch`, built by the model). Plain torch appears
only as glue: embedding lookup, cat / slicing / views, index-list construction.

Flow of one decoder layer (n = hc_mult streams per token):

    X [T,n,H] ──hc_pre(attn_hc)──> y [T,H] ──rms_norm──> Attention ──> a [T,H]
       │                             post, comb                          │
       └────────────────────────────────────hc_post(a, X, post, comb)────┘──> X
    X ──hc_pre(ffn_hc)──> y ──rms_norm──> MoE (routed + shared) ──> f ──hc_post──> X
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .config import CSA, HASH_MOE, HCA, SLIDING, DSV4Config
from .state import CompressorState, RequestState

FP32 = torch.float32

#: The lightning indexer concatenates the keys of consecutive requests into one scoring call while
#: they total at most this many rows; a request with more keys is scored from its own store (no
#: copy). Bounds the per-step key copy by a constant, whatever the context length.
INDEXER_CONCAT_ROWS = 4096


class OpsRef:
    """Shared, rebindable holder of the bound op table (`dsv4core.hal.OpTable`)."""

    __slots__ = ("t",)

    def __init__(self, table=None) -> None:
        self.t = table


def _param(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


FP8 = torch.float8_e4m3fn
FP8_BLOCK = 128


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Linear(nn.Module):
    """A bias-free projection `y = x W^T`, W `[out, in]` (HF `nn.Linear` parameter layout).

    Normally W holds dequantised values in the model dtype and `weight_scale_inv` is None (not in
    the state dict). After `keep_fp8()`, W is float8_e4m3fn and `weight_scale_inv` the float32
    128x128 block dequantisation multipliers `[ceil(out/128), ceil(in/128)]` (transformers' FP8
    names); both go to the `linear` op as they are."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__()
        self.weight = _param((out_features, in_features), dtype)
        self.register_parameter("weight_scale_inv", None)
        self._ops = ops

    def fp8_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(weight shape, scale shape) of the FP8 form."""
        n, k = self.weight.shape
        return (n, k), (_cdiv(n, FP8_BLOCK), _cdiv(k, FP8_BLOCK))

    def keep_fp8(self) -> None:
        """Switch to FP8 weight + float32 block scale (empty; filled by the checkpoint loader)."""
        (w, s), dev = self.fp8_shapes(), self.weight.device
        self.weight = nn.Parameter(torch.empty(w, dtype=FP8, device=dev), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(s, dtype=FP32, device=dev), requires_grad=False)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._ops.t.linear(x, self.weight, self.weight_scale_inv, out_dtype)


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the weight is kept in fp32 (as transformers does), math in the op."""

    def __init__(self, dim: int, eps: float, ops: OpsRef) -> None:
        super().__init__()
        self.weight = _param((dim,), FP32)
        self.eps = eps
        self._ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.t.rms_norm(x, self.weight, self.eps)


class HyperConnection(nn.Module):
    """mHC mixing parameters of one sublayer (fp32): `fn [(2+n)n, nH]`, `base [(2+n)n]`, `scale [3]`."""

    def __init__(self, cfg: DSV4Config, ops: OpsRef) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.fn = _param(((2 + n) * n, n * cfg.hidden_size), FP32)
        self.base = _param(((2 + n) * n,), FP32)
        self.scale = _param((3,), FP32)
        self.rms_eps, self.hc_eps, self.iters = cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        self._ops = ops

    def forward(self, x: torch.Tensor):
        """x [T,n,H] -> (y [T,H], post [T,n] f32, comb [T,n,n] f32)."""
        return self._ops.t.hc_pre(x, self.fn, self.scale, self.base, self.rms_eps, self.hc_eps, self.iters)


class HyperHead(nn.Module):
    """Final stream collapse (no Sinkhorn): `hc_fn [n, nH]`, `hc_base [n]`, `hc_scale [1]` (fp32)."""

    def __init__(self, cfg: DSV4Config, ops: OpsRef) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.hc_fn = _param((n, n * cfg.hidden_size), FP32)
        self.hc_base = _param((n,), FP32)
        self.hc_scale = _param((1,), FP32)
        self.rms_eps, self.hc_eps = cfg.rms_norm_eps, cfg.hc_eps
        self._ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.t.hc_head(x, self.hc_fn, self.hc_scale, self.hc_base, self.rms_eps, self.hc_eps)


# --------------------------------------------------------------------------------------------
# batch description


@dataclass
class Batch:
    """Flattened tokens of several requests. Segment r holds the `counts[r]` new tokens of request
    `states[r]` (contiguous from `starts[r]`, positions `start_len[r] .. start_len[r]+counts[r]-1`)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seg_of_token: torch.Tensor  # [T] int64 (segment index)
    states: list[RequestState]
    starts: list[int]  # first flattened token of each segment
    counts: list[int]  # tokens of each segment
    start_len: list[int]  # state.length before this forward
    inv_freq: dict[str, torch.Tensor] = field(default_factory=dict)
    max_position: int = -1  # largest position in the batch (host value: no device sync)
    _per_token: dict[tuple, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def per_token(self, per_segment: list[int]) -> torch.Tensor:
        """int64 [T] on the batch's device: `per_segment[r]` for every token of segment r.
        The host->device copy (a device sync) is made once per distinct list and forward, not
        once per layer: layers of one kind lay out their row stores identically."""
        key = tuple(per_segment)
        t = self._per_token.get(key)
        if t is None:
            t = torch.tensor(per_segment, dtype=torch.int64, device=self.input_ids.device)[self.seg_of_token]
            self._per_token[key] = t
        return t


# --------------------------------------------------------------------------------------------
# compressors


class Compressor(nn.Module):
    """Softmax-gated window pooling (SPEC compress_pool). HCA: `overlap=False`, projections of
    width d'; CSA (and the indexer's own compressor): `overlap=True`, width 2 d' (A | B halves).
    Parameter names follow transformers (`kv_proj`, `gate_proj`, `position_bias`, `kv_norm`)."""

    def __init__(self, cfg: DSV4Config, ratio: int, dim: int, overlap: bool, dtype: torch.dtype, ops: OpsRef):
        super().__init__()
        c = 2 if overlap else 1
        self.ratio, self.dim, self.overlap = ratio, dim, overlap
        self.kv_proj = Linear(cfg.hidden_size, c * dim, dtype, ops)
        self.gate_proj = Linear(cfg.hidden_size, c * dim, dtype, ops)
        self.position_bias = _param((ratio, c * dim), FP32)
        self.kv_norm = RMSNorm(dim, cfg.rms_norm_eps, ops)
        self._ops = ops

    def update(self, x: torch.Tensor, batch: Batch, states: list[CompressorState]) -> None:
        """Feed the segment tokens of `x [T,H]` into each request's compressor state; every window
        that becomes complete emits one entry (pooled, normed, roped at the window start)."""
        ops = self._ops.t
        m, dim = self.ratio, self.dim
        kv_all = self.kv_proj(x, FP32)  # projections taken as fp32 (SPEC section 0)
        sc_all = self.gate_proj(x, FP32)
        inv_freq = batch.inv_freq["compress"]
        for r, st in enumerate(states):
            s0, n = batch.starts[r], batch.counts[r]
            kv = torch.cat([st.buf_kv, kv_all[s0:s0 + n]])
            sc = torch.cat([st.buf_score, sc_all[s0:s0 + n]])
            wn = kv.shape[0] // m
            used = wn * m
            if wn:
                pooled = ops.compress_pool(kv[:used].view(wn, m, -1), sc[:used].view(wn, m, -1), self.position_bias,
                                           self.overlap, st.prev_kv, st.prev_score)
                pos = (torch.arange(wn, device=x.device, dtype=torch.int64) + st.count) * m
                ent = ops.kv_norm_rope(pooled, self.kv_norm.weight, pos, inv_freq, self.kv_norm.eps)
                st.append(ent.to(st.store.dtype))  # in place: old entries are not copied
                if self.overlap:
                    st.prev_kv = kv[used - m:used, :dim].clone()
                    st.prev_score = sc[used - m:used, :dim].clone()
            st.buf_kv, st.buf_score = kv[used:].clone(), sc[used:].clone()


class IndexerScorer(nn.Module):
    def __init__(self, cfg: DSV4Config, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__()
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, dtype, ops)


class Indexer(nn.Module):
    """Lightning indexer (CSA): own compressor at d_I, `q_b_proj` from the q latent, head weights."""

    def __init__(self, cfg: DSV4Config, ratio: int, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__()
        dI, nI = cfg.index_head_dim, cfg.index_n_heads
        self.n_heads, self.head_dim, self.topk, self.ratio = nI, dI, cfg.index_topk, ratio
        # same parameter names as transformers' DeepseekV4Indexer (compressor params inline)
        self.kv_proj = Linear(cfg.hidden_size, 2 * dI, dtype, ops)
        self.gate_proj = Linear(cfg.hidden_size, 2 * dI, dtype, ops)
        self.position_bias = _param((ratio, 2 * dI), FP32)
        self.kv_norm = RMSNorm(dI, cfg.rms_norm_eps, ops)
        self.q_b_proj = Linear(cfg.q_lora_rank, nI * dI, dtype, ops)
        self.scorer = IndexerScorer(cfg, dtype, ops)
        self._ops = ops

    # the indexer's compressor shares Compressor.update's code through this view
    ratio: int
    dim = property(lambda self: self.head_dim)
    overlap = True
    update = Compressor.update

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, batch: Batch, states: list[RequestState],
               layer: int) -> torch.Tensor:
        """Top-k compressed entries per query: int32 [T, topk], relative to the request's own
        entries, -1 = unused. Updates the indexer key state first.

        Requests are scored in runs of consecutive segments, one `indexer_scores` +
        `indexer_topk` per run: a run's keys are concatenated only while they total at most
        `INDEXER_CONCAT_ROWS` (a bounded copy that saves op calls); a request with more keys is a
        run of its own, scored straight from its key store (no copy at any context length)."""
        ops = self._ops.t
        T = batch.num_tokens
        comp_states = [s.layers[layer].index_comp for s in states]
        self.update(x, batch, comp_states)
        q = self.q_b_proj(q_latent).view(T, self.n_heads, self.head_dim)
        q = ops.rope(q, batch.positions, batch.inv_freq["compress"])
        w = self.scorer.weights_proj(x, FP32) * (self.n_heads ** -0.5)
        k_lengths = (batch.positions + 1) // self.ratio
        runs: list[list[int]] = []
        offs, rows = [], 0  # offs[r]: first key of request r within its run's key tensor
        for r, c in enumerate(comp_states):
            if not runs or rows + c.count > INDEXER_CONCAT_ROWS:
                runs.append([])
                rows = 0
            runs[-1].append(r)
            offs.append(rows)
            rows += c.count
        k_offsets = batch.per_token(offs)
        picks = []
        for run in runs:
            a, b = batch.starts[run[0]], batch.starts[run[-1]] + batch.counts[run[-1]]
            keys = [comp_states[r].entries for r in run]
            keys = keys[0] if len(keys) == 1 else torch.cat(keys)
            scores = ops.indexer_scores(q[a:b], keys.to(q.dtype), w[a:b], k_offsets[a:b], k_lengths[a:b],
                                        self.head_dim ** -0.5)
            picks.append(ops.indexer_topk(scores, k_lengths[a:b], self.topk))
        return torch.cat(picks) if picks else torch.full((T, self.topk), -1, dtype=torch.int32, device=x.device)


class CSACompressor(Compressor):
    def __init__(self, cfg: DSV4Config, dtype: torch.dtype, ops: OpsRef) -> None:
        ratio = int(cfg.compress_rates[CSA])
        super().__init__(cfg, ratio, cfg.head_dim, True, dtype, ops)
        self.indexer = Indexer(cfg, ratio, dtype, ops)


class HCACompressor(Compressor):
    def __init__(self, cfg: DSV4Config, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__(cfg, int(cfg.compress_rates[HCA]), cfg.head_dim, False, dtype, ops)


# --------------------------------------------------------------------------------------------
# attention


class GroupedLinear(nn.Module):
    """`o_a_proj`: weight `[G*R, h*d/G]`, used as `[G, R, h*d/G]` by the `wo_a` op."""

    def __init__(self, in_per_group: int, out_features: int, groups: int, dtype: torch.dtype, ops: OpsRef):
        super().__init__()
        self.weight = _param((out_features, in_per_group), dtype)
        self.register_parameter("weight_scale_inv", None)
        self.groups = groups
        self._ops = ops

    def fp8_shapes(self) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
        """(weight shape, scale shape) as the `wo_a` op takes them: `[G, R, D]`, `[G, R/128, ceil(D/128)]`.
        The checkpoint's `[G*R/128, ceil(D/128)]` scale grid splits per group only if R % 128 == 0."""
        G = self.groups
        R, D = self.weight.shape[0] // G, self.weight.shape[1]
        return (G, R, D), (G, R // FP8_BLOCK, _cdiv(D, FP8_BLOCK))

    def fp8_ok(self) -> bool:
        return (self.weight.shape[0] // self.groups) % FP8_BLOCK == 0

    def keep_fp8(self) -> None:
        """Switch to FP8 weight `[G*R, D]` + float32 scale `[G*R/128, ceil(D/128)]` (checkpoint layout)."""
        if not self.fp8_ok():
            raise ValueError(f"wo_a FP8 needs R % {FP8_BLOCK} == 0 (weight {tuple(self.weight.shape)}, G={self.groups})")
        n, d = self.weight.shape
        dev = self.weight.device
        self.weight = nn.Parameter(torch.empty(n, d, dtype=FP8, device=dev), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(n // FP8_BLOCK, _cdiv(d, FP8_BLOCK), dtype=FP32, device=dev),
                                             requires_grad=False)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        G, w, s = self.groups, self.weight, self.weight_scale_inv
        return self._ops.t.wo_a(o, w.view(G, -1, w.shape[-1]), None if s is None else s.view(G, -1, s.shape[-1]))


class Attention(nn.Module):
    """Shared-KV MQA with sliding window (+ CSA top-k or HCA compressed rows), sink, inverse rope
    on the output, grouped output projection. One `sparse_mqa_attention` call per layer over the
    flattened batch: the row store is [window rows | new rows | compressed rows] per request
    (CSA: only the picked compressed rows once a request has more entries than picks)."""

    def __init__(self, cfg: DSV4Config, layer: int, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__()
        h, d = cfg.num_attention_heads, cfg.head_dim
        self.layer, self.layer_type = layer, cfg.layer_types[layer]
        self.rope_kind = cfg.rope_kind(layer)
        self.h, self.d, self.W, self.eps = h, d, cfg.sliding_window, cfg.rms_norm_eps
        self.ratio = cfg.compress_ratio(layer)
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype, ops)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, ops)
        self.q_b_proj = Linear(cfg.q_lora_rank, h * d, dtype, ops)
        self.kv_proj = Linear(cfg.hidden_size, d, dtype, ops)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps, ops)
        self.o_a_proj = GroupedLinear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups, dtype, ops)
        self.o_b_proj = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, dtype, ops)
        self.sinks = _param((h,), FP32)
        if self.layer_type == CSA:
            self.compressor = CSACompressor(cfg, dtype, ops)
        elif self.layer_type == HCA:
            self.compressor = HCACompressor(cfg, dtype, ops)
        else:
            self.compressor = None
        self._ops = ops

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        ops = self._ops.t
        T, dev = batch.num_tokens, x.device
        pos = batch.positions
        inv_freq = batch.inv_freq[self.rope_kind]
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(T, self.h, self.d)
        q = ops.q_norm_rope(q, pos, inv_freq, self.eps)
        kv = ops.kv_norm_rope(self.kv_proj(x), self.kv_norm.weight, pos, inv_freq, self.eps)

        layer_states = [s.layers[self.layer] for s in batch.states]
        topk_local = None
        if self.compressor is not None:
            self.compressor.update(x, batch, [ls.comp for ls in layer_states])
            if self.layer_type == CSA:
                topk_local = self.compressor.indexer.select(x, q_latent, batch, batch.states, self.layer)

        # row store: per request [window rows | new rows | compressed rows]. Compressed rows: HCA
        # all entries (every query reads them all); CSA all entries while they are no more than
        # the request's n * topk picks, else only the picked rows, gathered in pick order (slot
        # t*topk + j), so a decode step copies window + topk rows whatever the context length.
        parts, win_base, comp_base, gathered, cursor = [], [], [], [], 0
        for r, ls in enumerate(layer_states):
            s0, n = batch.starts[r], batch.counts[r]
            parts += [ls.window, kv[s0:s0 + n]]
            # row index of absolute position 0 of this request (may be negative: not stored)
            win_base.append(cursor - (batch.start_len[r] - ls.window.shape[0]))
            cursor += ls.window.shape[0] + n
            if self.compressor is not None:
                ent = ls.comp.entries
                g = topk_local is not None and n * topk_local.shape[1] < ent.shape[0]
                if g:
                    ent = ent[topk_local[s0:s0 + n].reshape(-1).long().clamp_min(0)]
                parts.append(ent)
                comp_base.append(cursor)
                gathered.append(int(g))
                cursor += ent.shape[0]
        rows = torch.cat(parts) if parts else kv.new_zeros(0, self.d)

        # sliding window: positions p-W+1 .. p (W keys including the query itself)
        cand = pos[:, None] - (self.W - 1) + torch.arange(self.W, device=dev)[None]
        base = batch.per_token(win_base) if T else pos
        idx = torch.where(cand >= 0, base[:, None] + cand, -1)
        if self.compressor is not None and T:
            cbase = batch.per_token(comp_base)[:, None]
            if topk_local is not None:  # CSA: the indexer's picks
                tl = topk_local.long()
                rel = tl
                if any(gathered):  # gathered requests: pick j of token t sits at slot t*topk + j
                    K = tl.shape[1]
                    t_in_seg = torch.arange(T, device=dev) - batch.per_token(batch.starts)
                    slot = t_in_seg[:, None] * K + torch.arange(K, device=dev)[None]
                    rel = torch.where(batch.per_token(gathered)[:, None] > 0, slot, tl)
                cidx = torch.where(tl >= 0, cbase + rel, -1)
            else:  # HCA: every complete window w < floor((p+1)/m)
                visible = (pos + 1) // self.ratio
                width = (batch.max_position + 1) // self.ratio
                w = torch.arange(width, device=dev)[None]
                cidx = torch.where(w < visible[:, None], cbase + w, -1)
            idx = torch.cat([idx, cidx], dim=1)
        o = ops.sparse_mqa_attention(q, rows, idx.to(torch.int32), self.sinks, self.d ** -0.5)
        o = ops.rope(o, pos, inv_freq, inverse=True)

        # keep the last W-1 raw rows per request
        keep = self.W - 1
        for r, ls in enumerate(layer_states):
            s0, n = batch.starts[r], batch.counts[r]
            win = torch.cat([ls.window, kv[s0:s0 + n]])
            ls.window = win[max(0, win.shape[0] - keep):].clone() if keep > 0 else win[:0].clone()

        g = self.o_a_proj(o.reshape(T, self.o_a_proj.groups, self.h * self.d // self.o_a_proj.groups))
        return self.o_b_proj(g.reshape(T, g.shape[1] * g.shape[2]))


# --------------------------------------------------------------------------------------------
# MoE


class Router(nn.Module):
    """`gate.weight [E,H]` + `e_score_correction_bias [E]` (top-k layers) or `tid2eid [V,k]` (hash)."""

    def __init__(self, cfg: DSV4Config, is_hash: bool, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__()
        self.is_hash, self.topk, self.scaling = is_hash, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.weight = _param((cfg.n_routed_experts, cfg.hidden_size), dtype)
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=FP32))
        self._ops = ops

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        ops = self._ops.t
        logits = ops.linear(x, self.weight, None, FP32)
        if self.is_hash:
            return ops.moe_route(logits, self.topk, self.scaling, None, self.tid2eid[input_ids])
        return ops.moe_route(logits, self.topk, self.scaling, self.e_score_correction_bias, None)


class Experts(nn.Module):
    """Routed experts in the model dtype, or kept packed (FP4 / FP8) with their `moe_experts`
    scales in `*_scale_inv` (None otherwise; set by `dsv4core.model.experts_quant`)."""

    def __init__(self, cfg: DSV4Config, dtype: torch.dtype) -> None:
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = _param((E, 2 * I, H), dtype)
        self.down_proj = _param((E, H, I), dtype)
        self.register_parameter("gate_up_proj_scale_inv", None)
        self.register_parameter("down_proj_scale_inv", None)


class SharedMLP(nn.Module):
    """Shared expert (same clamped SwiGLU), run through `moe_experts` as a single expert."""

    def __init__(self, cfg: DSV4Config, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_proj = Linear(H, I, dtype, ops)
        self.up_proj = Linear(H, I, dtype, ops)
        self.down_proj = Linear(I, H, dtype, ops)
        self.limit = cfg.swiglu_limit
        self._ops = ops
        self._packed: tuple | None = None

    def _weights(self):
        key = (self.gate_proj.weight.data_ptr(), self.up_proj.weight.data_ptr(), self.down_proj.weight.data_ptr(),
               self.gate_proj.weight._version, self.up_proj.weight._version, self.down_proj.weight._version)
        if self._packed is None or self._packed[0] != key:
            w13 = torch.cat([self.gate_proj.weight, self.up_proj.weight]).unsqueeze(0)
            self._packed = (key, w13, self.down_proj.weight.unsqueeze(0))
        return self._packed[1], self._packed[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        w13, w2 = self._weights()
        ids = torch.zeros(T, 1, dtype=torch.int32, device=x.device)
        wts = torch.ones(T, 1, dtype=FP32, device=x.device)
        return self._ops.t.moe_experts(x, ids, wts, w13, w2, self.limit)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: DSV4Config, layer: int, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__()
        self.is_hash = cfg.mlp_layer_types[layer] == HASH_MOE
        self.gate = Router(cfg, self.is_hash, dtype, ops)
        self.experts = Experts(cfg, dtype)
        self.shared_experts = SharedMLP(cfg, dtype, ops)
        self.limit = cfg.swiglu_limit
        self._ops = ops

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        ex = self.experts
        routed = self._ops.t.moe_experts(x, ids, weights, ex.gate_up_proj, ex.down_proj, self.limit,
                                         ex.gate_up_proj_scale_inv, ex.down_proj_scale_inv)
        return routed + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSV4Config, layer: int, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, dtype, ops)
        self.mlp = SparseMoeBlock(cfg, layer, dtype, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.attn_hc = HyperConnection(cfg, ops)
        self.ffn_hc = HyperConnection(cfg, ops)
        self._ops = ops

    def forward(self, X: torch.Tensor, batch: Batch) -> torch.Tensor:
        ops = self._ops.t
        y, post, comb = self.attn_hc(X)
        a = self.self_attn(self.input_layernorm(y), batch)
        X = ops.hc_post(a, X, post, comb)
        y, post, comb = self.ffn_hc(X)
        f = self.mlp(self.post_attention_layernorm(y), batch.input_ids)
        return ops.hc_post(f, X, post, comb)


__all__ = ["OpsRef", "Batch", "DecoderLayer", "HyperHead", "RMSNorm", "SLIDING"]
