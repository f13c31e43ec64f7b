"""The DSV4 causal LM: batched forward over flattened tokens of several requests, each with an
explicit `RequestState`; greedy generation (prefill, then decode steps with the state).

The module tree and `state_dict()` keys equal transformers 5.23.0 `DeepseekV4ForCausalLM`
(`model.embed_tokens`, `model.layers.N....`, `model.norm`, `model.hc_head`, `lm_head`), so a
transformers checkpoint loads with no renaming.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from .config import DSV4Config
from .modules import FP32, Batch, DecoderLayer, HyperHead, OpsRef, RMSNorm
from .state import RequestState


class InputError(ValueError):
    """Bad request input (out-of-vocabulary id, empty prompt, too long, malformed batch)."""


def _host_long(a) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a list / tensor (one copy if the tensor lives on a device)."""
    t = torch.as_tensor(a, dtype=torch.int64) if not isinstance(a, torch.Tensor) else a
    return t.detach().to("cpu", torch.int64).reshape(-1)


class DSV4Model(nn.Module):
    def __init__(self, cfg: DSV4Config, dtype: torch.dtype, ops: OpsRef) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, i, dtype, ops) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.hc_head = HyperHead(cfg, ops)


class DSV4ForCausalLM(nn.Module):
    """DSV4 with a device-neutral forward on HAL ops. Build with `load_model` (dsv4core.model.api)
    or directly: `DSV4ForCausalLM(config, ops, dtype=...)` then load weights."""

    def __init__(self, config: DSV4Config, ops=None, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.act_dtype = dtype
        self._ops = OpsRef(ops)
        self.model = DSV4Model(config, dtype, self._ops)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.lm_head.weight.requires_grad_(False)
        self._inv_freq: dict[tuple, dict[str, torch.Tensor]] = {}
        self.backend = None  # informational: the backend request the op table was bound with
        self._quantization: dict | None = None  # set by load_model (see quantization_report)

    # ------------------------------------------------------------------ plumbing
    @property
    def ops(self):
        return self._ops.t

    def bind_ops(self, ops) -> None:
        """Swap the op table (e.g. after moving to another device)."""
        self._ops.t = ops

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def hal_report(self):
        """The binding table of the op table this model calls (op -> implementation)."""
        t = self._ops.t
        for name in ("report", "hal_report", "table"):
            fn = getattr(t, name, None)
            if callable(fn):
                return fn()
        return repr(t)

    def quantization_report(self) -> dict:
        """Which weights are kept FP8 (+ block scale) and why each FP8-capable projection was or was
        not: ``{"mode", "kept": [names], "kept_bytes", "decisions": [{weight, op, backend, kept, reason}]}``
        (set by ``load_model``; a model built otherwise keeps nothing)."""
        from .fp8 import report

        return self._quantization if self._quantization is not None else report(self, "dequantize", [])

    def _freqs(self, device: torch.device) -> dict[str, torch.Tensor]:
        key = (device.type, device.index)
        if key not in self._inv_freq:
            self._inv_freq[key] = {k: self.config.inv_freq(k, device) for k in ("main", "compress")}
        return self._inv_freq[key]

    def new_state(self) -> RequestState:
        return RequestState.new(self.config, self.act_dtype, self.device)

    # ------------------------------------------------------------------ validation
    def _check_ids(self, ids: torch.Tensor, what: str) -> None:
        V = self.config.vocab_size
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            bad = ids[(ids < 0) | (ids >= V)][:5].tolist()
            raise InputError(f"{what}: token ids out of vocabulary [0, {V}): {bad}")

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward_batch(self, input_ids: torch.Tensor, positions: torch.Tensor, request_ids: torch.Tensor,
                      states: Sequence[RequestState], logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """One forward over flattened tokens.

        input_ids, positions, request_ids: [T] int64. `request_ids[t]` indexes `states`; each
        request's tokens are contiguous and their positions are `state.length, state.length+1, ...`
        (prefill: many tokens; decode: one; any mix of requests in one call).
        logits_rows: which flattened rows to return logits for (default all). Returns float32
        logits [len(logits_rows), vocab]. Everything is validated before any state changes.
        """
        dev = self.device
        # validation and bookkeeping on host copies (no device syncs on the hot path)
        ids_h, pos_h, rid_h = (_host_long(a) for a in (input_ids, positions, request_ids))
        T = ids_h.shape[0]
        if pos_h.shape[0] != T or rid_h.shape[0] != T:
            raise InputError(f"input_ids ({T}), positions ({pos_h.shape[0]}) and request_ids "
                             f"({rid_h.shape[0]}) must have the same length")
        self._check_ids(ids_h, "input_ids")
        # segments (contiguous runs of one request)
        starts, counts, rids = [], [], []
        rl = rid_h.tolist()
        for t, r in enumerate(rl):
            if t == 0 or r != rl[t - 1]:
                starts.append(t)
                counts.append(0)
                rids.append(r)
            counts[-1] += 1
        if len(set(rids)) != len(rids):
            raise InputError("each request's tokens must be contiguous in the flattened batch")
        if any(r < 0 or r >= len(states) for r in rids):
            raise InputError(f"request_ids must index states (0..{len(states) - 1}); got {sorted(set(rids))}")
        seg_states = [states[r] for r in rids]
        if len({id(s) for s in seg_states}) != len(seg_states):
            raise InputError("two request_ids refer to the same RequestState object")
        start_len = [s.length for s in seg_states]
        maxpos = self.config.max_position_embeddings
        pl = pos_h.tolist()
        for s0, n, L, r in zip(starts, counts, start_len, rids):
            if pl[s0:s0 + n] != list(range(L, L + n)):
                raise InputError(f"request {r}: positions must continue its state ({L}..{L + n - 1}); "
                                 f"got {pl[s0]}..{pl[s0 + n - 1]}")
            if L + n > maxpos:
                raise InputError(f"request {r}: length {L + n} exceeds max_position_embeddings={maxpos}")
        rows_h = None
        if logits_rows is not None:
            rows_h = _host_long(logits_rows)
            if rows_h.numel() and (int(rows_h.min()) < -T or int(rows_h.max()) >= T):
                raise InputError(f"logits_rows must index the {T} flattened tokens; got {rows_h.tolist()[:8]}")
        seg_h = torch.repeat_interleave(torch.arange(len(starts), dtype=torch.int64),
                                        torch.tensor(counts, dtype=torch.int64))
        # one host->device copy for all per-token index vectors (each copy is a device sync)
        packed = torch.cat([ids_h, pos_h, seg_h] + ([rows_h] if rows_h is not None else [])).to(dev)
        batch = Batch(input_ids=packed[:T], positions=packed[T:2 * T], seg_of_token=packed[2 * T:3 * T],
                      states=seg_states, starts=starts, counts=counts, start_len=start_len,
                      inv_freq=self._freqs(dev), max_position=max(pl) if pl else -1)

        n = self.config.hc_mult
        h = self.model.embed_tokens.weight[batch.input_ids]  # embedding lookup (glue)
        X = h.unsqueeze(1).expand(T, n, h.shape[-1]).contiguous()
        for layer in self.model.layers:
            X = layer(X, batch)
        if rows_h is not None:
            X = X[packed[3 * T:]]
        y = self.model.norm(self.model.hc_head(X))
        logits = self.ops.linear(y, self.lm_head.weight, None, FP32)
        for st, n_ in zip(seg_states, counts):
            st.length += n_
        return logits

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def logits(self, input_ids) -> torch.Tensor:
        """One full prefill of one sequence from a fresh state: float32 logits [seq, vocab]."""
        ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1)
        if ids.numel() == 0:
            raise InputError("empty input_ids")
        st = self.new_state()
        T = ids.numel()
        return self.forward_batch(ids, torch.arange(T), torch.zeros(T, dtype=torch.int64), [st])

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                 eos_token_id: int | None = None, prefill_chunk: int | None = None,
                 progress: Callable[[int, int], None] | None = None) -> list[list[int]]:
        """Greedy, batched: one prefill forward of all prompts (or, with `prefill_chunk`, one
        forward per chunk of at most that many tokens of each prompt), then one decode forward per
        step for all unfinished requests. Returns only the new tokens of each prompt. With
        `eos_token_id`, a request stops after emitting it."""
        if isinstance(prompts, torch.Tensor):
            prompts = prompts.tolist()
        prompts = [list(map(int, p)) for p in prompts]
        if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
        V, maxpos = self.config.vocab_size, self.config.max_position_embeddings
        for i, p in enumerate(prompts):
            if not p:
                raise InputError(f"prompt {i} is empty")
            bad = [t for t in p if t < 0 or t >= V]
            if bad:
                raise InputError(f"prompt {i}: token ids out of vocabulary [0, {V}): {bad[:5]}")
            if len(p) + max_new_tokens > maxpos:
                raise InputError(f"prompt {i}: {len(p)} prompt + {max_new_tokens} new tokens exceeds "
                                 f"max_position_embeddings={maxpos}")
        out: list[list[int]] = [[] for _ in prompts]
        if not prompts or max_new_tokens == 0:
            return out
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise InputError(f"prefill_chunk must be an int >= 1; got {prefill_chunk!r}")
        states = [self.new_state() for _ in prompts]
        logits = self._prefill(prompts, states, prefill_chunk)
        active = list(range(len(prompts)))
        step = 0
        while True:
            nxt = logits.argmax(-1).tolist()
            still = []
            for i, tok in zip(active, nxt):
                out[i].append(tok)
                if len(out[i]) < max_new_tokens and tok != eos_token_id:
                    still.append(i)
            step += 1
            if progress is not None:
                progress(step, max_new_tokens)
            active = still
            if not active:
                break
            ids = torch.tensor([out[i][-1] for i in active], dtype=torch.int64)
            pos = torch.tensor([states[i].length for i in active], dtype=torch.int64)
            logits = self.forward_batch(ids, pos, torch.arange(len(active)), [states[i] for i in active])
        return out

    def _prefill(self, prompts: list[list[int]], states: list[RequestState], chunk: int | None) -> torch.Tensor:
        """Prefill all prompts (chunked over positions if `chunk`); logits of each last token."""
        chunk = chunk or max(len(p) for p in prompts)
        last: list[torch.Tensor | None] = [None] * len(prompts)
        for off in range(0, max(len(p) for p in prompts), chunk):
            ids: list[int] = []
            pos: list[int] = []
            rid: list[int] = []
            rows: list[int] = []
            owners: list[int] = []
            for i, p in enumerate(prompts):
                seg = p[off:off + chunk]
                if not seg:
                    continue
                ids += seg
                pos += range(off, off + len(seg))
                rid += [i] * len(seg)
                if off + len(seg) == len(p):
                    rows.append(len(ids) - 1)
                    owners.append(i)
            lg = self.forward_batch(torch.tensor(ids), torch.tensor(pos), torch.tensor(rid), states,
                                    logits_rows=torch.tensor(rows, dtype=torch.int64))
            for i, row in zip(owners, lg):
                last[i] = row
        return torch.stack(last)


