"""Speculative decoding: the MTP block's draft call (`mtp_draft`), the proposer interface
(`Proposer`, `MTPProposer`) and the verifier, greedy generation with continuous batching that
checks the drafted tokens of every request in one step (`generate(..., speculative_tokens=k)`).

One round of a request whose state holds n tokens and whose next token x_n is known:

1. draft: its proposer drafts d_1..d_k (the MTP proposer: `mtp_draft`);
2. verify: one `forward_batch` over [x_n, d_1, .., d_k] at positions n..n+k (together with the
   other requests' rounds and prefill chunks), logits of every row; g_j is the argmax of row j,
   a the length of the longest prefix with d_{j+1} = g_j; the new tokens are g_0..g_a (the last
   one the "bonus" token);
3. roll back: `state.truncate(n + 1 + a)`: the rejected drafts' rows lie past the length;
4. the proposer observes the committed rows (the MTP proposer: the MTP block catches up over
   positions n..n+a with the main model's stream of those rows and the tokens after them, and
   drafts from its last row).

The verifier (2, 3) is the same for every proposer. Greedy only: the output equals plain greedy
decoding token for token.

The MTP block's state is one more (sliding-window) layer of the cache, addressed through the
request's window block table like the other layers' rows, so it is forked (copy-on-write) and
truncated with the request; `RequestState.mtp_length` says how far it holds rows. Its draft rows
past the request's length live only during `mtp_draft` (their blocks are given back at the end).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .kvcache import PoolFullError, RequestState
from .graphs import DecodeGraphs
from .inputs import InputError
from .scheduler import Scheduler


def _check_mtp(model, what: str) -> None:
    if not model.has_mtp:
        raise InputError(f"{what}: speculative decoding is unavailable: {model.speculation_why}")


@torch.no_grad()
def mtp_draft(model, states: Sequence[RequestState], tokens: Sequence[Sequence[int]],
              hidden: Sequence[torch.Tensor], k: int | Sequence[int]) -> list[list[int]]:
    """Advance the MTP block's state of each request to its length, then draft `k` tokens.

    states[i]: a request tracking the MTP block (`model.new_state(mtp=True)`), c_i = length -
    mtp_length rows behind its main layers; tokens[i]: the c_i token ids of positions
    mtp_length + 1 .. length (the last one the request's next token, not yet in its state);
    hidden[i]: [c_i, hc_mult, hidden] the main model's stream before its hc_head at positions
    mtp_length .. length - 1 (`forward_batch(..., hidden_rows=...)`). k: drafts per request (an
    int for all, or one each; 0: catch up only; k >= 1 needs c_i >= 1).

    One forward of the MTP block over every request's c_i tokens (its rows at those positions
    become state: mtp_length = length), whose last row's logits give d_1, then k - 1 one-token
    forwards (the block re-run on its own stream and the previous draft, at positions length ..
    length + k - 2; rows past the length, not kept). Returns the greedy drafts [d_1..d_k] of each
    request. Bad input raises before anything changes; a failure inside leaves every request
    as it was. The forwards of one token a request (the drafts past d_1; the catch-up when every
    request is one row behind) replay device graphs when the model uses graphs (`_draft_graphs`)."""
    _check_mtp(model, "mtp_draft")
    cache = model.cache
    n = len(states)
    ks = [k] * n if isinstance(k, int) else [int(x) for x in k]
    if len(ks) != n or len(tokens) != n or len(hidden) != n:
        raise InputError(f"mtp_draft: states ({n}), tokens ({len(tokens)}), hidden ({len(hidden)}) and k "
                         f"({len(ks)}) must have one entry per request")
    V, hc, H = model.config.vocab_size, model.config.hc_mult, model.config.hidden_size
    seen = set()
    for i, st in enumerate(states):
        if not isinstance(st, RequestState) or st.cache is not cache:
            raise InputError(f"mtp_draft: request {i} is not a request of this model's cache (use model.new_state())")
        if st.released:
            raise InputError(f"mtp_draft: request {i} (slot {st.slot}) was released")
        if st.mtp_length is None:
            raise InputError(f"mtp_draft: request {i} does not track the MTP block (create it with "
                             f"model.new_state(mtp=True))")
        if id(st) in seen:
            raise InputError(f"mtp_draft: request {i} appears twice")
        seen.add(id(st))
        c = st.length - st.mtp_length
        if len(tokens[i]) != c:
            raise InputError(f"mtp_draft: request {i}: tokens must be the {c} ids of positions {st.mtp_length + 1}.."
                             f"{st.length} (its MTP rows are {c} behind its length {st.length}); got {len(tokens[i])}")
        bad = [t for t in tokens[i] if not 0 <= int(t) < V]
        if bad:
            raise InputError(f"mtp_draft: request {i}: token ids out of vocabulary [0, {V}): {bad[:5]}")
        h = hidden[i]
        if not isinstance(h, torch.Tensor) or tuple(h.shape) != (c, hc, H) or h.device != model.device:
            got = f"{tuple(h.shape)} on {h.device}" if isinstance(h, torch.Tensor) else type(h).__name__
            raise InputError(f"mtp_draft: request {i}: hidden must be [{c}, {hc}, {H}] on {model.device}; got {got}")
        if ks[i] < 0 or (ks[i] > 0 and c == 0):
            raise InputError(f"mtp_draft: request {i}: k = {ks[i]}; drafting (k >= 1) needs the stream and the next "
                             f"token of its last position (its MTP rows are at its length already)" if ks[i] > 0
                             else f"mtp_draft: request {i}: k must be >= 0; got {ks[i]}")
    cu = [i for i in range(n) if states[i].length > states[i].mtp_length]
    dr = [i for i in cu if ks[i] > 0]
    counts = np.array([states[i].length - states[i].mtp_length for i in cu], dtype=np.int64)
    starts = np.array([states[i].mtp_length for i in cu], dtype=np.int64)
    out: list[list[int]] = [[] for _ in range(n)]
    if not cu:
        return out
    blk = model.model.mtp[0]
    plan = cache.prepare([states[i] for i in cu], counts, starts=starts)     # raises with nothing changed
    chain = [i for i in dr if ks[i] > 1]
    plan_d = None
    try:
        if chain:   # the draft positions past the length: blocks for this call only
            plan_d = cache.prepare([states[i] for i in chain], [ks[i] - 1 for i in chain])
        cache.sync_tables()
        ids = np.array([int(t) for i in cu for t in tokens[i]], dtype=np.int64)
        pos = np.concatenate([np.arange(states[i].mtp_length, states[i].length) for i in cu])
        ends = np.cumsum(counts) - 1
        last = np.array([ends[cu.index(i)] for i in dr], dtype=np.int64)
        stream = torch.cat([hidden[i] for i in cu]).to(model.act_dtype)
        graphs = _draft_graphs(model)
        got = None
        if graphs is not None and counts.size == ids.size:      # one row a request: decode-shaped
            got = graphs.run_stream(ids, pos, plan.slots, stream)
        if got is not None:
            X, d = got
            if len(dr) < len(cu):
                at = cache.uploads.to_device(last)
                X, d = X[at], d[at]
        else:
            step, (rows,) = model._make_step(ids, pos, counts, plan.slots, starts, (last,))
            X = blk(model._embed(step.input_ids), stream, step)
            X = X[rows]                                      # [len(dr), hc, H]: each drafter's last row
            d = model._lm_head(blk.head(X)).argmax(-1)
        drafts = [(list(range(len(dr))), d)]
        slot = {i: states[i].slot for i in dr}
        for j in range(2, max(ks[i] for i in dr) + 1 if dr else 0):
            sel = [a for a in range(len(dr)) if ks[dr[a]] >= j]
            sel_t = torch.tensor(sel, device=model.device)
            p = np.array([states[dr[a]].length + j - 2 for a in sel], dtype=np.int64)
            sl = np.array([slot[dr[a]] for a in sel], dtype=np.int64)
            got = None if graphs is None else graphs.run_stream(d[sel_t], p, sl, X[sel_t])
            if got is None:
                step, _ = model._make_step(d[sel_t], p, np.ones(len(sel), dtype=np.int64), sl, p)
                got = _draft_step(model, step, X[sel_t])
            Xj, dj = got
            X, d = X.index_copy(0, sel_t, Xj), d.index_copy(0, sel_t, dj)
            drafts.append((sel, dj))
        for sel, dj in drafts:
            for a, t in zip(sel, dj.tolist()):
                out[dr[a]].append(t)
    except BaseException:
        if plan_d is not None:
            plan_d.rollback()
        plan.rollback()
        raise
    if plan_d is not None:
        plan_d.rollback()            # the draft rows past the length are not state
    for i in cu:
        states[i].mtp_length = states[i].length
    plan.commit()                    # frees the window blocks the MTP rows no longer need either
    return out


def _draft_step(model, step, stream: torch.Tensor):
    """The MTP block over a step continuing `stream` [T, hc, H]: (its stream, the greedy token of
    each row). Eager, and what the draft graphs record."""
    blk = model.model.mtp[0]
    X = blk(model._embed(step.input_ids), stream, step)
    return X, model._lm_head(blk.head(X)).argmax(-1)


def _draft_graphs(model):
    """The graphs of the draft steps (one token a request: a variant of the model's decode graphs,
    sharing their memory pool; the block is sliding-window only), or None when graphs are off."""
    if model.graph_status():
        return None
    if model._graphs is None:
        model._graphs = DecodeGraphs(model, model.graph_buckets, model._graph_why[2])
    return model._graphs.variant("mtp_draft", lambda step, stream: _draft_step(model, step, stream), contexts=False)


# --------------------------------------------------------------------------------------------
# proposers


@dataclass
class DraftRequest:
    """What a proposer sees of one request after a step committed rows of it.

    `state`: the request (its length counts the committed rows); `tokens`: its known tokens
    (prompt and generated ones), `tokens[state.length]` being its next token (not yet in the
    state; further ones are prompt tokens still to prefill); `hidden`: the main model's stream
    before its hc_head [m, hc_mult, hidden] of the m rows the step committed (positions
    length - m .. length - 1), or None for a proposer that does not ask for it; `k`: how many
    tokens to draft now (0 while the prompt is still being prefilled, fewer near the end)."""

    state: RequestState
    tokens: Sequence[int]
    hidden: torch.Tensor | None
    k: int


class Proposer(abc.ABC):
    """Drafts tokens for a batch of requests from their states; the verifier (`generate` with
    `speculative_tokens`) is the same for every proposer.

    `propose` is called after every step that committed rows of the requests (a prefill chunk or
    a verification, after its rollback), with all of them at once; it returns up to `k` draft
    tokens for each (fewer, or none, is allowed: the round then verifies what there is).
    `new_state` creates the requests (a proposer with state of its own in the cache asks for it
    there). `needs_hidden`: whether the main model's steps return the stream of the committed
    rows for it (`DraftRequest.hidden`)."""

    needs_hidden: bool = False

    def new_state(self, model) -> RequestState:
        return model.new_state()

    def check(self, model) -> None:
        """Raise a clear error when this proposer cannot draft for `model`."""

    @abc.abstractmethod
    def propose(self, model, batch: Sequence[DraftRequest]) -> list[list[int]]:
        ...


class MTPProposer(Proposer):
    """The model's own MTP block: its state is one more layer of the cache (`mtp_draft`)."""

    needs_hidden = True

    def new_state(self, model) -> RequestState:
        return model.new_state(mtp=True)

    def check(self, model) -> None:
        _check_mtp(model, "the MTP proposer")

    def propose(self, model, batch: Sequence[DraftRequest]) -> list[list[int]]:
        toks = [list(r.tokens[r.state.mtp_length + 1:r.state.length + 1]) for r in batch]
        return mtp_draft(model, [r.state for r in batch], toks, [r.hidden for r in batch], [r.k for r in batch])


