"""Loading synthetic checkpoints: official (FP8 e8m0 / fp32 scales, FP4 experts, sharded) vs
transformers layout of the same dequantised values; error vs the unquantised original.

Bounds used against the original (derivation in test_checkpoint_quant.py), per element x with
block / group absolute maximum a:
* FP8 e4m3, 128x128 blocks, scale s <= a/224 (pow2: a/s in (224, 448]; fp32: s = a/448):
  |x - x_hat| <= max(|x| / 16, 2^-10 * a / 224)
* FP4 e2m1, 1x32 groups, pow2 scale s < a/3 (a/s in (3, 6]): |x - x_hat| <= max(|x|, a/3) / 4
* BF16 on disk (embedding, head, norms, router gate, compressor / indexer projections):
  |x - x_hat| <= 2^-8 |x|  (8 significant bits, round to nearest)
* fp32 / int64 on disk (mHC, sinks, ape, gate bias, tid2eid): exact.
"""

from __future__ import annotations

import logging

import pytest
import torch
from checkpoint_fixtures import build_pair, tiny_config, tiny_model

from dsv4core.checkpoint import hf_to_official, open_checkpoint

E8M0 = torch.float8_e8m0fnu


@pytest.fixture(scope="module", params=["e8m0", "fp32"])
def pair(request, tmp_path_factory):
    sdt = E8M0 if request.param == "e8m0" else torch.float32
    return build_pair(tmp_path_factory.mktemp(f"ckpt_{request.param}"), scale_dtype=sdt)


def _load(path, **kw):
    m = tiny_model(meta=True)
    open_checkpoint(path).load_into(m, **kw)
    return m


def test_format_detection(pair, tmp_path):
    model, off, hf, _ = pair
    a, b = open_checkpoint(off), open_checkpoint(hf)
    assert a.format == "official" and b.format == "transformers"
    assert len(a.files) > 2 and len(b.files) > 2, "the fixtures must be sharded"
    assert "compress_ratios" in a.config_dict and a.config_dict["expert_dtype"] == "fp4"
    assert any(n.endswith(".scale") for n in a.tensor_names())
    # single file, no index; transformers' own save_pretrained output
    model.save_pretrained(tmp_path / "saved")
    c = open_checkpoint(tmp_path / "saved")
    assert c.format == "transformers" and len(c.files) == 1
    single = open_checkpoint(c.files[0])
    assert single.format == "transformers"
    m = tiny_model(meta=True)
    single.load_into(m)
    for k, v in m.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k


def test_official_equals_transformers(pair):
    model, off, hf, ref = pair
    a, b = _load(off), _load(hf)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() == ref.keys()
    for k in sa:
        assert sa[k].dtype == model.state_dict()[k].dtype, k
        assert torch.equal(sa[k], sb[k]), k
        assert torch.equal(sa[k], ref[k]), k
    assert not any(p.is_meta for p in a.parameters())


