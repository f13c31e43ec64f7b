"""A small engine stand-in for the vLLM adapter's tests: it pages requests as vLLM does (one
block table per cache group, block ids from one shuffled pool, 0 the null block, sliding groups
releasing the blocks below their window, slot mappings ``block * block_tokens + offset`` and -1 for
padding) and hands out vLLM's per-step inputs."""

from __future__ import annotations

import random

import torch

from dsv4core.engines.vllm import allocate_packed


class MiniEngine:
    """Pages the requests like vLLM: per cache group a block table, blocks drawn from one shuffled
    pool of ids (0 is the null block), sliding groups releasing blocks below their window."""

    def __init__(self, parts, groups, num_blocks, seed=0, order=1, tensors=None):
        self.info = {}
        for p in parts:
            g = groups[p.key]
            self.info[g] = (p.block_tokens, p.window if p.paging == "sliding" else None)
        # the pages in `parts` order or reversed (a layer's entries before its window rows), or
        # the engine's own `tensors`; NaN rows everywhere, so a read of a row no step wrote shows
        if tensors is None:
            _, tensors = allocate_packed(parts[::order], num_blocks, fill=0xFF)
        self.tensors = tensors
        self.ref = {}
        for t in tensors.values():
            if t.is_floating_point():
                t[1:] = float("nan")
        for t in tensors.values():
            t[0] = 0         # the null block: zeros, as in vLLM's zero-filled allocation (never handed out)
        ids = list(range(1, num_blocks))
        random.Random(seed).shuffle(ids)
        self.free = ids
        self.tables = {g: {} for g in self.info}
        self.computed = {}

    def step(self, sched, pad_to=None, slot_mappings=True):
        """sched: [(request id, tokens)]; returns build_step's engine inputs."""
        ids, pos, qsl, lens = [], [], [0], []
        for rid, toks in sched:
            c = self.computed.get(rid, 0)
            ids += toks
            pos += range(c, c + len(toks))
            qsl.append(qsl[-1] + len(toks))
            lens.append(c + len(toks))
        n = len(pos)
        T = pad_to or n
        tables, slots = {}, {}
        for g, (bs, _) in self.info.items():
            rows = []
            for (rid, _), L in zip(sched, lens):
                t = self.tables[g].setdefault(rid, [])
                while len(t) * bs < L:
                    t.append(self.free.pop())
                    self.ref[t[-1]] = 1
                rows.append(t)
            width = max(len(r) for r in rows) + 1
            tables[g] = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)
            sm = torch.full((T,), -1, dtype=torch.int64)
            k = 0
            for r, (rid, toks) in zip(rows, sched):
                for j in range(len(toks)):
                    p = pos[k]
                    sm[k] = r[p // bs] * bs + p % bs
                    k += 1
            slots[g] = sm
        ids += [0] * (T - n)
        pos += [0] * (T - n)
        for (rid, toks), L in zip(sched, lens):
            self.computed[rid] = L
            for g, (bs, win) in self.info.items():
                if win is None:
                    continue
                t = self.tables[g][rid]
                for j in range(len(t)):
                    if t[j] and (j + 1) * bs <= L - win + 1:     # no position of it readable any more
                        self._release(t[j])
                        t[j] = 0
        return dict(input_ids=torch.tensor(ids), positions=torch.tensor(pos), query_start_loc=torch.tensor(qsl),
                    seq_lens=torch.tensor(lens), block_tables=tables, slot_mappings=slots if slot_mappings else None)


    def _release(self, b):
        self.ref[b] -= 1
        if not self.ref[b]:
            self.free.append(b)

    def share(self, src, dst):
        """Request `dst` starts as a copy of request `src`'s tokens (a prefix-cache hit on all of
        them, at a block boundary of every group): its tables list `src`'s blocks, shared."""
        n = self.computed[src]
        for g, (bs, _) in self.info.items():
            assert n % bs == 0, (g, n, bs)
            self.tables[g][dst] = list(self.tables[g][src])
            for b in self.tables[g][dst]:
                if b:
                    self.ref[b] += 1
        self.computed[dst] = n


def allocate_overlaid(parts, groups, num_blocks, fill=0xFF):
    """vLLM's packed layout (ENGINES.md 1.2): one allocation of `num_blocks` blocks; within a block,
    each cache group's pages side by side from byte 0 in `parts` order (no padding between pages),
    the groups laid over each other (a block id serves one group); the block stride the longest
    group's pages, rounded up to `block_stride_alignment` and 8 bytes. Part key -> block tensor."""
    from math import lcm

    from dsv4core.engines.vllm.layout import block_stride_alignment

    offs, ends = {}, {}
    for p in parts:
        g = groups[p.key]
        offs[p.key] = ends.get(g, 0)
        ends[g] = offs[p.key] + p.page_bytes
    align = lcm(block_stride_alignment(parts), 8)
    stride = -(-max(ends.values()) // align) * align
    buf = torch.full((num_blocks * stride,), fill, dtype=torch.uint8)
    out = {}
    for p in parts:
        es = p.dtype.itemsize
        assert offs[p.key] % es == 0 and stride % es == 0, p.key
        out[p.key] = torch.as_strided(buf.view(p.dtype), (num_blocks, p.rows_per_block, p.row_width),
                                      (stride // es, p.row_width, 1), offs[p.key] // es)
    return out


def groups_like_vllm(parts):
    """vLLM's grouping of the tiny model's parts (what vLLM's own grouping gives, see
    tests/test_vllm_real.py): the window rows in two groups, every compressed part in one 256-token
    group, the states by block size."""
    out = {}
    for p in parts:
        if p.part == "window":
            out[p.key] = f"swa{p.layer % 2}"
        elif p.paging == "full":
            out[p.key] = "compressed"
        else:
            out[p.key] = f"state{p.block_tokens}"
    return out


def tokens(n, seed):
    return torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def native_logits(m, states, sched, positions):
    """dsv4core's own step over the same requests."""
    ids = torch.tensor([t for _, toks in sched for t in toks])
    rid = torch.tensor([k for k, (_, toks) in enumerate(sched) for _ in toks])
    return m.forward_batch(ids, positions, rid, [states[r] for r, _ in sched])


def step_plan(prompts):
    """The steps of the tests: mixed prefill chunks and decodes of four requests (one crossing a
    256-token block), then decodes of all four."""
    at = {r: 0 for r in prompts}

    def chunk(r, k):
        toks = prompts[r][at[r]:at[r] + k]
        at[r] += k
        return (r, toks)

    plan = [[chunk(0, 100), chunk(1, 70), chunk(2, 5)],
            [chunk(0, 130), (1, tokens(1, 11)), (2, tokens(1, 12)), chunk(3, 40)],
            [chunk(0, 70), (1, tokens(1, 13)), (2, tokens(1, 14)), chunk(3, 100)]]
    return plan + [[(r, tokens(1, 20 + 4 * s + r)) for r in range(4)] for s in range(6)]
