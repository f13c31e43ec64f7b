"""DSV4 modules: parameters laid out exactly as transformers 5.23.0 `DeepseekV4ForCausalLM`
(same attribute paths, names, shapes), math done only through the bound HAL op table.

Each module holds an `OpsRef` (its call site's: `dsv4core.model.opsref`) and exposes a forward
over *flattened* tokens of several requests (`Step`, built by the model). Plain torch appears
only as glue: embedding lookup, cat / slicing / views, index-list construction.

Flow of one decoder layer (n = hc_mult streams per token):

    X [T,n,H] ──hc_pre(attn_hc)──> y [T,H] ──rms_norm──> Attention ──> a [T,H]
       │                             post, comb                          │
       └────────────────────────────────────hc_post(a, X, post, comb)────┘──> X
    X ──hc_pre(ffn_hc)──> y ──rms_norm──> MoE (routed + shared) ──> f ──hc_post──> X
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4core.hal.ops.projections import ACT_BLOCKS
from dsv4core.hal.ops.rope import NOPE_QUANT_BLOCKS
from dsv4core.hal.util import cdiv

from . import indexing as ix
from .opsref import OpsRef
from .step import Step
from .config import CSA, HASH_MOE, HCA, SLIDING, DSV4Config
from .parallel import SINGLE, Parallel

FP32 = torch.float32


#: the official numerics' block sizes (the HAL's): W8A8 activations, FP8 KV rows (non-rope channels)
ACT_BLOCK, KV_QUANT_BLOCK = ACT_BLOCKS[0], NOPE_QUANT_BLOCKS[0]


def _param(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


FP8 = torch.float8_e4m3fn
FP8_BLOCK = 128


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
        #: the official W8A8 activation block (set by `dsv4core.model.numerics` on the projections
        #: the official inference runs in FP8; None: x as it is)
        self.act_block: int | None = None

    def fp8_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(weight shape, scale shape) of the FP8 form."""
        n, k = self.weight.shape
        return (n, k), (cdiv(n, FP8_BLOCK), cdiv(k, FP8_BLOCK))

    def keep_fp8(self) -> None:
        """Switch to FP8 weight + float32 block scale (empty; filled by the checkpoint loader)."""
        (w, s), dev = self.fp8_shapes(), self.weight.device
        self.weight = nn.Parameter(torch.empty(w, dtype=FP8, device=dev), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(s, dtype=FP32, device=dev), requires_grad=False)

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.act_block is None:
            return self._ops.t.linear(x, self.weight, self.weight_scale_inv, out_dtype)
        return self._ops.t.linear(x, self.weight, self.weight_scale_inv, out_dtype, act_block=self.act_block)


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


def _views_of(weights, packed: torch.Tensor) -> bool:
    """Whether `weights` are, in order, the contiguous row blocks of `packed`."""
    off = packed.data_ptr()
    if weights[0].untyped_storage().data_ptr() != packed.untyped_storage().data_ptr():
        return False
    for w in weights:
        if w.data_ptr() != off or not w.is_contiguous():
            return False
        off += w.numel() * w.element_size()
    return off == packed.data_ptr() + packed.numel() * packed.element_size()


def packed_weight(linears, packed: torch.Tensor | None) -> torch.Tensor | None:
    """The weights of `linears` (each `[N_i, K]`) as the row blocks of one `[sum N_i, K]` tensor,
    so one GEMM computes all their outputs: `packed` itself while every weight is still a view of
    it, else a new tensor that the weights then become views of (state-dict names and values
    unchanged, no second copy held; a weight replaced later, e.g. by another load or a move, is
    packed again; in-place loads write through). None when they cannot share one GEMM: an FP8
    weight with a block scale, or weights of different dtypes, devices or widths."""
    ws = [lin.weight for lin in linears]
    if any(lin.weight_scale_inv is not None for lin in linears) or len({(w.dtype, w.device, w.shape[1])
                                                                          for w in ws}) != 1:
        return None
    if packed is not None and _views_of(ws, packed):
        return packed
    packed, o = torch.cat(ws), 0
    for lin, w in zip(linears, ws):
        lin.weight = nn.Parameter(packed[o:o + w.shape[0]], requires_grad=False)
        o += w.shape[0]
    return packed


