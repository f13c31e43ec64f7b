"""Decode ms/step of the model core as the context grows (does a step cost grow with context?).

A small model (sliding window 8, CSA ratio 4, HCA ratio 8, 16 indexer heads, index_topk 8) is
prefilled to each context length (one request, chunked prefill; it is then forked into
`--batch` requests), then `--steps` decode steps of the whole batch are timed.

    python benchmarks/decode_context_scaling.py                       # CPU, 1 thread
    python benchmarks/decode_context_scaling.py --contexts 256 2048 8192 --json
    python benchmarks/decode_context_scaling.py --head-dim 512    # DSV4's row width

Run against another checkout with PYTHONPATH pointing at it (before/after comparisons).
Measured, never asserted.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

CSA, HCA, SW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

CONFIG = dict(
    model_type="deepseek_v4", vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=64, qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
    moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    routed_scaling_factor=1.5, swiglu_limit=10.0, max_position_embeddings=65536, sliding_window=8,
    layer_types=[SW, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 8},
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    index_n_heads=16, index_head_dim=32, index_topk=8, rms_norm_eps=1e-6, rope_theta=10000.0,
    compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 256,
                     "beta_fast": 32, "beta_slow": 1},
    bos_token_id=0, eos_token_id=1,
)


@torch.no_grad()
def run(context: int, batch: int, steps: int, repeats: int, chunk: int, device: str, head_dim: int,
        no_hca: bool) -> dict:
    from dsv4core.model.api import build_model

    cfg = dict(CONFIG, head_dim=head_dim)
    if no_hca:
        cfg["layer_types"] = [SW if t == HCA else t for t in cfg["layer_types"]]
    model = build_model(cfg, dtype=torch.float32, device=device, backend="reference", seed=0)
    model.configure_cache(max_requests=batch + 1, max_request_tokens=context + steps + 1,
                          max_tokens=(batch + 1) * (context + steps + 1), max_step_tokens=max(chunk, batch))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, CONFIG["vocab_size"], (context,), generator=g)
    st = model.new_state()
    t0 = time.perf_counter()
    for off in range(0, context, chunk):
        n = min(chunk, context - off)
        model.forward_batch(ids[off:off + n], torch.arange(off, off + n), torch.zeros(n, dtype=torch.long), [st])
    prefill_s = time.perf_counter() - t0
    best = float("inf")
    for _ in range(repeats):
        states = [st.fork() for _ in range(batch)]
        tok = torch.full((batch,), 5, dtype=torch.long)
        t0 = time.perf_counter()
        for s in range(steps):
            lg = model.forward_batch(tok, torch.full((batch,), context + s), torch.arange(batch), states)
            tok = lg.argmax(-1)
        best = min(best, (time.perf_counter() - t0) / steps)
        held = states[0].nbytes()
        for s_ in states:
            s_.release()
    return {"context": context, "batch": batch, "steps": steps, "decode_ms_per_step": 1e3 * best,
            "prefill_s": prefill_s, "state_MiB_per_request": held / 2**20}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    ap.add_argument("--head-dim", type=int, default=64, help="attention head dim (DSV4: 512)")
    ap.add_argument("--no-hca", action="store_true", help="the HCA layer becomes a sliding one")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    import dsv4core

    rows = [run(c, a.batch, a.steps, a.repeats, a.chunk, a.device, a.head_dim, a.no_hca) for c in a.contexts]
    if a.json:
        print(json.dumps({"dsv4core": dsv4core.__file__, "threads": a.threads, "head_dim": a.head_dim,
                          "no_hca": a.no_hca, "results": rows}, indent=2))
        return
    layers = ", no HCA" if a.no_hca else ""
    print(f"# dsv4core from {dsv4core.__file__}; {a.threads} thread(s), head_dim {a.head_dim}{layers}, "
          f"batch {a.batch}, {a.steps} steps")
    for r in rows:
        print(f"context {r['context']:6d}: decode {r['decode_ms_per_step']:7.2f} ms/step   "
              f"(prefill {r['prefill_s']:.1f} s, state {r['state_MiB_per_request']:.2f} MiB/request)")


if __name__ == "__main__":
    main()