def _block_amax(x: torch.Tensor, br: int, bc: int) -> torch.Tensor:
    *lead, n, k = x.shape
    nb, kb = -(-n // br), -(-k // bc)
    pad = torch.zeros(*lead, nb * br, kb * bc)
    pad[..., :n, :k] = x.abs()
    a = pad.reshape(*lead, nb, br, kb, bc).amax(dim=(-1, -3))
    return a.repeat_interleave(br, -2).repeat_interleave(bc, -1)[..., :n, :k]


def test_error_vs_unquantised_original(pair):
    model, off, _, _ = pair
    ck = open_checkpoint(off)
    loaded = _load(off).state_dict()
    seen = {"fp8": 0, "fp4": 0, "bf16": 0, "exact": 0}
    worst = {}
    for k, x in model.state_dict().items():
        xh = loaded[k]
        err = (xh.double() - x.double()).abs()
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            kind = "fp4"
            bound = torch.maximum(x.abs(), _block_amax(x, 1, 32) / 3) / 4
        else:
            dt = ck.tensor_info(hf_to_official(k)).dtype
            kind = {"F8_E4M3": "fp8", "BF16": "bf16"}.get(dt, "exact")
            if kind == "fp8":
                bound = torch.maximum(x.abs() / 16, _block_amax(x, 128, 128) * 2.0 ** -10 / 224)
            elif kind == "bf16":
                bound = x.abs() * 2.0 ** -8
            else:
                bound = torch.zeros_like(x, dtype=torch.float64)
        assert (err <= bound.double()).all(), (k, kind, (err - bound.double()).max().item())
        seen[kind] += 1
        if kind != "exact":
            worst[kind] = max(worst.get(kind, 0.0), (err / bound.double().clamp_min(1e-30)).max().item())
    assert all(v > 0 for v in seen.values()), seen
    # the quantisation really happened (errors reach a good fraction of their bound)
    assert worst["fp8"] > 0.3 and worst["fp4"] > 0.3 and worst["bf16"] > 0.3, worst


def _hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_logits_official_vs_transformers_and_original(pair):
    model, off, hf, _ = pair
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(3))
    # load into real (non-meta) HF models: exercises the in-place copy path
    ma, mb = tiny_model(seed=7), tiny_model(seed=8)
    open_checkpoint(off).load_into(ma)
    open_checkpoint(hf).load_into(mb)
    la, lb, lo = _hf_logits(ma, ids), _hf_logits(mb, ids), _hf_logits(model, ids)
    assert torch.isfinite(la).all()
    # both hold exactly the dequantised reference values (test_official_equals_transformers)
    assert torch.equal(la, lb)
    # Against the unquantised original. This random tiny model is sensitive (routing and indexer
    # top-k flips), so the logits error is large (~0.25 with FP8 only, ~0.4 with FP4 experts) and
    # is compared with what the rounding predicts: the same per-tensor error values, shuffled
    # within each tensor (same distribution, no correlation with the weights), must give a
    # logits error of the same size.
    rel_q = ((la - lo).norm() / lo.norm()).item()
    sd, qd = model.state_dict(), ma.state_dict()
    rel_n = []
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        noisy = {}
        for k, x in sd.items():
            if x.is_floating_point():
                d = (qd[k] - x).flatten()
                noisy[k] = x + d[torch.randperm(d.numel(), generator=g)].view_as(x)
            else:
                noisy[k] = x
        mb.load_state_dict(noisy)
        rel_n.append(((_hf_logits(mb, ids) - lo).norm() / lo.norm()).item())
    pred = sum(rel_n) / len(rel_n)
    assert 0.5 * pred <= rel_q <= 2 * pred, (rel_q, rel_n)


def test_dsv4core_load_model_logits(pair):
    from dsv4core.model import api    # an import failure fails the test (the model package is part of the tree)

    _, off, hf, _ = pair
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(4))
    la = api.load_model(str(off), dtype=torch.float32, device="cpu").logits(ids)
    lb = api.load_model(str(hf), dtype=torch.float32, device="cpu").logits(ids)
    assert torch.isfinite(la).all()
    assert torch.equal(la, lb)  # the same dequantised weights, the same ops: bit-identical


def test_mtp_skipped_with_one_log_line(pair, caplog):
    _, off, _, _ = pair
    assert any(n.startswith("mtp.") for n in open_checkpoint(off).tensor_names())
    with caplog.at_level(logging.INFO, logger="dsv4core.checkpoint"):
        _load(off)
    lines = [r for r in caplog.records if "mtp" in r.getMessage()]
    assert len(lines) == 1 and "skipping 2 mtp.* tensors" in lines[0].getMessage()


