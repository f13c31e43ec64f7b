"""dsv4core model core: config dialects and validation, the built-in tiny model, public API,
bad input, state size, the `generate` CLI subcommand."""

from __future__ import annotations

import argparse
import io
import json
import math
import re
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

import dsv4core
from dsv4core.model import ConfigError, DSV4Config, InputError, state_bytes
from dsv4core.model.api import TINY_CONFIG, load_model
from _model_hf import CONFIG_A, hf_model, _one_thread  # noqa: F401 (autouse: one torch thread)

CSA, HCA, SW = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", backend="reference")


# ------------------------------------------------------------------ config

def official_flash() -> dict:
    """The official DSV4-Flash config.json (PEERS.md table 1.1), legacy key names."""
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 129280, "hidden_size": 4096,
        "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024,
        "n_routed_experts": 256, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2048,
        "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 3, "sliding_window": 128,
        "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0],
        "compress_rope_theta": 160000, "rope_theta": 10000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "expert_dtype": "fp4",
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                                "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
        "bos_token_id": 0, "eos_token_id": 1,
    }


def test_official_config_schedule_and_rope():
    cfg = DSV4Config.from_dict(official_flash())
    assert len(cfg.layer_types) == 43  # MTP entry dropped
    assert cfg.layer_types[:4] == [SW, SW, CSA, HCA] and cfg.layer_types[-1] == CSA
    assert cfg.layer_types.count(CSA) == 21 and cfg.layer_types.count(HCA) == 20
    assert cfg.compress_rates == {CSA: 4, HCA: 128}
    assert cfg.mlp_layer_types[:4] == ["hash_moe"] * 3 + ["moe"]
    assert cfg.qk_rope_head_dim == 64 and cfg.rope_kind(0) == "main" and cfg.rope_kind(2) == "compress"
    w = cfg.inv_freq("compress")
    # PEERS.md 4.2 sample values: pairs <= 15 unchanged, >= 25 divided by 16
    for i, v in {0: 1.0, 15: 3.6355e-3, 16: 2.2656e-3, 20: 2.9698e-4, 24: 1.9531e-5, 25: 5.3723e-6,
                 31: 5.6805e-7}.items():
        assert math.isclose(w[i].item(), v, rel_tol=2e-4), (i, w[i].item(), v)
    assert math.isclose(cfg.inv_freq("main")[31].item(), 1.3335e-4, rel_tol=2e-4)


def test_official_and_transformers_configs_agree_with_transformers():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    off = official_flash()
    hcfg = DeepseekV4Config(**{k: v for k, v in off.items() if k not in ("architectures",)})
    ours_off = DSV4Config.from_dict(off)
    ours_hf = DSV4Config.from_dict(json.loads(hcfg.to_json_string()))
    assert ours_off == ours_hf
    assert ours_hf.layer_types == hcfg.layer_types and ours_hf.mlp_layer_types == hcfg.mlp_layer_types
    rot = DeepseekV4RotaryEmbedding(hcfg)
    for kind in ("main", "compress"):
        assert torch.equal(ours_hf.inv_freq(kind), getattr(rot, f"{kind}_inv_freq"))
    assert DSV4Config.from_dict(ours_hf.to_hf_dict()) == ours_hf


@pytest.mark.parametrize("change, msg", [
    ({"layer_types": [SW, "full_attention", SW, SW, SW]}, "layer_types"),
    ({"layer_types": [SW, SW]}, "num_hidden_layers"),
    ({"o_groups": 3}, "o_groups"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"model_type": "llama"}, "model_type"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"compress_rates": {CSA: 0, HCA: 8}}, "compress_rates"),
    ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                          "compress": {"rope_type": "yarn", "rope_theta": 1.6e5, "factor": 16,
                                       "original_max_position_embeddings": 64, "attention_factor": 1.277}}},
     "attention_factor"),
    ({"hidden_size": -4}, "hidden_size"),
])
def test_config_errors_are_clear(change, msg):
    d = {**CONFIG_A, **change}
    with pytest.raises(ConfigError, match=msg):
        DSV4Config.from_dict(d)