# --------------------------------------------------------------------------------------------
# the verifier: greedy generation with continuous batching


@dataclass
class AcceptanceStats:
    """Acceptance of drafted tokens over the verification rounds that had at least one draft:
    `mean_acceptance_length` = tokens emitted per such round (accepted drafts + the bonus token),
    `per_position[j]`: how often the (j+1)-th draft was offered and accepted."""

    k: int
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    offered_at: list = field(default_factory=list)
    accepted_at: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.offered_at = [0] * self.k
        self.accepted_at = [0] * self.k

    def record(self, n_drafts: int, n_accepted: int) -> None:
        if not n_drafts:
            return
        self.rounds += 1
        self.drafted += n_drafts
        self.accepted += n_accepted
        for j in range(n_drafts):
            self.offered_at[j] += 1
            self.accepted_at[j] += j < n_accepted

    def as_dict(self) -> dict:
        r = self.rounds
        return {
            "speculative_tokens": self.k, "rounds": r, "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
            "mean_acceptance_length": (r + self.accepted) / r if r else None,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "per_position": [{"position": j + 1, "offered": o, "accepted": a, "rate": a / o if o else None}
                             for j, (o, a) in enumerate(zip(self.offered_at, self.accepted_at))],
        }


class Generation(list):
    """`generate`'s result: the new tokens of each prompt (a list of lists), and `speculation`:
    the acceptance statistics (`AcceptanceStats.as_dict()`) when drafts were verified, else None."""

    speculation: dict | None = None