def test_dtype_of_each_parameter_is_kept(pair):
    """bf16 model with fp32 mHC / sinks / ape / bias: each tensor takes its parameter's dtype."""
    _, off, _, ref = pair
    m = tiny_model(meta=True).to(torch.bfloat16)
    fp32 = ("_hc.fn", "_hc.base", "_hc.scale", "hc_fn", "hc_base", "hc_scale", "sinks", "position_bias",
            "e_score_correction_bias")
    for name, p in list(m.state_dict(keep_vars=True).items()):
        if name.endswith(fp32):
            owner, _, attr = name.rpartition(".")
            mod = m.get_submodule(owner)
            if attr in mod._parameters:
                mod._parameters[attr] = torch.nn.Parameter(torch.empty(p.shape, device="meta"))
            else:
                mod._buffers[attr] = torch.empty(p.shape, device="meta")
    open_checkpoint(off).load_into(m)
    for k, v in m.state_dict().items():
        if k.endswith(fp32):
            assert v.dtype == torch.float32 and torch.equal(v, ref[k]), k
        elif v.is_floating_point():
            assert v.dtype == torch.bfloat16 and torch.equal(v, ref[k].to(torch.bfloat16)), k
        else:
            assert torch.equal(v, ref[k]), k
    # dtype= replaces reduced-precision parameters' dtype, never fp32 ones
    m2 = tiny_model(meta=True).to(torch.bfloat16)
    open_checkpoint(off).load_into(m2, dtype=torch.float16)
    assert m2.lm_head.weight.dtype == torch.float16


def test_keep_fp8_when_module_asks_for_it(pair):
    """A module that holds FP8 weights + a weight_scale_inv companion gets the raw FP8 data."""
    _, off, _, ref = pair
    ck = open_checkpoint(off)
    m = tiny_model(meta=True)
    lin = m.model.layers[0].self_attn.q_a_proj
    lin.weight = torch.nn.Parameter(torch.empty(lin.weight.shape, dtype=torch.float8_e4m3fn, device="meta"),
                                    requires_grad=False)
    sdt = ck.tensor_info("layers.0.attn.wq_a.scale").torch_dtype
    lin.weight_scale_inv = torch.nn.Parameter(torch.empty(1, 2, dtype=sdt, device="meta"), requires_grad=False)
    ck.load_into(m)
    from safetensors import safe_open

    info = ck.tensor_info("layers.0.attn.wq_a.weight")
    with safe_open(str(info.file), "pt") as f:
        raw = f.get_tensor("layers.0.attn.wq_a.weight")
    with safe_open(str(ck.tensor_info("layers.0.attn.wq_a.scale").file), "pt") as f:
        sc = f.get_tensor("layers.0.attn.wq_a.scale")
    assert lin.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(lin.weight.view(torch.uint8), raw.view(torch.uint8))
    assert torch.equal(lin.weight_scale_inv.float(), sc.float())
    from dsv4core.checkpoint import dequantize_fp8

    assert torch.equal(dequantize_fp8(lin.weight, lin.weight_scale_inv), ref["model.layers.0.self_attn.q_a_proj.weight"])


def test_strict_false_ignores_unexpected(pair, tmp_path):
    from dsv4core.checkpoint import CheckpointError
    from dsv4core.checkpoint.writer import write_transformers

    _, _, _, ref = pair
    sd = dict(ref)
    sd["model.layers.0.bogus.weight"] = torch.zeros(3)
    write_transformers(sd, tiny_config().to_dict(), tmp_path / "x")
    with pytest.raises(CheckpointError, match="bogus"):
        _load(tmp_path / "x")
    m = _load(tmp_path / "x", strict=False)
    assert torch.equal(m.lm_head.weight, ref["lm_head.weight"])


def test_row_chunked_conversion_is_identical(pair, monkeypatch):
    """Large tensors are read and dequantised in row chunks; force tiny chunks (one FP8 block
    row) and check the result is bit-identical."""
    from dsv4core.checkpoint import convert

    _, off, _, ref = pair
    monkeypatch.setattr(convert, "_CHUNK_ROWS", 128)
    m = _load(off)
    for k, v in m.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_official_config_reads_back(pair):
    from transformers import DeepseekV4Config

    model, off, _, _ = pair
    c = DeepseekV4Config(**open_checkpoint(off).config_dict)
    for k in ("layer_types", "mlp_layer_types", "qk_rope_head_dim", "hidden_size", "n_routed_experts"):
        assert getattr(c, k) == getattr(model.config, k), k