def test_official_config_errors():
    d = official_flash()
    d["compress_ratios"] = [0, 4, 128]
    with pytest.raises(ConfigError, match="compress_ratios has 3 entries"):
        DSV4Config.from_dict(d)
    d["compress_ratios"] = [0, 4, 128, 64] + [0] * 40
    with pytest.raises(ConfigError, match="several non-CSA ratios"):
        DSV4Config.from_dict(d)


# ------------------------------------------------------------------ tiny model and API

def test_tiny_covers_every_layer_and_moe_kind(tiny):
    cfg = tiny.config
    assert set(cfg.layer_types) == {SW, CSA, HCA}
    assert set(cfg.mlp_layer_types) == {"hash_moe", "moe"}
    assert cfg.hc_mult == 4 and DSV4Config.from_dict(TINY_CONFIG) == cfg


def test_tiny_is_deterministic(tiny):
    other = load_model("tiny", backend="reference")
    a, b = tiny.state_dict(), other.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    out = tiny.generate([[1, 2, 3], [7] * 40], 12)
    assert out == other.generate([[1, 2, 3], [7] * 40], 12)
    assert [len(o) for o in out] == [12, 12]


def test_logits_shape_and_api(tiny):
    lg = tiny.logits([5, 6, 7, 8])
    assert lg.shape == (4, tiny.config.vocab_size) and lg.dtype == torch.float32
    assert torch.equal(lg, tiny.logits(torch.tensor([5, 6, 7, 8])))
    # greedy first token of generate == argmax of the prefill's last row
    assert tiny.generate([[5, 6, 7, 8]], 1) == [[int(lg[-1].argmax())]]
    assert tiny.generate([[1]], 0) == [[]]
    assert dsv4core.load_model is not None


def test_hal_report(tiny):
    rep = tiny.hal_report()
    ops = {r["op"]: r["backend"] for r in rep}
    for op in ("hc_pre", "hc_post", "hc_head", "rms_norm", "rope", "q_norm_rope", "kv_norm_rope",
               "sparse_mqa_attention", "compress_pool", "indexer_scores", "indexer_topk", "linear", "wo_a",
               "moe_route", "moe_experts"):
        assert ops[op] == "reference"


def test_bf16_keeps_fp32_parameters():
    m = load_model("tiny", backend="reference", dtype="bfloat16")
    fp32_leaf = ("fn", "base", "scale", "hc_fn", "hc_base", "hc_scale", "sinks", "position_bias",
                 "e_score_correction_bias")
    for name, p in m.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in fp32_leaf or name.endswith("norm.weight"):
            assert p.dtype == torch.float32, name
        elif leaf == "tid2eid":
            assert p.dtype == torch.int64
        else:
            assert p.dtype == torch.bfloat16, name
    out = m.generate([[3, 4, 5]], 4)
    assert len(out[0]) == 4


def test_no_vendor_names_in_model_core():
    root = Path(dsv4core.__file__).parent / "model"
    pat = re.compile(r"\b(cuda|hip|npu|rocm|xpu|nvidia|ascend|triton|cudnn|nccl)\b", re.I)
    for f in root.glob("*.py"):
        hits = [ln for ln in f.read_text().splitlines() if pat.search(ln)]
        assert not hits, (f.name, hits)


# ------------------------------------------------------------------ bad input

