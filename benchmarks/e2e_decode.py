"""End-to-end decode of the model core: step time against GPU-busy time and the streaming floor.

Model: DSV4 with Flash dims (`--dims flash`: hidden 4096, 64 heads x 512, `--experts` x 2048 top-6,
indexer 64 x 128 top-512, window 128, vocab 129280) or small ones for a CPU (`--dims small`, `tiny`);
`--layers` cycling sliding / CSA 4 / HCA 128 / CSA 4 (the first hash-routed); random weights drawn
on the device; bf16. Every backend of `--backend` runs on the same weights (`bind_ops`).

Per backend and (batch B, context): B random prompts prefilled (whole requests packed into forwards
of <= `--prefill-chunk` tokens), then greedy decode, one token per request (argmax -> next ids):
  * step ms: median wall time of `--steps` steps after `--warmup` (graph capture, Triton JIT); mode
    "graph" replays the decode graph (`graph_status() == ''`), then "eager" (`use_graphs = False`);
    each step reads the previous step's argmax back to the host, so it starts when that one ended;
  * "-queued" modes: the ids stay on the device (`model.greedy_tokens`), the steps are queued back
    to back with one synchronisation at the end: step ms = wall / steps (a pipelined engine's step);
    host ms = the median time one forward_batch call holds the host; replay ms = the recorded graph
    alone, replayed back to back (the GPU's side of a step, gaps between kernels included);
  * GPU-busy ms, kernels: one more step under torch.profiler: summed device events (kernels, memcpy,
    memset), kernel count, and `kernel_top` in the JSON (launches and us per kernel name); "n/a" on
    the CPU or when the profiler sees no device event;
  * floor ms: the bytes a step must read at the copy rate (a large device-to-device copy in the same
    run, bytes read + written / time, or `--copy-rate`): all parameters but routed experts and the
    embedding table, B embedding rows, and per layer the expected distinct experts of B tokens under
    uniform routing, E * (1 - (1 - k/E)^B). KV rows are left out (a few % at these contexts).
    PERF-ANCHORS.md section 10 counted the whole embedding table: `floor_ms_s10` in the JSON;
  * x b1 step: step time / the batch-1 step of the same backend, mode and context (the target: a step's
    host work should not grow with the number of requests).
`--peer`: transformers' DeepseekV4 (eager experts) on the same weights, after the first backend.
`--weights official`: the formats of an official DSV4 checkpoint, with the decisions `load_model`
makes for one (`quantized="auto"`): every projection the checkpoint stores in FP8 (attention,
compressor, indexer; 128x128 fp32 block scales) kept FP8 where the bound `linear` / `wo_a` reads it
natively, routed experts packed FP4 e2m1 + UE8M0 / 32 where `moe_experts` does; shared experts,
embedding and lm_head stay bf16. The random bf16 weights are quantised on the device
(`dsv4core.hal.quant`); the decisions are in the JSON (`meta.quantization`).

    python benchmarks/e2e_decode.py --device cpu --dims small --batches 1,8,64 --contexts 256
    python benchmarks/e2e_decode.py --backend cuda,reference --combos 1x1024,8x8192 --peer --json r.json

Measured, never asserted. Progress on stderr; --json / --markdown are rewritten after every row.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from dsv4core.hal import bind
from dsv4core.model import DSV4Config, randomize_weights_
from dsv4core.hal.quant import quantize_fp4, quantize_fp8_block
from dsv4core.model import experts_quant, fp8
from dsv4core.model.api import TINY_CONFIG, build_model

CSA, HCA, SW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
DIMS = {  # flash: the config defaults (transformers' DeepseekV4Config, dsv4core.model.config) are its dims
    "flash": dict(rope_scaling=YARN),
    "small": dict(vocab_size=1024, hidden_size=256, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
                  q_lora_rank=64, o_groups=2, o_lora_rank=64, moe_intermediate_size=128, n_routed_experts=8,
                  num_experts_per_tok=2, index_n_heads=8, index_head_dim=32, index_topk=16, sliding_window=32,
                  compress_rates={CSA: 4, HCA: 16}, rope_scaling=dict(YARN, original_max_position_embeddings=4096)),
    "tiny": {k: v for k, v in TINY_CONFIG.items() if k != "model_type"},   # `load_model("tiny")`'s dims
}


def log(msg: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free(dev: torch.device) -> None:
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def config_dict(dims: str, layers: int, experts: int | None) -> dict:
    return dict(DIMS[dims], num_hidden_layers=layers, **({"n_routed_experts": experts} if experts else {}),
                layer_types=[(SW, CSA, HCA, CSA)[i % 4] for i in range(layers)],
                mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1), bos_token_id=None, eos_token_id=None)


@torch.no_grad()
def randomize_on_device_(model, cfg, seed: int) -> None:
    """`randomize_weights_` draws on the host (minutes for 50 GiB): here the 2-D `weight`s and expert
    stacks are drawn on the device with its rule (std fan_in^-0.5, embedding 1), the rest by it."""
    big = [(m, k, p) for m in model.modules() for k, p in m._parameters.items()
           if p is not None and p.is_floating_point() and p.numel() >= 1 << 16
           and ((k == "weight" and p.dim() == 2) or k in ("gate_up_proj", "down_proj"))]
    for m, k, _ in big:
        m._parameters[k] = None            # hidden from named_parameters()
    try:
        randomize_weights_(model, cfg, seed=seed)
    finally:
        for m, k, p in big:
            m._parameters[k] = p
    g = torch.Generator(device=model.device).manual_seed(seed)
    for m, _, p in big:
        p.normal_(0.0, 1.0 if isinstance(m, torch.nn.Embedding) else p.shape[-1] ** -0.5, generator=g)


@torch.no_grad()
def quantize_official_(model, dev: torch.device, chunk: int = 16) -> dict:
    """In place: FP8 projections and packed FP4 routed experts where the bound ops read them (the
    decisions of `load_model(quantized="auto")` for an official checkpoint; see the module
    docstring); the kept weights are the quantised random bf16 ones. Returns the decisions."""
    dtype, ops = model.act_dtype, model.ops
    mods = dict(model.named_modules())
    proj = fp8.plan(model, ops, "auto", {n for n, _, _ in fp8.candidates(model)}, dtype, dev)
    for d in proj:
        if d.kept:
            mod = mods[d.weight[: -len(".weight")]]
            q, s = quantize_fp8_block(mod.weight, torch.float32)
            mod.keep_fp8()
            mod.weight.copy_(q)
            mod.weight_scale_inv.copy_(s)
            del q, s
    formats = {f"{n}.experts.{p}": ("fp4", torch.int8) for n, m in mods.items()
               if hasattr(m, "experts") and hasattr(m.experts, "gate_up_proj_scale_inv") for p in experts_quant.PARTS}
    ex = experts_quant.plan(model, ops, "auto", formats, dtype, dev, True)
    bf16 = {n: getattr(mods[n.rsplit(".", 1)[0]], n.rsplit(".", 1)[1]) for n in formats}
    experts_quant.apply(model, ex, formats)
    for d in ex:
        if d.kept:
            owner, part = d.weight.rsplit(".", 1)
            mod, w = mods[owner], bf16[d.weight]
            dst, dst_s = getattr(mod, part), getattr(mod, part + "_scale_inv")
            for e0 in range(0, w.shape[0], chunk):        # bounded fp32 temporaries
                q, s = quantize_fp4(w[e0:e0 + chunk], scale_dtype=dst_s.dtype)
                dst[e0:e0 + chunk].copy_(q.view(dst.dtype))
                dst_s[e0:e0 + chunk].copy_(s)
            bf16[d.weight] = None
    del bf16
    free(dev)
    return {"decisions": [d.as_dict() for d in proj + ex],
            "kept": sum(d.kept for d in proj + ex), "declined": sum(not d.kept for d in proj + ex)}


def copy_rate(dev: torch.device) -> float:
    """Bytes/s (read + written) of the best of 5 large same-device copies."""
    n = (4 << 30) if dev.type == "cuda" else (128 << 20)
    a, b = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    return 2 * n / min(timed(lambda: b.copy_(a), dev)[1] for _ in range(6))   # the buffers stay cached


def weight_bytes(model, exclude: tuple[str, ...] = ()) -> dict:
    """Parameter bytes: routed experts, embedding, the rest; names containing a part of ``exclude``
    left out (``(".mtp.",)``: the MTP block, which a main-model step does not read)."""
    out = {"routed_experts": 0, "embedding": 0, "other": 0}
    for name, p in model.named_parameters():
        if any(x in f".{name}" for x in exclude):
            continue
        key = "routed_experts" if ".experts." in name else "embedding" if "embed_tokens" in name else "other"
        out[key] += p.numel() * p.element_size()
    return out


def floor_bytes(cfg, wb: dict, B: int) -> float:
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    hit = E * (1.0 - (1.0 - k / E) ** B)     # expected distinct experts per layer; every layer is MoE
    return wb["other"] + B * wb["embedding"] / cfg.vocab_size + hit * wb["routed_experts"] / E


def profile_step(step, dev: torch.device) -> dict:
    """One step under torch.profiler: summed device-event time (busy), the kernel count, and the
    kernels by name (count, total us; the 30 with the most launches)."""
    if dev.type != "cuda":
        return {"busy_ms": "n/a", "kernels": "n/a", "profile_note": "no device profile on the CPU"}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        sync(dev)
    busy_us, kernels, launches, by_name = 0.0, 0, 0, {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False):
            us = e.time_range.elapsed_us()
            busy_us += us
            kernels += not e.name.startswith(("Memcpy", "Memset"))
            n, tot = by_name.get(e.name[:90], (0, 0.0))
            by_name[e.name[:90]] = (n + 1, tot + us)
        elif "LaunchKernel" in e.name or "GraphLaunch" in e.name:
            launches += 1
    if not busy_us:
        return {"busy_ms": "n/a", "kernels": "n/a", "profile_note": "the profiler recorded no device event"}
    top = sorted(by_name.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:30]
    return {"busy_ms": busy_us / 1e3, "kernels": kernels, "host_launch_calls": launches,
            "kernel_top": [{"name": k, "count": n, "us": round(us, 1)} for k, (n, us) in top]}


def time_steps(step, dev: torch.device, warmup: int, steps: int) -> dict:
    for _ in range(warmup):
        step()
    ts = [timed(step, dev)[1] for _ in range(steps)]
    return {"step_ms": 1e3 * statistics.median(ts), "step_ms_min": 1e3 * min(ts),
            "steps_ms": [round(1e3 * t, 4) for t in ts], **profile_step(step, dev)}


def time_queued(step, dev: torch.device, warmup: int, steps: int) -> dict:
    """Steps queued back to back (each feeds the next its ids on the device, `greedy_tokens`), one
    synchronisation at the end: step ms = wall / steps, what a pipelined engine gets; host ms = the
    median time a forward_batch call holds the host."""
    for _ in range(warmup):
        step()
    sync(dev)
    host = []
    t0 = time.perf_counter()
    for _ in range(steps):
        h0 = time.perf_counter()
        step()
        host.append(time.perf_counter() - h0)
    sync(dev)
    wall = (time.perf_counter() - t0) / steps
    return {"step_ms": 1e3 * wall, "host_ms": 1e3 * statistics.median(host), **profile_step(step, dev)}


def time_replays(replay, dev: torch.device, n: int) -> float:
    """ms per replay of a recorded decode graph, n replays back to back (no host work between)."""
    replay()
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(n):
        replay()
    sync(dev)
    return 1e3 * (time.perf_counter() - t0) / n


def timed(fn, dev: torch.device):
    sync(dev)
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t0


def prompts(vocab: int, B: int, ctx: int) -> torch.Tensor:   # the same for ours and the peer
    return torch.randint(0, vocab, (B, ctx), generator=torch.Generator().manual_seed(B * 100003 + ctx))


def prefill(model, ids: torch.Tensor, chunk: int, states) -> torch.Tensor:
    """Prefill prompts [B, ctx]: whole requests packed into forwards of <= chunk tokens (a longer
    prompt is split into chunks). Returns the last-position logits [B, vocab]."""
    B, ctx = ids.shape
    pieces = [(r, off, min(chunk, ctx - off)) for r in range(B) for off in range(0, ctx, chunk)]
    last = [None] * B
    while pieces:
        call, n = [], 0
        while pieces and n + pieces[0][2] <= chunk:
            call.append(pieces.pop(0))
            n += call[-1][2]
        ends = [i for i, (r, o, c) in enumerate(call) if o + c == ctx]
        rows = torch.tensor([sum(c for _, _, c in call[:i + 1]) - 1 for i in ends], dtype=torch.int64)
        lg = model.forward_batch(torch.cat([ids[r, o:o + c] for r, o, c in call]),
                                 torch.cat([torch.arange(o, o + c) for r, o, c in call]),
                                 torch.cat([torch.full((c,), r, dtype=torch.int64) for r, o, c in call]),
                                 states, logits_rows=rows)
        for j, i in enumerate(ends):
            last[call[i][0]] = lg[j]
    return torch.stack(last)


def ours_combo(model, B: int, ctx: int, a, dev: torch.device) -> list[dict]:
    """Prefill B requests, then time graph (when available) and eager decode on the same requests."""
    total = ctx + 2 * (a.warmup + a.steps + 1) + 8     # max_request_tokens a power of 2, as generate() sizes it
    cc = dict(max_requests=B, max_request_tokens=1 << (total - 1).bit_length(), max_step_tokens=a.prefill_chunk,
              kv_dtype=None if a.kv_dtype == "auto" else a.kv_dtype)
    bt = model.configure_cache(max_tokens=total, **cc).block_tokens     # requests hold whole blocks
    model.configure_cache(max_tokens=B * -(-total // bt) * bt, **cc)
    states = [model.new_state() for _ in range(B)]
    try:
        ids = prompts(model.config.vocab_size, B, ctx)
        logits, sec = timed(lambda: prefill(model, ids, a.prefill_chunk, states), dev)
        box, pre_tok_s = [logits], B * ctx / sec

        def step():          # the ids read back to the host: each step waits for the one before
            pos = torch.tensor([s.length for s in states])
            box[0] = model.forward_batch(box[0].argmax(-1), pos, torch.arange(B), states)

        def step_queued():   # the ids stay on the device: the host queues the next step at once
            pos = torch.tensor([s.length for s in states])
            box[0] = model.forward_batch(model.greedy_tokens(box[0]), pos, torch.arange(B), states)

        top = max(model.graph_buckets)
        status = model.graph_status() or (f"batch {B} > largest graph bucket {top}: eager only" if B > top else "")
        rows = []
        for mode in ["eager", "eager-queued"] if status else ["graph", "graph-queued", "eager"]:
            model.use_graphs = mode.startswith("graph")
            r0 = getattr(model._graphs, "replays", 0)
            try:
                if mode.endswith("queued"):
                    res = time_queued(step_queued, dev, a.warmup, a.steps)
                else:
                    res = time_steps(step, dev, a.warmup, a.steps)
                if mode == "graph-queued" and model._graphs and model._graphs.graphs:
                    key = (model._graphs.bucket(B), model._graphs.context_bucket(max(s.length for s in states)))
                    if key in model._graphs.graphs:   # last: a replay repeats the last step's writes
                        res["replay_ms"] = time_replays(model._graphs.graphs[key][0], dev, a.steps)
            finally:
                model.use_graphs = True
            replays = getattr(model._graphs, "replays", 0) - r0
            failed = dict(getattr(model._graphs, "failed", {}) or {})
            if mode == "graph" and failed:
                log(f"  graph recording failed: {failed}")
            rows.append(dict(mode=mode, prefill_tok_s=pre_tok_s, graph_status=status, graph_replays=replays,
                             graph_failures={f"{k[0]}x{k[1]}": v for k, v in failed.items()},
                             graphs=list(getattr(model._graphs, "graphs", {})) if mode == "graph" else [],
                             cache_bytes=model.cache.bytes_report(), **res))
        return rows
    finally:
        for s in states:
            s.release()


def build_peer(cfg, model, dtype, dev, out: dict) -> list:
    """transformers' model on our weights (bf16 throughout), warmed up: out["hf"], out["meta"]."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, __version__, logging as hf_logging
    from transformers.initialization import no_init_weights

    hf_logging.set_verbosity_error()
    hcfg = DeepseekV4Config(**cfg.to_hf_dict())
    hcfg._experts_implementation = "eager"   # grouped_mm needs 16-byte strides in bf16
    with no_init_weights(), torch.device(dev):
        hf = DeepseekV4ForCausalLM._from_config(hcfg, dtype=dtype)
    hf = hf.to(dtype).eval()  # DSV4's fp32 parameters (norms, mHC, sinks) become bf16, as in bench_model.py
    hf.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        hf(torch.arange(64, device=dev)[None], use_cache=True, logits_to_keep=1)    # first-call costs
    out.update(hf=hf, meta=dict(transformers=__version__, attn=hf.config._attn_implementation))
    return []


