"""``dsv4core inspect PATH``: format, dtypes, quantisation, layer schedule, parameter count, size.

Reads only safetensors headers and ``config.json``; no tensor data is loaded.
"""

from __future__ import annotations

import json

from ._util import print_json, print_table


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("inspect", help="describe a checkpoint (format, dtypes, quantisation, schedule, size)",
                              description="Describe a DeepSeek-V4 checkpoint directory (official or transformers "
                                          "layout, single file or sharded) from its headers and config.json.")
    p.add_argument("path", metavar="PATH", help="checkpoint directory or .safetensors file")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _compact_schedule(sched: list[dict]) -> str:
    """Runs of equal (attention, moe) as 'a-b: CSA/topk'."""
    out, start = [], 0
    for i in range(1, len(sched) + 1):
        if i == len(sched) or (sched[i]["attention"], sched[i]["moe"]) != (sched[start]["attention"],
                                                                           sched[start]["moe"]):
            s = sched[start]
            rng = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            out.append(f"{rng}:{s['attention']}/{s['moe']}")
            start = i
    return " ".join(out)


def _numerics(ckpt) -> str:
    """What ``load_model(path)`` (numerics="auto") computes with, and why."""
    from dsv4core.model.config import DSV4Config
    from dsv4core.model.numerics import dims_problem, resolve

    if not ckpt.config_dict:
        return "unknown (no config.json)"
    picked = resolve("auto", ckpt.format, ckpt.config_dict)
    if picked == "official":
        why = dims_problem(DSV4Config.from_dict(ckpt.config_dict))
        return f"exact (quantised, but {why})" if why else "official"
    return "exact"


def run(args) -> int:
    from dsv4core.checkpoint import open_checkpoint
    from dsv4core.checkpoint.summary import summarize

    ckpt = open_checkpoint(args.path)
    info = summarize(ckpt)
    info["numerics"] = _numerics(ckpt)
    if args.json:
        print_json(info)
        return 0
    q = info["quantization"]
    print(f"path:        {info['path']}")
    print(f"format:      {info['format']}")
    print(f"numerics:    {info['numerics']} (load_model's default, numerics='auto')")
    print(f"files:       {info['files']} ({'sharded, with index' if info['sharded'] else 'no index'}), "
          f"{_size(info['size_bytes'])}; largest shard {info['largest_shard']['file']} "
          f"({_size(info['largest_shard']['bytes'])})")
    print(f"tensors:     {info['tensors']}")
    mtp = info["mtp"]
    print(f"parameters:  {info['parameters']:,} (+ {info['mtp_parameters']:,} in mtp.*)")
    print(f"mtp:         " + (f"1 MTP block, {mtp['parameters']:,} parameters (loaded; speculative decoding: "
                              f"generate --speculative-tokens K)" if mtp["loaded"]
                              else f"not loaded: {mtp['speculation_unavailable']}"))
    fp8 = ", ".join(f"{n} with {d} scales" for d, n in q["fp8_block_scaled_weights"].items()) or "none"
    fp4 = ", ".join(f"{n} with {d} scales" for d, n in q["fp4_packed_weights"].items()) or "none"
    print(f"FP8 128x128: {fp8}")
    print(f"FP4 e2m1:    {fp4}")
    if q["quantization_config"]:
        print(f"quant cfg:   {q['quantization_config']} expert_dtype={q['expert_dtype']}")
    print(f"config:      {json.dumps(info['config'], default=str)}")
    print(f"schedule:    {_compact_schedule(info['layer_schedule']) or '(no config)'}")
    print()
    print_table(("dtype", "tensors", "size"), [(k, v["tensors"], _size(v["bytes"])) for k, v in info["dtypes"].items()])
    return 0