def test_bad_inputs_raise_clearly(tiny):
    V = tiny.config.vocab_size
    with pytest.raises(InputError, match="empty"):
        tiny.logits([])
    with pytest.raises(InputError, match="out of vocabulary"):
        tiny.logits([1, V])
    with pytest.raises(InputError, match="prompt 1 is empty"):
        tiny.generate([[1, 2], []], 3)
    with pytest.raises(InputError, match="prompt 0: token ids out of vocabulary"):
        tiny.generate([[1, -1]], 3)
    with pytest.raises(InputError, match="max_position_embeddings"):
        tiny.generate([[1]], tiny.config.max_position_embeddings)
    with pytest.raises(InputError, match="max_new_tokens"):
        tiny.generate([[1]], -1)


def test_bad_request_does_not_corrupt_others(tiny):
    V = tiny.config.vocab_size
    good = [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12, 13, 14, 15, 16, 17, 18]
    ref = tiny.logits(good)
    s1, s2 = tiny.new_state(), tiny.new_state()
    tiny.forward_batch(torch.tensor(good[:10]), torch.arange(10), torch.zeros(10, dtype=torch.long), [s1])
    before = s1.nbytes(), s1.length
    cases = [
        ([good[10], V + 5], [10, 0], [0, 1], "out of vocabulary"),            # OOV in request 1
        ([good[10], 3], [10, 4], [0, 1], "positions must continue"),        # wrong positions
        ([good[10], 3, good[11]], [10, 0, 11], [0, 1, 0], "contiguous"),   # interleaved requests
        ([good[10]], [10], [5], "request_ids"),
    ]
    for ids, pos, rid, msg in cases:
        with pytest.raises(InputError, match=msg):
            tiny.forward_batch(torch.tensor(ids), torch.tensor(pos), torch.tensor(rid), [s1, s2])
        assert (s1.nbytes(), s1.length) == before and s2.length == 0
    # logits_rows outside the batch, and one state under two request ids: refused before any change
    with pytest.raises(InputError, match="logits_rows"):
        tiny.forward_batch(torch.tensor([good[10], 3]), torch.tensor([10, 0]), torch.tensor([0, 1]), [s1, s2],
                           logits_rows=torch.tensor([2]))
    with pytest.raises(InputError, match="same RequestState"):
        tiny.forward_batch(torch.tensor([good[10], good[10]]), torch.tensor([10, 10]), torch.tensor([0, 1]),
                           [s1, s1])
    assert (s1.nbytes(), s1.length) == before and s2.length == 0
    rest = tiny.forward_batch(torch.tensor(good[10:]), torch.arange(10, len(good)),
                              torch.zeros(len(good) - 10, dtype=torch.long), [s1])
    assert (rest - ref[10:]).abs().max() <= 2e-5 * ref.abs().max()  # fp32; measured ~1e-6
    # and a generate() batch with one bad prompt raises before running anything
    with pytest.raises(InputError):
        tiny.generate([good, [V]], 2)


def test_config_contradicting_weights(tmp_path):
    from dsv4core.checkpoint import CheckpointError

    hf = hf_model(CONFIG_A, seed=3)
    hf.save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    orig = json.loads(cfg_path.read_text())
    for change in ({"hidden_size": 64}, {"num_hidden_layers": 4, "layer_types": orig["layer_types"][:4],
                                         "mlp_layer_types": orig["mlp_layer_types"][:4]},
                   {"layer_types": [SW] * 5}, {"n_routed_experts": 7}):
        cfg_path.write_text(json.dumps({**orig, **change}))
        with pytest.raises((CheckpointError, ValueError)) as ei:
            load_model(str(tmp_path), backend="reference")
        assert re.search(r"model\.layers|lm_head|embed|tensor", str(ei.value)), str(ei.value)
    cfg_path.write_text(json.dumps({**orig, "o_groups": 3}))
    with pytest.raises(ConfigError, match="o_groups"):
        load_model(str(tmp_path), backend="reference")


# ------------------------------------------------------------------ state size