class SpeculativeScheduler(Scheduler):
    """`generate` with speculative decoding: every step is one `forward_batch` over the prefill
    chunks of admitted requests and the verification rounds ([next token, drafts]) of the others;
    host-synchronous (the drafts depend on the step's result)."""

    def __init__(self, model, cache, prompts, max_new, eos, chunk, progress, proposer: Proposer, k: int) -> None:
        super().__init__(model, cache, prompts, max_new, eos, chunk, progress)
        self.proposer, self.k = proposer, k
        self.drafts: dict[int, list[int]] = {}
        self.stats = AcceptanceStats(k)

    def _new_request(self):
        return self.proposer.new_state(self.model)

    def run(self, out: list[list[int]]) -> None:
        self.total = len(self.prompts) * self.max_new
        while self.waiting or self.running:
            self._round(out)

    def _round(self, out) -> None:
        self._admit()
        ids, pos, rid, states, segs = [], [], [], [], []
        budget = self.cache.cc.max_step_tokens
        for i, (st, used) in self.running.items():
            p = self.prompts[i]
            if used < len(p):                              # a prefill chunk
                n = min(self.chunk, len(p) - used, budget)
                if n <= 0:
                    continue
                seg = p[used:used + n]
                self.running[i][1] = used + n
                final = used + n == len(p)
            else:                                          # a verification round
                seg = [out[i][-1]] + self.drafts.pop(i, [])[:max(budget - 1, 0)]
                if budget < 1:
                    continue
                final = None
            n = len(seg)
            budget -= n
            segs.append((i, len(ids), n, final))
            rid += [len(states)] * n
            states.append(st)
            ids += seg
            pos += range(st.length, st.length + n)
        if not segs:
            raise PoolFullError("generate: the step budget (max_step_tokens) admits no request")
        rows = [r for i, t0, n, final in segs for r in (range(t0, t0 + n) if final is None else
                                                         [t0 + n - 1] if final else [])]
        hrows = torch.arange(len(ids)) if self.proposer.needs_hidden else None
        res = self.model.forward_batch(torch.tensor(ids), torch.tensor(pos), torch.tensor(rid), states,
                                       logits_rows=torch.tensor(rows, dtype=torch.int64), hidden_rows=hrows)
        lg, hid = res if hrows is not None else (res, None)
        g = lg.argmax(-1).tolist()
        at = 0
        batch, owners = [], []
        for i, t0, n, final in segs:
            st = self.running[i][0]
            if final is False:                             # a prefill chunk: no token yet
                keep, new = n, []
            elif final:
                keep, new = n, [g[at]]
                at += 1
            else:
                tgt, drafted = g[at:at + n], ids[t0 + 1:t0 + n]
                at += n
                a = 0
                while a < len(drafted) and drafted[a] == tgt[a]:
                    a += 1
                self.stats.record(len(drafted), a)
                if a < len(drafted):
                    st.truncate(st.length - (len(drafted) - a))    # roll back the rejected drafts
                keep, new = 1 + a, tgt[:a + 1]
            if self._emit(out, i, new):
                continue                                   # finished and released
            left = self.max_new - len(out[i])
            k = 0 if self.running[i][1] < len(self.prompts[i]) else max(0, min(self.k, left - 1))
            batch.append(DraftRequest(st, self.prompts[i] + out[i],
                                      hid[t0:t0 + keep] if hid is not None else None, k))
            owners.append(i)
        if batch:
            for i, d in zip(owners, self.proposer.propose(self.model, batch)):
                want = batch[owners.index(i)].k
                self.drafts[i] = [int(t) for t in d[:want]]
        if self.progress is not None:
            self.progress(self.done, self.total)

    def _emit(self, out, i: int, new: list[int]) -> bool:
        """Append a request's new tokens; True when it finished (max_new, eos) and was released."""
        for tok in new:
            out[i].append(tok)
            self.done += 1
            if len(out[i]) >= self.max_new or tok in self.eos:
                self.done += self.max_new - len(out[i])
                st, _ = self.running.pop(i)
                st.release()
                self.drafts.pop(i, None)
                return True
        return False


__all__ = ["AcceptanceStats", "DraftRequest", "Generation", "MTPProposer", "Proposer", "SpeculativeScheduler",
           "mtp_draft"]