def test_transformers_layout_with_fp8_and_fp4_companions(pair, tmp_path):
    """Transformers-named checkpoints may carry FP8 ``weight_scale_inv`` and packed-FP4 experts
    with ``gate_up_proj_scale_inv`` (transformers' FineGrainedFP8 layout): dequantised on load."""
    from dsv4core.checkpoint import quantize_fp4, quantize_fp8_block
    from dsv4core.checkpoint.writer import write_transformers

    _, _, _, ref = pair
    sd = dict(ref)
    n = "model.layers.1.self_attn.o_b_proj.weight"
    q, s = quantize_fp8_block(sd[n], torch.float32)
    sd[n], sd[n + "_scale_inv"] = q, s
    e = "model.layers.2.mlp.experts.gate_up_proj"
    q4, s4 = quantize_fp4(sd[e])
    sd[e], sd[e + "_scale_inv"] = q4, s4
    write_transformers(sd, tiny_config().to_dict(), tmp_path / "fp8hf", max_shard_bytes=200_000)
    m = _load(tmp_path / "fp8hf")
    from dsv4core.checkpoint import dequantize_fp4, dequantize_fp8

    assert torch.equal(m.state_dict()[n], dequantize_fp8(q, s))
    assert torch.equal(m.state_dict()[e], dequantize_fp4(q4, s4))
    assert torch.equal(m.state_dict()[e], ref[e])  # FP4 of FP4-representable values is lossless


