"""End-to-end speed of the dsv4core model core against transformers' eager DeepseekV4 (same
weights, same process, same thread count): prefill tokens/s and decode tokens/s, and the ratio.

    python benchmarks/bench_model.py                      # tiny and mid, CPU, reference backend
    python benchmarks/bench_model.py --configs mid --backend auto --device cpu --threads 2 --json

Also prints the computed (not allocated) per-request state size for DSV4-Flash dimensions.
Measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

CSA, HCA, SW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

CONFIGS = {
    # the built-in tiny model's dimensions
    "tiny": None,
    # real head_dim / rope dim / indexer dims, small width and depth
    "mid": dict(
        vocab_size=8192, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=512, o_groups=4, o_lora_rank=256, moe_intermediate_size=512,
        n_routed_experts=16, num_experts_per_tok=4, index_n_heads=16, index_head_dim=128, index_topk=64,
        sliding_window=128, compress_rates={CSA: 4, HCA: 128}, layer_types=[SW, CSA, HCA, CSA],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=4, max_position_embeddings=65536,
        rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1},
    ),
}
DEFAULT_LENGTHS = {"tiny": (256, 32, 4), "mid": (512, 16, 4)}  # prompt, decode steps, batch


def _models(name: str, backend: str, device: str, dtype: torch.dtype):
    import transformers
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    from dsv4core.model import DSV4Config, randomize_weights_
    from dsv4core.model.api import TINY_CONFIG, build_model

    transformers.logging.set_verbosity_error()
    kw = dict(CONFIGS[name] or {k: v for k, v in TINY_CONFIG.items() if k != "model_type"})
    kw.update(eos_token_id=None, bos_token_id=None)
    hcfg = DeepseekV4Config(**kw)
    if dtype == torch.bfloat16:  # grouped_mm needs 16-byte strides in bf16
        hcfg._experts_implementation = "eager"
    hf = DeepseekV4ForCausalLM(hcfg).eval()
    cfg = DSV4Config.from_dict(json.loads(hcfg.to_json_string()))
    randomize_weights_(hf, cfg, seed=0)
    hf = hf.to(device=device, dtype=dtype)
    # built on the device, so its op table is bound for that device (moving a built model with
    # .to() would keep the table bound for cpu); DSV4's fp32 parameters stay fp32 in ours (they
    # take the values transformers' to() rounded to `dtype`: the same weights in both)
    ours = build_model(cfg, dtype=dtype, device=device, backend=backend)
    ours.load_state_dict(hf.state_dict(), strict=True)
    return cfg, hf, ours


def _sync(device: str) -> None:
    mod = getattr(torch, torch.device(device).type, None)
    if mod is not None and hasattr(mod, "synchronize"):
        mod.synchronize()


@torch.no_grad()
def bench(name: str, backend: str, device: str, dtype: torch.dtype, prompt: int, steps: int, batch: int,
          repeats: int) -> dict:
    cfg, hf, ours = _models(name, backend, device, dtype)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=g).to(device)
    res: dict = {"config": name, "prompt": prompt, "decode_steps": steps, "batch": batch,
                 "dtype": str(dtype).removeprefix("torch."), "backend": backend}
    # pools sized to the run: one prefill forward of every prompt, then `steps` decode steps
    ours.configure_cache(max_requests=batch, max_tokens=batch * (prompt + steps + 1),
                         max_request_tokens=prompt + steps + 1, max_step_tokens=batch * prompt)
    res["graphs"] = ours.graph_status() or "on"

    def ours_run():
        states = [ours.new_state() for _ in range(batch)]
        flat = ids.reshape(-1)
        pos = torch.arange(prompt, device=device).repeat(batch)
        rid = torch.arange(batch, device=device).repeat_interleave(prompt)
        last = torch.arange(batch, device=device) * prompt + prompt - 1
        _sync(device)
        t0 = time.perf_counter()
        lg = ours.forward_batch(flat, pos, rid, states, logits_rows=last)
        _sync(device)
        t1 = time.perf_counter()
        for s in range(steps):
            nxt = lg.argmax(-1)
            lg = ours.forward_batch(nxt, torch.full((batch,), prompt + s, device=device),
                                    torch.arange(batch, device=device), states)
        _sync(device)
        t2 = time.perf_counter()
        for st in states:
            st.release()
        return t1 - t0, t2 - t1

    def hf_run():
        _sync(device)
        t0 = time.perf_counter()
        out = hf(ids, use_cache=True, logits_to_keep=1)
        _sync(device)
        t1 = time.perf_counter()
        pkv, lg = out.past_key_values, out.logits[:, -1]
        for _ in range(steps):
            nxt = lg.argmax(-1, keepdim=True)
            out = hf(nxt, past_key_values=pkv, use_cache=True)
            pkv, lg = out.past_key_values, out.logits[:, -1]
        _sync(device)
        return t1 - t0, time.perf_counter() - t1

    for who, fn in (("ours", ours_run), ("hf", hf_run)):
        fn()  # warm-up
        pre, dec = min((fn() for _ in range(repeats)), key=lambda x: x[0] + x[1])
        res[f"{who}_prefill_tok_s"] = batch * prompt / pre
        res[f"{who}_decode_tok_s"] = batch * steps / dec if steps else float("nan")
    res["prefill_ratio"] = res["ours_prefill_tok_s"] / res["hf_prefill_tok_s"]
    res["decode_ratio"] = res["ours_decode_tok_s"] / res["hf_decode_tok_s"]
    return res


def flash_state_bytes() -> dict:
    from dsv4core.model import state_bytes
    from dsv4core.model.config import DSV4Config

    flash = DSV4Config.from_dict({
        "num_hidden_layers": 43, "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0],
        "num_hash_layers": 3})
    return {t: state_bytes(flash, t, act_bytes=2) for t in (1024, 8192, 65536)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="tiny,mid")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    logging.disable(logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    results = []
    for name in args.configs.split(","):
        p, s, b = DEFAULT_LENGTHS[name]
        r = bench(name, args.backend, args.device, dtype, args.prompt or p, args.steps or s, args.batch or b,
                  args.repeats)
        results.append(r)
        if not args.json:
            print(f"{name:5s} {r['dtype']} batch {r['batch']} prompt {r['prompt']} decode {r['decode_steps']} | "
                  f"prefill tok/s ours {r['ours_prefill_tok_s']:.0f} hf {r['hf_prefill_tok_s']:.0f} "
                  f"ratio {r['prefill_ratio']:.2f} | decode tok/s ours {r['ours_decode_tok_s']:.1f} "
                  f"hf {r['hf_decode_tok_s']:.1f} ratio {r['decode_ratio']:.2f}", flush=True)
    sb = flash_state_bytes()
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "results": results, "flash_state_bytes": sb}, indent=2))
    else:
        print(f"(threads: {torch.get_num_threads()})")
        print("DSV4-Flash pool memory per request (bf16 rows, fp32 compressor rings; CacheConfig defaults), "
              "computed bound:")
        for t, v in sb.items():
            print(f"  {t:6d} tokens: total {v['total'] / 2**20:8.2f} MiB  (window {v['window_rows'] / 2**20:.2f}, "
                  f"compressed {v['compressed_entries'] / 2**20:.2f}, indexer keys {v['indexer_keys'] / 2**20:.2f}, "
                  f"rings {v['compressor_rings'] / 2**20:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
