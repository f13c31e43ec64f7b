"""Train only the MTP block of the built-in tiny model ("tiny-mtp") on the tiny model's own greedy
continuations, so that its drafts are accepted; then measure speculative decoding end to end.

    python benchmarks/train_tiny_mtp.py --steps 300 --out /tmp/tiny-mtp-trained --json result.json

Data: random prompts, each continued greedily by the (fixed, random-weight) main model. A step
prefills a batch of these sequences through the main model (no gradient; the pre-hc_head stream
of every row), then runs the MTP block over the same positions with the tokens after them (the
catch-up `mtp_draft` does, here with autograd on the block's parameters) and takes the cross
entropy of its logits at position p against the sequence's token p + 2 wherever that token is a
generated one. Only the `model.mtp.0.*` parameters change; the embedding and the lm_head are the
main model's and stay fixed. Everything is seeded (one CPU thread): the trained checkpoint is
reproducible from the seed. Measured, never asserted: mean acceptance length for k = 1, 2, 3 on
held-out prompts and batch-1 tokens/s with and without speculation.

    python benchmarks/train_tiny_mtp.py --measure /tmp/tiny-mtp-trained --device cuda --json result.json

measures a trained checkpoint (the same held-out prompts of the seed) on another device and
backend, without training: acceptance and batch-1 tokens/s, speculation off and on.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def _sequences(model, n, prompt_len, new, gen):
    prompts = [torch.randint(2, model.config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(n)]
    outs = model.generate(prompts, new)
    return [p + o for p, o in zip(prompts, outs)]


def _mtp_loss(model, seqs, prompt_len):
    """Cross entropy of the MTP block's predictions of token p + 2 over a batch of sequences."""
    cache, blk = model.cache, model.model.mtp[0]
    states = [model.new_state(mtp=True) for _ in seqs]
    try:
        T = len(seqs[0]) - 1                        # positions 0..T-1 fed, token T only as a target
        ids = torch.tensor([t for s in seqs for t in s[:T]])
        pos = torch.arange(T).repeat(len(seqs))
        rid = torch.arange(len(seqs)).repeat_interleave(T)
        with torch.no_grad():
            _, hidden = model.forward_batch(ids, pos, rid, states, hidden_rows=torch.arange(len(ids)))
        # the block over positions 0..T-2 (their next tokens 1..T-1), as the catch-up runs it
        n = T - 1
        keep = torch.cat([torch.arange(r * T, r * T + n) for r in range(len(seqs))])
        nxt = np.array([t for s in seqs for t in s[1:T]], dtype=np.int64)
        p = np.tile(np.arange(n), len(seqs))
        counts = np.full(len(seqs), n, dtype=np.int64)
        plan = cache.prepare(states, counts, starts=np.zeros(len(seqs), dtype=np.int64))
        try:
            cache.sync_tables()
            step, _ = model._make_step(nxt, p, counts, plan.slots, np.zeros(len(seqs), dtype=np.int64))
            with torch.enable_grad():
                X = blk(model._embed(step.input_ids), hidden[keep], step)
                logits = model._lm_head(blk.head(X))
                target = torch.tensor([t for s in seqs for t in s[2:T + 1]])
                mask = torch.tensor([q + 2 >= prompt_len for _ in seqs for q in range(n)])
                loss = torch.nn.functional.cross_entropy(logits[mask], target[mask])
        finally:
            plan.rollback()
        return loss
    finally:
        for st in states:
            st.release()
        # the pools hold rows written with autograd on: keep only their values
        cache.rows[:] = [r.detach() for r in cache.rows]


def _measure(model, prompts, new):
    out = {}
    t = time.perf_counter()
    want = [model.generate([p], new) for p in prompts]
    out["plain_tok_s"] = len(prompts) * new / (time.perf_counter() - t)
    for k in (1, 2, 3):
        t = time.perf_counter()
        got, acc, rounds = [], 0, 0
        for p in prompts:
            g = model.generate([p], new, speculative_tokens=k)
            got.append(g)
            acc += g.speculation["accepted_tokens"]
            rounds += g.speculation["rounds"]
        dt = time.perf_counter() - t
        assert got == want, "speculative output differs from greedy"
        out[f"k{k}"] = {"mean_acceptance_length": (rounds + acc) / rounds if rounds else None,
                        "tok_s": len(prompts) * new / dt}
    return out