def _gather_window(new: torch.Tensor, ring: torch.Tensor, src, fill: torch.Tensor) -> torch.Tensor:
    """[E, S, width] window slots: this step's rows `new` [T, width] where the slot's position is
    in the step, the ring's rows before, `fill` [width] before position 0 (glue: two gathers + two
    selects)."""
    new_i, ring_i, from_new, masked = src
    if not new.shape[0]:
        a = new.new_zeros(new_i.shape + new.shape[1:])
    elif new_i.shape[1] == 1:                  # a decode step: each candidate's own row
        a = ix.take(new, new_i[:, 0])[:, None]
    else:
        a = new[new_i]
    out = torch.where(from_new[..., None], a, ring[ring_i])
    return torch.where(masked[..., None], fill, out)


def _project(ops, comp: nn.Module, x: torch.Tensor, extra: "Linear | None") -> torch.Tensor:
    """fp32 [T, 2w (+ extra's width)] = x [kv_proj; gate_proj (; extra)]^T, in one GEMM over the
    packed weights (`comp._wkg`, see `packed_weight`) where they can be packed; else `extra`
    separately, or (an FP8 kv / gate projection) every projection on its own."""
    lins = (comp.kv_proj, comp.gate_proj) + ((extra,) if extra is not None else ())
    wkg = comp._wkg = packed_weight(lins, comp._wkg)
    if wkg is not None:
        return ops.linear(x, wkg, None, FP32)
    return torch.cat([lin(x, FP32) for lin in lins], dim=1)


def compress_step(ops, comp: nn.Module, overlap: bool, x: torch.Tensor, step: Step, cap: int,
                  ring: torch.Tensor, entry_pool: torch.Tensor, per_block: int,
                  extra: "Linear | None" = None, official: bool = False,
                  indexer: bool = False) -> torch.Tensor | None:
    """Feed the step's tokens into a compressor `comp` (a `Compressor` or an `Indexer`: `kv_proj`,
    `gate_proj`, `position_bias`, `kv_norm`, `ratio`): project (fp32, SPEC section 0; both
    projections in one GEMM, `_project`), add the position bias to the scores, pool every
    window the step completes from the ring and this step's rows (`compress_windows`), norm + rope
    the entries at their window start and store them into `entry_pool` (entry rows); queue the
    ring write (`step.deferred`). `ring`: the compressor's rings `[kv | score]`
    (KVCache.ring_pairs), whose row layout the projections `both = [kv | score]` already have.
    `extra`: one more projection of x (fp32) computed in the same GEMM and returned (else None).
    `official` (numerics): the pooled rows are rounded to the activation dtype before their norm,
    and the entries are the official rows: FP8 non-rope channels (`kv_norm_rope`'s
    `nope_quant_block`), or for the `indexer` keys the Hadamard + FP4 simulation."""
    ratio, w, where = comp.ratio, comp.kv_proj.weight.shape[0], "keys" if indexer else "rows"   # where: Step's `pool`
    out = _project(ops, comp, x, extra)
    both = out[:, :2 * w]                  # a view: the ring write and the window gather read strides
    both[:, w:].add_(comp.position_bias[step.pos_mod(ratio)])
    if step.emit_tok[ratio].numel():       # no candidate (an eager step where no window completes): no pooling
        win = _gather_window(both, ring, step.sources(ratio, overlap, cap, per_block, where), step.cache.ring_fill(w))
        pooled = ops.compress_windows(win[..., :w], win[..., w:], overlap)
        if not official:
            ent = ops.kv_norm_rope(pooled, comp.kv_norm.weight, step.entry_starts(ratio, per_block),
                                   step.inv_freq["compress"], comp.kv_norm.eps)
        elif indexer:
            ent = ops.indexer_rotate_quant(ops.kv_norm_rope(pooled.to(x.dtype), comp.kv_norm.weight,
                                                            step.entry_starts(ratio, per_block),
                                                            step.inv_freq["compress"], comp.kv_norm.eps))
        else:
            ent = ops.kv_norm_rope(pooled.to(x.dtype), comp.kv_norm.weight, step.entry_starts(ratio, per_block),
                                   step.inv_freq["compress"], comp.kv_norm.eps, nope_quant_block=KV_QUANT_BLOCK)
        c = step.cache
        ops.cache_store(entry_pool, step.emissions(ratio, per_block, where)[1], ent, **(c.key_store if indexer else c.row_store))
    if step.ring_tok.numel():
        step.deferred.append((ring, step.ring_rows(cap, where), ix.take(both, step.ring_tok)))
    return out[:, 2 * w:] if extra is not None else None


