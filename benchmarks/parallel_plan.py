"""Per-rank memory and collective bytes of the tensor x expert parallel layout (computed, not
measured) for DSV4-Flash and DSV4-Pro; writes benchmarks/results/computed/<date>_<commit>/bench/parallel-plan-flash-pro.json and the tables
of docs/parallelism.md (between the <!-- plan --> markers).

    python benchmarks/parallel_plan.py            # rewrite both
    python benchmarks/parallel_plan.py --check    # exit 1 if docs/parallelism.md is stale

Weights: the model is built on the meta device for rank 0 of each layout (dsv4core.model.parallel
cuts; rank 0 holds the largest share), bytes counted per tensor in the serving format: FP8
e4m3 + float32 128x128 block scale for every projection the FP8 plan can keep (dsv4core.model.fp8
candidates: attention, compressor, indexer, router gate), FP4 e2m1 (half a byte) + one UE8M0
byte per 32 for the routed experts, FP8 + block scale for the shared expert, bf16 for the
embedding and lm_head, float32 for norms, mHC, sinks and biases (int64 hash tables as stored).
State: `state_bytes` (bf16 rows, fp32 compressor rings): replicated, the same on every rank.
Collectives per token: bf16 activations [H], ring algorithms (an all_reduce sends
2 (n-1)/n of its payload from each rank, an all_gather (n-1)/n of the result).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

from _results import result_path

from dsv4core.model import DSV4ForCausalLM, state_bytes
from dsv4core.model.config import DSV4Config
from dsv4core.model.fp8 import candidates
from dsv4core.model.parallel import Parallel, ParallelError, check_layout

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "parallelism.md"
JSON_NAME = "parallel-plan-flash-pro.json"     # under benchmarks/results/computed/<date>_<commit>/bench/

H200_BYTES = 141 * 10**9          # HBM3e per H200 (141 GB)
RESERVE = 12 * 2**30              # activations, workspace, graphs, allocator slack per GPU (assumed)
SIZES = (1, 2, 4, 8)
CONTEXTS = (8192, 131072, 1048576)
BATCH = {8192: 64, 131072: 16, 1048576: 2}   # the batch the "smallest H200 count" column must hold


def flash() -> DSV4Config:
    return DSV4Config.from_dict({
        "num_hidden_layers": 43, "num_hash_layers": 3,
        "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0]})


def pro() -> DSV4Config:
    return DSV4Config.from_dict({
        "num_hidden_layers": 61, "num_hash_layers": 3, "hidden_size": 7168, "num_attention_heads": 128,
        "q_lora_rank": 1536, "o_groups": 16, "n_routed_experts": 384, "moe_intermediate_size": 3072,
        "routed_scaling_factor": 2.5,
        "compress_ratios": [128, 128] + [4 if i % 2 == 0 else 128 for i in range(59)] + [0]})


def _fp8(n: int, k: int) -> int:
    return n * k + (-(-n // 128)) * (-(-k // 128)) * 4


def weight_bytes(cfg: DSV4Config, par: Parallel) -> dict[str, int]:
    with torch.device("meta"):
        m = DSV4ForCausalLM(cfg, None, dtype=torch.bfloat16, parallel=par)
    fp8 = {name for name, _, _ in candidates(m)}
    out = {"attention_fp8": 0, "routed_experts_fp4": 0, "shared_expert_fp8": 0, "embed_lm_head_bf16": 0,
           "other": 0}
    for name, t in list(m.named_parameters()) + list(m.named_buffers()):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            out["routed_experts_fp4"] += t.numel() // 2 + t.numel() // 32
        elif ".shared_experts." in name:
            out["shared_expert_fp8"] += _fp8(*t.shape)
        elif name in fp8:
            out["attention_fp8"] += _fp8(*t.shape)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out["embed_lm_head_bf16"] += t.numel() * 2
        else:
            out["other"] += t.numel() * t.element_size()
    out["total"] = sum(out.values())
    return out


def collective_bytes(cfg: DSV4Config, tp: int, ep: int) -> dict[str, float]:
    """Bytes one rank sends per token, per layer and per step ends (bf16 payloads, ring)."""
    H, V, k, w = cfg.hidden_size, cfg.vocab_size, cfg.num_experts_per_tok, tp * ep
    act = H * 2
    ring = lambda n: 2 * (n - 1) / n if n > 1 else 0.0  # noqa: E731
    return {
        "attn_all_reduce_tp_per_layer": act * ring(tp),
        "moe_all_reduce_world_per_layer": act * ring(w),
        "embed_all_reduce_tp": act * ring(tp),
        "logits_all_gather_tp": V * 4 * (tp - 1) / tp,
        # the alternative: all_to_all dispatch + combine of k expert rows, (ep-1)/ep of them remote
        "moe_all_to_all_alternative_per_layer": 2 * k * act * (ep - 1) / ep,
    }


def plan() -> dict:
    res = {"assumptions": {"h200_bytes": H200_BYTES, "reserve_bytes_per_gpu": RESERVE, "batch": BATCH,
                           "state_rows": "bf16", "collectives": "bf16 activations, ring algorithms"},
           "models": {}}
    for mname, cfg in (("DSV4-Flash", flash()), ("DSV4-Pro", pro())):
        st = {ctx: state_bytes(cfg, ctx, act_bytes=2)["total"] for ctx in CONTEXTS}
        rows = []
        for tp in SIZES:
            for ep in SIZES:
                try:
                    check_layout(cfg, tp, ep)
                except ParallelError as e:
                    rows.append({"tp": tp, "ep": ep, "invalid": str(e)})
                    continue
                wb = weight_bytes(cfg, Parallel(tp=tp, ep=ep, rank=0))
                free = H200_BYTES - RESERVE - wb["total"]
                fits = {ctx: free >= BATCH[ctx] * st[ctx] for ctx in CONTEXTS}
                max_batch = {ctx: max(0, int(free // st[ctx])) for ctx in CONTEXTS}
                rows.append({"tp": tp, "ep": ep, "world": tp * ep, "weights": wb, "fits": fits,
                             "max_batch": max_batch, "collectives": collective_bytes(cfg, tp, ep)})
        smallest = {}
        for ctx in CONTEXTS:
            ok = [r for r in rows if "invalid" not in r and r["fits"][ctx]]
            best = min(ok, key=lambda r: (r["world"], r["weights"]["total"])) if ok else None
            smallest[ctx] = None if best is None else {"world": best["world"], "tp": best["tp"], "ep": best["ep"]}
        res["models"][mname] = {"state_bytes_per_request": st, "layouts": rows, "smallest": smallest}
    return res


def _gb(b: float) -> str:
    return f"{b / 1e9:.1f}"


def tables(res: dict) -> str:
    lines = []
    for mname, m in res["models"].items():
        st = m["state_bytes_per_request"]
        lines.append(f"### {mname}\n")
        lines.append("State per request (every rank; KV path replicated): " + ", ".join(
            f"{int(c) // 1024}k: {_gb(b)} GB" for c, b in st.items()) + "\n")
        lines.append("| tp | ep | ranks | weights GB/rank (attn FP8 / experts FP4 / shared / embed+head / other) "
                     "| max batch 8k / 128k / 1M | attn AR KB/tok/layer | MoE AR KB/tok/layer "
                     "| (all_to_all alt.) | logits AG KB/tok |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in m["layouts"]:
            if "invalid" in r:
                lines.append(f"| {r['tp']} | {r['ep']} | - | not a valid layout: {r['invalid']} | | | | | |")
                continue
            w, c = r["weights"], r["collectives"]
            mb = " / ".join(str(r["max_batch"][ctx]) for ctx in st)
            lines.append(
                f"| {r['tp']} | {r['ep']} | {r['world']} | **{_gb(w['total'])}** ({_gb(w['attention_fp8'])} / "
                f"{_gb(w['routed_experts_fp4'])} / {_gb(w['shared_expert_fp8'])} / {_gb(w['embed_lm_head_bf16'])} / "
                f"{_gb(w['other'])}) | {mb} | {c['attn_all_reduce_tp_per_layer'] / 1e3:.1f} | "
                f"{c['moe_all_reduce_world_per_layer'] / 1e3:.1f} | {c['moe_all_to_all_alternative_per_layer'] / 1e3:.1f}"
                f" | {c['logits_all_gather_tp'] / 1e3:.0f} |")
        sm = m["smallest"]
        lines.append("")
        lines.append("Smallest H200 count: " + "; ".join(
            f"batch {BATCH[c]} at {int(c) // 1024}k: " +
            ("none of these layouts" if v is None else f"{v['world']} (tp={v['tp']}, ep={v['ep']})")
            for c, v in sm.items()) + "\n")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/parallelism.md is not current")
    args = ap.parse_args(argv)
    res = plan()
    text = tables(res)
    doc = DOC.read_text()
    new = re.sub(r"(<!-- plan -->\n).*?(<!-- /plan -->)", lambda m: m.group(1) + text + "\n" + m.group(2), doc,
                 flags=re.S)
    if args.check:
        if new != doc:
            print(f"{DOC} is stale: run python benchmarks/parallel_plan.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    out = result_path("computed", "bench", JSON_NAME)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
