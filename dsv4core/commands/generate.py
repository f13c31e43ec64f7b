"""``dsv4core generate``: generation (greedy, or sampled with a seed) from token ids or text with a DSV4
model (a checkpoint or ``tiny``)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time


def _ids(text: str) -> list[int]:
    """``--input-ids``: comma-separated non-negative integers, strictly (``'1 2 3'`` is not 123,
    ``1,,2`` is no list); argparse shows the message as the one-line usage error."""
    items = [t.strip() for t in text.split(",")]
    for t in items:
        if not t:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r} (an empty item)")
        if not t.lstrip("-").isdigit() or t.count("-") > 1 or "-" in t[1:]:
            hint = "; separate ids with commas, not spaces" if " " in t else ""
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r} "
                                             f"({t!r} is not an integer{hint})")
    ids = [int(t) for t in items]
    neg = [i for i in ids if i < 0]
    if neg:
        raise argparse.ArgumentTypeError(f"token ids must be >= 0, got {neg[0]} in {text!r}")
    return ids


#: argparse reads an argument that starts with "-" as an option unless it looks like a negative
#: number; this makes "-3,4" (and "-3") a value, so `--input-ids -3,4` is refused as a negative id
#: instead of "expected one argument"
_NEGATIVE_IDS = re.compile(r"^-\d[\d,\s-]*$")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate tokens / text (greedy or sampled)",
                              description="Load a DSV4 model (checkpoint directory or the built-in 'tiny') and "
                                          "generate tokens for one or more prompts given as token ids or text, "
                                          "batched: one prefill, then one decode step per new token; greedy "
                                          "unless --temperature > 0.")
    p._negative_number_matcher = _NEGATIVE_IDS
    p.add_argument("--model", required=True, help="checkpoint directory, or 'tiny' / 'tiny-official' for the built-in tiny DSV4 (exact numerics) "
                        "or its variant whose dims carry the official numerics ('tiny-mtp' / "
                        "'tiny-official-mtp': with an MTP block)")
    p.add_argument("--input-ids", action="append", default=[], type=_ids, metavar="1,2,3",
                   help="prompt token ids, comma-separated; repeat for a batch of prompts")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a text prompt, encoded with the model's tokenizer (tokenizer.json; the tiny model's "
                        "is one token per byte); repeat for a batch; combines with --input-ids")
    p.add_argument("--chat", action="store_true",
                   help="treat each --prompt as a user message: render it with the checkpoint's chat template "
                        "(chat_template.jinja, else tokenizer_config.json's chat_template; the tiny model's is "
                        "'User: TEXT<newline>Assistant:') and stop at its eos_token")
    p.add_argument("--system", default=None, metavar="TEXT", help="with --chat: a system message before each prompt")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print the new text as it is generated (one prompt; default: on when stdout is a "
                        "terminal, there is one prompt and no --json)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy, the argmax (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the most likely tokens "
                   "whose probability mass reaches P (default: 1, all)")
    p.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (default: 0, all)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: the same seed, prompts and model "
                   "give the same tokens, on any batch, with or without device graphs (default: a fresh one "
                   "each run)")
    p.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate per prompt (default: 16)")
    p.add_argument("--backend", default=None, help="HAL backend name or 'auto' (default: $DSV4CORE_BACKEND or auto)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--quantized", default="auto", choices=["auto", "keep", "dequantize"],
                   help="quantised checkpoint weights (FP8 projections, packed FP4 / FP8 routed experts): "
                        "keep them quantised where the serving backend computes with them (auto), "
                        "always keep, or dequantise (default: auto)")
    p.add_argument("--numerics", default="auto", choices=["auto", "exact", "official"],
                   help="exact (the transformers math) or official (DeepSeek-V4's quantised inference: W8A8, "
                        "FP8 KV rows, FP4 indexer); auto: official for an official or FP8 / FP4 checkpoint "
                        "(default: auto)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="activation dtype (default: float32 for tiny, the checkpoint's dtype otherwise)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prefill at most N tokens of each prompt per forward (default: whole prompts)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default on the CPU, unless OMP_NUM_THREADS is set: 1 for a model of "
                        "hidden size <= 256, such as the built-in tiny models, measured fastest; else one a physical "
                        "core this process may run on)")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor-parallel ranks (attention heads, shared expert, vocabulary); run under "
                        "torchrun --nproc-per-node tp*ep (default: 1)")
    p.add_argument("--ep", type=int, default=1, metavar="N",
                   help="expert-parallel ranks (routed experts split over them; default: 1)")
    p.add_argument("--allow-nonfinite", action="store_true",
                   help="load weights holding NaN / Inf instead of refusing them (debugging)")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="speculative decoding (greedy only): the model's MTP block drafts K tokens a request "
                        "(1..3 typical, at most the cache's max_rollback) and one step verifies them; the tokens "
                        "equal plain greedy decoding; acceptance statistics on stderr / in --json (default: 0, off)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--no-progress", action="store_true", help="no progress display on stderr")
    p.set_defaults(func=run)


#: control characters other than newline and tab: the stream writes them escaped (``\\x1b``), so
#: a model's output cannot drive the terminal
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class _TextStream:
    """`on_token` for one prompt: writes its new text to `stream` as the tokens arrive (the token
    ids, comma-separated, when the model has no tokenizer). The text so far is decoded whole each
    time and only its new tail written; a tail ending in U+FFFD (a UTF-8 sequence not complete
    yet) waits for the next token. Control characters but newline and tab are written escaped.
    `close()` writes what is left and a newline."""

    def __init__(self, tok, stream) -> None:
        self.tok, self.stream, self.ids, self.shown = tok, stream, [], ""

    def _write(self, final: bool) -> None:
        if self.tok is None:
            return
        text = self.tok.decode(self.ids)
        if (final or not text.endswith("\ufffd")) and text.startswith(self.shown):
            self.stream.write(_CONTROL.sub(lambda m: repr(m.group())[1:-1], text[len(self.shown):]))
            self.shown = text

    def __call__(self, i: int, token: int) -> None:
        self.ids.append(token)
        if self.tok is None:
            self.stream.write(("," if len(self.ids) > 1 else "") + str(token))
        self._write(False)
        self.stream.flush()

    def close(self) -> None:
        self._write(True)
        self.stream.write("\n")
        self.stream.flush()


def _chat_prompts(model, texts: list[str], system: str | None) -> tuple[list[str], int | None]:
    """The --prompt texts rendered as one-turn conversations with the model's chat template, and
    the eos id generation stops at (None when the tokenizer names none)."""
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise ValueError(f"--chat needs the model's tokenizer: {getattr(model, 'tokenizer_why', '') or 'none'}")
    head = [{"role": "system", "content": system}] if system is not None else []
    return [tok.apply_chat_template(head + [{"role": "user", "content": t}]) for t in texts], tok.eos_token_id


def _converse(model, args, stdin, stdout) -> int:
    """`--chat` without `--prompt`: a conversation. Each line read from `stdin` is a user message
    (blank lines are skipped; end of input ends it); the whole conversation so far, rendered with
    the chat template, is the prompt, and the reply is streamed to `stdout`, then kept (its text,
    without the eos token) as the assistant's message of the next turn. On a terminal "you> " on
    stderr asks for each line."""
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise ValueError(f"--chat needs the model's tokenizer: {getattr(model, 'tokenizer_why', '') or 'none'}")
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    ask = stdin.isatty()
    while True:
        if ask:
            sys.stderr.write("you> ")
            sys.stderr.flush()
        line = stdin.readline()
        if not line:
            if ask:
                sys.stderr.write("\n")
            return 0
        text = line.rstrip("\n")
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        prompt = tok.apply_chat_template(messages)
        streamer = _TextStream(tok, stdout)
        eos = tok.eos_token_id
        (new,) = model.generate([prompt], args.max_new_tokens, prefill_chunk=args.prefill_chunk,
                                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                eos_token_id=eos, on_token=streamer)
        streamer.close()
        messages.append({"role": "assistant", "content": tok.decode(new[:-1] if new and new[-1] == eos else new)})


class _Progress:
    """Progress on stderr once a run takes more than a second: on a terminal one line rewritten in
    place (``\\r``); otherwise (a log, a pipe) a plain line every `every` seconds and a last one,
    so no carriage return reaches a file."""

    def __init__(self, enabled: bool, stream=None, every: float = 10.0) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and self.stream is not None
        self.tty = self.enabled and bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every
        self.t0 = time.perf_counter()
        self.shown = False
        self.last = 0.0

    def __call__(self, step: int, total: int) -> None:
        if not self.enabled:
            return
        dt = time.perf_counter() - self.t0
        if dt < 1.0 and step < total:
            return
        if not self.shown and step >= total:
            return
        if not self.tty and step < total and self.shown and dt - self.last < self.every:
            return
        self.shown, self.last = True, dt
        rate = step / dt if dt > 0 else 0.0
        line = f"generate: {step}/{total} tokens, {rate:.1f} tokens/s"
        if self.tty:
            self.stream.write(f"\r{line}" + ("\n" if step >= total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


#: The largest hidden size `generate` runs on one CPU thread by default: the tiny models (64, 128)
#: and the "small" dims (256) generated fastest on one thread of 1..4 (benchmarks/generate_threads.py;
#: README "Command line" cites the figures).
ONE_THREAD_HIDDEN = 256


def physical_cores() -> int:
    """The physical cores this process may run on: the CPUs of its affinity mask, SMT siblings of one
    core counted once (Linux topology files; elsewhere, or without them, the number of CPUs)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)
    cores = set()
    for c in cpus:
        base = f"/sys/devices/system/cpu/cpu{c}/topology/"
        try:
            with open(base + "physical_package_id") as f, open(base + "core_id") as g:
                cores.add((f.read().strip(), g.read().strip()))
        except OSError:
            cores.add(("cpu", str(c)))
    return max(1, len(cores))