def test_state_is_bounded_and_matches_computed_size(tiny):
    """A request holds window blocks for W-1 + max_rollback rows behind its length, one compressed
    block per block_tokens tokens and its ring slot: within `state_bytes`, growing with the
    compressed blocks only; the cache reports its allocated bytes per component."""
    cfg = tiny.config
    cc = tiny.cache.cc
    st = tiny.new_state()
    n = 300
    ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    tiny.forward_batch(ids, torch.arange(n), torch.zeros(n, dtype=torch.long), [st])
    bound = state_bytes(cfg, n, cc, act_bytes=4)
    assert 0 < st.nbytes() <= bound["total"]
    c = tiny.cache
    held_win = int((c.window_table[st.slot] > 0).sum())
    assert held_win * c.window_block >= cfg.sliding_window - 1 + cc.max_rollback - c.window_block
    assert held_win <= -(-(cfg.sliding_window - 1 + cc.max_rollback) // c.window_block) + 1
    assert int((c.comp_table[st.slot] > 0).sum()) == -(-n // c.block_tokens)
    rep = c.bytes_report()
    assert rep["total"] == sum(v for k, v in rep.items() if k != "total")
    assert sum(comp.nbytes for comp in c.components()) == rep["total"] - rep["block_tables"]
    st.release()
    assert st.nbytes() == 0
    flash = DSV4Config.from_dict(official_flash())
    sizes = [state_bytes(flash, t)["total"] for t in (1024, 8192, 65536)]
    assert sizes[0] < sizes[1] < sizes[2]


def test_decode_growth_matches_one_shot(tiny):
    """Two requests of different lengths decode together (the long one 2 tokens a step, crossing
    compressed-block boundaries): logits equal one-shot prefill, the held bytes stay within
    `state_bytes`."""
    cfg = tiny.config
    n0, steps, m0 = 40, 60, 20
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (n0 + steps,), generator=g)
    ids2 = torch.randint(0, cfg.vocab_size, (m0 + steps // 2,), generator=g)
    ref, ref2 = tiny.logits(ids), tiny.logits(ids2)
    s1, s2 = tiny.new_state(), tiny.new_state()
    tiny.forward_batch(torch.cat([ids[:n0], ids2[:m0]]), torch.cat([torch.arange(n0), torch.arange(m0)]),
                       torch.tensor([0] * n0 + [1] * m0), [s1, s2])
    long_, short = [], []
    for j, t in enumerate(range(n0, n0 + steps, 2)):  # the long request takes 2 tokens per step
        lg = tiny.forward_batch(torch.cat([ids[t:t + 2], ids2[m0 + j:m0 + j + 1]]),
                                torch.tensor([t, t + 1, m0 + j]), torch.tensor([0, 0, 1]), [s1, s2])
        long_.append(lg[:2])
        short.append(lg[2])
    scale = ref.abs().max()
    assert (torch.cat(long_) - ref[n0:]).abs().max() <= 2e-5 * scale  # fp32; measured ~1e-6
    assert (torch.stack(short) - ref2[m0:]).abs().max() <= 2e-5 * scale
    cc = tiny.cache.cc
    assert s1.nbytes() <= state_bytes(cfg, n0 + steps, cc, act_bytes=4)["total"]
    assert s2.nbytes() <= state_bytes(cfg, m0 + steps // 2, cc, act_bytes=4)["total"]


# ------------------------------------------------------------------ CLI

def _cli(argv):
    from dsv4core.commands import generate

    parser = argparse.ArgumentParser()
    generate.add_parser(parser.add_subparsers())
    args = parser.parse_args(argv)
    buf = io.StringIO()
    with redirect_stdout(buf):
        rc = args.func(args)
    return rc, buf.getvalue()


def test_cli_generate_json(tiny):
    rc, out = _cli(["generate", "--model", "tiny", "--input-ids", "1,2,3", "--input-ids", "4,5",
                    "--max-new-tokens", "6", "--backend", "reference", "--json", "--no-progress"])
    assert rc == 0
    data = json.loads(out)
    assert data["new_tokens"] == tiny.generate([[1, 2, 3], [4, 5]], 6)


def test_cli_generate_text_and_bad_ids():
    rc, out = _cli(["generate", "--model", "tiny", "--input-ids", "1,2,3", "--max-new-tokens", "2",
                    "--backend", "reference", "--dtype", "bfloat16"])
    assert rc == 0 and "new tokens (2)" in out
    with pytest.raises(SystemExit):
        _cli(["generate", "--model", "tiny", "--input-ids", "1,x"])


def test_empty_forward_is_legal(tiny):
    s = tiny.new_state()
    e = torch.zeros(0, dtype=torch.long)
    assert tiny.forward_batch(e, e, e, [s]).shape == (0, tiny.config.vocab_size)
    assert s.length == 0 and tiny.generate([], 4) == []


def test_official_format_checkpoint_loads(tiny, tmp_path):
    """The tiny model written in the official DeepSeek layout (FP8 dense + FP4 experts, sharded,
    legacy config keys declaring an MTP layer the files do not hold) loads through load_model and
    equals a model holding the writer's dequantised reference weights; it says why it cannot
    speculate. A partial MTP block (one mtp.* tensor) is an error naming a missing tensor."""
    from dsv4core.checkpoint import CheckpointError
    from dsv4core.checkpoint.writer import official_config, write_official
    from dsv4core.model.api import build_model

    hf_cfg = {**tiny.config.to_hf_dict(), "num_nextn_predict_layers": 1}
    off = official_config(hf_cfg)
    off["rope_scaling"] = dict(TINY_CONFIG["rope_parameters"], type="yarn")
    assert off["compress_ratios"][-1] == 0 and len(off["compress_ratios"]) == tiny.config.num_hidden_layers + 1
    assert DSV4Config.from_dict(off) == tiny.config.model_copy(update={"num_nextn_predict_layers": 1})
    sd = {k: v.detach().clone() for k, v in tiny.state_dict().items()}
    write_official(sd, off, tmp_path / "partial", max_shard_bytes=200_000,
                   mtp={"mtp.0.norm.weight": torch.ones(tiny.config.hidden_size)}, reference=False)
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.mtp\.0\."):
        load_model(str(tmp_path / "partial"), backend="reference", dtype="float32")
    ref = write_official(sd, off, tmp_path, max_shard_bytes=200_000)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    loaded = load_model(str(tmp_path), backend="reference", dtype="float32")
    assert not loaded.has_mtp and "no mtp.* tensors" in loaded.speculation_why
    want = build_model(tiny.config, backend="reference")
    want.load_state_dict({k: ref[k].to(v.dtype) for k, v in want.state_dict().items()}, strict=True)
    ids = list(range(3, 120))
    sl, sw = loaded.state_dict(), want.state_dict()
    assert sl.keys() == sw.keys() and all(torch.equal(sl[k], sw[k]) for k in sw)
    # identical weights, same ops, same shapes: the logits are bit-identical
    assert torch.equal(loaded.logits(ids), want.logits(ids))
    assert load_model(str(tmp_path), backend="reference").act_dtype == torch.bfloat16  # no dtype in config


def test_chunked_prefill_generate_equals_one_shot(tiny):
    prompts = [list(range(5, 80)), [3, 4], list(range(100, 141))]
    want = tiny.generate(prompts, 8)
    assert tiny.generate(prompts, 8, prefill_chunk=7) == want
    assert tiny.generate(prompts, 8, prefill_chunk=1) == want
    with pytest.raises(InputError, match="prefill_chunk"):
        tiny.generate(prompts, 2, prefill_chunk=0)


def test_load_model_errors(tmp_path):
    from dsv4core.checkpoint import CheckpointError
    from dsv4core.hal import HALError

    with pytest.raises(HALError, match="no-such-backend"):
        load_model("tiny", backend="no-such-backend")
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="dtype"):
        load_model("tiny", dtype="float16")
