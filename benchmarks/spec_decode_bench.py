"""Speculative decoding's step costs: a plain decode step, a verify step and the k MTP draft steps,
per batch size and k, and the speedup they predict for measured mean acceptance lengths.

Model: `--model flash|small|tiny` (e2e_decode.py's dims, `--layers` cycling sliding / CSA / HCA / CSA,
an MTP block, random weights drawn on the device; `--weights official`: e2e_decode.py's FP8 / packed
FP4 formats) or a built-in model with an MTP block (`tiny-mtp`, `tiny-official-mtp`).

Per batch B: B random prompts of `--context` tokens prefilled (the MTP block following each chunk, as
`generate` does), then for each k:
  * verify ms: `forward_batch` over [next token, d_1..d_k] of every request (1 + k tokens a request,
    the logits and the MTP block's input stream of every row: the step `generate(speculative_tokens=k)`
    issues), the greedy tokens read back; then the k drafts rolled back (a round accepting none).
    It replays a graph only where the model records one for that step (`verify_path`);
  * draft ms: one `mtp_draft` call drafting k tokens, each request one row behind (the catch-up over
    the verified row gives d_1, then k - 1 one-token forwards): graph replays when the model uses
    graphs (`draft_path`);
  * decode ms: a plain greedy decode step (one token a request, graph replay; the greedy token read
    back), alternating with the draft calls;
each the median of `--reps` timings after `--warmup` untimed ones (graph recording, JIT), every timing
between two device synchronisations (wall time: the host's work included).

Expected speedup for a mean acceptance length L (tokens emitted per verified round: accepted drafts +
the bonus token), against plain decoding:

    speedup = L / ((t_verify + t_draft) / t_decode)

one round emits L tokens in t_verify + t_draft; plain decoding emits one token per t_decode. L comes from
the tiny-mtp training result (`--acceptance`, its mean acceptance length at each k, before and after
training) and from DeepSeek-V4's published figures as docs/model-core.md cites them (labelled
"published"; not measured here). Approximations: the draft call is timed with a one-row catch-up
(a round that accepted a drafts catches up over 1 + a rows), and the per-round host work of the
scheduler beyond these calls is not counted.

    python benchmarks/spec_decode_bench.py --device cpu --model tiny-mtp --batches 1,2 --reps 3
    python benchmarks/spec_decode_bench.py --device cuda --model flash --layers 4 --json r.json --markdown r.md

Measured, never asserted. Progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_decode import DSV4Config, build_model, config_dict, floor_bytes, free, quantize_official_, \
    randomize_on_device_, timed, weight_bytes  # noqa: E402

BUILT_IN = ("tiny-mtp", "tiny-official-mtp")
ACCEPTANCE = "benchmarks/results/cpu/2026-12-02_54e0f02/bench/train-tiny-mtp.json"
#: DeepSeek-V4's MTP block, mean acceptance length by k, as docs/model-core.md cites the engines' reports
PUBLISHED = {1: (1.8,), 3: (2.8, 3.1)}
FORMULA = "speedup = L / ((t_verify + t_draft) / t_decode)"
#: what ``floor_verify_over_decode`` is: the weight bytes a verify step of B(1 + k) tokens must read over those
#: of a decode step of B tokens, tokens routed independently (e2e_decode.floor_bytes; the MTP block not counted)
FLOOR_RATIO = "floor_bytes(B * (1 + k)) / floor_bytes(B): expected distinct experts E(1 - (1 - top_k/E)^T) a layer"


def log(msg: str) -> None:
    print(f"[spec {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build(a, dev: torch.device):
    """The model (with an MTP block) and what was built."""
    backend = a.backend or ("cuda" if dev.type == "cuda" else "reference")
    if a.model in BUILT_IN:
        from dsv4core.model.api import load_model

        model = load_model(a.model, backend=backend, dtype=a.dtype, device=dev)
        quant = None
    else:
        cfg = DSV4Config.from_dict(dict(config_dict(a.model, a.layers, a.experts), num_nextn_predict_layers=1))
        model = build_model(cfg, dtype=getattr(torch, a.dtype), device=dev, backend=backend, seed=None)
        randomize_on_device_(model, cfg, seed=0)
        quant = quantize_official_(model, dev) if a.weights == "official" else None
    if a.numerics:
        model.set_numerics(a.numerics)
    if not model.has_mtp:
        raise SystemExit(f"spec_decode_bench: the model has no MTP block: {model.speculation_why}")
    return model, backend, quant


def setup(model, B: int, ctx: int, rows: int, k_max: int, chunk: int, seed: int = 0, spare: int = 0):
    """A cache for B requests of ctx + `rows` tokens (and `spare` more slots, for forks); B random prompts prefilled in chunks, the MTP
    block caught up after each (as `generate` does). Returns (states, next tokens, the stream of each
    request's last row [B, hc, H])."""
    total = ctx + rows + k_max + 1
    cc = dict(max_requests=B + spare, max_request_tokens=1 << (total - 1).bit_length(), max_rollback=max(k_max, 1),
              max_step_tokens=max(min(chunk, ctx), B * (1 + k_max)))
    bt = model.configure_cache(max_tokens=total, **cc).block_tokens       # requests hold whole blocks
    model.configure_cache(max_tokens=(B + spare) * -(-total // bt) * bt, **cc)
    ids = torch.randint(0, model.config.vocab_size, (B, ctx + 1), generator=torch.Generator().manual_seed(seed))
    states, last = [model.new_state(mtp=True) for _ in range(B)], []
    for i, st in enumerate(states):
        for o in range(0, ctx, chunk):
            c = min(chunk, ctx - o)
            _, h = model.forward_batch(ids[i, o:o + c], torch.arange(o, o + c), torch.zeros(c, dtype=torch.int64),
                                       [st], hidden_rows=torch.arange(c))
            model.mtp_draft([st], [ids[i, o + 1:o + c + 1].tolist()], [h], 0)
        last.append(h[-1:])
    return states, ids[:, ctx].tolist(), torch.cat(last)


def decode_step(model, states, toks: list[int]) -> list[int]:
    """One plain greedy decode step (one token a request): the next tokens."""
    B = len(states)
    lg = model.forward_batch(torch.tensor(toks), torch.tensor([s.length for s in states]), torch.arange(B), states)
    return lg.argmax(-1).tolist()


def verify_step(model, states, toks: list[int], drafts: list[list[int]]):
    """The verification step of a speculative round: [toks[i], *drafts[i]] at positions length ..
    length + k of each request, the logits and the pre-hc_head stream of every row (what the MTP
    proposer reads); the greedy tokens read back. Returns (logits, stream, greedy tokens)."""
    seg = [[t, *d] for t, d in zip(toks, drafts)]
    ids = torch.tensor([t for s in seg for t in s])
    pos = torch.tensor([p for st, s in zip(states, seg) for p in range(st.length, st.length + len(s))])
    rid = torch.tensor([i for i, s in enumerate(seg) for _ in s])
    every = torch.arange(ids.shape[0])
    lg, hid = model.forward_batch(ids, pos, rid, states, logits_rows=every, hidden_rows=every)
    return lg, hid, lg.argmax(-1).tolist()


class _EagerCount:
    """Counts the model's eager forwards while active (a step that ran without a graph)."""

    def __init__(self, model):
        self.model, self.n = model, 0

    def __enter__(self):
        f = type(self.model)._eager.__get__(self.model)

        def counted(*args, **kw):
            self.n += 1
            return f(*args, **kw)

        self.model._eager = counted
        return self

    def __exit__(self, *exc):
        del self.model._eager


def _replays(model, name=None) -> int:
    g = model._graphs
    if g is None:
        return 0
    g = g if name is None else g.variants.get(name)
    return 0 if g is None else g.replays


def measure(model, B: int, ks, a, dev: torch.device) -> list[dict]:
    n = a.warmup + a.reps
    wb = weight_bytes(model, exclude=(".mtp.",))      # what a main-model step reads
    states, toks, h = setup(model, B, a.context, 2 * n * len(ks), max(ks), a.prefill_chunk)
    g = torch.Generator().manual_seed(B)
    rows = []
    try:
        for k in ks:
            drafts = torch.randint(0, model.config.vocab_size, (B, k), generator=g).tolist()
            tv, hv = [], []
            with _EagerCount(model) as eager:
                for r in range(n):
                    (_, hid, _), s = timed(lambda: verify_step(model, states, toks, drafts), dev)
                    for st in states:
                        st.truncate(st.length - k)             # the drafts rejected: the token stays
                    hv.append(hid[::1 + k])                        # the stream of each request's kept row
                    if r >= a.warmup:
                        tv.append(s)
            verify_eager = eager.n
            # the MTP block caught up over the kept rows, then decode steps and draft calls alternate
            for i, st in enumerate(states):
                c = st.length - st.mtp_length
                model.mtp_draft([st], [[toks[i]] * c], [torch.stack([x[i] for x in hv[-c:]])], 0)
            h = hv[-1]
            td, tdr = [], []
            d0, m0 = _replays(model), _replays(model, "mtp_draft")
            for r in range(n):
                toks, s = timed(lambda: decode_step(model, states, toks), dev)
                _, s2 = timed(lambda: model.mtp_draft(states, [[t] for t in toks], [h[i:i + 1] for i in range(B)], k),
                              dev)
                if r >= a.warmup:
                    td.append(s)
                    tdr.append(s2)
            dec_rep, draft_rep = _replays(model) - d0, _replays(model, "mtp_draft") - m0
            med = {key: 1e3 * statistics.median(v) for key, v in (("decode_ms", td), ("verify_ms", tv),
                                                                  ("draft_ms", tdr))}
            row = dict(batch=B, k=k, context=a.context, **med,
                       verify_over_decode=med["verify_ms"] / med["decode_ms"],
                       floor_verify_over_decode=floor_bytes(model.config, wb, B * (1 + k))
                       / floor_bytes(model.config, wb, B),
                       cycle_over_decode=(med["verify_ms"] + med["draft_ms"]) / med["decode_ms"],
                       decode_path="graph" if dec_rep == n else "eager" if not dec_rep else f"graph {dec_rep}/{n}",
                       verify_path="eager" if verify_eager == n else "graph" if not verify_eager
                       else f"eager {verify_eager}/{n}",
                       draft_path="graph" if draft_rep == k * n else "eager" if not draft_rep
                       else f"graph {draft_rep}/{k * n} forwards",
                       samples_ms={"decode": [round(1e3 * t, 4) for t in td], "verify": [round(1e3 * t, 4) for t in tv],
                                   "draft": [round(1e3 * t, 4) for t in tdr]})
            rows.append(row)
            log(f"  batch {B} k {k}: decode {med['decode_ms']:.3f} ms ({row['decode_path']}), verify "
                f"{med['verify_ms']:.3f} ms ({row['verify_path']}), draft {med['draft_ms']:.3f} ms ({row['draft_path']})")
    finally:
        for st in states:
            st.release()
    return rows


def acceptance_lengths(path: str | None, ks) -> list[dict]:
    """The mean acceptance lengths L to price: the tiny-mtp training result's (before / after) at
    each k, and the published DeepSeek-V4 figures docs/model-core.md cites."""
    out = []
    if path:
        p = Path(path)
        if not p.is_absolute() and not p.exists():
            p = Path(__file__).resolve().parents[1] / path
        res = json.loads(p.read_text())
        for when in ("after", "before"):
            for k in ks:
                L = res.get(when, {}).get(f"k{k}", {}).get("mean_acceptance_length")
                if L is not None:
                    out.append(dict(source=f"measured by train_tiny_mtp.py, {when} training ({path})",
                                    label=f"tiny-mtp {'trained' if when == 'after' else 'untrained'}", k=k, L=L))
    for k in ks:
        for L in PUBLISHED.get(k, ()):
            out.append(dict(source="published: DeepSeek-V4's MTP block as the engines report it (cited in "
                                   "docs/model-core.md; not measured here)", label="published DSV4", k=k, L=L))
    return out


def speedups(rows, lengths) -> None:
    for r in rows:
        r["speedup"] = [dict(label=x["label"], source=x["source"], L=x["L"],
                             speedup=x["L"] * r["decode_ms"] / (r["verify_ms"] + r["draft_ms"]))
                        for x in lengths if x["k"] == r["k"]]


def markdown(res: dict) -> str:
    m = res["meta"]
    labels = list(dict.fromkeys(x["label"] for r in res["rows"] for x in r["speedup"]))
    out = [f"# speculative decoding step costs: {m['model']}, {m['dtype']}, {m['device_name']}", "",
           f"Context {m['context']} tokens a request; median of {m['reps']} timings after {m['warmup']} warm-up; "
           f"backend {m['backend']}, graphs: {m['graph_status'] or 'on'}. Expected speedup: `{FORMULA}` "
           f"(L: mean acceptance length, tokens per verified round).", "",
           "| batch | k | decode ms | verify ms | draft ms | verify / decode (weight-byte floor) | (verify + draft) / decode "
           "| paths (decode / verify / draft) | " + " | ".join(f"speedup at L ({lb})" for lb in labels) + " |",
           "|" + "---|" * (8 + len(labels))]
    for r in res["rows"]:
        sp = [", ".join(f"{x['L']:.2f}: {x['speedup']:.2f}x" for x in r["speedup"] if x["label"] == lb) or "-"
              for lb in labels]
        out.append(f"| {r['batch']} | {r['k']} | {r['decode_ms']:.3f} | {r['verify_ms']:.3f} | {r['draft_ms']:.3f} | "
                   f"{r['verify_over_decode']:.2f} ({r['floor_verify_over_decode']:.2f}) | "
                   f"{r['cycle_over_decode']:.2f} | {r['decode_path']} / {r['verify_path']} / {r['draft_path']} | "
                   + " | ".join(sp) + " |")
    notes = [f"- {x['label']}: {x['source']}" for x in {x["label"]: x for x in res["acceptance"]}.values()]
    notes += [f"- skipped batch {s['batch']}: {s['reason']}" for s in res["skipped"]]
    return "\n".join(out + ([""] + notes if notes else [])) + "\n"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", help="default cuda on CUDA, else reference")
    ap.add_argument("--model", choices=["flash", "small", "tiny", *BUILT_IN], default="flash",
                    help="e2e_decode.py's dims with an MTP block, or a built-in model with one")
    ap.add_argument("--layers", type=int, default=4, help="main layers (dims models): sliding, CSA, HCA, CSA, ...")
    ap.add_argument("--experts", type=int, help="routed experts (dims models; default the dims')")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], help="default bfloat16 (dims models), float32 (built-in)")
    ap.add_argument("--weights", choices=["bf16", "official"], default="bf16",
                    help="official: e2e_decode.py's FP8 projections + packed FP4 routed experts (dims models)")
    ap.add_argument("--numerics", choices=["exact", "official"], help="default: the model's")
    ap.add_argument("--batches", default="1,2,4,8,16,32")
    ap.add_argument("--ks", default="1,2,3", help="drafted tokens a round")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens a request")
    ap.add_argument("--prefill-chunk", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--acceptance", default=ACCEPTANCE, help="train_tiny_mtp.py's JSON ('' for none)")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--markdown", metavar="PATH")
    a = ap.parse_args(argv)
    if a.dtype is None:
        a.dtype = "float32" if a.model in BUILT_IN else "bfloat16"
    if a.weights != "bf16" and a.model in BUILT_IN:
        ap.error("--weights official: the dims models only")
    if a.warmup < 1 or a.reps < 1:
        ap.error("--warmup and --reps must be >= 1 (the first calls record the graphs)")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    logging.disable(logging.WARNING)   # the HAL's one-per-op fallback warnings
    t0 = time.perf_counter()
    dev = torch.device(a.device)
    batches, ks = [int(x) for x in a.batches.split(",")], [int(x) for x in a.ks.split(",")]
    model, backend, quant = build(a, dev)
    lengths = acceptance_lengths(a.acceptance, ks)
    meta = dict(model=a.model, layers=model.config.num_hidden_layers, dtype=a.dtype, weights=a.weights,
                numerics=model.numerics, backend=backend, device=dev.type,
                device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                torch=torch.__version__, threads=torch.get_num_threads(), argv=sys.argv[1:] if argv is None else argv,
                context=a.context, reps=a.reps, warmup=a.warmup, graph_status=model.graph_status(),
                graph_buckets=list(model.graph_buckets), formula=FORMULA, quantization=quant,
                main_weight_bytes=weight_bytes(model, exclude=(".mtp.",)), floor_ratio=FLOOR_RATIO)
    res = {"meta": meta, "acceptance": lengths, "rows": [], "skipped": []}

    def save():
        for path, text in ((a.json, json.dumps(res, indent=1, default=str)), (a.markdown, markdown(res))):
            if path:
                Path(path).write_text(text)

    for B in batches:
        log(f"batch {B} ...")
        try:
            rows = measure(model, B, ks, a, dev)
        except Exception as e:  # noqa: BLE001 -- OOM, a full pool: recorded, the run goes on
            res["skipped"].append(dict(batch=B, reason=f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"))
            log(f"  skipped: {res['skipped'][-1]['reason']}")
            rows = []
        free(dev)
        speedups(rows, lengths)
        res["rows"] += rows
        save()
    meta["graph_failures"] = {"x".join(map(str, k)): v for k, v in model.graph_failures().items()}
    meta["total_s"] = time.perf_counter() - t0
    save()
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