def measure_only(a) -> None:
    """A trained checkpoint on ``a.device`` / ``a.backend``: acceptance and batch-1 tokens/s on the
    seed's held-out prompts (the training run's), the best of ``a.reps`` passes after a warm-up."""
    import platform

    from dsv4core.model.api import load_model

    model = load_model(a.measure, backend=a.backend, device=a.device)
    gen = torch.Generator().manual_seed(a.seed)
    held_out = [torch.randint(2, 256, (a.prompt_len,), generator=gen).tolist() for _ in range(8)]
    passes = [_measure(model, held_out, 32) for _ in range(max(2, a.reps))][1:]
    best = {"plain_tok_s": max(p["plain_tok_s"] for p in passes)}
    for k in (1, 2, 3):
        best[f"k{k}"] = {"mean_acceptance_length": passes[0][f"k{k}"]["mean_acceptance_length"],
                         "tok_s": max(p[f"k{k}"]["tok_s"] for p in passes)}
        best[f"k{k}"]["speedup"] = round(best[f"k{k}"]["tok_s"] / best["plain_tok_s"], 3)
    res = {"what": "the trained tiny-mtp checkpoint: mean acceptance length (k = 1, 2, 3) and batch-1 tokens/s "
                   "with and without speculation on 8 held-out prompts (32 new tokens each; best of the timed passes)",
           "checkpoint": str(a.measure), "device": str(model.device), "backend": model.hal_report()[0].get("backend"),
           "graphs": model.graph_status() or "on", "passes": len(passes), "seed": a.seed, "torch": torch.__version__,
           "python": platform.python_version(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "result": best}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--new", type=int, default=40, help="greedy tokens per training sequence")
    ap.add_argument("--pool", type=int, default=512, help="training sequences (generated once)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the trained model (transformers layout) here")
    ap.add_argument("--json", default=None)
    ap.add_argument("--measure", metavar="DIR", help="only measure this trained checkpoint (no training)")
    ap.add_argument("--device", default="cpu", help="--measure: the device")
    ap.add_argument("--backend", default=None, help="--measure: the backend (default: the device's auto)")
    ap.add_argument("--reps", type=int, default=3, help="--measure: timed passes over the prompts (the first is a warm-up)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    from dsv4core.model.api import load_model

    if a.measure:
        return measure_only(a)
    model = load_model("tiny-mtp", backend="reference")
    model.use_graphs = False
    model.configure_cache(max_requests=max(a.batch, 8), max_tokens=a.batch * 256, max_request_tokens=256,
                          max_step_tokens=a.batch * 256)
    gen = torch.Generator().manual_seed(a.seed)
    held_out = [torch.randint(2, 256, (a.prompt_len,), generator=gen).tolist() for _ in range(8)]
    t0 = time.perf_counter()
    data = _sequences(model, a.pool, a.prompt_len, a.new, gen)
    t_data = time.perf_counter() - t0
    before = _measure(model, held_out, 32)
    params = [p for n, p in model.named_parameters() if n.startswith("model.mtp.")]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=a.lr)
    log = []
    t0 = time.perf_counter()
    for s in range(a.steps):
        idx = torch.randint(0, len(data), (a.batch,), generator=gen).tolist()
        loss = _mtp_loss(model, [data[i] for i in idx], a.prompt_len)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if s % 25 == 0 or s == a.steps - 1:
            log.append((s, round(loss.item(), 4)))
            print(f"step {s}: loss {loss.item():.4f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    t_train = time.perf_counter() - t0
    for p in params:
        p.requires_grad_(False)
    after = _measure(model, held_out, 32)
    res = {"what": "tiny-mtp: only the MTP block trained on the main model's greedy continuations; mean acceptance "
                   "length (k = 1, 2, 3) and batch-1 tokens/s on 8 held-out prompts, before and after",
           "command": f"python benchmarks/train_tiny_mtp.py --steps {a.steps} --pool {a.pool} --batch {a.batch} "
                      f"--seed {a.seed}", "steps": a.steps, "batch": a.batch, "seed": a.seed, "lr": a.lr, "data_s": round(t_data, 1),
           "train_s": round(t_train, 1), "loss": log, "before": before, "after": after}
    print(json.dumps(res, indent=1))
    if a.out:
        from dsv4core.checkpoint import save

        save(model, a.out)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