@torch.no_grad()
def peer_combo(hf, cfg, B: int, ctx: int, a, dev: torch.device) -> list[dict]:
    if dev.type == "cuda":   # eager attention holds ~5 score tensors [B, H, T, ~1.25 T] in bf16
        need, free_b = 5 * B * cfg.num_attention_heads * ctx * 1.25 * ctx * 2, torch.cuda.mem_get_info(dev)[0]
        if need > 0.8 * free_b:
            raise MemoryError(f"eager attention needs ~{need / 2**30:.1f} GiB, {free_b / 2**30:.1f} GiB free")
    ids = prompts(cfg.vocab_size, B, ctx).to(dev)
    out, sec = timed(lambda: hf(ids, use_cache=True, logits_to_keep=1), dev)
    box = [out.past_key_values, out.logits[:, -1]]
    del out, ids

    def step():
        o = hf(box[1].argmax(-1, keepdim=True), past_key_values=box[0], use_cache=True)
        box[0], box[1] = o.past_key_values, o.logits[:, -1]

    return [dict(mode="eager", prefill_tok_s=B * ctx / sec, **time_steps(step, dev, a.warmup, a.steps))]


def fmt(v, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


COLUMNS = [("backend", "backend", ""), ("mode", "mode", ""), ("batch", "batch", ""), ("context", "context", ""),
           ("prefill tok/s", "prefill_tok_s", ",.0f"), ("decode step ms", "step_ms", ".2f"),
           ("GPU-busy ms", "busy_ms", ".2f"), ("host ms", "host_ms", ".2f"), ("replay ms", "replay_ms", ".2f"),
           ("kernels / step", "kernels", ","), ("floor ms", "floor_ms", ".2f"),
           ("% of floor", "pct_floor", ".1f"), ("decode tok/s", "decode_tok_s", ",.1f"),
           ("x b1 step", "x_b1_step", ".2f")]


def markdown(res: dict) -> str:
    m = res["meta"]
    out = [f"# e2e decode: {m['dims']} dims, {m['layers']} layers ({', '.join(m['layer_types'])}), "
           f"{m['experts']} experts, {m['dtype']}, {m['device_name']}", "",
           f"Parameters {m['param_bytes_total'] / 2**30:.2f} GiB (routed experts "
           f"{m['weight_bytes']['routed_experts'] / 2**30:.2f}); copy rate {m['copy_rate_Bps'] / 1e12:.3f} TB/s "
           f"({m['copy_rate_source']}); {m['steps']} timed decode steps (median) after {m['warmup']} warm-up; "
           f"torch {m['torch']}, {m['threads']} threads. Each backend first ran one short untimed request; "
           f"prefill shapes it did not cover compile (Triton JIT) in their first row.", "",
           "| " + " | ".join(c[0] for c in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(fmt(r.get(k, "n/a"), f) for _, k, f in COLUMNS) + " |" for r in res["rows"]]
    notes = [f"- graph status, {b}: {s or 'decode steps replay CUDA graphs'}" for b, s in m["graph_status"].items()]
    notes += [f"- skipped {s['backend']} batch {s['batch']} context {s['context']}: {s['reason']}"
              for s in res["skipped"]]
    notes += [f"- GPU-busy n/a at {r['backend']} {r['mode']} batch {r['batch']}: {r['profile_note']}"
              for r in res["rows"] if r.get("profile_note") and r["device"] == "cuda"]
    return "\n".join(out + ([""] + notes if notes else [])) + "\n"


def set_tune(items: list[str]) -> dict:
    """``--tune MODULE.KEY=VALUE`` items set on the kernel modules' TUNE; returns them as a dict."""
    import ast
    import importlib

    out = {}
    for item in items:
        name, _, value = item.partition("=")
        module, _, key = name.partition(".")
        if not (module and key and value):
            raise SystemExit(f"--tune {item!r}: expected MODULE.KEY=VALUE, e.g. moe.dequant_rows=None")
        mod = importlib.import_module(f"dsv4core.kernels.triton.{module}")
        mod.TUNE[key] = ast.literal_eval(value)   # an unknown key raises, naming the module's keys
        out[name] = mod.TUNE[key]
    return out


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", help="comma list, e.g. cuda,reference; default cuda on CUDA, else reference")
    ap.add_argument("--dims", choices=sorted(DIMS), default="flash")
    ap.add_argument("--layers", type=int, default=4, help="layer types cycle sliding, CSA, HCA, CSA")
    ap.add_argument("--experts", type=int, help="routed experts (default: the dims', 256 for flash)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--weights", choices=["bf16", "official"], default="bf16",
                    help="official: FP8 projections + packed FP4 routed experts where the ops read them")
    ap.add_argument("--numerics", choices=["exact", "official"], default="exact",
                    help="the model's numerics (official: W8A8 projections, FP8 KV rows, FP4 indexer)")
    ap.add_argument("--kv-dtype", choices=["auto", "bf16", "fp8"], default="auto",
                    help="CacheConfig.kv_dtype (fp8: the 584-byte FP8 rows; needs --numerics official)")
    ap.add_argument("--batches", default="1,8,32,64,128", help="comma list; every one at every --contexts")
    ap.add_argument("--contexts", default="1024,8192", help="comma list (prompt tokens per request)")
    ap.add_argument("--combos", help="BxCTX list (e.g. 1x1024,8x8192) instead of batches x contexts")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps per mode")
    ap.add_argument("--warmup", type=int, default=3, help="untimed decode steps first (graph capture, JIT)")
    ap.add_argument("--prefill-chunk", type=int, default=8192, help="most tokens per prefill forward")
    ap.add_argument("--peer", action="store_true", help="also transformers eager on the same weights")
    ap.add_argument("--peer-combos", default="1x1024,8x1024,32x1024,1x256,8x256", help="BxCTX the peer runs")
    ap.add_argument("--copy-rate", type=float, help="TB/s for the floor instead of measuring it")
    ap.add_argument("--time-budget", type=float, help="seconds; combinations not started by then are skipped")
    ap.add_argument("--threads", type=int, default=int(os.environ.get("TORCH_NUM_THREADS", 0)) or None)
    ap.add_argument("--tune", action="append", default=[], metavar="MODULE.KEY=VALUE",
                    help="a kernel module's launch override for the whole run (dsv4core.kernels.triton.MODULE.TUNE; "
                         "VALUE a Python literal, e.g. moe.dequant_rows=None); repeatable; recorded in meta.tune")
    ap.add_argument("--json", metavar="PATH", help="results (rewritten after every row)")
    ap.add_argument("--markdown", metavar="PATH", help="the table of PERF-ANCHORS.md section 10, and notes")
    a = ap.parse_args(argv)
    if a.peer and a.weights != "bf16":
        ap.error("--peer runs transformers on the same weights: bf16 only (--weights bf16)")
    if a.weights != "bf16" and a.backend and "," in a.backend:
        ap.error("--weights official keeps what the first backend's ops read natively: one --backend only")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    tune = set_tune(a.tune)
    logging.disable(logging.WARNING)   # the HAL's one-per-op fallback warnings
    if a.threads:
        torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    dev, dtype = torch.device(a.device), getattr(torch, a.dtype)
    combos = ([tuple(int(x) for x in c.split("x")) for c in a.combos.split(",")] if a.combos else
              [(int(b), int(c)) for c in a.contexts.split(",") for b in a.batches.split(",")])
    peer = [(B, c) for B, c in combos if a.peer and f"{B}x{c}" in a.peer_combos.split(",")]
    backends = (a.backend or ("cuda" if dev.type == "cuda" else "reference")).split(",")
    cfg = DSV4Config.from_dict(config_dict(a.dims, a.layers, a.experts))
    rate, rate_src = (a.copy_rate * 1e12, "--copy-rate") if a.copy_rate else (copy_rate(dev), "measured, same run")
    model, build_s = timed(lambda: build_model(cfg, dtype=dtype, device=dev, backend=backends[0], seed=None), dev)
    _, rand_s = timed(lambda: randomize_on_device_(model, cfg, seed=0), dev)
    quant = None
    if a.weights == "official":
        quant, q_s = timed(lambda: quantize_official_(model, dev), dev)
        rand_s += q_s
        log(f"official formats: {quant['kept']} tensors kept quantised, {quant['declined']} not "
            f"(meta.quantization in the JSON)")
    model.set_numerics(a.numerics)
    wb = weight_bytes(model)
    meta = dict(numerics=a.numerics, kv_dtype=a.kv_dtype, dims=a.dims, layers=a.layers, layer_types=cfg.layer_types, experts=cfg.n_routed_experts, dtype=a.dtype,
                device=dev.type, device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                threads=torch.get_num_threads(), torch=torch.__version__, argv=sys.argv[1:],
                config=cfg.to_hf_dict(), weight_bytes=wb, param_bytes_total=sum(wb.values()), copy_rate_Bps=rate,
                copy_rate_source=rate_src, steps=a.steps, warmup=a.warmup, prefill_chunk=a.prefill_chunk,
                build_s=build_s + rand_s, graph_status={}, hal={}, weights=a.weights, quantization=quant, tune=tune)
    res = {"meta": meta, "rows": [], "skipped": []}
    log(f"copy rate {rate / 1e12:.3f} TB/s ({rate_src}); {a.dims} model built on {dev} in {build_s + rand_s:.1f} s: "
        f"{sum(wb.values()) / 2**30:.2f} GiB of parameters")

    def save():
        for path, text in ((a.json, json.dumps(res, indent=1, default=str)), (a.markdown, markdown(res))):
            if path:
                Path(path).write_text(text)

    def run(backend, B, ctx, fn, record=True):
        base = dict(backend=backend, batch=B, context=ctx, device=dev.type)
        if a.time_budget and time.perf_counter() - t_start > a.time_budget:
            return res["skipped"].append(dict(base, reason=f"--time-budget {a.time_budget:.0f} s spent"))
        log(f"{backend} batch {B} context {ctx}{'' if record else ' (warm-up, untimed)'} ...")
        try:
            rows, reason = fn(), None
        except Exception as e:  # noqa: BLE001 -- OOM, a full pool, an op's error: recorded, the run goes on
            rows, reason = [], f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            if not isinstance(e, (torch.OutOfMemoryError, MemoryError)):
                traceback.print_exc()
        free(dev)      # after the except clause: its traceback no longer holds the step's tensors
        if reason:
            res["skipped"].append(dict(base, reason=reason))
            log(f"  skipped: {reason}")
        for r in rows if record else []:
            fl = floor_bytes(cfg, wb, B) / rate
            r = dict(base, **r, floor_ms=1e3 * fl, pct_floor=100 * fl / (r["step_ms"] / 1e3),
                     floor_ms_s10=1e3 * (fl + wb["embedding"] * (1 - B / cfg.vocab_size) / rate),
                     decode_tok_s=B / (r["step_ms"] / 1e3))
            b1 = [x["step_ms"] for x in res["rows"] if (x["backend"], x["mode"], x["batch"], x["context"]) ==
                  (backend, r["mode"], 1, ctx)]
            r["x_b1_step"] = r["step_ms"] / b1[0] if b1 else "-"
            res["rows"].append(r)
            log(f"  {r['mode']}: prefill {r['prefill_tok_s']:,.0f} tok/s, step {r['step_ms']:.2f} ms, busy "
                f"{fmt(r['busy_ms'], '.2f')} ms, {r['kernels']} kernels, {r['pct_floor']:.1f} % of the floor")
        save()

    def run_peer():
        model.configure_cache(max_requests=1, max_tokens=256)   # give back the last combination's pools
        box: dict = {}
        run("transformers", 1, 64, lambda: build_peer(cfg, model, dtype, dev, box), record=False)
        meta["peer"] = box.get("meta", "not built (see skipped)")
        for B, ctx in peer if "hf" in box else []:
            run("transformers", B, ctx, lambda: peer_combo(box["hf"], cfg, B, ctx, a, dev))
        box.clear()
        free(dev)

    warm = argparse.Namespace(**dict(vars(a), warmup=1, steps=1))
    for i, backend in enumerate(backends):
        if i:
            model.bind_ops(bind(dev, backend=backend))
        model.backend = backend
        meta["graph_status"][backend] = model.graph_status()
        meta["hal"][backend] = {b["op"]: b["backend"] for b in model.hal_report()}
        w = max(2 * max(cfg.compress_rates.values()), min(c for _, c in combos))   # every boundary, a used shape
        run(backend, 1, w, lambda: ours_combo(model, 1, w, warm, dev), record=False)
        for B, ctx in combos:
            run(backend, B, ctx, lambda: ours_combo(model, B, ctx, a, dev))
        if i == 0 and peer:
            run_peer()     # after the first backend, before the others: on the same weights
    meta["total_s"] = time.perf_counter() - t_start
    save()
    print(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