def default_threads(hidden_size: int) -> int:
    """`generate`'s CPU thread count when neither --threads nor OMP_NUM_THREADS sets one: 1 for a
    model of hidden size <= ONE_THREAD_HIDDEN (a step of such matrices is too small to split: more
    threads only add synchronisation), else the physical cores this process may run on
    (`physical_cores`: a thread a core, none on an SMT sibling, none outside the affinity mask),
    shared among the ranks a launcher started on this host (LOCAL_WORLD_SIZE)."""
    if hidden_size <= ONE_THREAD_HIDDEN:
        return 1
    return max(1, physical_cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or "1")))


def _threads(args, hidden_size: int | None = None) -> int | None:
    """The torch thread count to set, or None to leave torch's: --threads when given; else, on the
    CPU without OMP_NUM_THREADS set, `default_threads` of the model's hidden size (None: not known
    yet, before a checkpoint is read; a built-in model's is known by name)."""
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        return args.threads
    from dsv4core.model.api import BUILT_IN

    if hidden_size is None and str(args.model) in BUILT_IN:
        hidden_size = BUILT_IN[str(args.model)][0]["hidden_size"]
    if args.device == "cpu" and hidden_size is not None and not os.environ.get("OMP_NUM_THREADS"):
        return default_threads(hidden_size)
    return None