class Compressor(nn.Module):
    """Softmax-gated window pooling (SPEC compress_pool). HCA: `overlap=False`, projections of
    width d'; CSA: `overlap=True`, width 2 d' (A | B halves). Parameter names follow transformers
    (`kv_proj`, `gate_proj`, `position_bias`, `kv_norm`)."""

    def __init__(self, cfg: DSV4Config, layer: int, ratio: int, dim: int, overlap: bool, dtype: torch.dtype,
                 ops: OpsRef):
        super().__init__()
        c = 2 if overlap else 1
        self.layer, self.ratio, self.dim, self.overlap = layer, ratio, dim, overlap
        self.kv_proj = Linear(cfg.hidden_size, c * dim, dtype, ops)
        self.gate_proj = Linear(cfg.hidden_size, c * dim, dtype, ops)
        self.position_bias = _param((ratio, c * dim), FP32)
        self.kv_norm = RMSNorm(dim, cfg.rms_norm_eps, ops)
        self._ops = ops
        self._wkg: torch.Tensor | None = None      # [kv_proj; gate_proj] weights (packed_weight)

    def forward(self, x: torch.Tensor, step: Step) -> None:
        """Store the entries the step completes into the layer's row pool (after the window rows)."""
        c, i = step.cache, self.layer
        compress_step(self._ops.t, self, self.overlap, x, step, c.ring_cap[i], c.ring_pairs[i]["kv"],
                      c.rows[i][c.Rw:], c.epb[i], official=self._ops.official)


