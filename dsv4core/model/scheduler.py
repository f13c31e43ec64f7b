"""Continuous batching for `DSV4ForCausalLM.generate`: which requests run in the next step, how
many of a prompt's tokens it prefills, admission against the pools' free blocks (host-side
bookkeeping only; the step itself is `forward_batch`)."""

from __future__ import annotations

import secrets
from collections import deque

import numpy as np
import torch

from .kvcache import PoolFullError
from .inputs import DeviceTokens, InputError, eos_ids
from .sampling import RowSampling, request_seed


def _base_seed(model, seed: int | None) -> int:
    """`seed`, or (None) a fresh random one, rank 0's on every rank of a tp x ep model (all draw alike)."""
    if seed is not None:
        return seed
    seed = secrets.randbits(63)
    if model.parallel.world == 1:
        return seed
    mine = torch.tensor([[seed]], dtype=torch.int64, device=model.device)
    return int(model.ops.all_gather(mine, 0, None)[0, 0])


class Scheduler:
    """Continuous batching for `generate` (host-side bookkeeping only)."""

    def __init__(self, model, cache, prompts, max_new, eos, chunk, progress, sampling=None, on_token=None) -> None:
        self.model, self.cache, self.prompts, self.max_new = model, cache, prompts, max_new
        self.eos = eos if isinstance(eos, frozenset) else eos_ids(eos)    # the ids that end a request
        self.chunk, self.progress, self.on_token = chunk, progress, on_token
        #: sampled decoding: each prompt's row (`sampling.RowSampling`), seeded request_seed(seed, i)
        self.rows = None if sampling is None or sampling.greedy else RowSampling(
            sampling, [request_seed(_base_seed(model, sampling.seed), i) for i in range(len(prompts))])
        self.waiting = deque(range(len(prompts)))
        self.running: dict[int, list] = {}     # i -> [state, prompt tokens consumed]
        self.done = 0

    def _new_request(self):
        return self.cache.new_request()

    def _blocks(self, i: int) -> int:
        return -(-(len(self.prompts[i]) + self.max_new) // self.cache.block_tokens) if self.cache.ratios else 0

    def _free_blocks(self) -> int:
        """The compressed blocks not yet promised to running requests: the pool's free blocks,
        less what running requests will still take (requests outside this call hold theirs)."""
        c = self.cache
        pending = sum(max(0, self._blocks(i) - int((c.comp_table[st.slot] > 0).sum()))
                      for i, (st, _) in self.running.items())
        return len(c.comp_pool.free) - pending

    def _can_admit(self) -> bool:
        """Would `_admit` admit the first waiting prompt now (a free slot and its blocks)?"""
        return bool(self.waiting and self.cache.free_slots and self._blocks(self.waiting[0]) <= self._free_blocks())

    def _admit(self) -> None:
        """Admit waiting prompts while a slot is free and the compressed blocks not yet promised to
        running requests (`_free_blocks`) cover a prompt's whole length."""
        c = self.cache
        free_blocks = self._free_blocks()
        while self.waiting:
            i = self.waiting[0]
            need = self._blocks(i)
            if not c.free_slots or need > free_blocks:
                if self.running:
                    break                          # wait for a running request to finish
                if need > c.comp_pool.n - 1:
                    raise InputError(f"prompt {i}: {len(self.prompts[i])} + {self.max_new} tokens need {need} "
                                     f"compressed blocks; the cache has {c.comp_pool.n - 1} (raise CacheConfig.max_tokens)")
                if not c.free_slots:
                    raise PoolFullError(f"generate: no free request slot (all {c.cc.max_requests} are held by live "
                                        f"requests outside this call); release some or configure a larger cache")
                raise PoolFullError(f"generate: prompt {i} needs {need} compressed blocks, {free_blocks} are free "
                                    f"(live requests outside this call hold the rest)")
            self.waiting.popleft()
            self.running[i] = [self._new_request(), 0]
            free_blocks -= need

    def run(self, out: list[list[int]]) -> None:
        """Steps until every prompt is done. A step's tokens are read back one step late when the
        next step can be built without them: all running requests decode, none is admitted. Then
        the next step takes them as `DeviceTokens` and is queued before the host waits for them,
        so the host's bookkeeping overlaps the device's step. A request found finished (eos) in
        the read-back ran one step too many; that step's token is dropped."""
        self.total = len(self.prompts) * self.max_new
        pending = None                    # (owners, DeviceTokens) of the last step, not read yet
        while self.waiting or self.running or pending:
            nxt = self._queued_step(out, *pending) if pending else None
            if pending:
                self._take(out, *pending)
            if nxt is None:
                if not (self.waiting or self.running):
                    break
                nxt = self._host_step(out)
            pending = nxt

    def _queued_step(self, out, owners, toks):
        """The next all-decode step fed the pending tokens (`toks`, one per owner) on the device,
        or None when it needs them on the host first: a prefill chunk or a request without a
        pending token, a possible admission, more tokens than a step takes."""
        run = self.running
        if any(run[i][1] < len(self.prompts[i]) for i in run):
            return None
        # finishing with the pending token (max_new; an eos shows only when it is read)
        done_now = {i for i in owners if i in run and len(out[i]) + 1 >= self.max_new}
        keep = [k for k, i in enumerate(owners) if i in run and i not in done_now]
        if not keep or len(keep) + len(done_now) != len(run) or len(keep) > self.cache.cc.max_step_tokens:
            return None
        if self.waiting and (done_now or self._can_admit()):
            return None                   # a prompt can be admitted (or may be, once these finish): host path
        sel = [owners[k] for k in keep]
        states = [self.running[i][0] for i in sel]
        ids = toks if len(keep) == len(owners) else DeviceTokens(
            toks.tensor.index_select(0, self.cache.uploads.to_device(np.array(keep, dtype=np.int64))), toks.vocab)
        return sel, self._next(ids, torch.tensor([st.length for st in states]), torch.arange(len(states)), states,
                               sel)

    def _host_step(self, out):
        """A step built from host values: admissions, prefill chunks, decode tokens read back."""
        self._admit()
        ids, pos, rid, rows, owners, states = [], [], [], [], [], []
        budget = self.cache.cc.max_step_tokens
        for i, (st, used) in self.running.items():
            p = self.prompts[i]
            if used < len(p):                      # prefill chunk
                n = min(self.chunk, len(p) - used, budget)
                if n <= 0:
                    continue
                seg = p[used:used + n]
                self.running[i][1] = used + n
                last = used + n == len(p)
            else:                                  # decode
                if budget <= 0:
                    continue
                seg, n, last = [out[i][-1]], 1, True
            budget -= n
            r = len(states)
            states.append(st)
            ids += seg
            pos += range(st.length, st.length + n)
            rid += [r] * n
            if last:
                rows.append(len(ids) - 1)
                owners.append(i)
        return owners, self._next(torch.tensor(ids), torch.tensor(pos), torch.tensor(rid), states, owners,
                                  torch.tensor(rows, dtype=torch.int64))

    def _next(self, ids, pos, rid, states, owners, rows=None) -> DeviceTokens:
        """Run the step; its next tokens (one per owner), left on the device: the argmax of the
        logits, or drawn on the device (`forward_batch(sample=...)`: inside the decode graph)."""
        if self.rows is None:
            return self.model.greedy_tokens(self.model.forward_batch(ids, pos, rid, states, logits_rows=rows))
        return self.model.forward_batch(ids, pos, rid, states, logits_rows=rows, sample=self.rows.select(owners))

    def _take(self, out, owners, toks) -> None:
        """Read a step's tokens (this waits for it): append, and retire finished requests."""
        for i, tok in zip(owners, toks.tolist()):
            if i not in self.running:          # finished (eos) in the step before: one step too many
                continue
            out[i].append(tok)
            self.done += 1
            if self.on_token is not None:
                self.on_token(i, tok)
            if len(out[i]) >= self.max_new or tok in self.eos:
                self.done += self.max_new - len(out[i])
                st, _ = self.running.pop(i)
                st.release()
        if self.progress is not None:
            self.progress(self.done, self.total)

    def release_all(self) -> None:
        for st, _ in self.running.values():
            st.release()
        self.running.clear()