def run(args) -> int:
    import dsv4core
    from dsv4core.commands._util import print_json

    from dsv4core.commands._util import check_device

    if args.max_new_tokens < 0:
        raise ValueError("--max-new-tokens must be >= 0")
    check_device(args.device)
    conversation = args.chat and not args.input_ids and not args.prompt
    if not args.input_ids and not args.prompt and not conversation:
        raise ValueError("give at least one prompt: --input-ids 1,2,3 or --prompt TEXT (or --chat alone: a "
                         "conversation read from stdin)")
    if conversation and (args.json or args.stream is False or args.tp * args.ep > 1):
        raise ValueError("--chat without --prompt is a conversation streamed to stdout in one process: "
                         "it takes no --json, --no-stream, --tp or --ep")
    from dsv4core.model.sampling import SamplingParams

    SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)   # a bad value: exit 2 before loading
    if args.chat and args.input_ids:
        raise ValueError("--chat takes text prompts (--prompt TEXT), not --input-ids")
    if args.system is not None and not args.chat:
        raise ValueError("--system is a chat message: give it with --chat")
    prompts = list(args.input_ids) + list(args.prompt)
    if args.stream and args.json:
        raise ValueError("--stream writes text as it comes; --json writes one object at the end: choose one")
    if args.stream and len(prompts) > 1:
        raise ValueError(f"--stream shows one prompt's text as it is generated; got {len(prompts)} prompts")
    stream = args.stream if args.stream is not None else (
        not args.json and len(prompts) == 1 and sys.stdout.isatty())
    threads = _threads(args)
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    parallel = args.tp * args.ep > 1
    world = int(os.environ.get("WORLD_SIZE", "1") or "1")
    if world > 1 and not parallel:   # each process would run (and print) the whole model
        raise ValueError(f"started as {world} processes (WORLD_SIZE={world}) but --tp {args.tp} x --ep {args.ep} "
                         f"= 1 rank: give --tp / --ep with tp x ep = {world}, or run one process without torchrun")
    rank = int(os.environ.get("RANK", "0")) if parallel else 0
    device = args.device
    if parallel and device != "cpu" and ":" not in device:   # one accelerator per local rank
        device = f"{device}:{int(os.environ.get('LOCAL_RANK', '0'))}"
    t0 = time.perf_counter()
    try:
        from dsv4core._progress import StatusLine
        from dsv4core.checkpoint import load_progress

        status = StatusLine(not args.no_progress and rank == 0, lines=True, every=10.0, delay=1.0)

        def loading(done: int, total: int, shard: str) -> None:
            status.update(f"load: {done / 2**20:,.0f} / {total / 2**20:,.0f} MiB read ({shard})", final=done >= total)

        try:
            with load_progress(loading):
                model = dsv4core.load_model(args.model, backend=args.backend, dtype=args.dtype, device=device,
                                            numerics=args.numerics, quantized=args.quantized, tp=args.tp,
                                            ep=args.ep, allow_nonfinite=args.allow_nonfinite)
        finally:   # the status line off the terminal before any error message
            status.close()
        t_load = time.perf_counter() - t0
        if threads is None and _threads(args, model.config.hidden_size) is not None:   # a checkpoint's default
            torch.set_num_threads(_threads(args, model.config.hidden_size))
        eos, chat_texts = None, None
        if conversation:
            return _converse(model, args, sys.stdin, sys.stdout)
        if args.chat:
            chat_texts, eos = _chat_prompts(model, prompts, args.system)
        streamer = _TextStream(getattr(model, "tokenizer", None), sys.stdout) if stream and rank == 0 else None
        progress = _Progress(not args.no_progress and rank == 0 and streamer is None)
        t1 = time.perf_counter()
        out = model.generate(chat_texts or prompts, args.max_new_tokens, prefill_chunk=args.prefill_chunk,
                             progress=progress, temperature=args.temperature, top_p=args.top_p,
                             top_k=args.top_k, seed=args.seed, eos_token_id=eos,
                             on_token=(lambda i, t: streamer(i, t)) if streamer is not None else None,
                             speculative_tokens=args.speculative_tokens)
        if streamer is not None:
            streamer.close()
        t_gen = time.perf_counter() - t1
    finally:
        if parallel:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    if rank != 0:      # every rank computed the same tokens; rank 0 reports them
        return 0
    tok = getattr(model, "tokenizer", None)
    texts = [tok.decode(o) for o in out] if tok is not None else None
    if args.json:
        dtype = str(model.act_dtype).removeprefix("torch.")
        print_json({"model": str(args.model), "backend": model.backend, "dtype": dtype, "numerics": model.numerics,
                    "tp": args.tp, "ep": args.ep, "threads": torch.get_num_threads(),
                    "prompts": prompts, "chat": args.chat, "chat_prompts": chat_texts, "eos_token_id": eos,
                    "new_tokens": out, "new_text": texts,
                    "sampling": {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                                 "seed": args.seed}, "load_s": round(t_load, 3),
                    "generate_s": round(t_gen, 3), "cache_bytes": model.cache.bytes_report(),
                    "graphs": model.graph_status() or "on", "speculation": out.speculation})
    else:
        for i, (p, o) in enumerate(zip(prompts, out) if streamer is None else ()):   # streamed: shown already
            if isinstance(p, str):
                kind = "chat, user message" if args.chat else "text"
                print(f"[{i}] prompt ({kind}): {json.dumps(p, ensure_ascii=False)}")
            else:
                print(f"[{i}] prompt ({len(p)} tokens): {','.join(map(str, p))}")
            print(f"[{i}] new tokens ({len(o)}): {','.join(map(str, o))}")
            if texts is not None:   # quoted, control characters escaped
                print(f"[{i}] new text: {json.dumps(texts[i], ensure_ascii=False)}")
        n = sum(len(o) for o in out)
        mib = model.cache.bytes_report()["total"] / 2**20
        print(f"{n} tokens in {t_gen:.2f}s (load {t_load:.2f}s; state pools {mib:.1f} MiB; "
              f"{torch.get_num_threads()} CPU thread{'s' if torch.get_num_threads() != 1 else ''})", file=sys.stderr)
        sp = out.speculation
        if sp is not None:
            mal = "n/a" if sp["mean_acceptance_length"] is None else f"{sp['mean_acceptance_length']:.2f}"
            per = ", ".join("n/a" if r["rate"] is None else f"{r['rate']:.2f}" for r in sp["per_position"])
            print(f"speculation: k={sp['speculative_tokens']}, {sp['rounds']} verification rounds, mean acceptance "
                  f"length {mal}, acceptance per draft position: {per}", file=sys.stderr)
    summary = model.ops.verify_summary() if hasattr(model.ops, "verify_summary") else None
    if summary is not None:
        diverged = ", ".join(f"{op} {v['divergences']}/{v['checked']}" for op, v in summary["diverged"].items())
        sites = summary.get("sites", {})
        bad_sites = [k for k, v in sites.items() if v["divergences"]]
        print(f"verify: {summary['checked']} of {summary['calls']} op calls checked against the reference "
              f"(fraction {summary['fraction']:g}, seed {summary['seed']}; "
              f"{sum(1 for v in sites.values() if v['checked'])} of {len(sites)} call sites checked), "
              f"{summary['divergences']} diverged"
              + (f" ({diverged}; at {', '.join(bad_sites[:5])}{', ...' if len(bad_sites) > 5 else ''})"
                 if diverged else "") + ("; DSV4CORE_VERIFY_STRICT=1 makes the first one an error"
                                         if summary["divergences"] else ""), file=sys.stderr)
    return 0