class IndexerScorer(nn.Module):
    def __init__(self, cfg: DSV4Config, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__()
        self.weights_proj = Linear(cfg.hidden_size, cfg.index_n_heads, dtype, ops)


class Indexer(nn.Module):
    """Lightning indexer (CSA): own compressor at d_I, `q_b_proj` from the q latent, head weights."""

    def __init__(self, cfg: DSV4Config, layer: int, ratio: int, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__()
        dI, nI = cfg.index_head_dim, cfg.index_n_heads
        self.layer, self.n_heads, self.head_dim, self.topk, self.ratio = layer, nI, dI, cfg.index_topk, ratio
        # same parameter names as transformers' DeepseekV4Indexer (compressor params inline)
        self.kv_proj = Linear(cfg.hidden_size, 2 * dI, dtype, ops)
        self.gate_proj = Linear(cfg.hidden_size, 2 * dI, dtype, ops)
        self.position_bias = _param((ratio, 2 * dI), FP32)
        self.kv_norm = RMSNorm(dI, cfg.rms_norm_eps, ops)
        self.q_b_proj = Linear(cfg.q_lora_rank, nI * dI, dtype, ops)
        self.scorer = IndexerScorer(cfg, dtype, ops)
        self._ops = ops
        self._wkg: torch.Tensor | None = None      # [kv_proj; gate_proj; scorer.weights_proj] (packed_weight)

    def select(self, x: torch.Tensor, q_latent: torch.Tensor, step: Step, base: int = 0) -> torch.Tensor:
        """Top-k compressed entries per query as rows of the layer's entry region plus `base`,
        integer [T, topk], -1 = unused. Stores this step's indexer keys first."""
        ops, c, i = self._ops.t, step.cache, self.layer
        official = self._ops.official
        hw = compress_step(ops, self, True, x, step, c.ring_cap[i], c.ring_pairs[i]["ikv"], c.keys[i], c.epb[i],
                           extra=self.scorer.weights_proj, official=official, indexer=True)  # + head weights
        T = step.num_tokens
        q = self.q_b_proj(q_latent).view(T, self.n_heads, self.head_dim)
        q = ops.rope(q, step.positions, step.inv_freq["compress"])
        if official:
            q = ops.indexer_rotate_quant(q)
        w = hw * (self.n_heads ** -0.5)
        rows = step.entry_reads(self.ratio, c.epb[i], pool="keys")        # [T, L] entry w -> key row
        scores = ops.indexer_scores_rows(q, c.keys[i], w, rows, self.head_dim ** -0.5, **c.key_read)
        picks = ops.indexer_topk(scores, step.visible(self.ratio), self.topk)      # int32, -1 = unused
        if not rows.shape[1]:                                             # no entry yet: every pick -1
            return picks
        got = step.entry_reads(self.ratio, c.epb[i], base)[step.token_col(), picks]   # entry w -> its row (+ base);
        return got.masked_fill(picks < 0, -1)     # a -1 pick reads the last column (wrap-around): dropped


class CSACompressor(Compressor):
    def __init__(self, cfg: DSV4Config, layer: int, dtype: torch.dtype, ops: OpsRef) -> None:
        ratio = int(cfg.compress_rates[CSA])
        super().__init__(cfg, layer, ratio, cfg.head_dim, True, dtype, ops)
        self.indexer = Indexer(cfg, layer, ratio, dtype, ops)


class HCACompressor(Compressor):
    def __init__(self, cfg: DSV4Config, layer: int, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__(cfg, layer, int(cfg.compress_rates[HCA]), cfg.head_dim, False, dtype, ops)


# -- attention ------------------------------------------------------------------------------

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
        return (G, R, D), (G, R // FP8_BLOCK, cdiv(D, FP8_BLOCK))

    def fp8_ok(self) -> bool:
        return (self.weight.shape[0] // self.groups) % FP8_BLOCK == 0

    def keep_fp8(self) -> None:
        """Switch to FP8 weight `[G*R, D]` + float32 scale `[G*R/128, ceil(D/128)]` (checkpoint layout)."""
        if not self.fp8_ok():
            raise ValueError(f"wo_a FP8 needs R % {FP8_BLOCK} == 0 (weight {tuple(self.weight.shape)}, G={self.groups})")
        n, d = self.weight.shape
        dev = self.weight.device
        self.weight = nn.Parameter(torch.empty(n, d, dtype=FP8, device=dev), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(n // FP8_BLOCK, cdiv(d, FP8_BLOCK), dtype=FP32, device=dev),
                                             requires_grad=False)

    def forward(self, o: torch.Tensor) -> torch.Tensor:
        G, w, s = self.groups, self.weight, self.weight_scale_inv
        return self._ops.t.wo_a(o, w.view(G, -1, w.shape[-1]), None if s is None else s.view(G, -1, s.shape[-1]))


class Attention(nn.Module):
    """Shared-KV MQA with sliding window (+ CSA top-k or HCA compressed rows), sink, inverse rope
    on the output, grouped output projection. One `sparse_mqa_attention` call per layer over the
    flattened step, reading the layer's row pool: per query the W window rows (paged window
    region) then its compressed rows (CSA: the indexer's picks; HCA: every visible entry).

    Tensor-parallel (`par.tp > 1`): this rank holds h/tp query heads (q_b_proj rows, sinks) and
    o_groups/tp output groups (o_a_proj rows, o_b_proj columns); the o_b_proj partial sums are
    all-reduced over the tp group. The KV path (kv_proj, compressor, indexer) is replicated."""

    def __init__(self, cfg: DSV4Config, layer: int, dtype: torch.dtype, ops: OpsRef, par: Parallel = SINGLE) -> None:
        super().__init__()
        h, d = cfg.num_attention_heads // par.tp, cfg.head_dim
        G = cfg.o_groups // par.tp
        self.layer, self.layer_type = layer, cfg.layer_types[layer]
        self.rope_kind = cfg.rope_kind(layer)
        self.h, self.d, self.W, self.eps = h, d, cfg.sliding_window, cfg.rms_norm_eps
        self.ratio = cfg.compress_ratio(layer)
        self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, dtype, ops)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, ops)
        self.q_b_proj = Linear(cfg.q_lora_rank, h * d, dtype, ops)
        self.kv_proj = Linear(cfg.hidden_size, d, dtype, ops)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps, ops)
        self.o_a_proj = GroupedLinear(h * d // G, G * cfg.o_lora_rank, G, dtype, ops)
        self.o_b_proj = Linear(G * cfg.o_lora_rank, cfg.hidden_size, dtype, ops)
        self.par = par
        self.sinks = _param((h,), FP32)
        if self.layer_type == CSA:
            self.compressor = CSACompressor(cfg, layer, dtype, ops)
        elif self.layer_type == HCA:
            self.compressor = HCACompressor(cfg, layer, dtype, ops)
        else:
            self.compressor = None
        self._ops = ops

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        ops, c = self._ops.t, step.cache
        T, pos = step.num_tokens, step.positions
        pool = c.rows[self.layer]
        inv_freq = step.inv_freq[self.rope_kind]
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_latent).view(T, self.h, self.d)
        q = ops.q_norm_rope(q, pos, inv_freq, self.eps)
        if self._ops.official:                                # the official row: FP8 non-rope channels
            kv = ops.kv_norm_rope(self.kv_proj(x), self.kv_norm.weight, pos, inv_freq, self.eps,
                                  nope_quant_block=KV_QUANT_BLOCK)
        else:
            kv = ops.kv_norm_rope(self.kv_proj(x), self.kv_norm.weight, pos, inv_freq, self.eps)
        ops.cache_store(pool, step.window_writes(), kv, **c.row_store)   # rows >= start: unread until committed
        if self.compressor is not None:
            self.compressor(x, step)
        if self.layer_type == CSA:                            # the window, then the indexer's picks
            index = step.csa_rows(self.compressor.indexer.topk)
            index[:, c.W:] = self.compressor.indexer.select(x, q_latent, step, base=c.Rw)
        else:                                                 # the window (+ HCA: every visible entry)
            index = step.attention_rows(self.ratio, c.epb[self.layer])
        o = ops.sparse_mqa_attention(q, pool, index, self.sinks, self.d ** -0.5, **c.row_read)
        o = ops.rope(o, pos, inv_freq, inverse=True)
        g = self.o_a_proj(o.reshape(T, self.o_a_proj.groups, self.h * self.d // self.o_a_proj.groups))
        out = self.o_b_proj(g.reshape(T, g.shape[1] * g.shape[2]))
        return ops.all_reduce(out, self.par.tp_group) if self.par.tp > 1 else out


# -- MoE ------------------------------------------------------------------------------------

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
    """Routed experts `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]` in the model dtype, or kept
    packed (FP4 / FP8) with their `moe_experts` scales in `*_scale_inv` (None otherwise; set by
    `dsv4core.model.experts_quant`); with expert/tensor parallelism this rank's E/ep experts, each
    cut to I/tp of its intermediate size."""

    def __init__(self, cfg: DSV4Config, dtype: torch.dtype, par: Parallel = SINGLE) -> None:
        super().__init__()
        E, H, I = cfg.n_routed_experts // par.ep, cfg.hidden_size, cfg.moe_intermediate_size // par.tp
        self.gate_up_proj = _param((E, 2 * I, H), dtype)
        self.down_proj = _param((E, H, I), dtype)
        self.register_parameter("gate_up_proj_scale_inv", None)
        self.register_parameter("down_proj_scale_inv", None)


class SharedMLP(nn.Module):
    """Shared expert (same clamped SwiGLU), run through `moe_experts` as a single expert.

    `moe_experts` takes W1 and W3 as one `[1, 2I, H]` tensor: on first use the gate and up weights
    are moved into one buffer and `gate_proj.weight` / `up_proj.weight` become views of its two
    halves (`packed_weight`: state-dict names and values unchanged, no second copy held). A weight
    replaced later (another load) is packed again. With parallelism this rank holds I/(tp*ep) of the
    intermediate size (gate/up rows, down columns) and returns a partial sum."""

    def __init__(self, cfg: DSV4Config, dtype: torch.dtype, ops: OpsRef, par: Parallel = SINGLE) -> None:
        super().__init__()
        H, I = cfg.hidden_size, cfg.moe_intermediate_size // par.world
        self.gate_proj = Linear(H, I, dtype, ops)
        self.up_proj = Linear(H, I, dtype, ops)
        self.down_proj = Linear(I, H, dtype, ops)
        self.limit = cfg.swiglu_limit
        self._ops = ops
        self._w13: torch.Tensor | None = None
        # the [1, N, K] one-expert views handed to moe_experts: the same tensor objects from call
        # to call while the weights are unchanged (a backend may cache work per weight tensor)
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _expert_view(self, key: str, w: torch.Tensor) -> torch.Tensor:
        v = self._views.get(key)
        if v is None or v[0] is not w:
            v = self._views[key] = (w, w.unsqueeze(0))
        return v[1]

    def w13(self) -> torch.Tensor:
        self._w13 = packed_weight((self.gate_proj, self.up_proj), self._w13)
        if self._w13 is None:
            raise ValueError(f"shared expert: gate_proj and up_proj weights must share dtype, device and width "
                             f"(got {self.gate_proj.weight.dtype} {tuple(self.gate_proj.weight.shape)} on "
                             f"{self.gate_proj.weight.device}, {self.up_proj.weight.dtype} "
                             f"{tuple(self.up_proj.weight.shape)} on {self.up_proj.weight.device})")
        return self._expert_view("w13", self._w13)

    def forward(self, x: torch.Tensor, step: Step | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H]. `step`: the step whose every token this runs on (its one-expert
        routing, ids 0 and weights 1, is built once per step for every layer)."""
        T, dev = x.shape[0], x.device

        def route():                           # (padding rows: -1, no expert work)
            ids = torch.zeros(T, 1, dtype=torch.int32, device=dev)
            return (ids if step is None else step.no_padding(ids)), torch.ones(T, 1, dtype=FP32, device=dev)

        ids, wts = route() if step is None else step.memo(("shared", T), route)
        w13, w2 = self.w13(), self._expert_view("w2", self.down_proj.weight)
        if self._ops.official:
            return self._ops.t.moe_experts(x, ids, wts, w13, w2, self.limit, act_block=ACT_BLOCK)
        return self._ops.t.moe_experts(x, ids, wts, w13, w2, self.limit)


class SparseMoeBlock(nn.Module):
    """Router + routed experts + shared expert. Parallel (`par.world > 1`): every rank routes all
    tokens (the router is replicated), runs the routing entries that fall on its experts
    (`par.experts`; the others become -1, which `moe_experts` skips) and its shared-expert slice,
    and one `all_reduce` over every rank sums the partial outputs (see `dsv4core.model.parallel`)."""

    def __init__(self, cfg: DSV4Config, layer: int, dtype: torch.dtype, ops: OpsRef, par: Parallel = SINGLE) -> None:
        super().__init__()
        self.is_hash = cfg.mlp_layer_types[layer] == HASH_MOE
        self.gate = Router(cfg, self.is_hash, dtype, ops)
        self.experts = Experts(cfg, dtype, par)
        self.shared_experts = SharedMLP(cfg, dtype, ops, par)
        self.limit = cfg.swiglu_limit
        self.par = par
        self.expert_range = par.experts(cfg)
        self._ops = ops

    def forward(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        weights, ids = self.gate(x, step.input_ids)
        ids = step.no_padding(ids)             # bucket padding: no expert work
        if self.par.ep > 1:                    # global expert ids -> this rank's, -1 elsewhere
            e0, e1 = self.expert_range
            ids = torch.where((ids >= e0) & (ids < e1), ids - e0, -1).to(ids.dtype)
        ex = self.experts
        quant = {"act_block": ACT_BLOCK} if self._ops.official else {}
        routed = self._ops.t.moe_experts(x, ids, weights, ex.gate_up_proj, ex.down_proj, self.limit,
                                         ex.gate_up_proj_scale_inv, ex.down_proj_scale_inv, **quant)
        out = routed + self.shared_experts(x, step)
        return self._ops.t.all_reduce(out, self.par.world_group) if self.par.world > 1 else out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSV4Config, layer: int, dtype: torch.dtype, ops: OpsRef, par: Parallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer, dtype, ops, par)
        self.mlp = SparseMoeBlock(cfg, layer, dtype, ops, par)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.attn_hc = HyperConnection(cfg, ops)
        self.ffn_hc = HyperConnection(cfg, ops)
        self._ops = ops

    def forward(self, X: torch.Tensor, step: Step) -> torch.Tensor:
        ops = self._ops.t
        y, post, comb = self.attn_hc(X)
        a = self.self_attn(self.input_layernorm(y), step)
        X = ops.hc_post(a, X, post, comb)
        y, post, comb = self.ffn_hc(X)
        f = self.mlp(self.post_attention_layernorm(y), step)
        return ops.hc_post(f, X, post, comb)


class MTPLayer(DecoderLayer):
    """The multi-token-prediction ("NextN") block of DeepSeek-V4 (the official `MTPBlock`): a full
    decoder layer (its own attention, MoE and mHC) at layer index `num_hidden_layers`, built from
    `DSV4Config.with_mtp_layer()` (sliding-window attention, top-k MoE), plus `e_proj`, `h_proj`
    (H x H), `enorm`, `hnorm`, `norm` and its own `hc_head`. The embedding and the lm_head are the
    main model's.

        X = e_proj(enorm(embed(token)))  (broadcast over the hc streams)  + h_proj(hnorm(h))
        X = layer(X);  logits = lm_head(norm(hc_head(X)))

    `h` [T, hc, H] is the main model's residual stream before its hc_head at the position of
    the token before `token` (or, drafting further, this block's own X there)."""

    def __init__(self, cfg: DSV4Config, layer: int, dtype: torch.dtype, ops: OpsRef, par: Parallel = SINGLE) -> None:
        super().__init__(cfg, layer, dtype, ops, par)
        H = cfg.hidden_size
        self.e_proj = Linear(H, H, dtype, ops)
        self.h_proj = Linear(H, H, dtype, ops)
        self.enorm = RMSNorm(H, cfg.rms_norm_eps, ops)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps, ops)
        self.norm = RMSNorm(H, cfg.rms_norm_eps, ops)
        self.hc_head = HyperHead(cfg, ops)

    def forward(self, e: torch.Tensor, h: torch.Tensor, step: Step) -> torch.Tensor:
        """e [T, H]: the embeddings of the step's tokens; h [T, hc, H]: the stream they continue.
        Returns this block's stream [T, hc, H] (before its hc_head)."""
        T, n, H = h.shape
        x = self.e_proj(self.enorm(e))
        hp = self.h_proj(self.hnorm(h.reshape(T * n, H))).view(T, n, H)
        return super().forward(hp + x.unsqueeze(1), step)

    def head(self, X: torch.Tensor) -> torch.Tensor:
        """[T, H]: the block's stream collapsed by its own hc_head, then its norm (lm_head next)."""
        return self.norm(self.hc_head(X))


__all__ = ["OpsRef", "DecoderLayer", "HyperHead", "MTPLayer", "RMSNorm", "SLIDING"]