def test_keep_fp4_experts_packed_when_module_asks_for_it(pair):
    """A module holding packed int8 experts + ``gate_up_proj_scale_inv`` gets the raw FP4 data,
    assembled from the per-expert official tensors (w1 rows first, then w3)."""
    from dsv4core.checkpoint import dequantize_fp4

    _, off, _, ref = pair
    m = tiny_model(meta=True)
    ex = m.model.layers[1].mlp.experts
    E, I2, H = ex.gate_up_proj.shape
    ex.gate_up_proj = torch.nn.Parameter(torch.empty(E, I2, H // 2, dtype=torch.int8, device="meta"),
                                         requires_grad=False)
    ex.gate_up_proj_scale_inv = torch.nn.Parameter(
        torch.empty(E, I2, H // 32, dtype=torch.float8_e8m0fnu, device="meta"), requires_grad=False)
    open_checkpoint(off).load_into(m)
    assert ex.gate_up_proj.dtype == torch.int8
    assert torch.equal(dequantize_fp4(ex.gate_up_proj, ex.gate_up_proj_scale_inv),
                       ref["model.layers.1.mlp.experts.gate_up_proj"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_onto_cuda_matches_cpu(pair):
    _, off, _, ref = pair
    m = _load(off, device="cuda")
    for k, v in m.state_dict().items():
        assert v.device.type == "cuda"
        assert torch.equal(v.cpu(), ref[k]), k


def test_keep_fp8_from_transformers_layout_and_unscaled_source_is_an_error(pair, tmp_path):
    from dsv4core.checkpoint import CheckpointError, quantize_fp8_block
    from dsv4core.checkpoint.writer import write_transformers

    _, _, hf, ref = pair
    n = "model.layers.1.self_attn.o_b_proj.weight"

    def fp8_module():
        m = tiny_model(meta=True)
        lin = m.model.layers[1].self_attn.o_b_proj
        lin.weight = torch.nn.Parameter(torch.empty(lin.weight.shape, dtype=torch.float8_e4m3fn, device="meta"),
                                        requires_grad=False)
        lin.weight_scale_inv = torch.nn.Parameter(torch.empty(2, 2, dtype=torch.float32, device="meta"),
                                                  requires_grad=False)
        return m

    sd = dict(ref)
    q, s = quantize_fp8_block(sd[n], torch.float32)
    sd[n], sd[n + "_scale_inv"] = q, s
    write_transformers(sd, tiny_config().to_dict(), tmp_path / "q")
    m = fp8_module()
    open_checkpoint(tmp_path / "q").load_into(m)
    lin = m.model.layers[1].self_attn.o_b_proj
    assert torch.equal(lin.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(lin.weight_scale_inv, s)
    # an unquantised checkpoint cannot fill an FP8-kept parameter: an error, not a silent cast
    with pytest.raises(CheckpointError, match="dtype mismatch") as ei:
        open_checkpoint(hf).load_into(fp8_module())
    assert ei.value.tensor == n


def test_official_config_keeps_the_compress_yarn_rope():
    """The writer's official config.json must carry rope_scaling / compress_rope_theta so the
    compressed layers' YaRN inv_freq survives the round trip (it used to be dropped)."""
    from transformers import DeepseekV4Config

    from dsv4core.checkpoint.writer import official_config
    from dsv4core.model.config import DSV4Config

    yarn = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
    hf = DeepseekV4Config(num_hidden_layers=4, hidden_size=64, vocab_size=100, compress_rope_theta=40000.0,
                          rope_scaling=dict(yarn)).to_dict()
    off = official_config(hf)
    assert off["rope_scaling"] == yarn and off["compress_rope_theta"] == 40000.0
    a, b = DSV4Config.from_dict(hf), DSV4Config.from_dict(off)
    for kind in ("main", "compress"):
        assert torch.equal(a.inv_freq(kind), b.inv_freq(kind)), kind
    assert not torch.equal(a.inv_freq("compress"), DSV4Config.from_dict({**off, "rope_scaling": None}).inv_freq("compress"))


def test_keep_fp8_experts_when_module_asks_for_it(tmp_path):
    """Official FP8 experts (expert_dtype fp8) into a module holding FP8 ``gate_up_proj`` + a
    ``[E, 2I/128, H/128]`` scale: w1 / w3 fill their halves of the weight AND of the scale grid
    (one scale row per 128 weight rows, not per weight row)."""
    from dsv4core.checkpoint import dequantize_fp8
    from dsv4core.checkpoint.writer import write_official

    model = tiny_model(seed=2)
    ref = write_official(model.state_dict(), model.config.to_dict(), tmp_path, fp4_experts=False,
                         max_shard_bytes=300_000)
    m = tiny_model(meta=True)
    ex = m.model.layers[1].mlp.experts
    E, I2, H = ex.gate_up_proj.shape
    assert (I2 // 2) % 128 == 0
    ex.gate_up_proj = torch.nn.Parameter(torch.empty(E, I2, H, dtype=torch.float8_e4m3fn, device="meta"),
                                         requires_grad=False)
    ex.gate_up_proj_scale_inv = torch.nn.Parameter(
        torch.empty(E, I2 // 128, H // 128, dtype=torch.float8_e8m0fnu, device="meta"), requires_grad=False)
    open_checkpoint(tmp_path).load_into(m)
    assert ex.gate_up_proj.dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize_fp8(ex.gate_up_proj, ex.gate_up_proj_scale_inv),
                       ref["model.layers.1.mlp.experts.gate_up_proj"])


def test_official_config_keeps_a_non_default_csa_rate():
    """compress_ratios alone cannot say which ratio is CSA; a CSA rate other than 4 is written as
    ``compress_rate_csa`` so the schedule reads back (CSA layers used to come back as HCA)."""
    from dsv4core.checkpoint.writer import official_config
    from dsv4core.model.config import DSV4Config

    hf = tiny_config(compress_ratios=None, compress_rates={"compressed_sparse_attention": 3,
                                                           "heavily_compressed_attention": 5}).to_dict()
    assert DSV4Config.from_dict(official_config(hf)) == DSV4Config.from_dict(hf)