# ---------------------------------------------------------------------------------------------
# deterministic random weights (built-in tiny model, tests)


@torch.no_grad()
def randomize_weights_(module: nn.Module, config: DSV4Config, seed: int = 0) -> None:
    """Fill every parameter/buffer of a DSV4 module tree (ours or transformers', the names are the
    same) with deterministic random values of a scale that keeps activations O(1)."""
    g = torch.Generator().manual_seed(seed)
    E, k = config.n_routed_experts, config.num_experts_per_tok

    def rnd(shape, std, mean=0.0):
        return torch.randn(*shape, generator=g) * std + mean

    for name, t in sorted(list(module.named_parameters()) + list(module.named_buffers())):
        leaf = name.rsplit(".", 1)[-1]
        shape = tuple(t.shape)
        if "rotary" in name or "inv_freq" in name:
            continue
        if leaf == "tid2eid":
            v = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(shape[0])])
        elif leaf == "e_score_correction_bias":
            v = rnd(shape, 0.1)
        elif leaf == "sinks":
            v = rnd(shape, 0.5)
        elif leaf == "position_bias":
            v = rnd(shape, 0.5)
        elif leaf in ("fn", "hc_fn"):
            v = rnd(shape, 0.5 / shape[1] ** 0.5)
        elif leaf in ("base", "hc_base"):
            v = rnd(shape, 0.3)
        elif leaf in ("scale", "hc_scale"):
            v = rnd(shape, 0.2, 1.0)
        elif name.endswith("norm.weight"):
            v = rnd(shape, 0.1, 1.0)
        elif leaf in ("gate_up_proj", "down_proj") and len(shape) == 3:
            v = rnd(shape, shape[-1] ** -0.5)
        elif name.endswith("embed_tokens.weight"):
            v = rnd(shape, 1.0)
        elif leaf == "weight" and len(shape) == 2:
            v = rnd(shape, shape[-1] ** -0.5)
        else:
            raise RuntimeError(f"randomize_weights_: no rule for {name} {shape}")
        t.copy_(v.to(t.dtype))
